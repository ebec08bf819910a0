"""Side by side with llama.cpp's diffusion CLI (`llama-diffusion-cli`), the CPU engine users compare us with
(issue 34 item 2): the same LLaDA-layout weights (f32 on both sides), the same prompt ids, the same
unmasking order and number of model calls, the same threads.

    python -m bench.peer build --dir /tmp/peer                     # once, ~10-20 min on 2 cores; never in CI
    python -m bench.peer run --peer /tmp/peer --size 100M 300M --threads 2 --reps 5
    python -m bench.peer profile --peer /tmp/peer --size 100M 300M --threads 2

`build` downloads the `llama-cpp-python` sdist (`pip download --no-binary :all: --no-deps`), whose
`vendor/llama.cpp` is llama.cpp's whole tree, and builds only `llama-diffusion-cli` (and `llama-tokenize`,
to check the prompt's ids) with cmake: CPU, Release, -DGGML_NATIVE=ON, no CURL.

`run`, per size:
  1. a random LLaDA-layout checkpoint (`models.random_checkpoint.make_checkpoint`, seeded; or the shipped
     5.6M model's weights) with a converter tokenizer (`write_peer_tokenizer`): every id i is the added
     token `<t{i}>` except eos `<|eos|>`, mask `<|mask|>`, bos `<|bos|>` (special) and three plain BPE
     tokens `a`, `b`, `ab` (the one merge llama.cpp's BPE loader insists on). The prompt is written as
     added tokens only, so both tokenizers map it to the same ids without pre-tokenizing anything, and the
     CLI's output text maps back to ids exactly. Two things the converter and the CLI would otherwise do:
     - the converter refuses a BPE tokenizer whose pre-tokenizer hash it does not know: `convert()` runs
       the vendored `convert_hf_to_gguf.py` unchanged except that an unrecognised hash is written as
       pre-tokenizer `default` instead of raising (it never applies: no prompt text is pre-tokenized);
     - the CLI always formats the prompt with the model's chat template (ChatML when the GGUF has none;
       no flag turns it off), so the tokenizer config carries an identity template
       (`{{ message['content'] }}`), i.e. no template is applied.
     `llama-tokenize` checks that the peer's prompt ids equal ours (bos first: the converter sets
     add_bos_token for LLaDA).
  2. llama-diffusion-cli with `--top-k 1 --temp 0` and one block over the whole canvas, steps = gen
     length: its confidence order then sees probability 1 everywhere and breaks ties by position, so it
     unmasks the left-most masked position each step with its argmax; the engine's `left` with threshold
     1.0 (the run after the left-most position joins only at probability 1.0: `run` checks that every
     call committed one token) does the same: one token a step, left to right, one call a step, cache none.
  3. repeated and interleaved (peer, engine, peer, engine, ...) so the shared machine's noise shows in
     both columns; min and median.

Timing. The peer prints `total time: T ms, time per step: S ms, sampling time per step: P ms` (ggml_time_us
around its decoding loop; load and exit outside): its ms per call is S - P (the `llama_process` call
and its step bookkeeping), its ms per step S, its ms per token T / gen length. The engine's: its ms per
call is the mean time of `Transformer.forward` (timed around the model object the decoder calls), its ms
per step `SequenceResult.seconds / calls`, per token `seconds / tokens`. The process wall time of the
peer (load included) is printed beside.

CPU time, for a machine others share (wall time then measures the neighbours as much as the program):
the peer's CPU ms per step is (CPU of its run - CPU of the same run with one step) / (steps - 1), both
from getrusage of the finished child, so load, one call and exit cancel; the engine's is the process CPU
time of the decode / its calls (its per-step bookkeeping included). With one thread each this is the
work each side does per step, whatever else runs; with more threads it also counts spinning workers.

`--gemm torch onednn` times the engine with each matmul backend beside the same peer runs (models.transformer
GEMMS: onednn is opt-in, it rounds differently).

`profile` times one engine call at the run's shape under torch.profiler and splits it into the model's
matmuls and the rest.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from engine.frontend import Parser, guarded, set_threads, thread_count, threads_value
from models.transformer import GEMMS

PEER_VERSION = "0.3.36"
PACKAGE = "llama-cpp-python"
TARGETS = ("llama-diffusion-cli", "llama-tokenize")
SHIPPED = Path(__file__).resolve().parent.parent / "models" / "default"

# LLaDA layout (untied embeddings, SwiGLU, RMSNorm, RoPE); parameters counted with the embeddings
SIZES: dict[str, dict | None] = {
    "5.6M": None,                                   # the shipped model (models/default)
    "100M": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=7, num_heads=12,
                 num_kv_heads=12, head_dim=64),
    "300M": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=18, num_heads=16,
                 num_kv_heads=16, head_dim=64),
}

TIMING = re.compile(r"total time:\s*([0-9.]+)ms, time per step:\s*([0-9.]+)ms, "
                    r"sampling time per step:\s*([0-9.]+)ms")


LOG_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ [A-Z] ?")


class PeerError(Exception):
    """A peer step failed (its command's last output lines in the message)."""


def n_params(shape: dict) -> int:
    v, d, i, n = shape["vocab_size"], shape["hidden_size"], shape["intermediate_size"], shape["num_layers"]
    hd = shape["head_dim"]
    attn = d * shape["num_heads"] * hd * 2 + d * shape["num_kv_heads"] * hd * 2
    return 2 * v * d + n * (attn + 3 * d * i + 2 * d) + d


# ---------------------------------------------------------------------------------------------- tokens

def token_ids(vocab_size: int, eos: int, mask: int, bos: int) -> dict:
    """The converter tokenizer's id layout: the specials, and the three plain BPE tokens (the first ids
    that are not special)."""
    specials = {eos: "<|eos|>", mask: "<|mask|>", bos: "<|bos|>"}
    if len(specials) != 3 or not all(0 <= i < vocab_size for i in specials):
        raise ValueError(f"eos {eos}, mask {mask}, bos {bos}: three distinct ids below {vocab_size}")
    free = [i for i in range(vocab_size) if i not in specials][:3]
    return {"specials": specials, "plain": dict(zip(free, ("a", "b", "ab")))}


def piece(i: int, layout: dict) -> str:
    return layout["specials"].get(i) or layout["plain"].get(i) or f"<t{i}>"


def write_peer_tokenizer(d: str | os.PathLike, vocab_size: int, eos: int, mask: int, bos: int) -> dict:
    """tokenizer.json + tokenizer_config.json for the converter (see the module's doc): returns the layout."""
    d = Path(d)
    layout = token_ids(vocab_size, eos, mask, bos)
    vocab = {piece(i, layout): i for i in range(vocab_size)}
    added = [dict(id=i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=False,
                  special=i in layout["specials"]) for s, i in vocab.items() if i not in layout["plain"]]
    a, b, ab = sorted(layout["plain"])
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": False, "vocab": vocab, "merges": [["a", "b"]]}}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "mask_token": "<|mask|>", "add_bos_token": True, "clean_up_tokenization_spaces": False,
        # the CLI applies a chat template unconditionally: this one passes the prompt through unchanged
        "chat_template": "{% for message in messages %}{{ message['content'] }}{% endfor %}"}))
    return layout


