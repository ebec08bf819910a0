"""`python -m bench.peer_answers`: time per answer of the engine's methods against llama.cpp's diffusion CLI
settings on a task (issue 34 item 4), on the shipped model's weights, with the same prompt ids and the same
checker, interleaved problem by problem (the peer's settings, then the engine's methods, for each problem).

    python -m bench.peer_answers --peer /tmp/peer --task math --limit 100 --threads 1 \\
        --steps 64 32 16 8 --methods greedy confidence:threshold=0.9 psd:policy=confidence,d=3

How the answers are made comparable:
- Weights: the shipped model (models/default) converted to GGUF f32 by llama.cpp's own converter, with
  bench.peer's id-level tokenizer (every id an added token, bench.peer's docstring), so the prompt's ids
  are ours and the CLI's output text maps back to ids exactly. One change for answers: EOS is an ordinary
  added token written `<e>` (not special), so the CLI prints it and the answer ends at the first one, as
  the engine's do (§5); the CLI's own `--override-kv tokenizer.ggml.add_bos_token=bool:false` keeps it
  from adding a BOS the model never saw in training.
- The CLI decodes the whole canvas (prompt + gen length) with its timestep schedule (`--diffusion-eps`,
  one block: its block schedule counts blocks from the canvas start and needs the canvas to be a multiple
  of the block, which a prompt of any length is not), its confidence algorithm (4, LLaDA's low-confidence
  order), top-k 1 at temperature 0, f32 K/V, flash attention off, and `--diffusion-steps S` steps (S is
  the setting swept: fewer steps, more tokens per call). It has no early stop: every answer costs S calls.
- Time per answer: the peer's is its own `total time` line (its decoding loop; model load and exit not
  counted, to its advantage), the engine's the `SequenceResult.seconds` of a batch-1 decode (no load).
- Exit: the CLI's log is written by a thread that loses its last lines (the timing line and the answer)
  when the process exits at once; the run sets LD_PRELOAD to a 6-line shim (built here with the C
  compiler) whose atexit handler waits 0.3 s so the thread can flush. It changes nothing the CLI computes
  or times.
"""
from __future__ import annotations

import json
import os
import sys
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from engine.frontend import Parser, guarded, set_threads, thread_count, threads_value
from models.transformer import GEMMS

from . import peer as P

EOS_PIECE = "<e>"
SHIM_C = """#include <stdlib.h>
#include <unistd.h>
static void linger(void) { usleep(300000); }
__attribute__((constructor)) static void init(void) { atexit(linger); }
"""


def shim(work: Path) -> Path:
    """The exit-delay shim (see the module's doc), compiled once."""
    so = work / "liblinger.so"
    if not so.exists():
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise P.PeerError("no C compiler on PATH (cc or gcc) to build the exit-delay shim")
        src = work / "linger.c"
        src.write_text(SHIM_C)
        P._run([cc, "-shared", "-fPIC", "-O2", "-o", so, src])
    return so


def write_answer_tokenizer(d: Path, vocab_size: int, eos: int, mask: int, bos: int) -> dict:
    """bench.peer's converter tokenizer with EOS an ordinary added token `<e>` (printed by the CLI);
    returns the layout (`eos` its id, no longer among the specials)."""
    P.write_peer_tokenizer(d, vocab_size, eos, mask, bos)
    layout = P.token_ids(vocab_size, eos, mask, bos)
    old = layout["specials"].pop(eos)
    tj = json.loads((d / "tokenizer.json").read_text())
    for a in tj["added_tokens"]:
        if a["id"] == eos:
            a["content"], a["special"] = EOS_PIECE, False
    tj["model"]["vocab"] = {(EOS_PIECE if k == old else k): i for k, i in tj["model"]["vocab"].items()}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "eos_token": EOS_PIECE}))
    return {**layout, "eos": eos}


def answer_checkpoint(peer: Path, work: Path) -> tuple[Path, dict]:
    """The shipped model as a GGUF whose tokenizer prints EOS as `<e>`; (gguf, layout)."""
    d = work / "ckpt-shipped-answers"
    cfg = json.loads((P.SHIPPED / "config.json").read_text())
    v, eos, mask = cfg["vocab_size"], cfg["eos_token_id"], cfg["mask_token_id"]
    bos = next(i for i in range(v) if i not in (eos, mask))
    if not (d / "DONE").exists():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy(P.SHIPPED / f, d / f)
        layout = write_answer_tokenizer(d, v, eos, mask, bos)
        (d / "DONE").write_text("")
    else:
        layout = {**P.token_ids(v, eos, mask, bos), "eos": eos}
        layout["specials"].pop(eos)
    return P.convert(peer, d, work / "shipped-answers.f32.gguf"), layout


