"""Errors a caller causes with bad arguments or input; the CLI prints them in one line, exit 2."""
from __future__ import annotations

from pathlib import Path

from models.config import MAX_FILE_BYTES, check_regular, read_bytes, read_text  # noqa: F401  (one checked reader)
from models.config import read_json as _read_checked_json


class InputError(ValueError):
    """Bad decoding arguments or prompt (the message names the problem)."""


class DecodingError(RuntimeError):
    """Decoding cannot go on: the model's output is unusable (NaN/Inf) or a step committed nothing.
    `sequence`: the batch row that failed, when one did (the batch's other rows can go on once it
    leaves, `Decoder.leave`); None when the batch as a whole cannot. `handle`: that sequence's handle
    when `engine.live.LiveBatch.step` raised it (cancel it there and the others go on)."""

    def __init__(self, message: str = "", sequence: int | None = None):
        super().__init__(message)
        self.sequence = sequence
        self.handle: int | None = None


def read_json(path: Path, what: str):
    """The parsed JSON file a caller named (`what`: how messages call it), or an InputError. The
    file is checked to be a regular file of at most MAX_FILE_BYTES before it is opened
    (models.config.read_json, the one reader of named files)."""
    return _read_checked_json(path, what, InputError)


def read_user_text(path, what: str) -> str:
    """The UTF-8 text of a file a caller named, checked as `read_json` checks, or an InputError."""
    return read_text(path, what, InputError)
