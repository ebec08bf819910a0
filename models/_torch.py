"""The first thing every package here imports: PyTorch, or one error line saying it is missing.

A `pip install --no-deps .` (or a virtualenv without torch) otherwise answers `python -m
engine.generate` with a ModuleNotFoundError traceback from deep inside the package. From a command
line of this project (`python -m engine.generate`, `engine.serve`, `bench.eval`, ...; the psd-*
console scripts) it is one `error:` line and exit status 2; imported by another program it is a
ModuleNotFoundError (name "torch") whose message says what to install. Ctrl-C while it loads: one
`interrupted` line (`quiet_start`).
"""
import os
import signal
import sys

PACKAGES = ("engine", "models", "bench", "psd_kernels")
CONSOLE_SCRIPTS = ("psd-generate", "psd-serve", "psd-eval")   # setup.py's entry points


def _from_command_line() -> bool:
    if sys.argv[:1] == ["-m"]:              # `python -m pkg.mod` while runpy imports pkg
        return True
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.split(".")[0] in PACKAGES:
        return True
    return bool(sys.argv) and os.path.basename(sys.argv[0]) in CONSOLE_SCRIPTS


def _interrupted_while_loading(signum, frame):
    sys.stderr.write("interrupted\n")
    raise SystemExit(130)


def quiet_start() -> None:
    """From a command line of this project, Ctrl-C while the packages load (importing torch takes
    seconds) is one `interrupted` line and exit status 130, not a traceback from inside an import;
    `engine.frontend.guarded` gives SIGINT back to Python (KeyboardInterrupt) once the command runs
    (`loud_interrupts`). Nothing changes where SIGINT is ignored or handled already."""
    try:
        if _from_command_line() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _interrupted_while_loading)
    except ValueError:             # not the main thread: signals are not its to set
        pass


def loud_interrupts() -> None:
    """SIGINT as Python's KeyboardInterrupt again, where `quiet_start` had set it."""
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted_while_loading:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:             # not the main thread
        pass


def require_torch():
    quiet_start()
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        message = (f"psd-engine needs PyTorch, which {sys.executable} cannot import: install it first "
                   f"(`bash install.sh` in the repository for the CPU build, or `pip install torch`)")
        if _from_command_line():
            sys.stderr.write(f"error: {message}\n")
            raise SystemExit(2) from None
        raise ModuleNotFoundError(message, name="torch") from None
    return torch
