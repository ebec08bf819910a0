"""MBPP: the real benchmark, shipped in ``bench/data/mbpp/`` (nothing is downloaded).

Data (google-research/google-research ``mbpp/``, Austin et al. 2021, CC BY 4.0;
``README.md`` and ``SOURCE.txt`` beside the files):

* ``mbpp.jsonl`` - all 974 tasks, ``{"task_id", "text", "code", "test_list"
  (3 asserts), "test_setup_code", "challenge_test_list"}``.  Evaluated by
  default: its **test split, task ids 11-510 (500 problems)**, the split the
  MBPP paper and lm-evaluation-harness's ``mbpp`` task (``full`` config) use.
* ``sanitized-mbpp.json`` - the 427 hand-verified tasks (a JSON list;
  ``prompt`` instead of ``text``, corrected asserts, ``test_imports``).
  ``--data bench/data/mbpp/sanitized-mbpp.json`` evaluates its test split
  (257 problems with ids 11-510).

Splits by task id: prompt 1-10, test 11-510, validation 511-600, train 601-974
(``load(split=...)``; ``"all"`` keeps every task).

Prompt (the MBPP paper's, as lm-eval's ``mbpp`` renders it)::

    You are an expert Python programmer, and here is your task: {text} Your code should pass these tests:

    {test_list, one per line}
    [BEGIN]
    {code}
    [DONE]

3 shots, tasks 2, 3 and 4 of ``mbpp.jsonl`` (the paper's choice; a file without
them gives its first tasks outside the test split, never an evaluated one), each
written out with its reference code verbatim and ``[DONE]``, each followed by
a blank line (``"\\n\\n"``); the query ends with ``[BEGIN]\\n``.

Checker: the completion is cut at the first ``[DONE]`` (or ``\\n[BEGIN]``,
``\\nYou are an expert``), a code fence is unwrapped; if that text compiles it
is used as is, otherwise ``common.extract_code`` pulls the function(s) out.
The program ``test_imports + code + test_setup_code + asserts`` (setup after
the code: the two tasks that have one build trees of the solution's ``Node``
class) runs in the sandbox through ``common.check_code`` (10 s).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

from .common import (DATA_DIR, _FENCE, _compiles, assemble_program, code_suite,
                     extract_code, read_jsonl, require_file, truncate_at,
                     ID, OBJECT, OPT_STR, STR, STR_LIST, TESTS, read_data)

NAME = "mbpp"
DATA_FILE = DATA_DIR / "mbpp" / "mbpp.jsonl"
SANITIZED_FILE = DATA_DIR / "mbpp" / "sanitized-mbpp.json"
DEFAULT_SHOTS = 3
FEW_SHOT_IDS = (2, 3, 4)
# the slowest reference solution (task 123, amicable numbers below 9999) takes
# 3-6 s on a loaded CPU core; 10 s leaves every reference room to pass
TIMEOUT_S = 10.0
SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600),
          "train": (601, 974)}
STOP_SEQUENCES = ("[DONE]", "\n[BEGIN]", "\nYou are an expert")
RUNS_CODE = True           # score runs generated code in bench.sandbox
FIELDS = {"id": ID, "prompt": STR, "answer": STR, "target": OBJECT, "target.tests": TESTS,
          "target.entry_point": OPT_STR, "target.setup": STR, "target.imports": STR_LIST}
HEADER = ("You are an expert Python programmer, and here is your task: {text} "
          "Your code should pass these tests:\n\n{tests}\n[BEGIN]\n")
SHOT_END = "\n[DONE]\n\n"

_CALLED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_DEF = re.compile(r"^def\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(", re.M)


def _entry_point(code: str, tests: list[str]) -> str | None:
    defs = _DEF.findall(code.replace("\r\n", "\n"))
    called = set(_CALLED.findall("\n".join(tests)))
    for name in defs:
        if name in called:
            return name
    return defs[-1] if defs else None


def _problem(rec: dict) -> dict:
    if not isinstance(rec["test_list"], list):
        raise TypeError("'test_list' (a list of assert strings)")
    tests = list(rec["test_list"])
    text = rec["text"] if "text" in rec else rec["prompt"]       # full file / sanitized file
    return {
        "id": f"mbpp-{rec['task_id']}",
        "task_id": rec["task_id"],
        "prompt": text,
        "answer": rec["code"],                                      # verbatim (the full file has \r\n)
        "target": {
            "tests": tests,
            "entry_point": _entry_point(rec["code"], tests),
            "setup": (rec.get("test_setup_code") or "").replace("\r\n", "\n"),
            "imports": list(rec.get("test_imports") or []),
        },
    }


def _read(path) -> list[dict]:
    """Records of an MBPP file: JSONL (``mbpp.jsonl``) or a JSON list
    (``sanitized-mbpp.json``)."""
    p = require_file(path)
    if p.suffix == ".json":
        try:
            recs = json.loads(read_data(p).decode("utf-8"))
        except (ValueError, RecursionError) as e:      # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ValueError(f"cannot read {p}: not valid JSON ({e})") from None
        if not isinstance(recs, list) or not all(isinstance(r, dict) for r in recs):
            raise ValueError(f"{p}: expected a JSON list of objects (sanitized-mbpp.json's layout)")
        return recs
    return read_jsonl(p)


def load(path: str | Path | None = None, split: str = "test", limit: int | None = None) -> list[dict]:
    """Problems of an MBPP file (default: the shipped ``mbpp.jsonl``), filtered
    to ``split`` by task_id (``"all"`` keeps every record)."""
    if split != "all" and split not in SPLITS:
        raise ValueError(f"unknown MBPP split {split!r}; choose from {', '.join(SPLITS)}, all")
    recs = _read(DATA_FILE if path is None else path)
    if split != "all":
        lo, hi = SPLITS[split]
        recs = [r for r in recs if lo <= int(r["task_id"]) <= hi]
    probs = [_problem(r) for r in recs]
    return probs[:limit] if limit is not None else probs


def few_shot(k: int = DEFAULT_SHOTS, path: str | Path | None = None) -> list[dict]:
    """Tasks 2, 3, 4 of ``path`` (default: the shipped ``mbpp.jsonl``); if
    those ids are absent, its first tasks outside the evaluated test split
    (ids 11-510).  A one-line ValueError when that leaves fewer than ``k``
    because the file's other tasks are evaluated ones (a test-split export)."""
    if k <= 0:
        return []
    allp = load(path, split="all")
    by_id = {p["task_id"]: p for p in allp}
    shots = [by_id[i] for i in FEW_SHOT_IDS if i in by_id][:k]
    lo, hi = SPLITS["test"]
    outside = [p for p in allp if p not in shots and not lo <= int(p["task_id"]) <= hi]
    shots += outside[: k - len(shots)]
    if len(shots) < k and len(allp) > len(shots):
        raise ValueError(f"--few-shot {k}: {DATA_FILE if path is None else path} holds only {len(shots)} MBPP "
                         f"tasks outside the evaluated test split (task ids {lo}-{hi}; the shots are tasks "
                         f"{', '.join(map(str, FEW_SHOT_IDS))}); give --few-shot-data FILE with such tasks")
    return shots


def _header(problem: dict) -> str:
    return HEADER.format(text=problem["prompt"], tests="\n".join(problem["target"]["tests"]))


def format_prompt(problem: dict, few_shot: Iterable[dict] = ()) -> str:
    shots = "".join(_header(s) + s["answer"] + SHOT_END for s in few_shot)
    return shots + _header(problem)


def extract(completion: str, problem: dict) -> str | None:
    text = truncate_at(completion.replace("\r\n", "\n"), STOP_SEQUENCES)
    m = _FENCE.search(text)
    if m:
        text = m.group(1)
    if text.strip() and _compiles(text):
        return text.strip("\n") + "\n"
    return extract_code(text, problem["target"].get("entry_point"))


def build_program(completion: str, problem: dict) -> str | None:
    t = problem["target"]
    return assemble_program(extract(completion, problem), t["tests"],
                        imports="\n".join(t.get("imports") or ()), setup=t.get("setup") or "")


score, score_batch, check = code_suite(build_program, FIELDS, TIMEOUT_S)