def prompt_text(ids, layout: dict) -> str:
    """The CLI's -p for prompt ids (without the bos it adds itself): added tokens only."""
    bad = [i for i in ids if i in layout["plain"] or i in layout["specials"]]
    if bad:
        raise ValueError(f"prompt ids {bad} are not added tokens")
    return "".join(piece(i, layout) for i in ids)


def parse_pieces(text: str, layout: dict) -> list[int]:
    """The CLI's detokenized output back to ids (special tokens are not printed by the CLI: an EOS it
    generated is absent here; `ab` always reads as the merged token)."""
    inv = {v: k for k, v in layout["specials"].items()} | {v: k for k, v in layout["plain"].items()}
    out, pos = [], 0
    pat = re.compile(r"<t(\d+)>|<\|eos\|>|<\|mask\|>|<\|bos\|>|ab|a|b")
    while pos < len(text):
        m = pat.match(text, pos)
        if m is None:
            raise ValueError(f"unparsable peer output at {pos}: {text[pos:pos + 20]!r}")
        out.append(int(m.group(1)) if m.group(1) else inv[m.group(0)])
        pos = m.end()
    return out


def parse_cli_output(out: str) -> dict:
    """llama-diffusion-cli's stdout+stderr: its timing line and the generated text (the first non-empty
    line after it, as `"\\n%s\\n"` prints it)."""
    m = None
    for m in TIMING.finditer(out):
        pass
    if m is None:
        raise ValueError("no 'total time: ...' line in the peer's output")
    # lines may carry the log's `0.05.066.214 I ` prefix (its own line before the text)
    rest = [LOG_PREFIX.sub("", ln) for ln in out[m.end():].splitlines()]
    rest = [ln for ln in rest if ln.strip()]
    text = rest[0].strip() if rest else ""
    total, step, sampling = (float(g) for g in m.groups())
    return {"total_ms": total, "step_ms": step, "sampling_ms": sampling, "call_ms": step - sampling,
            "text": text}


