"""How often the approximate KV-cache modes reproduce `--cache none` (docs/algorithms.md §6).

On bidirectional models (LLaDA, Dream) `prefix` and `dual` reuse keys/values computed at the
block start, so they may drift from the exact `none` reference; on context-causal models they are
exact. This measures token agreement per position and identical sequences.

    python -m bench.cache_agreement [--model DIR ...] [--families llada dream pangu] [--prompts 16]

Without --model it uses seeded random checkpoints of each family (the numbers in docs/loop.md).
The last line is one JSON object.
"""
from __future__ import annotations

import json
import platform

import torch

from engine import DecodeConfig, generate
from engine.frontend import Parser, add_threads_flag, set_threads
from models import ModelConfig, init_random, load_model


def agreement(model, prompts, method, cache, **kw):
    ref = generate(model, prompts, DecodeConfig(method=method, cache="none", **kw))
    got = generate(model, prompts, DecodeConfig(method=method, cache=cache, **kw))
    same = total = seqs = 0
    for a, b in zip(ref, got):
        n = max(a.tokens, b.tokens)
        pa = a.token_ids + [None] * (n - a.tokens)
        pb = b.token_ids + [None] * (n - b.tokens)
        same += sum(x == y for x, y in zip(pa, pb))
        total += n
        seqs += a.token_ids == b.token_ids
    return same / total, seqs / len(prompts)


def main(argv=None):
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="*", default=[])
    p.add_argument("--families", nargs="*", default=["llada", "dream", "pangu"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--block-length", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    add_threads_flag(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    models = [(d, load_model(d)) for d in args.model]
    for fam in ([] if args.model else args.families):
        cfg = ModelConfig.tiny(fam, vocab_size=512, mask_token_id=511, eos_token_id=510, hidden_size=128,
                               intermediate_size=256, num_layers=4, head_dim=32)
        models.append((f"random-{fam}", init_random(cfg, seed=args.seed, std=0.15)))
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print("| model | method | cache | token agreement | identical sequences |")
    print("|---|---|---|---|---|")
    for name, model in models:
        V = model.config.vocab_size
        prompts = [torch.randint(0, min(V, 500), (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(args.prompts)]
        prompts = [[t for t in q if t not in (model.config.mask_token_id, *model.config.stop_token_ids)] or [1] for q in prompts]
        for method, kw in (("greedy", {}), ("confidence", {"threshold": 0.9})):
            for cache in ("prefix", "dual"):
                tok, seq = agreement(model, prompts, method, cache, gen_length=args.gen_length,
                                     block_length=args.block_length, **kw)
                rows.append(dict(model=name, method=method, cache=cache, token_agreement=tok, identical=seq))
                print(f"| {name} | {method} | {cache} | {tok:.3f} | {seq:.3f} |", flush=True)   # a log sees each row
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
