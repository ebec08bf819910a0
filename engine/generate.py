"""`python -m engine.generate`: the command-line entry (its code is engine/cli.py).

Importing this module never replaces the function `engine.generate`: the `engine` package
refuses to rebind that name to a submodule (engine/__init__.py), so `import engine.generate`
followed by `engine.generate(model, prompts)` calls the decoder, as documented.
"""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