def peer_text(ids: list[int], layout: dict) -> str:
    bad = [i for i in ids if i in layout["plain"] or i in layout["specials"]]
    if bad:
        raise P.PeerError(f"prompt ids {bad[:4]} have no added token in the peer's tokenizer (a/b/ab or specials)")
    return "".join(EOS_PIECE if i == layout["eos"] else P.piece(i, layout) for i in ids)


def peer_answer_ids(text: str, layout: dict) -> list[int]:
    """The generated ids up to (not including) the first EOS."""
    gen = text.split(EOS_PIECE)[0]
    inv = {s: i for i, s in layout["plain"].items()}
    return [int(m.group(1)) if m.group(1) else inv[m.group(0)]
            for m in re.finditer(r"<t(\d+)>|ab|a|b", gen)]


def peer_cmd(peer: Path, gguf: Path, text: str, n_prompt: int, gen: int, steps: int, threads: int,
             block: int = 0) -> list[str]:
    """The CLI's command for one answer: `block` 0, the timestep schedule over prompt + gen with
    `steps` steps; else its block schedule, `steps` per block: the canvas rounded up to a multiple
    of `block` (its requirement; the positions past gen length are decoded too, and the answer is
    cut at its first EOS as always) and `steps` x canvas / block steps in all (it counts blocks
    from the canvas start, so the blocks past the canvas end take one call each and stop)."""
    if not block:
        cmd = P.peer_command(peer, gguf, text, n_prompt + gen, steps, threads)
        i = cmd.index("--diffusion-block-length")
        cmd[i:i + 2] = ["--diffusion-eps", "0.001"]
    else:
        n_ctx = -(-(n_prompt + gen) // block) * block
        cmd = P.peer_command(peer, gguf, text, n_ctx, steps * n_ctx // block, threads)
        cmd[cmd.index("--diffusion-block-length") + 1] = str(block)
    return cmd + ["--override-kv", "tokenizer.ggml.add_bos_token=bool:false"]


def run_peer_answer(cmd: list[str], so: Path, layout: dict) -> dict:
    c0 = P.children_cpu()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LD_PRELOAD": str(so)})
    cpu = P.children_cpu() - c0
    out = p.stdout + p.stderr
    if p.returncode != 0 or not P.TIMING.search(out):
        raise P.PeerError(f"llama-diffusion-cli exited {p.returncode} without its timing line:\n"
                          + "\n".join(out.splitlines()[-8:]))
    r = P.parse_cli_output(out)
    return {"ms": r["total_ms"], "cpu_ms": cpu * 1e3, "ids": peer_answer_ids(r["text"], layout),
            "calls": round(r["total_ms"] / r["step_ms"]) if r["step_ms"] else 0}


def engine_answer(decoder, ids: list[int]) -> dict:
    c0 = time.process_time()
    (res,) = decoder.generate([ids])
    return {"ms": res.seconds * 1e3, "cpu_ms": (time.process_time() - c0) * 1e3, "ids": list(res.token_ids),
            "calls": res.calls}


def peer_load_cpu(peer: Path, gguf: Path, so: Path, layout: dict, texts: list, args) -> float:
    """The CLI's CPU ms of a run beyond its decoding: the median of one-step runs (load, one call,
    exit), subtracted from every run's CPU so that both sides count the decoding of an answer."""
    runs = [run_peer_answer(peer_cmd(peer, gguf, t, n, args.gen, 1, args.threads), so, layout)["cpu_ms"]
            for t, n in texts]
    return statistics.median(runs)


def answers(args) -> int:
    from engine import DecodeConfig, Decoder
    from models import Tokenizer, load_model

    from .eval import parse_method
    from .tasks import get_task
    from .tasks.common import truncate_at

    peer, work = Path(args.peer), Path(args.work or Path(args.peer) / "work")
    if not P.binary(peer, "llama-diffusion-cli").exists():
        raise P.PeerError(f"no {P.binary(peer, 'llama-diffusion-cli')}: run `python -m bench.peer build --dir {peer}`")
    work.mkdir(parents=True, exist_ok=True)
    set_threads(args.threads)     # and the C allocator, as engine.generate
    task, tok = get_task(args.task), Tokenizer(P.SHIPPED)
    problems = task.load(None, limit=args.limit)
    gguf, layout = answer_checkpoint(peer, work)
    so = shim(work)
    model = load_model(P.SHIPPED, "float32", "cpu").set_gemm(args.gemm)
    decoders = {}
    for spec in args.methods:
        name, opts = parse_method(spec)
        decoders[spec] = Decoder(model, DecodeConfig(name, **{"gen_length": args.gen, "block_length": args.block,
                                                              "cache": args.cache, **opts}))
    per = f" per {args.peer_block}-block" if args.peer_block else ""
    sides = [(f"llama.cpp steps={s}{per}", s) for s in args.steps] + [(f"engine {k}", k) for k in decoders]
    rec = {name: {"ok": [], "ms": [], "cpu_ms": [], "calls": []} for name, _ in sides}
    first = [tok.encode(task.format_prompt(pr)) for pr in problems[:5]]
    load = peer_load_cpu(peer, gguf, so, layout, [(peer_text(i, layout), len(i)) for i in first], args)
    for n, pr in enumerate(problems):
        ids = tok.encode(task.format_prompt(pr))
        text = peer_text(ids, layout)
        for name, s in sides:
            if name.startswith("llama.cpp"):
                r = run_peer_answer(peer_cmd(peer, gguf, text, len(ids), args.gen, s, args.threads, args.peer_block),
                                    so, layout)
                r["cpu_ms"] = r["cpu_ms"] - load
            else:
                r = engine_answer(decoders[s], ids)
            completion = truncate_at(tok.decode(r["ids"]), getattr(task, "STOP_SEQUENCES", ()))
            rec[name]["ok"].append(bool(task.score(completion, pr)))
            rec[name]["ms"].append(r["ms"])
            rec[name]["cpu_ms"].append(r["cpu_ms"])
            rec[name]["calls"].append(r["calls"])
        if (n + 1) % 10 == 0:
            print(f"  {n + 1}/{len(problems)} problems", flush=True)
    print(f"the CLI's load + one call + exit, subtracted from its CPU: {load:.0f} ms (median of 5 one-step runs)")
    print(report_table(rec, len(problems)))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"},
                                              "records": rec}, indent=1))
    return 0


