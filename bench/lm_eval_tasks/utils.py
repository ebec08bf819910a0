"""Data loaders and the pass@1 metric of the offline lm-eval tasks gsm8k_local and mbpp_local.

lm-eval imports this file by path (`!function utils.NAME` in the YAMLs beside it). Every path
is resolved from this file, so the tasks work from any directory, from a checkout or an
installed wheel, with no network (docs/lm_eval.md, "Offline tasks").
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
GSM8K_FILE = DATA_DIR / "gsm8k" / "test.jsonl"
MBPP_FILE = DATA_DIR / "mbpp" / "mbpp.jsonl"
GSM8K_SHOT_POOL = 5                      # the first 5 problems: few-shot pool, never evaluated (bench/tasks/gsm8k.py)
MBPP_SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)}   # the hub's `full`
MBPP_FEW_SHOT_IDS = (2, 3, 4)
MBPP_TIMEOUT_S = 10.0                    # as bench.eval (bench/tasks/mbpp.py): the slowest reference needs 3-6 s loaded


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _dataset_dict(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def gsm8k_dataset(**_metadata):
    """{"train": the first 5 problems (the shots), "test": the other 1,314}, fields question, answer."""
    rows = [{"question": r["question"], "answer": r["answer"]} for r in _jsonl(GSM8K_FILE)]
    return _dataset_dict({"train": rows[:GSM8K_SHOT_POOL], "test": rows[GSM8K_SHOT_POOL:]})


def _mbpp_rows() -> list[dict]:
    keys = ("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list")
    return [{k: r.get(k, [] if k == "challenge_test_list" else "") for k in keys} for r in _jsonl(MBPP_FILE)]


def mbpp_dataset(**_metadata):
    """The hub's `full` configuration of MBPP, from the shipped file: splits by task id."""
    rows = _mbpp_rows()
    return _dataset_dict({name: [r for r in rows if lo <= r["task_id"] <= hi]
                          for name, (lo, hi) in MBPP_SPLITS.items()})


def list_fewshot_samples() -> list[dict]:
    """MBPP tasks 2, 3 and 4 (the paper's and lm-eval's shots), marked as shots for doc_to_target."""
    by_id = {r["task_id"]: r for r in _mbpp_rows()}
    return [{**by_id[i], "is_fewshot": True} for i in MBPP_FEW_SHOT_IDS]


def _sandbox():
    try:
        from bench import sandbox
    except ImportError:                  # lm-eval run without psd-engine importable: this file's package
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from bench import sandbox
    return sandbox


def pass_at_1(references, predictions) -> float:
    """lm-eval mbpp's pass@1 (one sample per problem): the share of predictions whose program
    `prediction + "\\n" + reference asserts` runs to its end, each in the sandbox."""
    if isinstance(references, str):
        references = [references]
    preds = [p if isinstance(p, str) else p[0] for p in predictions]
    results = _sandbox().run_python_batch([p + "\n" + r for p, r in zip(preds, references, strict=True)],
                                          timeout_s=MBPP_TIMEOUT_S)
    return sum(r.ok for r in results) / max(len(results), 1)
