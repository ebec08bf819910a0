"""GSM8K loader (local JSONL in the official format; nothing is downloaded).

Each line of the official ``test.jsonl`` / ``train.jsonl`` is
``{"question": ..., "answer": "... <<48/2=24>> ... #### 72"}``.

Problems: ``id`` = ``gsm8k-<line index>``, ``prompt`` = question, ``answer``
= the reference solution with the ``<<...>>`` calculator annotations removed,
``target`` = the number after ``####`` (commas removed).

Prompt format: the same as the ``math`` suite (and lm-evaluation-harness's
``gsm8k``): ``Question: <q>\\nAnswer: `` with few-shot pairs separated by a
blank line.  Few-shot examples are the first ``k`` (default 5) problems of
the *train* file, if one is given.  Checker: the math suite's flexible match.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Sequence

from .common import (extract_answer_number, numbers_equal, qa_prompt,
                     read_jsonl)

NAME = "gsm8k"
ANSWER_SEP = " "
DEFAULT_SHOTS = 5
STOP_SEQUENCES = ("\nQuestion:", "\n\n")

_CALC = re.compile(r"<<[^>]*>>")


def _target(answer: str) -> str:
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '####' line")
    return answer.split("####")[-1].strip().replace(",", "")


def _problem(i: int, rec: dict) -> dict:
    return {
        "id": f"gsm8k-{i}",
        "prompt": rec["question"].strip(),
        "answer": _CALC.sub("", rec["answer"]).strip(),
        "target": _target(rec["answer"]),
    }


def load(path: str | Path, limit: int | None = None) -> list[dict]:
    """Problems from a GSM8K JSONL file (``question``/``answer`` fields)."""
    recs = read_jsonl(path)
    if limit is not None:
        recs = recs[:limit]
    return [_problem(i, r) for i, r in enumerate(recs)]


def few_shot(k: int = DEFAULT_SHOTS, path: str | Path | None = None) -> list[dict]:
    """The first ``k`` problems of the train file ``path`` ([] if no path)."""
    if path is None or k <= 0:
        return []
    return load(path, limit=k)


def format_prompt(problem: dict, few_shot: Iterable[dict] = ()) -> str:
    return qa_prompt(problem["prompt"], ANSWER_SEP, few_shot)


def score(completion: str, problem: dict) -> bool:
    """Flexible match: number after ``####``, else the last number."""
    return numbers_equal(extract_answer_number(completion), problem["target"])


def score_batch(completions: Sequence[str], problems: Sequence[dict]) -> list[bool]:
    return [score(c, p) for c, p in zip(completions, problems, strict=True)]