# ---------------------------------------------------------------------------------------------- build

def _run(cmd, cwd=None, log=None, env=None) -> str:
    print("+", " ".join(str(c) if "\n" not in str(c) else "<bench.peer's converter wrapper>" for c in cmd),
          flush=True)
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    if log is not None:
        Path(log).write_text(p.stdout)
    if p.returncode != 0:
        tail = "\n".join(p.stdout.splitlines()[-15:])
        raise PeerError(f"{cmd[0]} exited {p.returncode}:\n{tail}")
    return p.stdout


def llama_dir(peer: Path) -> Path:
    return Path(peer) / "src" / "vendor" / "llama.cpp"


def binary(peer: Path, name: str) -> Path:
    return llama_dir(peer) / "build" / "bin" / name


def build(peer: Path, version: str, jobs: int) -> int:
    peer = Path(peer)
    dl = peer / "dl"
    sdist = dl / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"{PACKAGE}=={version}", "-d", dl])
    src = peer / "src"
    if not (llama_dir(peer) / "examples" / "diffusion").is_dir():
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(sdist) as t:
            t.extractall(peer, filter="data")
        (peer / f"llama_cpp_python-{version}").rename(src)
    root = llama_dir(peer)
    for need in ("examples/diffusion/diffusion-cli.cpp", "convert_hf_to_gguf.py", "conversion/llada.py"):
        if not (root / need).exists():
            raise PeerError(f"{PACKAGE} {version} vendors no {need}: pick a newer --version")
    (peer / "VERSION").write_text(version + "\n")
    if shutil.which("cmake") is None:
        raise PeerError("cmake is not on PATH (pip install cmake)")
    _run(["cmake", "-S", root, "-B", root / "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_SERVER=OFF"], log=peer / "cmake.log")
    for target in TARGETS:
        _run(["cmake", "--build", root / "build", "--target", target, "-j", str(jobs)], log=peer / f"{target}.log")
    print(f"built {', '.join(str(binary(peer, t)) for t in TARGETS)} ({PACKAGE} {version})")
    return 0


# ---------------------------------------------------------------------------------------------- weights

