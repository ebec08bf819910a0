"""`python -m engine`: the same command as `python -m engine.generate` (engine/cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
