"""Code-suite accuracy per method, split by whether the problem's family has several right answers.

    python -m bench.code_breakdown bench/results/eval_code.jsonl [--problems bench/data/code_test.jsonl]

The code suite trains on several equivalent bodies for 28 of its 50 families
(`bench.tasks.code.ALTERNATIVES`: `x + 7` / `7 + x`, a loop variable written twice, ...).
Parallel decoding can only lose where the model is unsure between right answers, so this splits
each method's accuracy into those families and the single-answer ones. The last line is one
JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys

from .tasks import code as code_suite
from .tasks.common import read_results


def summarize(records, problems) -> list[dict]:
    """Per method: accuracy overall, on several-answer families and on single-answer families."""
    family = {p["id"]: p["family"] for p in problems}
    missing = sorted({r["id"] for r in records} - set(family))
    if missing:
        raise ValueError(f"{len(missing)} problem ids are not in the problems file (first: {missing[0]})")
    rows: dict[str, dict] = {}
    for r in records:
        row = rows.setdefault(r["method"], {"method": r["method"], "problems": 0, "correct": 0,
                                            "several": 0, "several_correct": 0, "single": 0, "single_correct": 0})
        part = "several" if family[r["id"]] in code_suite.ALTERNATIVES else "single"
        row["problems"] += 1
        row["correct"] += bool(r["correct"])
        row[part] += 1
        row[part + "_correct"] += bool(r["correct"])
    for row in rows.values():
        row["accuracy"] = row["correct"] / row["problems"]
        for part in ("several", "single"):
            row[part + "_accuracy"] = row[part + "_correct"] / row[part] if row[part] else 0.0
    return list(rows.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.code_breakdown", description=__doc__.split("\n")[0])
    p.add_argument("results", help="per-problem JSONL written by python -m bench.eval --task code")
    p.add_argument("--problems", default=None,
                   help="the code problems the run used (default: the held-out file bench/data/code_test.jsonl)")
    args = p.parse_args(argv)
    try:
        records = read_results(args.results, ("id", "method", "correct"))
        problems = code_suite.load(args.problems)
        if any("family" not in q for q in problems):
            raise ValueError(f"{args.problems or code_suite.TEST_FILE}: problems have no family (not a code-suite file)")
        rows = summarize(records, problems)
    except (OSError, ValueError) as e:
        print(f"error: {args.results}: {e}", file=sys.stderr)
        return 2
    print("| method | problems | accuracy | several right answers | one right answer |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['problems']} | {100 * r['accuracy']:.1f}% | "
              f"{100 * r['several_accuracy']:.1f}% of {r['several']} | {100 * r['single_accuracy']:.1f}% of {r['single']} |")
    print(json.dumps({"results_file": args.results, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
