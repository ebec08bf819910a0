"""pytest for the kernel microbenchmarks' pytest-benchmark view (`pytest bench/bench_top1.py
--benchmark-only`), and stand-ins where pytest is not installed: their command line
(`python -m bench.bench_top1`) is a plain command of an installed wheel, which does not need pytest,
so the view's decorators must not fail at import."""
from __future__ import annotations

try:
    import pytest
except ImportError:                    # a plain install: the view's tests are never collected
    class _Mark:
        def __getattr__(self, name):
            return lambda *args, **kwargs: (lambda f: f)

    class pytest:                      # noqa: N801 -- stands in for the module
        mark = _Mark()

        @staticmethod
        def skip(reason: str = ""):
            raise RuntimeError(f"pytest is not installed ({reason})")

__all__ = ["pytest"]