CONVERT = r"""
import logging, runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
orig = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:   # bench.peer's tokenizer: prompts are added tokens only, never pre-tokenized
        logging.getLogger("bench.peer").warning("unrecognised pre-tokenizer written as 'default'")
        return "default"
base.TextModel.get_vocab_base_pre = pre
# transformers' added_tokens_decoder rebuilds its dict on every access and the LLaDA converter reads it
# once per token: quadratic in a vocabulary of added tokens. The same dict, built once per tokenizer:
from transformers import tokenization_utils_tokenizers as tut
fget = tut.TokenizersBackend.added_tokens_decoder.fget
def once(self):
    if "_bench_peer_atd" not in self.__dict__:
        self.__dict__["_bench_peer_atd"] = fget(self)
    return self.__dict__["_bench_peer_atd"]
tut.TokenizersBackend.added_tokens_decoder = property(once)
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def checkpoint(size: str, work: Path, seed: int) -> tuple[Path, dict]:
    """The converter's input directory for `size` (weights + config + the peer tokenizer), made once."""
    d = work / f"ckpt-{size}-seed{seed}"
    done = d / "DONE"
    if not done.exists():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        if SIZES[size] is None:
            for f in ("config.json", "model.safetensors"):
                shutil.copy(SHIPPED / f, d / f)
        else:
            from models.random_checkpoint import make_checkpoint

            shape = SIZES[size]
            make_checkpoint(d, "llada", seed=seed, eos_bias=0.0, mask_token_id=shape["vocab_size"] - 1,
                            eos_token_id=0, max_length=4096, **shape)
        done.write_text("")
    cfg = json.loads((d / "config.json").read_text())
    v, eos, mask = cfg["vocab_size"], cfg["eos_token_id"], cfg["mask_token_id"]
    bos = next(i for i in range(v) if i not in (eos, mask))
    layout = write_peer_tokenizer(d, v, eos, mask, bos)
    layout["bos"] = bos
    return d, layout


def convert(peer: Path, ckpt: Path, out: Path) -> Path:
    if out.exists() and out.stat().st_mtime >= (ckpt / "model.safetensors").stat().st_mtime:
        return out
    tmp = out.with_suffix(".part")
    _run([sys.executable, "-c", CONVERT, llama_dir(peer), ckpt, "--outtype", "f32", "--outfile", tmp],
         log=out.with_suffix(".convert.log"))
    tmp.rename(out)
    return out


def peer_prompt_ids(peer: Path, gguf: Path, text: str) -> list[int]:
    out = _run([binary(peer, "llama-tokenize"), "-m", gguf, "-p", text, "--ids", "--log-disable"])
    line = [ln for ln in out.splitlines() if ln.startswith("[")][-1]
    return json.loads(line)


# ---------------------------------------------------------------------------------------------- one run

def peer_command(peer: Path, gguf: Path, text: str, n_ctx: int, gen: int, threads: int, fa: str = "off") -> list[str]:
    """The CLI's command line: f32 K/V (its default is f16) and, by default, flash attention off: its CPU
    flash attention computes Q.K in f16 (measured: it changes tokens of the f32 model; `-fa off` gives the
    engine's tokens)."""
    return [str(binary(peer, "llama-diffusion-cli")), "-m", str(gguf), "-p", text, "-ub", str(n_ctx), "-b",
            str(n_ctx), "-c", str(n_ctx), "--diffusion-steps", str(gen), "--diffusion-block-length", str(n_ctx),
            "--diffusion-algorithm", "4", "--top-k", "1", "--temp", "0", "--seed", "0", "-t", str(threads),
            "-tb", str(threads), "-ctk", "f32", "-ctv", "f32", "-fa", fa]


