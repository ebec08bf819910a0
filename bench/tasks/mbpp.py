"""MBPP loader (local JSONL in the original format; nothing is downloaded).

Each line of the original ``mbpp.jsonl`` is ``{"task_id": 11, "text": ...,
"code": ..., "test_list": [3 asserts], "test_setup_code": "",
"challenge_test_list": [...]}``.  The full file holds all 974 tasks; the
standard splits are by ``task_id``: prompt 1-10, test 11-510, validation
511-600, train 601-974 (``load(split=...)``; ``split="all"`` keeps every line).

Prompt format (the original MBPP / lm-evaluation-harness prompt)::

    You are an expert Python programmer, and here is your task: {text} Your code should pass these tests:

    {test_list, one per line}
    [BEGIN]
    {code}
    [DONE]

Few-shot examples (default 3) are tasks 2, 3 and 4 (the standard choice) taken
from the prompt split of the file given to ``few_shot`` (or, if those ids are
absent, its first tasks); they are written out with their code and
``[DONE]``; the query ends with ``[BEGIN]\\n``.

Checker: the completion is cut at the first ``[DONE]`` (or a new
``[BEGIN]``/``You are an expert``), a ``` fence is unwrapped; if that text
compiles it is used as is (the standard behaviour), otherwise
``common.extract_code`` pulls out the function(s).  Then
``test_setup_code + code + test_list`` runs in the sandbox.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Sequence

from ..sandbox import run_python, run_python_batch
from .common import _FENCE, _compiles, extract_code, read_jsonl, truncate_at

NAME = "mbpp"
DEFAULT_SHOTS = 3
FEW_SHOT_IDS = (2, 3, 4)
TIMEOUT_S = 5.0
SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600),
          "train": (601, 974)}
STOP_SEQUENCES = ("[DONE]", "\n[BEGIN]", "\nYou are an expert")
HEADER = ("You are an expert Python programmer, and here is your task: {text} "
          "Your code should pass these tests:\n\n{tests}\n")

_CALLED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_DEF = re.compile(r"^def\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(", re.M)


def _entry_point(code: str, tests: list[str]) -> str | None:
    defs = _DEF.findall(code)
    called = set(_CALLED.findall("\n".join(tests)))
    for name in defs:
        if name in called:
            return name
    return defs[-1] if defs else None


def _problem(rec: dict) -> dict:
    tests = list(rec["test_list"])
    code = rec["code"].replace("\r\n", "\n").replace("\r", "\n")
    return {
        "id": f"mbpp-{rec['task_id']}",
        "task_id": rec["task_id"],
        "prompt": rec["text"].strip(),
        "answer": code,
        "target": {
            "tests": tests,
            "entry_point": _entry_point(code, tests),
            "setup": rec.get("test_setup_code") or "",
        },
    }


def load(path: str | Path, split: str = "test", limit: int | None = None) -> list[dict]:
    """Problems from an MBPP JSONL file, filtered to ``split`` by task_id
    (``"all"`` keeps every record)."""
    if split != "all" and split not in SPLITS:
        raise ValueError(f"unknown MBPP split {split!r}; choose from {', '.join(SPLITS)}, all")
    recs = read_jsonl(path)
    if split != "all":
        lo, hi = SPLITS[split]
        recs = [r for r in recs if lo <= int(r["task_id"]) <= hi]
    probs = [_problem(r) for r in recs]
    return probs[:limit] if limit is not None else probs


def few_shot(k: int = DEFAULT_SHOTS, path: str | Path | None = None) -> list[dict]:
    """Tasks 2, 3, 4 of the file ``path`` (first ``k`` records if absent)."""
    if path is None or k <= 0:
        return []
    allp = load(path, split="all")
    by_id = {p["task_id"]: p for p in allp}
    shots = [by_id[i] for i in FEW_SHOT_IDS if i in by_id][:k]
    if len(shots) < k:
        shots += [p for p in allp if p not in shots][: k - len(shots)]
    return shots


def _header(problem: dict) -> str:
    return HEADER.format(text=problem["prompt"], tests="\n".join(problem["target"]["tests"]))


def format_prompt(problem: dict, few_shot: Iterable[dict] = ()) -> str:
    parts = [_header(s) + "[BEGIN]\n" + s["answer"].strip() + "\n[DONE]\n" for s in few_shot]
    parts.append(_header(problem) + "[BEGIN]\n")
    return "\n".join(parts)


def extract(completion: str, problem: dict) -> str | None:
    text = truncate_at(completion.replace("\r\n", "\n"), STOP_SEQUENCES)
    m = _FENCE.search(text)
    if m:
        text = m.group(1)
    if text.strip() and _compiles(text):
        return text.strip("\n") + "\n"
    return extract_code(text, problem["target"].get("entry_point"))


def build_program(completion: str, problem: dict) -> str | None:
    code = extract(completion, problem)
    if code is None:
        return None
    t = problem["target"]
    setup = t.get("setup") or ""
    return (setup + "\n" if setup else "") + code + "\n\n" + "\n".join(t["tests"]) + "\n"


def score(completion: str, problem: dict, timeout_s: float = TIMEOUT_S) -> bool:
    prog = build_program(completion, problem)
    return prog is not None and run_python(prog, timeout_s=timeout_s).ok


def score_batch(completions: Sequence[str], problems: Sequence[dict],
                timeout_s: float = TIMEOUT_S) -> list[bool]:
    progs = [build_program(c, p) for c, p in zip(completions, problems, strict=True)]
    idx = [i for i, p in enumerate(progs) if p is not None]
    res = run_python_batch([progs[i] for i in idx], timeout_s=timeout_s)
    out = [False] * len(progs)
    for i, r in zip(idx, res):
        out[i] = r.ok
    return out
