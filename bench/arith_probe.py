"""Teacher-forced arithmetic probe: can a checkpoint compute the math suite's equations?

    python -m bench.arith_probe --model models/default [--n 64] [--seed 424242]

Builds `--n` arithmetic drills (`bench.tasks.math.generate_drill`: the suite's own equations,
3-4 per item), writes each answer on the canvas with **only the result digits masked** and
reads the model's argmax at those positions in one call. Per operation it reports the share of
result digits right and of equations whose every result digit is right. Unlike
`bench.step_accuracy`, which judges whatever equations a decoder wrote, this isolates the
arithmetic from planning and decoding: the operands and the result's length are given.
The last line is one JSON object.
"""
from __future__ import annotations

import json
import sys

import torch

from engine.frontend import Parser, add_threads_flag, set_threads


def build_batch(tok, drills, fmt, mask_id: int, pad_id: int, answer_len: int):
    """The drills on `bench.train.collate`'s canvas with their result digits masked:
    (ids [B, N], targets [B, N], valid [B, N], P, [(row, canvas index, op, equation #)])."""
    from bench.tasks.math import _EQUATION
    from bench.train import collate

    examples, where = [], []
    for b, d in enumerate(drills):
        a_ids, offsets = tok.encode_with_offsets(d["answer"])
        if len(a_ids) > answer_len:
            raise ValueError(f"drill answer of {len(a_ids)} tokens exceeds --answer-len {answer_len}")
        spans = [(m.start(4), m.end(4), m.group(2), k) for k, m in enumerate(_EQUATION.finditer(d["answer"]))]
        where.append([(b, i, op, k) for i, (s, e) in enumerate(offsets)
                      for s0, e0, op, k in spans if s0 <= s and e <= e0 and e > s])
        examples.append((tok.encode(fmt(d)), a_ids + [pad_id] * (answer_len - len(a_ids))))
    target, valid, P = collate(examples, pad_id)
    where = [(b, P + i, op, k) for row in where for b, i, op, k in row]
    x = target.clone()
    for b, i, _, _ in where:
        x[b, i] = mask_id
    return x, target, valid, P, where


def probe(model, tok, n: int = 64, seed: int = 424242, answer_len: int = 64) -> dict:
    from bench.tasks import math as M
    from bench.train import canvas_logits

    cfg = model.config
    x, target, valid, P, where = build_batch(tok, M.generate_drill(n, seed), M.format_prompt,
                                             cfg.mask_token_id, cfg.eos_token_id, answer_len)
    with torch.no_grad():
        pred = canvas_logits(model, x.to(model.device), valid.to(model.device), P).argmax(-1).cpu()
    digits: dict[str, list[bool]] = {}
    eqs: dict[tuple[int, int], list[bool]] = {}            # (row, equation #) -> its digits' hits
    for b, i, op, k in where:
        ok = bool(pred[b, i] == target[b, i])
        digits.setdefault(op, []).append(ok)
        eqs.setdefault((b, k), []).append(ok)
    ops = {(b, k): op for b, _, op, k in where}
    out = {}
    for op in sorted(digits):
        e = [all(hits) for key, hits in eqs.items() if ops[key] == op]
        out[op] = {"digits": len(digits[op]), "digit_accuracy": sum(digits[op]) / len(digits[op]),
                   "equations": len(e), "equation_accuracy": sum(e) / len(e)}
    return out


def main(argv=None) -> int:
    p = Parser(prog="python -m bench.arith_probe", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/default", help="checkpoint directory")
    p.add_argument("--n", type=int, default=64, help="number of drills (3-4 equations each)")
    p.add_argument("--seed", type=int, default=424242, help="drill seed")
    p.add_argument("--answer-len", type=int, default=64, help="answer region length in tokens")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_threads_flag(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    from models import load_model
    from models.errors import CheckpointError
    from models.tokenizer import Tokenizer

    if args.n < 1:
        print(f"error: --n must be >= 1, got {args.n}", file=sys.stderr)
        return 2
    try:
        model, tok = load_model(args.model, dtype=args.dtype), Tokenizer(args.model)
        res = probe(model, tok, args.n, args.seed, args.answer_len)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("| op | result digits | digit accuracy | equations | equation accuracy |")
    print("|---|---|---|---|---|")
    for op, r in res.items():
        print(f"| {op} | {r['digits']} | {100 * r['digit_accuracy']:.1f}% | {r['equations']} | "
              f"{100 * r['equation_accuracy']:.1f}% |")
    print(json.dumps({"model": args.model, "n": args.n, "seed": args.seed, "ops": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
