"""Errors a caller causes with bad arguments or input; the CLI prints them in one line, exit 2."""
from __future__ import annotations

import json
from pathlib import Path


class InputError(ValueError):
    """Bad decoding arguments or prompt (the message names the problem)."""


class DecodingError(RuntimeError):
    """Decoding cannot go on: the model's output is unusable (NaN/Inf) or a step committed nothing."""


def read_json(path: Path, what: str):
    """The parsed JSON file a caller named (`what`: how messages call it), or an InputError."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{what} {path} not found") from None
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {what} {path}: {e}") from None
