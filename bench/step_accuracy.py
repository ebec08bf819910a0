"""Equation-level accuracy of math-suite completions, per method, from a `bench.eval` JSONL.

    python -m bench.step_accuracy bench/results/eval_math.jsonl

For every method: the share of written ``a op b = c`` equations whose result is right for the
operands the model wrote (`bench.tasks.math.equation_check`), next to the problem accuracy. A
model that writes well-formed plans with wrong arithmetic shows low equation accuracy; one that
computes correctly but plans wrongly shows high equation accuracy and low problem accuracy.
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys

from .tasks.common import read_results
from .tasks.math import equation_check


def summarize(records) -> list[dict]:
    rows: dict[str, dict] = {}
    for r in records:
        row = rows.setdefault(r["method"], {"method": r["method"], "problems": 0, "correct": 0,
                                            "equations": 0, "equations_right": 0})
        ok, total = equation_check(r["completion"])
        row["problems"] += 1
        row["correct"] += bool(r["correct"])
        row["equations"] += total
        row["equations_right"] += ok
    for row in rows.values():
        row["accuracy"] = row["correct"] / row["problems"]
        row["equation_accuracy"] = row["equations_right"] / row["equations"] if row["equations"] else 0.0
    return list(rows.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_accuracy", description=__doc__.split("\n")[0])
    p.add_argument("results", help="per-problem JSONL written by python -m bench.eval --task math")
    args = p.parse_args(argv)
    path = args.results
    try:
        records = read_results(path, ("method", "completion", "correct"))
    except (OSError, ValueError) as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return 2
    rows = summarize(records)
    print("| method | problems | accuracy | equations | equation accuracy |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['problems']} | {100 * r['accuracy']:.1f}% | {r['equations']} | "
              f"{100 * r['equation_accuracy']:.1f}% |")
    print(json.dumps({"results_file": path, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
