"""Errors a caller causes with bad arguments or input; the CLI prints them in one line, exit 2."""


class InputError(ValueError):
    """Bad decoding arguments or prompt (the message names the problem)."""
