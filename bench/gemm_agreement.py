"""`--gemm onednn` against the default matmuls on a suite: token agreement, identical answers,
accuracy and CPU time, side by side (models.transformer.GEMMS; issue 34 item 2: a faster CPU path
that changes numerics is an option with its agreement measured).

    python -m bench.gemm_agreement --task math --limit 100 --methods greedy confidence:threshold=0.9

Each batch of prompts is decoded with one backend and then the other (alternating which goes
first), on one model object (`Transformer.set_gemm`), so both see the same machine. CPU time is
the process's (one thread by default): on a shared machine wall time measures the neighbours too.
The last line is one JSON object.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from engine import DecodeConfig, Decoder
from engine.frontend import DEFAULT_MODEL_DIR, DTYPE_CHOICES, Parser, checked_gemm, guarded, set_threads, thread_count, threads_value
from models import CheckpointError, Tokenizer, load_model

from .eval import parse_method
from .tasks import get_task
from .tasks.common import truncate_at

BACKENDS = ("torch", "onednn")


def decode(model, gemm: str, decoder, prompts) -> tuple[list, float]:
    model.set_gemm(gemm)
    c0 = time.process_time()
    results = decoder.generate(prompts)
    return results, time.process_time() - c0


def compare(model, tok, task, problems, spec: str, args) -> dict:
    name, opts = parse_method(spec)
    dec = Decoder(model, DecodeConfig(name, **{"gen_length": args.gen_length, "block_length": args.block_length,
                                               "cache": args.cache, **opts}))
    out = {g: {"ids": [], "ok": [], "cpu": []} for g in BACKENDS}
    for k in range(0, len(problems), args.batch_size):
        part = problems[k:k + args.batch_size]
        prompts = [tok.encode(task.format_prompt(p)) for p in part]
        order = BACKENDS if (k // args.batch_size) % 2 == 0 else BACKENDS[::-1]
        for g in order:
            results, cpu = decode(model, g, dec, prompts)
            out[g]["cpu"].append(cpu)
            for r, p in zip(results, part):
                out[g]["ids"].append(r.token_ids)
                text = truncate_at(tok.decode(r.token_ids), getattr(task, "STOP_SEQUENCES", ()))
                out[g]["ok"].append(bool(task.score(text, p)))
    a, b = out["torch"]["ids"], out["onednn"]["ids"]
    same = sum(sum(x == y for x, y in zip(u, v)) for u, v in zip(a, b))
    total = sum(max(len(u), len(v)) for u, v in zip(a, b))
    return {"method": spec, "token_agreement": same / total, "identical": sum(u == v for u, v in zip(a, b)) / len(a),
            "accuracy": {g: sum(out[g]["ok"]) / len(a) for g in BACKENDS},
            "cpu_s": {g: sum(out[g]["cpu"]) for g in BACKENDS},
            "cpu_ratio_per_batch": statistics.median(x / y for x, y in zip(out["onednn"]["cpu"], out["torch"]["cpu"]))}


def run(args) -> int:
    set_threads(args.threads)     # and the C allocator, as engine.generate
    task, tok = get_task(args.task), Tokenizer(args.model)
    problems = task.load(None, limit=args.limit)
    checked_gemm("onednn", "cpu", args.dtype)             # before the weights are read
    model = load_model(args.model, args.dtype, "cpu")
    rows = [compare(model, tok, task, problems, spec, args) for spec in args.methods]
    print(f"| method | token agreement | identical answers | accuracy torch / onednn | CPU s torch / onednn "
          f"| onednn ÷ torch CPU (median batch) |\n|---|---|---|---|---|---|")
    for r in rows:
        acc, cpu = r["accuracy"], r["cpu_s"]
        print(f"| {r['method']} | {100 * r['token_agreement']:.2f}% | {100 * r['identical']:.1f}% | "
              f"{100 * acc['torch']:.1f}% / {100 * acc['onednn']:.1f}% | {cpu['torch']:.1f} / {cpu['onednn']:.1f} | "
              f"{r['cpu_ratio_per_batch']:.2f} |")
    print(json.dumps({"task": args.task, "problems": len(problems), "dtype": args.dtype, "threads": args.threads,
                      "torch": torch.__version__, "rows": rows}))
    return 0


def main(argv=None) -> int:
    p = Parser(prog="python -m bench.gemm_agreement", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--task", default="math", choices=("math", "code"))
    p.add_argument("--limit", type=thread_count, default=100)
    p.add_argument("--methods", nargs="+", default=["greedy", "confidence:threshold=0.9"])
    p.add_argument("--gen-length", type=thread_count, default=64)
    p.add_argument("--block-length", type=thread_count, default=32)
    p.add_argument("--cache", default="none", choices=("none", "prefix", "dual"))
    p.add_argument("--batch-size", type=thread_count, default=16)
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--threads", type=threads_value, default=1, metavar="N")
    args = p.parse_args(argv)
    return guarded(lambda: run(args), errors=(CheckpointError, ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
