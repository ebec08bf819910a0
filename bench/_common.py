"""Shared plumbing of the kernel microbenchmarks: device description, timing, peak copy
bandwidth and CSV output under ``runs/bench/`` of the current directory.

On CUDA, times come from ``triton.testing.do_bench`` (median, L2 flushed between runs); on CPU
from a perf_counter loop (median). Every CSV row carries the device name and the torch and
triton versions, so files from different machines can be concatenated.
"""
from __future__ import annotations

import csv
import datetime
import importlib.metadata
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

# microbenchmark CSVs go to runs/bench/ under the current directory (git-ignored in a checkout; never
# inside an installed package; bench/results/ holds the committed tables, which only
# bench/reproduce_results.sh writes); PSD_BENCH_RESULTS=DIR sends them elsewhere
RESULTS = Path(os.environ.get("PSD_BENCH_RESULTS") or "runs/bench")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_model(default: str) -> str:
    """The CPU's model name from /proc/cpuinfo, or `default` where it has none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model(platform.processor() or platform.machine())} ({torch.get_num_threads()} threads)"


def versions() -> dict[str, str]:
    try:
        triton_version = importlib.metadata.version("triton")  # no import: triton is optional
    except importlib.metadata.PackageNotFoundError:
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version}


def triton_usable(device: torch.device) -> bool:
    """The Triton provider is timed only compiled, on CUDA: interpreter timings mean nothing."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def time_ms(fn: Callable[[], object], device: torch.device, rep_ms: float = 100.0) -> float:
    """Median milliseconds per call of ``fn``."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    fn()  # warm-up: first-touch allocation, lazy init
    times = []
    deadline = time.perf_counter() + rep_ms / 1000.0
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


_PEAK: dict[str, float] = {}


def copy_bandwidth_gbps(device: torch.device, nbytes: int | None = None) -> float:
    """Achievable memory bandwidth: a device-to-device copy moves 2·nbytes (read + write)."""
    key = str(device)
    if key not in _PEAK:
        nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        ms = time_ms(lambda: dst.copy_(src), device, rep_ms=200.0)
        _PEAK[key] = 2 * nbytes / (ms * 1e-3) / 1e9
    return _PEAK[key]


def peak_memory_mb(fn: Callable[[], object], device: torch.device) -> float | None:
    """Extra device memory one call allocates at its peak (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48]


def write_csv(bench: str, rows: list[dict], device: torch.device) -> Path:
    """Write rows to RESULTS/<bench>_<device>.csv (replacing an older run on that device)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = device_name(device)
    stamp = {"device": name, **versions(), "date": datetime.datetime.now().isoformat(timespec="seconds")}
    path = RESULTS / f"{bench}_{'cpu' if device.type == 'cpu' else slug(name)}.csv"
    write_rows(path, rows, stamp)
    return path


def write_rows(path: Path, rows: list[dict], stamp: dict) -> None:
    """CSV of `rows`, each followed by the `stamp` columns (device, versions, command, ...); the
    columns are every key in order of first appearance."""
    full = [{**row, **stamp} for row in rows]
    fields: list[str] = []
    for row in full:
        fields += [k for k in row if k not in fields]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(full)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


THREADS_HELP = ("torch CPU threads (default: PSD_BENCH_THREADS, else torch's, one per core, as engine.serve; "
                "on a busy or shared CPU fewer, often 1, can be many times faster)")


def bench_threads(n: int | None = None) -> None:
    """Pin CPU benchmarks to `n` threads (a command's --threads), else to PSD_BENCH_THREADS (shared
    machines), else leave torch's default; the C allocator tuned as the engine's commands do
    (engine.frontend.tune_allocator)."""
    from engine.frontend import tune_allocator

    tune_allocator()
    n = n or os.environ.get("PSD_BENCH_THREADS")
    if n:
        torch.set_num_threads(int(n))
