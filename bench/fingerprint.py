"""A fingerprint of what the decoder produces over many configurations: every method, policy,
cache mode, acceptance mode, draft graph, sampling temperature, static rows and cross-block drafts,
on tiny random checkpoints of every model family. Each result's tokens, calls, per-token commit
records, accepted depths and draft node counts go into one SHA-256. A refactor that must not change
behaviour keeps it; `--list` prints one line per configuration to find where two runs differ.

    python -m bench.fingerprint [--list] [--quick]
"""
from __future__ import annotations

import hashlib
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]]
GEN, BLOCK = 16, 8
GRAPH = [[], [0], [1], [0, 1], [0, 2], [2]]


def configurations(quick: bool = False) -> list[dict]:
    """(method, options) for every combination the fingerprint covers."""
    plain = [("greedy", {}), ("topk", {"steps": 8}), ("confidence", {"threshold": 0.3}),
             ("localleap", {"threshold": 0.2, "kappa": 0.4, "window": 2})]
    out = []
    for cache, temp in itertools.product(("none", "prefix", "dual"), (0.0, 0.8)):
        base = {"cache": cache, "temperature": temp, "seed": 3}
        for m, o in plain:
            out.append({"method": m, **o, **base})
            for acc in ("policy", "exact"):
                out.append({"method": "psd", "policy_name": m, "depth": 3, "acceptance": acc, **o, **base})
        out.append({"method": "spiffy", "depth": 2, **base})
        out.append({"method": "spiffy", "graph": GRAPH, **base})
        out.append({"method": "psd", "policy_name": "confidence", "threshold": 0.5, "graph": GRAPH, **base})
        out.append({"method": "lopa", "k": 3, **base})
        out.append({"method": "ete", "k": 2, **base})
        out.append({"method": "fdm", "k": 2, "threshold": 0.2, **base})
        if not quick:
            out.append({"method": "psd", "policy_name": "confidence", "threshold": 0.5, "depth": 3,
                        "static_rows": True, **base})
            if cache == "none":
                for acc in ("policy", "exact"):
                    out.append({"method": "psd", "policy_name": "confidence", "threshold": 0.5, "depth": 3,
                                "acceptance": acc, "cross_block": True, **base})
                out.append({"method": "spiffy", "depth": 3, "cross_block": True, **base})
    return out


def run(families=("llada", "dream", "pangu"), quick: bool = False, listing: bool = False) -> str:
    from engine import DraftGraph, InputError, generate
    from models import load_model
    from models.random_checkpoint import make_checkpoint

    torch.manual_seed(0)
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            path, _ = make_checkpoint(Path(tmp) / family, family, seed=1, eos_bias=8.0)
            model = load_model(path)
            for cfg in configurations(quick):
                opts = dict(cfg)
                if "graph" in opts:
                    opts["graph"] = DraftGraph(opts["graph"])
                try:
                    res = generate(model, PROMPTS, gen_length=GEN, block_length=BLOCK, **opts)
                    rec = [[r.token_ids, r.calls, r.commit_call, r.commit_step, r.commit_source, r.commit_block,
                            sorted(r.accepted_depth.items()), sorted(r.draft_nodes.items()), r.stopped] for r in res]
                except InputError as e:  # a refused configuration is behaviour too
                    rec = ["error", str(e)]
                line = json.dumps([family, cfg, rec], sort_keys=True)
                digest.update(line.encode())
                if listing:
                    print(hashlib.sha256(line.encode()).hexdigest()[:12], family, json.dumps(cfg, sort_keys=True))
    return digest.hexdigest()


def main(argv=None) -> int:
    from engine.frontend import Parser, add_threads_flag, set_threads

    ap = Parser(prog="python -m bench.fingerprint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="one line per configuration (its own hash)")
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    add_threads_flag(ap)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    n = len(configurations(args.quick)) * 3
    print(f"{run(quick=args.quick, listing=args.list)}  ({n} configurations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
