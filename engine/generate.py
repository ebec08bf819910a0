"""`python -m engine.generate`: the command-line entry (its code is engine/cli.py).

`engine.generate` is also the decoder function (engine/loop.py), and Python binds an imported
submodule as an attribute of its package. So this module, imported rather than run, puts that
function in its own place in sys.modules, and the import binds the function: after
`import engine.generate`, `engine.generate(model, prompts)` still calls the decoder, as documented.
"""
import sys

if __name__ == "__main__":
    from .cli import main

    sys.exit(main())
else:
    from .loop import generate

    sys.modules[__name__] = generate
