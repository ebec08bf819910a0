"""Errors a caller causes with bad arguments or input; the CLI prints them in one line, exit 2."""


class InputError(ValueError):
    """Bad decoding arguments or prompt (the message names the problem)."""


class DecodingError(RuntimeError):
    """Decoding cannot go on: the model's output is unusable (NaN/Inf) or a step committed nothing."""
