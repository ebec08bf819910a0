"""Regenerate the committed held-out files deterministically.

    python -m bench.tasks.make_data              # write bench/data/*_test.jsonl
    python -m bench.tasks.make_data --check      # verify the committed files
    python -m bench.tasks.make_data --out-dir D  # write elsewhere

Training data is generated on the fly with ``generate_train(n, seed)`` of
``bench.tasks.math`` / ``bench.tasks.code``, which skips every held-out
problem; ``--train N --train-seed S`` also writes ``<suite>_train.jsonl``
files (not committed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import code, math
from .common import DATA_DIR, dumps_jsonl, write_jsonl

SUITES = {"math": math, "code": code}


def heldout_text(suite) -> str:
    """The exact bytes (as str) of a suite's held-out file."""
    return dumps_jsonl(suite.generate(suite.TEST_N, suite.TEST_SEED))


def write_heldout(out_dir: str | Path = DATA_DIR) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, suite in SUITES.items():
        p = out_dir / f"{name}_test.jsonl"
        with open(p, "w", encoding="ascii", newline="\n") as f:
            f.write(heldout_text(suite))
        paths.append(p)
    return paths


def check_heldout(data_dir: str | Path = DATA_DIR) -> list[str]:
    """Names of suites whose committed file differs from a regeneration."""
    bad = []
    for name, suite in SUITES.items():
        p = Path(data_dir) / f"{name}_test.jsonl"
        if not p.is_file() or p.read_bytes() != heldout_text(suite).encode("ascii"):
            bad.append(name)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tasks.make_data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=str(DATA_DIR))
    ap.add_argument("--check", action="store_true", help="only verify, exit 1 on mismatch")
    ap.add_argument("--train", type=int, default=0, help="also write N training problems per suite")
    ap.add_argument("--train-seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.check:
        bad = check_heldout(args.out_dir)
        if bad:
            print(f"held-out files differ from regeneration: {', '.join(bad)}", file=sys.stderr)
            return 1
        print("held-out files are up to date")
        return 0
    for p in write_heldout(args.out_dir):
        print(f"wrote {p}")
    if args.train > 0:
        for name, suite in SUITES.items():
            p = Path(args.out_dir) / f"{name}_train.jsonl"
            write_jsonl(p, suite.generate_train(args.train, args.train_seed))
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