def run_peer(cmd: list[str], layout: dict, tries: int = 3) -> dict:
    """One CLI run. Its log is written by a thread that can lose the last lines at exit (seen on short
    runs: no `total time` line, exit status 0): such a run is repeated, up to `tries` runs, and counted."""
    for attempt in range(tries):
        t0, c0 = time.perf_counter(), children_cpu()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall, cpu = time.perf_counter() - t0, children_cpu() - c0
        if p.returncode != 0:
            raise PeerError(f"llama-diffusion-cli exited {p.returncode}:\n" + "\n".join(p.stdout.splitlines()[-15:]))
        if TIMING.search(p.stdout):
            break
    r = parse_cli_output(p.stdout)
    r["wall_ms"], r["cpu_ms"], r["retries"] = wall * 1e3, cpu * 1e3, attempt
    r["ids"] = parse_pieces(r.pop("text"), layout)
    r["raw"] = p.stdout
    return r


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children."""
    import resource

    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def one_step(cmd: list[str]) -> list[str]:
    """The same CLI run with one diffusion step: its load, one call and its exit, to subtract."""
    i = cmd.index("--diffusion-steps")
    return cmd[:i + 1] + ["1"] + cmd[i + 2:]


class ForwardTimer:
    """Times every call of the model object the decoder calls (`Transformer.forward`)."""

    def __init__(self, model):
        self.model, self.times = model, []
        self.inner = model.forward

        def timed(*a, **k):
            t = time.perf_counter()
            out = self.inner(*a, **k)
            self.times.append(time.perf_counter() - t)
            return out

        model.forward = timed


def run_engine(model, timer: ForwardTimer, prompt: list[int], gen: int) -> dict:
    import engine

    timer.times.clear()
    c0 = time.process_time()
    (res,) = engine.generate(model, [prompt], method="left", threshold=1.0, gen_length=gen, block_length=gen,
                             cache="none", temperature=0.0)
    calls, cpu = res.calls, time.process_time() - c0
    return {"ids": list(res.token_ids), "calls": calls, "step_ms": res.seconds * 1e3 / calls,
            "call_ms": statistics.fmean(timer.times) * 1e3, "total_ms": res.seconds * 1e3,
            "forwards": len(timer.times), "cpu_step_ms": cpu * 1e3 / calls}


def summary(xs):
    return min(xs), statistics.median(xs)


def prepare(size: str, args, peer: Path, work: Path) -> dict:
    """The size's checkpoint, its GGUF, the prompt ids (checked against the peer's tokenizer) and the CLI's
    command line."""
    import torch

    ckpt, layout = checkpoint(size, work, args.seed)
    gguf = convert(peer, ckpt, work / f"{ckpt.name}.f32.gguf")
    cfg = json.loads((ckpt / "config.json").read_text())
    g = torch.Generator().manual_seed(args.seed)
    body = [i for i in torch.randint(0, cfg["vocab_size"], (4 * args.prompt,), generator=g).tolist()
            if i not in layout["plain"] and i not in layout["specials"]][:args.prompt]
    prompt = [layout["bos"]] + body
    text = prompt_text(body, layout)
    theirs = peer_prompt_ids(peer, gguf, text)
    if theirs != prompt:
        raise PeerError(f"{size}: the peer tokenizes the prompt to {theirs[:8]}..., ours {prompt[:8]}...")
    n_ctx = len(prompt) + args.gen
    return {"ckpt": ckpt, "layout": layout, "prompt": prompt, "n_ctx": n_ctx,
            "cmd": peer_command(peer, gguf, text, n_ctx, args.gen, args.threads, args.fa)}


def interleaved(size: str, args, w: dict) -> list[tuple[dict, dict]]:
    """peer, engine, peer, engine, ... (`args.reps` pairs) after one untimed engine warm-up."""
    from models import load_model

    model = load_model(w["ckpt"], "float32", "cpu")
    timer = ForwardTimer(model)
    for gemm in args.gemm:                    # warm-up (allocator, first-call paths), untimed
        run_engine(model.set_gemm(gemm), timer, w["prompt"], args.gen)
    cmd = w["cmd"]
    print(f"{size}: {n_params_of(model) / 1e6:.1f}M parameters, prompt {len(w['prompt'])} ids (bos incl.), "
          f"{args.gen} generated, canvas {w['n_ctx']}; peer: {' '.join(cmd[:1] + ['...'] + cmd[3:])}", flush=True)
    w["params"] = n_params_of(model)
    rows = []
    for rep in range(args.reps):
        p = run_peer(cmd, w["layout"])
        p1 = run_peer(one_step(cmd), w["layout"])        # CPU per step: (cpu - cpu of one step) / (steps - 1)
        p["cpu_step_ms"] = (p["cpu_ms"] - p1["cpu_ms"]) / max(1, args.gen - 1)
        es = {gemm: run_engine(model.set_gemm(gemm), timer, w["prompt"], args.gen) for gemm in args.gemm}
        rows.append((p, es))
        print(f"  rep {rep}: peer {p['call_ms']:.2f} ms/call ({p['step_ms']:.2f} ms/step, wall "
              f"{p['wall_ms']:.0f} ms) | " + " | ".join(
                  f"engine --gemm {g} {e['call_ms']:.2f} ms/call ({e['step_ms']:.2f} ms/step, {e['calls']} calls)"
                  for g, e in es.items()), flush=True)
    return rows


def size_report(args, w: dict, rows: list[tuple[dict, dict]]) -> dict:
    """One entry per engine matmul backend (`--gemm`), each against the same peer runs."""
    return {g: gemm_report(args, w, [(p, es[g]) for p, es in rows]) for g in rows[0][1]}


def gemm_report(args, w: dict, rows: list[tuple[dict, dict]]) -> dict:
    p0, e0 = rows[0]
    if e0["calls"] != args.gen:
        print(f"  WARNING: the engine took {e0['calls']} calls for {args.gen} tokens (a probability of 1.0 "
              f"joined the left-most run, or a stop token): the call structures differ", flush=True)
    agree = sum(a == b for a, b in zip(p0["ids"], e0["ids"]))
    same = all(p["ids"] == p0["ids"] for p, _ in rows) and all(e["ids"] == e0["ids"] for _, e in rows)
    stats = {}
    for side, k in (("peer", 0), ("engine", 1)):
        for m in ("call_ms", "step_ms", "cpu_step_ms"):
            stats[f"{side}_{m}"] = summary([r[k][m] for r in rows])
        stats[f"{side}_token_ms"] = summary([r[k]["total_ms"] / args.gen for r in rows])
    stats["peer_wall_ms"] = summary([r[0]["wall_ms"] for r in rows])
    stats["peer_sampling_ms"] = summary([r[0]["sampling_ms"] for r in rows])
    stats["peer_reruns"] = sum(r[0]["retries"] for r in rows)       # runs repeated for a lost timing line
    print(f"  tokens agree {agree}/{args.gen} (peer printed {len(p0['ids'])}, engine {len(e0['ids'])}); "
          f"calls peer {args.gen}, engine {e0['calls']}", flush=True)
    return {"params": w["params"], "canvas": w["n_ctx"], "agree": agree, "peer_tokens": len(p0["ids"]),
            "engine_tokens": len(e0["ids"]), "engine_calls": e0["calls"], "peer_calls": args.gen,
            "deterministic": same, "stats": stats, "command": w["cmd"],
            "per_rep": [{"peer": {k: v for k, v in p.items() if k not in ("ids", "raw")},
                         "engine": {k: v for k, v in e.items() if k != "ids"}} for p, e in rows]}


def run(args) -> int:
    import torch

    peer = Path(args.peer)
    if not binary(peer, "llama-diffusion-cli").exists():
        raise PeerError(f"no {binary(peer, 'llama-diffusion-cli')}: run `python -m bench.peer build --dir {peer}`")
    version = (peer / "VERSION").read_text().strip() if (peer / "VERSION").exists() else "?"
    work = Path(args.work or peer / "work")
    work.mkdir(parents=True, exist_ok=True)
    set_threads(args.threads)     # and the C allocator, as engine.generate
    report = {"peer": f"{PACKAGE} {version} (vendored llama.cpp)", "threads": args.threads, "gen": args.gen,
              "fa": args.fa, "prompt": args.prompt, "reps": args.reps, "torch": torch.__version__,
              "gemms": args.gemm, "sizes": {}}
    for size in args.size:
        w = prepare(size, args, peer, work)
        rows = interleaved(size, args, w)
        report["sizes"][size] = size_report(args, w, rows)
        if args.save_output:
            Path(args.save_output).write_text(rows[0][0]["raw"])
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def n_params_of(model) -> int:
    return sum(t.numel() for t in model.parameters())


def table(report: dict) -> str:
    lines = ["| size | engine --gemm | canvas | agree | calls (peer/engine) | peer ms/call min / med | engine ms/call min / med | "
             "engine ÷ peer (min / med) | CPU ms/step peer / engine (min) | CPU engine ÷ peer (min / med) | peer ms/token min / med | engine ms/token min / med | peer wall ms (med) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for size, gemm, r in ((size, g, r) for size, by in report["sizes"].items() for g, r in by.items()):
        s = r["stats"]
        pc, ec = s["peer_call_ms"], s["engine_call_ms"]
        lines.append(
            f"| {size} ({r['params'] / 1e6:.1f}M) | {gemm} | {r['canvas']} | {r['agree']}/{report['gen']} | "
            f"{r['peer_calls']}/{r['engine_calls']} | {pc[0]:.2f} / {pc[1]:.2f} | {ec[0]:.2f} / {ec[1]:.2f} | "
            f"{ec[0] / pc[0]:.2f} / {ec[1] / pc[1]:.2f} | {s['peer_cpu_step_ms'][0]:.2f} / "
            f"{s['engine_cpu_step_ms'][0]:.2f} | {s['engine_cpu_step_ms'][0] / s['peer_cpu_step_ms'][0]:.2f} / "
            f"{s['engine_cpu_step_ms'][1] / s['peer_cpu_step_ms'][1]:.2f} | {s['peer_token_ms'][0]:.2f} / {s['peer_token_ms'][1]:.2f} | "
            f"{s['engine_token_ms'][0]:.2f} / {s['engine_token_ms'][1]:.2f} | {s['peer_wall_ms'][1]:.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- profile

CATEGORIES = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn::_linear")),
              ("attention", ("aten::_scaled_dot_product", "aten::scaled_dot_product")),
              ("copy / layout", ("aten::copy_", "aten::contiguous", "aten::clone", "aten::cat", "aten::to",
                                 "aten::_to_copy", "aten::index", "aten::gather", "aten::slice", "aten::select",
                                 "aten::view", "aten::reshape", "aten::transpose", "aten::expand",
                                 "aten::narrow", "aten::unsqueeze", "aten::t", "aten::permute", "aten::stack")),
              ("allocation", ("aten::empty", "aten::zeros", "aten::ones", "aten::full", "aten::arange",
                              "aten::resize_")))


def category(name: str) -> str:
    for cat, prefixes in CATEGORIES:
        if name.startswith(prefixes):
            return cat
    return "elementwise / norm / other"


def one_call(model, prompt: list[int], gen: int):
    """The (args, kwargs) of the middle forward of a real `left` decode: the engine's own call."""
    import engine

    calls, inner = [], model.forward

    def grab(*a, **k):
        calls.append((a, k))
        return inner(*a, **k)

    model.forward = grab
    try:
        engine.generate(model, [prompt], method="left", threshold=1.0, gen_length=gen, block_length=gen,
                        cache="none", temperature=0.0)
    finally:
        del model.forward
    return calls[len(calls) // 2]


def profile_size(size: str, args, work: Path) -> None:
    import torch

    from models import load_model

    ckpt, layout = checkpoint(size, work, args.seed)
    model = load_model(ckpt, "float32", "cpu")
    cfg = json.loads((ckpt / "config.json").read_text())
    g = torch.Generator().manual_seed(args.seed)
    prompt = [layout["bos"]] + torch.randint(5, cfg["vocab_size"] - 1, (args.prompt,), generator=g).tolist()
    a, k = one_call(model, prompt, args.gen)
    for gemm in args.gemm:
        profile_gemm(size, args, model.set_gemm(gemm), a, k)


def profile_gemm(size: str, args, model, a, k) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with torch.inference_mode():
        for _ in range(2):
            model(*a, **k)
        walls = []
        for _ in range(args.reps):
            t = time.perf_counter()
            model(*a, **k)
            walls.append((time.perf_counter() - t) * 1e3)
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            model(*a, **k)
            prof_wall = (time.perf_counter() - t) * 1e3
    shapes = {k2: (tuple(v.shape) if hasattr(v, "shape") else v) for k2, v in k.items()}
    print(f"\n{size} (--gemm {model.gemm}): one engine call, {n_params_of(model) / 1e6:.1f}M parameters, input "
          f"{tuple(a[0].shape)}, kwargs {shapes}, {args.threads} threads")
    print(f"  wall ms (no profiler) min {min(walls):.2f} median {statistics.median(walls):.2f} over {args.reps}")
    print(profile_table(prof.key_averages(), prof_wall, args.top))


def profile_table(ev, wall: float, top: int) -> str:
    by_cat: dict[str, float] = {}
    leaf = 0.0
    for e in ev:
        by_cat[category(e.key)] = by_cat.get(category(e.key), 0.0) + e.self_cpu_time_total / 1e3
        leaf += e.self_cpu_time_total / 1e3
    out = [f"  under the profiler {wall:.2f} ms; the ops' self time summed {leaf:.2f} ms",
           "  | category | ms | share of the profiled call |", "  |---|---|---|"]
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        out.append(f"  | {cat} | {ms:.2f} | {ms / wall:.1%} |")
    out.append(f"  | not in any op (Python, dispatch) | {wall - leaf:.2f} | {(wall - leaf) / wall:.1%} |")
    out += ["  | op | calls | self ms |", "  |---|---|---|"]
    for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:top]:
        out.append(f"  | {e.key} | {e.count} | {e.self_cpu_time_total / 1e3:.2f} |")
    return "\n".join(out)


