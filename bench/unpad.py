"""One whole-canvas call with and without its padding columns (docs/loop.md, "Packed calls").

    python -m bench.unpad [--rows 8 32] [--gen 64 32] [--reps 7] [--shape small]

The call a running batch of mixed requests makes without a cache: `--rows` rows, row i the i-th
held-out math question with a generation of `--gen` lengths in turn (the server's 64/32 mix),
every row packed from its first column to `span` (its longest row's prompt and generation), the
block window at the first generated block. Timed both ways, interleaved, `--reps` times each
(median): every column through the model (`tokens=None`, what a GPU runs), and the real positions
only (`models.Tokens`, what a CPU runs: `Transformer.unpads`). Prints the share of real columns,
the two times, their ratio, and whether the real positions' logits are bitwise equal.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from engine.frontend import (DEFAULT_MODEL_DIR, DTYPE_CHOICES, Parser, add_threads_flag, guarded, set_threads,
                             thread_count)
from models import DTYPES, Tokenizer, Tokens, attention_mask, load_model, position_ids

from ._common import versions
from .serve_load import prompts
from .workload import SHAPES, build_random, param_count, shape_config


def call_inputs(tok, model, rows: int, gens: list[int]):
    """(ids, pos, mask, real [R, span], window start) of the packed call."""
    mc = model.config
    ids = [tok.encode(p) for p in prompts(rows)]
    lens = [len(p) + gens[i % len(gens)] for i, p in enumerate(ids)]
    span = max(lens)
    x = torch.full((rows, span), mc.pad_token_id or 0, dtype=torch.long)
    real = torch.zeros(rows, span, dtype=torch.bool)
    for r, (p, n) in enumerate(zip(ids, lens)):
        x[r, :len(p)] = torch.tensor(p)
        x[r, len(p):n] = mc.mask_token_id
        real[r, :n] = True
    lo = max(len(p) for p in ids)                       # a window every row has (the longest prompt's end)
    idx = torch.arange(span)
    return x, position_ids(mc, real), attention_mask(mc, real, lo, lo, 32, idx, idx), real, lo


def run(args) -> int:
    set_threads(args.threads or 1)
    tok = Tokenizer(args.model)                 # the prompts' ids (within every shape's vocabulary)
    if args.shape is None:
        model = load_model(args.model, args.dtype, "cpu")
    else:                                       # random weights at a real shape (bench.workload)
        model = build_random(shape_config(args.shape), torch.device("cpu"), DTYPES[args.dtype])
    out = []
    print("| rows | real columns | padded ms | real-only ms | ratio | logits equal |\n|---|---|---|---|---|---|")
    with torch.no_grad():
        for rows in args.rows:
            x, pos, mask, real, lo = call_inputs(tok, model, rows, args.gen)
            tokens = Tokens.of(real)
            start = lo - model.config.logit_shift
            call = lambda t: model(x, pos, mask, out_start=start, out_len=32, tokens=t)  # noqa: E731
            equal = torch.equal(call(None)[0][real[:, lo:lo + 32]], call(tokens)[0][real[:, lo:lo + 32]])
            times = {"padded": [], "real": []}
            for _ in range(args.reps):
                for name, t in (("padded", None), ("real", tokens)):
                    t0 = time.perf_counter()
                    call(t)
                    times[name].append(time.perf_counter() - t0)
            p, u = (statistics.median(times[k]) * 1e3 for k in ("padded", "real"))
            share = real.float().mean().item()
            out.append({"rows": rows, "real_share": share, "padded_ms": p, "real_ms": u, "equal": equal})
            print(f"| {rows} | {share:.0%} | {p:.1f} | {u:.1f} | {u / p:.2f} | {'yes' if equal else 'NO'} |")
    print(json.dumps({"model": args.shape or args.model, "parameters": param_count(model), "gen": args.gen,
                      "reps": args.reps, "threads": args.threads or 1, "dtype": args.dtype, **versions(),
                      "rows": out}))
    return 0


def main(argv=None) -> int:
    p = Parser(prog="python -m bench.unpad", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="checkpoint (and, with --shape, the tokenizer)")
    p.add_argument("--shape", choices=sorted(n for n in SHAPES if "hf" not in SHAPES[n] and
                                             SHAPES[n].get("mask_token_id") is not None),
                   help="random weights at this bench.workload shape instead of the checkpoint's")
    p.add_argument("--rows", nargs="+", type=thread_count, default=[8, 32])
    p.add_argument("--gen", nargs="+", type=thread_count, default=[64, 32])
    p.add_argument("--reps", type=thread_count, default=7)
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    add_threads_flag(p)
    return guarded(run, p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
