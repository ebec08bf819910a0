"""Entry point of `python -m engine.generate` (the code lives in engine/cli.py, so that importing
this module never shadows the `engine.generate` function)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
