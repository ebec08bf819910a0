"""Errors a user can cause by pointing the loader at a bad checkpoint; the CLI prints them in one line."""


class CheckpointError(ValueError):
    """A missing, unreadable or inconsistent model directory (the message names the problem)."""
