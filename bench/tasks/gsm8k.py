"""GSM8K: the real test set, shipped in ``bench/data/gsm8k/`` (nothing is downloaded).

Data: ``bench/data/gsm8k/test.jsonl``, the official test split (1,319 problems,
openai/grade-school-math, MIT licence; ``LICENSE`` and ``SOURCE.txt`` beside
it).  Each line is ``{"question": ..., "answer": "... <<48/2=24>> ... #### 72"}``.
``load(path)`` reads any file in that format instead (``--data``).

Prompt (lm-evaluation-harness's ``gsm8k`` task, version 3.0): every shot is
``"Question: {question}\\nAnswer: {answer}"`` with the official answer verbatim
(calculator annotations included), shots are followed by ``"\\n\\n"``, and the
query is ``"Question: {question}\\nAnswer:"`` (no trailing space).

Few-shot examples: lm-eval draws 5 random *train* problems per question; only
the test split ships here, so the first ``SHOT_POOL`` (5) problems of the file
(lines 0-4) are set aside as the shots, in file order, and ``load`` never
returns them: the evaluated set is lines 5-1318 (1,314 problems, ids
``gsm8k-5`` .. ``gsm8k-1318``) whatever ``--few-shot`` is.  ``few_shot(k,
path)`` with a separate file (``--few-shot-data``, e.g. the official
``train.jsonl``) takes that file's first ``k`` problems instead.

Scoring: lm-eval's two filters, both computed (``metrics``):

* ``strict_match``: the first ``#### (-?[0-9.,]+)`` in the completion;
* ``flexible_extract``: the *last* match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)``;

then lm-eval's ``exact_match``: drop ``,``, ``$``, everything up to the last
``"#### "`` and one trailing ``.`` from prediction and reference, lower-case,
compare the strings.  ``score`` (the ``correct`` column of bench.eval) is the
flexible-extract verdict.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Sequence

from .common import DATA_DIR, ID, NUMBER, STR, check_fields, read_jsonl

NAME = "gsm8k"
DATA_FILE = DATA_DIR / "gsm8k" / "test.jsonl"
DEFAULT_SHOTS = 5
SHOT_POOL = 5                      # lines 0-4 of the test file: shots, never evaluated
STOP_SEQUENCES = ("Question:", "</s>", "<|im_end|>")     # lm-eval gsm8k's `until`
METRICS = ("strict_match", "flexible_extract")
FIELDS = {"id": ID, "prompt": STR, "answer": STR, "target": NUMBER}   # checked before decoding

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


def _target(answer: str) -> str:
    if not isinstance(answer, str):
        raise TypeError("'answer' (a string)")
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '####' line")
    return answer.split("####")[-1].strip().replace(",", "")


def _problem(i: int, rec: dict) -> dict:
    return {"id": f"gsm8k-{i}", "prompt": rec["question"], "answer": rec["answer"],
            "target": _target(rec["answer"])}


def _records(path) -> list[dict]:
    path = DATA_FILE if path is None else path
    out = []
    for i, r in enumerate(read_jsonl(path)):
        try:
            out.append(_problem(i, r))
        except ValueError as e:          # which record: the others' errors name it too
            raise ValueError(f"{path}: record {i + 1} (gsm8k-{i}): {e}") from None
    return out


def load(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """Problems of a GSM8K JSONL file (default: the shipped test set), without
    its first ``SHOT_POOL`` lines (the few-shot examples)."""
    probs = _records(path)[SHOT_POOL:]
    return probs[:limit] if limit is not None else probs


def few_shot(k: int = DEFAULT_SHOTS, path: str | Path | None = None) -> list[dict]:
    """The first ``k`` problems of ``path`` (default: the shipped test set,
    whose first ``SHOT_POOL`` problems ``load`` leaves out)."""
    if k <= 0:
        return []
    if k > SHOT_POOL:
        raise ValueError(f"gsm8k sets aside {SHOT_POOL} few-shot examples (the first problems of the file), "
                         f"got --few-shot {k}")
    return _records(path)[:k]


def format_prompt(problem: dict, few_shot: Iterable[dict] = ()) -> str:
    shots = "".join(f"Question: {s['prompt']}\nAnswer: {s['answer']}\n\n" for s in few_shot)
    return shots + f"Question: {problem['prompt']}\nAnswer:"


# --------------------------------------------------------------------------
# lm-eval's filters and exact_match


def _first_group(match) -> str | None:
    if isinstance(match, tuple):
        match = next((m for m in match if m), None)
    return None if match is None else match.strip()


def strict_extract(completion: str) -> str | None:
    """strict-match: the number of the first ``#### N`` (None if there is none)."""
    found = STRICT.findall(completion)
    return _first_group(found[0]) if found else None


def flexible_extract(completion: str) -> str | None:
    """flexible-extract: the last number-like token of the completion (None if none)."""
    found = FLEXIBLE.findall(completion)
    return _first_group(found[-1]) if found else None


def normalise(text: str) -> str:
    """lm-eval gsm8k's exact_match normalisation (applied to both sides)."""
    for rx in _IGNORE:
        text = rx.sub("", text)
    return text.lower()


def _match(pred: str | None, problem: dict) -> bool:
    return pred is not None and normalise(pred) == normalise(problem["target"])


def metrics(completion: str, problem: dict) -> dict[str, bool]:
    """Both lm-eval verdicts: ``{"strict_match": ..., "flexible_extract": ...}``."""
    return {"strict_match": _match(strict_extract(completion), problem),
            "flexible_extract": _match(flexible_extract(completion), problem)}


def score(completion: str, problem: dict) -> bool:
    """The flexible-extract verdict."""
    return _match(flexible_extract(completion), problem)


def score_batch(completions: Sequence[str], problems: Sequence[dict]) -> list[bool]:
    return [score(c, p) for c, p in zip(completions, problems, strict=True)]


def check(problems: Sequence[dict], source: str) -> None:
    """A one-line ValueError unless every problem has the fields ``FIELDS`` names (bench.eval
    calls it on all rows before decoding anything)."""
    check_fields(problems, FIELDS, source)