def report_table(rec: dict, n: int) -> str:
    lines = [f"| side and setting | accuracy ({n} problems) | ms per answer mean / median | CPU ms per answer mean | "
             f"calls per answer |", "|---|---|---|---|---|"]
    for name, r in rec.items():
        lines.append(f"| {name} | {100 * sum(r['ok']) / n:.1f}% | {statistics.fmean(r['ms']):.0f} / "
                     f"{statistics.median(r['ms']):.0f} | {statistics.fmean(r['cpu_ms']):.0f} | "
                     f"{statistics.fmean(r['calls']):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = Parser(prog="python -m bench.peer_answers", description=__doc__.split("\n")[0].strip("`"))
    a.add_argument("--peer", required=True, help="the directory `python -m bench.peer build --dir` wrote")
    a.add_argument("--task", default="math", choices=("math", "code"), help="the held-out suite (default math)")
    a.add_argument("--limit", type=thread_count, default=100, help="the first N problems (default 100)")
    a.add_argument("--steps", type=thread_count, nargs="+", default=[64, 32, 16, 8],
                   help="the CLI's --diffusion-steps settings (calls per answer; default 64 32 16 8); with "
                        "--peer-block, steps per block")
    a.add_argument("--peer-block", type=int, default=0,
                   help="the CLI's block schedule with this block length (0, the default: its timestep schedule "
                        "over the whole canvas)")
    a.add_argument("--methods", nargs="+", default=["greedy", "confidence:threshold=0.9"],
                   help="engine method specs as bench.eval takes them (default greedy confidence:threshold=0.9)")
    a.add_argument("--gen", type=thread_count, default=64, help="gen length of both sides (default 64)")
    a.add_argument("--block", type=thread_count, default=32, help="the engine's block length (default 32)")
    a.add_argument("--cache", default="none", choices=("none", "prefix", "dual"), help="the engine's cache mode")
    a.add_argument("--threads", type=threads_value, default=1, metavar="N",
                   help="torch threads and the CLI's -t/-tb (default 1)")
    a.add_argument("--gemm", choices=GEMMS, default="torch", help="the engine's matmul backend")
    a.add_argument("--work", help="GGUF and shim directory (default PEER/work)")
    a.add_argument("--out", help="write the per-problem records as JSON")
    args = a.parse_args(argv)
    return guarded(lambda: answers(args), errors=(P.PeerError, ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
