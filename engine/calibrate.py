"""Draft-graph calibration (docs/algorithms.md §4, Spiffy's offline step).

    python -m engine.calibrate --model DIR --policy greedy --depth 4 --nodes 8 \
        --prompts prompts.txt --out graph.json [--gen-length 128 --block-length 32 --threshold T]

Replays the plain policy on the calibration prompts (one per line; a `.jsonl` file with a
`prompt` field also works). After each step it records the ranks, in that step's confidence
order σ, of the positions the next d steps actually commit with tokens that agree with that
step's predictions (a cumulative rank set per horizon, stopping at the first disagreement).
Each candidate rank set is scored by its own frequency plus its one-smaller subsets' frequencies
("degree-1 accumulation"); the best `--nodes` (root included) are kept, closed under the parent
relation so every node is reachable, and written as a graph file.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

from .config import DecodeConfig, text_ids
from .errors import InputError, read_user_text
from .graph import DraftGraph
from .loop import Decoder
from .methods import METHODS, policy_methods
from .uniform import for_model


def record_reveal_sets(model, prompts: list[list[int]], config: DecodeConfig, depth: int, batch: int = 16) -> Counter:
    """Frequencies of the cumulative rank sets the plain policy reveals in the next 1..depth steps;
    the root (the empty set) counts the steps observed."""
    freq: Counter = Counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        steps: list[tuple] = []

        def trace(rows, block, step, ranks, pred):
            for r, t, rk, pr in zip(rows.tolist(), step.tolist(), ranks.tolist(), pred.tolist()):
                steps.append((r, block, t, rk, pr))

        results = Decoder(model, config, trace=trace).generate(chunk)
        L = config.block_length
        freq[frozenset()] += len(steps)
        for r, block, t, ranks, pred in steps:
            res = results[r]
            cum: set[int] = set()
            for h in range(1, depth + 1):
                pos = [j for j in range(block * L, min((block + 1) * L, res.tokens))
                       if res.commit_step[j] == t + h and res.commit_source[j] == 0]
                if not pos or any(res.token_ids[j] != pred[j - block * L] for j in pos):
                    break
                cum |= {ranks[j - block * L] for j in pos}
                freq[frozenset(cum)] += 1
    return freq


def select_nodes(freq: Counter, nodes: int) -> DraftGraph:
    """Best `nodes` rank sets (root included) by degree-1 accumulated score, parent-closed."""
    if nodes < 1:
        raise InputError(f"--nodes must be >= 1, got {nodes}")
    score = {s: c + sum(freq.get(s - {r}, 0) for r in s) for s, c in freq.items()}
    ranked = sorted(score, key=lambda s: (-score[s], len(s), sorted(s)))
    chosen: list[frozenset] = [frozenset()]

    def parents_present(s):
        return len(s) <= 1 or any((s - {r}) in chosen for r in s)

    for s in ranked:
        if len(chosen) >= nodes:
            break
        if s in chosen:
            continue
        # add the missing ancestors first (best-scored parent at each level) so s is reachable
        chain, cur = [], s
        while not parents_present(cur):
            cur = max((cur - {r} for r in cur), key=lambda p: (score.get(p, 0), -max(p, default=0)))
            chain.append(cur)
        need = [c for c in reversed(chain) if c not in chosen] + [s]
        if len(chosen) + len(need) > nodes:
            continue
        chosen.extend(need)
    return DraftGraph([sorted(s) for s in chosen])


def _read_prompts(path: str, tok) -> list[list[int]]:
    p = Path(path)
    text = read_user_text(p, "prompts file")        # a regular file of sane size (a FIFO would block)
    if p.suffix == ".jsonl":
        lines = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise InputError(f"{path}:{n}: not valid JSON ({e})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not rec["prompt"].strip():
                raise InputError(f"{path}:{n}: expected an object with a non-empty string field 'prompt'")
            lines.append(rec["prompt"])
    else:
        lines = [l.replace("\\n", "\n") for l in text.splitlines() if l.strip()]
    if not lines:
        raise InputError(f"prompts file {path} holds no prompt")
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(text_ids(tok, line))
        except InputError as e:
            raise InputError(f"{path}: prompt {i}: {e}") from None
    return out


def _policy_options() -> list[str]:
    """The sizes and every option some plain policy takes."""
    return ["gen_length", "block_length"] + sorted({o for m in policy_methods() for o in METHODS[m].policy.params})


def main(argv=None) -> int:
    from .frontend import DTYPE_CHOICES, Parser, add_decoding_flags, add_plugin_flag, guarded, plugins_loaded

    argv = sys.argv[1:] if argv is None else argv
    if not plugins_loaded(argv):                 # a plugin's policies are --policy choices
        return 2
    p = Parser(prog="python -m engine.calibrate", description="calibrate a draft graph (docs/algorithms.md §4)")
    p.add_argument("--model", required=True)
    p.add_argument("--policy", default="greedy", choices=policy_methods())
    add_decoding_flags(p, _policy_options())
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True, help="graph JSON file to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    add_plugin_flag(p)
    return guarded(_run, p.parse_args(argv))


def _run(args) -> int:
    from models import ModelConfig, Tokenizer, load_model

    from .frontend import decoding_options

    mc = ModelConfig.from_dir(args.model)          # its config.json: sizes and checks before the weights are read
    options = {"gen_length": 128, "block_length": 32,
               **decoding_options(args, _policy_options(), mc.generation_defaults)}    # as engine.generate
    cfg = for_model(mc, DecodeConfig(method=args.policy, **options))
    if args.depth < 1:
        raise InputError(f"--depth must be >= 1, got {args.depth}")
    if args.nodes < 1:
        raise InputError(f"--nodes must be >= 1, got {args.nodes}")
    tok = Tokenizer(args.model)
    prompts = _read_prompts(args.prompts, tok)
    out = Path(args.out)                          # checked before any decoding
    if out.is_dir() or (out.exists() and not args.overwrite):
        raise InputError(f"--out {out} exists; pass --overwrite to replace it" if not out.is_dir()
                         else f"--out {out} is a directory; give a file path")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise InputError(f"--out {out}: its directory does not exist or is not writable")
    model = load_model(args.model, dtype=args.dtype)
    freq = record_reveal_sets(model, prompts, cfg, args.depth)
    graph = select_nodes(freq, args.nodes)
    steps = max(freq[frozenset()], 1)       # P(node revealed) per step: the draft budget's prior
    graph.save(args.out, policy=cfg.policy().describe(), depth=args.depth, prompts=len(prompts),
               observations=sum(v for k, v in freq.items() if k), steps=freq[frozenset()],
               acceptance=[round(freq[s] / steps, 6) if s else 1.0 for s in graph.nodes])
    print(f"wrote {len(graph)}-node graph (depth {graph.depth}) to {args.out}: {[sorted(s) for s in graph.nodes]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