def profile(args) -> int:
    import torch

    set_threads(args.threads)     # and the C allocator, as engine.generate
    work = Path(args.work or Path(args.peer) / "work")
    work.mkdir(parents=True, exist_ok=True)
    for size in args.size:
        profile_size(size, args, work)
    return 0


# ---------------------------------------------------------------------------------------------- CLI

def size_name(s: str) -> str:
    if s not in SIZES:
        raise ValueError
    return s


size_name.__name__ = "size (" + ", ".join(SIZES) + ")"


def main(argv=None) -> int:
    p = Parser(prog="python -m bench.peer", description="side by side with llama.cpp's llama-diffusion-cli")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    b = sub.add_parser("build", help="download the llama-cpp-python sdist and build llama-diffusion-cli (not in CI)")
    b.add_argument("--dir", required=True, help="where the sdist, its source tree and the build go")
    b.add_argument("--version", default=PEER_VERSION, help=f"{PACKAGE} version (default {PEER_VERSION})")
    b.add_argument("--jobs", type=thread_count, default=2)
    for name, helptext in (("run", "time both sides, interleaved"), ("profile", "torch.profiler over one call")):
        r = sub.add_parser(name, help=helptext)
        r.add_argument("--peer", required=True, help="the directory `build --dir` wrote")
        r.add_argument("--size", nargs="+", type=size_name, default=["100M"], help=", ".join(SIZES))
        r.add_argument("--threads", type=threads_value, default=2, help="torch threads and the CLI's -t/-tb")
        r.add_argument("--gen", type=thread_count, default=64, help="generated tokens = calls (default 64)")
        r.add_argument("--prompt", type=thread_count, default=31, help="prompt ids after bos (default 31)")
        r.add_argument("--reps", type=thread_count, default=3)
        r.add_argument("--seed", type=int, default=0)
        r.add_argument("--work", help="checkpoints and GGUFs (default PEER/work)")
        r.add_argument("--gemm", nargs="+", choices=GEMMS, default=["torch"],
                       help="the engine's matmul backend(s) (models.transformer.GEMMS; default torch); run: each "
                            "timed beside the same peer runs; profile: each profiled")
        if name == "run":
            r.add_argument("--out", help="write the report as JSON")
            r.add_argument("--save-output", help="write the first peer run's raw output here")
            r.add_argument("--fa", choices=("off", "on", "auto"), default="off",
                           help="the CLI's flash attention (default off: on, its f16 Q.K changes tokens)")

        else:
            r.add_argument("--top", type=thread_count, default=12)
    args = p.parse_args(argv)
    body = {"build": lambda: build(Path(args.dir), args.version, args.jobs), "run": lambda: run(args),
            "profile": lambda: profile(args)}[args.cmd]
    return guarded(body, errors=(PeerError, ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
