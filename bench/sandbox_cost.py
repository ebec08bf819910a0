"""Wall-clock and CPU cost of scoring code in the sandbox: HumanEval's 164 canonical solutions and
the MBPP reference solutions, each suite as one `run_python_batch` call (as the checkers score), plus
a few single `run_python` calls; every verdict must be `passed`.

    python -m bench.sandbox_cost [--repeats 3] [--mbpp 100]
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

from bench._common import cpu_model
from bench.sandbox import isolation_details, run_python


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _time(label: str, fn, n: int, repeats: int) -> None:
    for _ in range(repeats):
        c, t = _cpu(), time.perf_counter()
        ok = fn()
        wall, cpu = time.perf_counter() - t, _cpu() - c
        print(f"{label:28s} n={n:4d}  wall {wall:6.2f} s ({1000 * wall / n:5.1f} ms each)  "
              f"cpu {cpu:6.2f} s ({1000 * cpu / n:5.1f} ms each)  all passed: {ok}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sandbox_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mbpp", type=int, default=100, help="how many MBPP problems (reference solutions)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.mbpp < 1:
        print("error: --repeats and --mbpp must be >= 1", file=sys.stderr)
        return 2
    from bench.tasks import humaneval, mbpp

    print(f"# {cpu_model('unknown CPU')}; sandbox {isolation_details()}")
    he = humaneval.load()
    mb = mbpp.load()[:args.mbpp]
    _time("humaneval canonical (batch)", lambda: all(humaneval.score_batch([p["answer"] for p in he], he)),
          len(he), args.repeats)
    _time("mbpp references (batch)", lambda: all(mbpp.score_batch([p["answer"] for p in mb], mb)),
          len(mb), args.repeats)
    _time("run_python, one each", lambda: all(run_python("assert 1 + 1 == 2\n").ok for _ in range(20)), 20,
          args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
