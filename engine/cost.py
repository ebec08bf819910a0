"""The cost of one model call as a function of the canvases it holds (engine/budget.py uses it).

`CostModel` is piecewise linear through measured points; `measure` times calls of the decoder's
own rows; `CostModel.from_profile` reads what `python -m bench.speed --cost-curve` writes
(docs/gpu.md: `{"format": "psd-cost-profile/1", "curves": [{"cache", "block_length", "prefix",
"batch", "rows", "ms", ...}]}`).
"""
from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from pathlib import Path

import torch

from models.config import cache_dir, keep_file

from .errors import InputError, read_json

PROFILE_FORMAT = "psd-cost-profile/1"


class CostModel:
    """ms of one call holding `n` canvases: piecewise linear through measured points, linear in
    n (through the last point) beyond them."""

    def __init__(self, canvases, ms, source: str = "given"):
        canvases, ms = list(canvases), list(ms)
        if len(canvases) != len(ms):
            raise InputError(f"a cost model needs one ms per canvas count; got {len(canvases)} canvas counts and "
                             f"{len(ms)} times")
        pts = sorted(zip(canvases, ms))
        if not pts or any(n < 1 or not (t > 0 and math.isfinite(t)) for n, t in pts):
            raise InputError(f"a cost model needs points (canvases >= 1, ms > 0); got {list(zip(canvases, ms))}")
        self.n = [float(n) for n, _ in pts]
        self.ms_at = [float(t) for _, t in pts]
        self.source = source

    def ms(self, n: float) -> float:
        xs, ys = self.n, self.ms_at
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            return ys[-1] * n / xs[-1]
        i = next(i for i in range(1, len(xs)) if xs[i] >= n)
        w = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])

    @classmethod
    def from_profile(cls, path: str | Path, cache: str, block_length: int, prefix: int,
                     curves: list[dict] | None = None) -> "CostModel":
        """The curves of a `bench.speed --cost-curve` profile for this cache mode and block length,
        at the profiled prefix nearest to `prefix`; points = (batch · rows, ms). `curves`: the
        profile as `read_profile` returned it (read now if not given)."""
        path = Path(path)
        curves = read_profile(path) if curves is None else curves
        fit = [c for c in curves if c["cache"] == cache and c["block_length"] == block_length]
        have = sorted({(c["cache"], c["block_length"]) for c in curves})
        if not fit:
            raise InputError(f"cost profile {path} has no curve for cache {cache} and block length {block_length} "
                             f"(it has {', '.join(f'{a}/{b}' for a, b in have) or 'none'})")
        near = min({c["prefix"] for c in fit}, key=lambda s: abs(math.log(max(s, 1) / max(prefix, 1))))
        pts = [(c["batch"] * r, t) for c in fit if c["prefix"] == near for r, t in zip(c["rows"], c["ms"])]
        best: dict[int, float] = {}
        for n, t in pts:                          # one time per canvas count: the fastest measured
            best[n] = min(t, best.get(n, float("inf")))
        return cls(list(best), list(best.values()), f"{path} (prefix {near})")


def _is_int(v, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _is_ms(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _show(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def read_profile(path: str | Path) -> list[dict]:
    """The curves of a cost profile file, every field type-checked (an InputError of one line naming
    the curve and the field otherwise): the file is read once, before anything is decoded."""
    path = Path(path)
    raw = read_json(path, "cost profile")
    curves = raw.get("curves") if isinstance(raw, dict) else None
    if not isinstance(curves, list) or raw.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
        raise InputError(f"cost profile {path} is not a {PROFILE_FORMAT} file (bench.speed --cost-curve writes one)")
    checks = (("cache", lambda v: isinstance(v, str), "a cache mode (a string)"),
              ("block_length", lambda v: _is_int(v, 1), "a positive integer"),
              ("prefix", lambda v: _is_int(v, 0), "a non-negative integer"),
              ("batch", lambda v: _is_int(v, 1), "a positive integer"),
              ("rows", lambda v: isinstance(v, list) and v and all(_is_int(r, 1) for r in v),
               "a non-empty list of positive integers"),
              ("ms", lambda v: isinstance(v, list) and all(map(_is_ms, v)), "a list of positive finite numbers"))
    for i, c in enumerate(curves):
        if not isinstance(c, dict):
            raise InputError(f"cost profile {path}: curve {i} is not an object")
        for key, ok, expected in checks:
            if key not in c:
                raise InputError(f"cost profile {path}: curve {i} lacks {key!r} (every curve needs cache, "
                                 f"block_length, prefix, batch, rows and ms)")
            if not ok(c[key]):
                raise InputError(f"cost profile {path}: curve {i}: {key} must be {expected}, got {_show(c[key])}")
        if len(c["rows"]) != len(c["ms"]):
            raise InputError(f"cost profile {path}: curve {i} has {len(c['rows'])} rows but {len(c['ms'])} ms values")
    return curves


def measure(call, counts: list[int], device, reps: int = 3) -> CostModel:
    """Time `call(n)` (one model call of n canvases) for every n, interleaved, fastest of `reps`."""
    best = {n: float("inf") for n in counts}
    call(counts[0])                                  # warm-up (allocations, kernel choice)
    for _ in range(reps):
        for n in counts:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            call(n)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[n] = min(best[n], (time.perf_counter() - t0) * 1e3)
    return CostModel(counts, [best[n] for n in counts], "measured")


# ---------------------------------------------------------------------- measured curves, kept across runs
STORE_FORMAT = "psd-cost-store/1"


def store_dir() -> Path | None:
    """Where measured cost curves are kept between processes: $PSD_COST_CACHE ("off": nowhere),
    else $XDG_CACHE_HOME/psd-engine/cost (default ~/.cache/psd-engine/cost)."""
    return cache_dir("cost", "PSD_COST_CACHE")


def host_key(device) -> tuple:
    """What a call's cost depends on besides the model and its shapes: the device (its name on
    CUDA), the CPU and its threads, torch's version."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    return (dev.type, name, torch.get_num_threads(), torch.__version__)


def _path(key: tuple) -> Path | None:
    where = store_dir()
    return None if where is None else where / (hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".json")


def load_curve(key: tuple) -> CostModel | None:
    """The curve measured earlier for `key`, or None (none kept, the store off, or a file that is
    not one: it is measured again and replaced, never an error)."""
    path = _path(key)
    try:
        raw = json.loads(path.read_text()) if path is not None and path.is_file() else None
        if not raw or raw.get("format") != STORE_FORMAT or raw.get("key") != repr(key):
            return None
        return CostModel(raw["canvases"], raw["ms"], f"measured earlier ({path})")
    except (OSError, ValueError, KeyError, TypeError, InputError):
        return None


def save_curve(key: tuple, model: CostModel) -> None:
    """Keep `model` for later processes (best effort, written whole: models/config.py `keep_file`)."""
    path = _path(key)
    if path is not None:
        keep_file(path, json.dumps({"format": STORE_FORMAT, "key": repr(key), "canvases": model.n,
                                    "ms": model.ms_at}).encode())
