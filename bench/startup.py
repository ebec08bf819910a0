"""Start-up time of the command line, measured from outside the process.

    python -m bench.startup                      # 5 interleaved rounds in this checkout
    python -m bench.startup --rounds 9 --repo /tmp/before /tmp/after    # two checkouts side by side

Per command, seconds from process start to: the first byte of streamed text on stdout of
`python -m engine.generate --stream` (the shipped model's sample question; the process is killed
there), with torch's default threads and with `--threads 1`; the exit of `python -m
engine.generate --help`; the exit of `python -c "import torch"` (the floor). Commands and
checkouts are interleaved round by round, so a busy machine slows them alike; the median and
every run are printed.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine.errors import InputError
from engine.frontend import Parser, guarded

GENERATE = [sys.executable, "-m", "engine.generate"]
COMMANDS = {
    "first token": GENERATE + ["--stream"],
    "first token, --threads 1": GENERATE + ["--stream", "--threads", "1"],
    "help": GENERATE + ["--help"],
    "import torch": [sys.executable, "-c", "import torch"],
}


def seconds(cmd: list[str], cwd: Path, first_byte: bool, timeout: float = 300) -> float:
    """Wall time from the start of `cmd` to its first stdout byte (then it is killed) or its exit."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        if first_byte:
            if not p.stdout.read(1):
                raise InputError(f"{' '.join(cmd[1:])} in {cwd} printed nothing")
            return time.perf_counter() - t0
        p.stdout.read()
        if p.wait(timeout) != 0:
            raise InputError(f"{' '.join(cmd[1:])} in {cwd} exited with {p.returncode}")
        return time.perf_counter() - t0
    finally:
        p.kill()
        p.wait()


def build_parser() -> Parser:
    ap = Parser(prog="python -m bench.startup", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repo", nargs="+", default=[str(Path(__file__).resolve().parents[1])],
                    help="checkouts to time side by side (default: this one)")
    ap.add_argument("--commands", nargs="+", choices=sorted(COMMANDS), default=list(COMMANDS))
    return ap


def run(args) -> int:
    if args.rounds < 1:
        raise InputError(f"--rounds must be >= 1, got {args.rounds}")
    repos = [Path(r) for r in args.repo]
    for r in repos:
        if not (r / "engine" / "generate.py").is_file():
            raise InputError(f"--repo {r} is not a psd-engine checkout (no engine/generate.py)")
    times = {(r, c): [] for r in repos for c in args.commands}
    for _ in range(args.rounds):
        for c in args.commands:
            for r in repos:
                times[(r, c)].append(seconds(COMMANDS[c], r, c.startswith("first token")))
    print("| checkout | command | median s | runs |")
    print("|---|---|---|---|")
    for (r, c), v in times.items():
        print(f"| {r} | {c} | {statistics.median(v):.2f} | {' '.join(f'{x:.2f}' for x in v)} |")
    return 0


def main(argv=None) -> int:
    return guarded(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
