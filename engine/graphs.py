"""`--cuda-graphs`: verification calls replayed from captured CUDA graphs (docs/gpu.md).

NOT RUN ON A GPU YET. This module was written on a CPU-only machine against the torch 2.11 CUDA
graph API (`torch.cuda.CUDAGraph`, `torch.cuda.graph(g, pool=...)`, warm-up on a side stream
before capture); its bucketing and padding path runs on CPU in tests/test_cuda_graphs.py with
an eager stand-in for capture/replay (`EagerBackend`, tests/support.py), compared token for
token with the plain decoder. Whether replay pays on a card is what `bench/gpu_report.sh`'s
`cuda_graphs` section measures; until it has run, nothing says it does.

What is captured: a cache mode's `call` (engine/cache.py), i.e. the attention masks, the row
plan of the call and the model forward of one verification call. The block's first call
(`start`) stays eager (it builds the block's cache, once per block). With `--static-rows`
every verification call of a block has one shape (the block's rows x the graph's nodes), which
is why `--cuda-graphs` requires it (an InputError otherwise, not an implied option).

Shapes and buckets. A graph is keyed by

    (rows bucket, cache-rows bucket, canvas length, the window (block position and widths),
     the cached key length and dtype)

The rows of a call R and the cache rows C (the block's sequences) are padded up to the next
value of `LADDER` (1, 2, 3, 4, 6, 8, 12, 16, ... : powers of two and 1.5 times powers of two,
so padding wastes at most a third); padded call rows repeat row 0 and read cache row 0, padded
cache rows are zeros that no row reads, and the outputs of padded rows are dropped. A call of
more rows than `max_rows` runs eagerly (counted in `stats["eager"]`). The window is part of the
key, so each block of a decode has its own graph (a block's later calls replay it; later
batches of the same shape replay it too). A key never seen is captured; at most `max_graphs`
graphs are kept (least recently used evicted): every graph holds its own output (logits
[R, W, V]: 1 GiB at LLaDA-8B's vocabulary, 128 rows, block 32, bf16), which is the memory cap.

Static inputs. Captured kernels read fixed addresses, so every call copies its canvases, valid
flags, positions and row map into the graph's input buffers, and the block's KV cache is copied
once per block (when a new cache object arrives) into a buffer shared by the graphs of that
cache shape: one device copy of the cache per block, and one extra cache's worth of memory.
All graphs share one memory pool; a graph's output is valid until the next replay of any graph
(the loop reads the logits at once, before the next call).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .errors import InputError

MAX_GRAPHS = 8            # captured graphs kept per decoder (each holds its logits: the memory cap)
MAX_ROWS = 1024           # calls with more rows run eagerly
_ACTIVE = [0]             # > 0 while a graphed call runs (its warm-ups and captures are not calls of the decode)


def active() -> bool:
    """True inside a graphed call: a forward seen now is a warm-up, a capture or an eager fallback of
    one verification call (bench.speed's call counter counts the call once, from `stats`)."""
    return _ACTIVE[0] > 0


def ladder(top: int = MAX_ROWS) -> list[int]:
    """The bucket sizes: 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5 x powers of two) <= top."""
    out, p = [], 1
    while p <= top:
        out += [p] + ([p * 3 // 2] if p >= 2 and p * 3 // 2 <= top else [])
        p *= 2
    return out


def bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket >= n, or None when n is beyond the ladder (the call runs eagerly)."""
    if n < 1:
        raise ValueError(f"a call needs at least one row, got {n}")
    return next((s for s in sizes if s >= n), None)


def pad_rows(t: torch.Tensor, to: int) -> torch.Tensor:
    """`t` [n, ...] grown to [to, ...] by repeating row 0 (a real row: no NaN from an empty softmax)."""
    n = t.shape[0]
    if n == to:
        return t
    return torch.cat((t, t[:1].expand(to - n, *t.shape[1:])))


def graph_key(rows: int, cache_rows: int, x: torch.Tensor, win, cache) -> tuple:
    """What fixes a captured graph's shapes and addresses (rows already bucketed)."""
    if cache is None:
        return rows, 0, x.shape[1], win, None
    k0 = cache.layers[0][0] if cache.layers else cache.key_mask
    return rows, cache_rows, x.shape[1], win, (cache.length, len(cache.layers), tuple(k0.shape[1:]), k0.dtype)


# ---------------------------------------------------------------------- capture / replay backends
@dataclass
class Captured:
    replay: object                 # () -> the output tensor
    out: torch.Tensor | None = None


class CUDAGraphBackend:
    """torch.cuda.CUDAGraph capture: warm-up calls on a side stream (allocations, kernel choice,
    Triton autotuning happen outside the capture), then one capture into a pool shared by every
    graph of the decoder; replay reruns the kernels on the static buffers."""

    def __init__(self, device: torch.device, warmup: int = 2):
        self.device, self.warmup = device, warmup
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn, inputs: tuple) -> Captured:
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn(*inputs)
        except RuntimeError as e:          # e.g. a host read inside the call (the reference kernels)
            raise RuntimeError(f"CUDA graph capture of a verification call failed ({e}); the call must not read "
                               f"back to the host (psd_kernels' Triton backend); run without --cuda-graphs") from e

        def replay():
            graph.replay()
            return out

        return Captured(replay, out)


# ---------------------------------------------------------------------- the graphed cache mode
@dataclass
class _Graph:
    captured: Captured
    inputs: dict                   # static x, valid, pos, rows
    cache_key: tuple | None


@dataclass
class _CacheBuffer:
    cache: object                  # a KVCache over static layer buffers, `rows` cache rows
    source: object = None          # weakref to the block cache last copied in
    users: int = 0
    extra: dict = field(default_factory=dict)


class GraphedCall:
    """A cache mode whose `call` runs through padded, bucketed, captured graphs (`start` is the
    mode's own). `backend`: CUDAGraphBackend, or any object with `capture(fn, inputs) -> Captured`
    built as `cls(device)` (the tests' eager stand-in; engine.distributed rebuilds the backend on
    every rank from its class)."""

    def __init__(self, mode, backend, max_graphs: int = MAX_GRAPHS, max_rows: int = MAX_ROWS):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.mode, self.backend, self.max_graphs = mode, backend, max_graphs
        self.name, self.mc, self.model = mode.name, mode.mc, mode.model
        self.sizes = ladder(max_rows)
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.buffers: dict[tuple, _CacheBuffer] = {}
        self.stats = {"calls": 0, "rows": 0, "captures": 0, "replays": 0, "evictions": 0, "eager": 0,
                      "cache_copies": 0}

    def start(self, x, valid, pos, win):
        return self.mode.start(x, valid, pos, win)

    def __getattr__(self, name):           # query_span, cached_positions, ... of the wrapped mode
        mode = self.__dict__.get("mode")
        if mode is None:
            raise AttributeError(name)
        return getattr(mode, name)

    def call(self, x, valid, pos, win, cache, rows):
        self.stats["calls"] += 1
        self.stats["rows"] += x.shape[0]
        _ACTIVE[0] += 1
        try:
            return self._call(x, valid, pos, win, cache, rows)
        finally:
            _ACTIVE[0] -= 1

    def _call(self, x, valid, pos, win, cache, rows):
        R = x.shape[0]
        Rb = bucket(R, self.sizes)
        C = cache.key_mask.shape[0] if cache is not None else 0
        Cb = bucket(C, self.sizes) if cache is not None else 0
        if Rb is None or Cb is None:
            self.stats["eager"] += 1
            return self.mode.call(x, valid, pos, win, cache, rows)
        key = graph_key(Rb, Cb, x, win, cache)
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(key, x, valid, pos, win, cache, rows, Rb, Cb)
        else:
            self.graphs.move_to_end(key)
            self._fill(g, x, valid, pos, rows, cache)
        self.stats["replays"] += 1
        return g.captured.replay()[:R]

    # ------------------------------------------------------------------ internals
    def _fill(self, g: _Graph, x, valid, pos, rows, cache) -> None:
        """Copy this call's inputs into the graph's static buffers (padded rows repeat row 0)."""
        R, Rb = x.shape[0], g.inputs["x"].shape[0]
        for name, t in (("x", x), ("valid", valid), ("pos", pos)):
            g.inputs[name][:R].copy_(t)
            g.inputs[name][R:].copy_(t[:1].expand(Rb - R, *t.shape[1:]))
        g.inputs["rows"][:R].copy_(rows)
        g.inputs["rows"][R:].zero_()                     # padded rows read cache row 0
        if g.cache_key is not None:
            self._load_cache(self.buffers[g.cache_key], cache)

    def _load_cache(self, buf: _CacheBuffer, cache) -> None:
        """The block's cache into the shared static buffer, once per block (a new cache object)."""
        if buf.source is not None and buf.source() is cache:
            return
        C = cache.key_mask.shape[0]
        for (k_s, v_s), (k, v) in zip(buf.cache.layers, cache.layers):
            k_s[:C].copy_(k)
            v_s[:C].copy_(v)
        buf.cache.key_mask[:C].copy_(cache.key_mask)
        buf.cache.key_mask[C:] = False
        buf.source = weakref.ref(cache)
        self.stats["cache_copies"] += 1

    def _capture(self, key, x, valid, pos, win, cache, rows, Rb: int, Cb: int) -> _Graph:
        while len(self.graphs) >= self.max_graphs:
            _, old = self.graphs.popitem(last=False)
            self.stats["evictions"] += 1
            if old.cache_key is not None:
                buf = self.buffers[old.cache_key]
                buf.users -= 1
                if buf.users == 0:
                    del self.buffers[old.cache_key]
        inputs = {"x": torch.empty((Rb, *x.shape[1:]), dtype=x.dtype, device=x.device),
                  "valid": torch.empty((Rb, *valid.shape[1:]), dtype=valid.dtype, device=valid.device),
                  "pos": torch.empty((Rb, *pos.shape[1:]), dtype=pos.dtype, device=pos.device),
                  "rows": torch.zeros(Rb, dtype=torch.long, device=x.device)}
        cache_key = None if cache is None else key[1:2] + key[4:]
        if cache_key is not None and cache_key not in self.buffers:
            from models import KVCache

            layers = [(torch.zeros((Cb, *k.shape[1:]), dtype=k.dtype, device=k.device),
                       torch.zeros((Cb, *v.shape[1:]), dtype=v.dtype, device=v.device)) for k, v in cache.layers]
            mask = torch.zeros((Cb, cache.key_mask.shape[1]), dtype=torch.bool, device=cache.key_mask.device)
            self.buffers[cache_key] = _CacheBuffer(KVCache(layers, mask))
        g = _Graph(None, inputs, cache_key)
        if cache_key is not None:
            self.buffers[cache_key].users += 1
        self._fill(g, x, valid, pos, rows, cache)
        static_cache = self.buffers[cache_key].cache if cache_key is not None else None
        mode = self.mode

        def fn(x_s, valid_s, pos_s, rows_s):
            return mode.call(x_s, valid_s, pos_s, win, static_cache, rows_s)

        g.captured = self.backend.capture(fn, (inputs["x"], inputs["valid"], inputs["pos"], inputs["rows"]))
        self.graphs[key] = g
        self.stats["captures"] += 1
        return g


def graphed(mode, config, device: torch.device) -> GraphedCall:
    """`--cuda-graphs` for a decoder: checks the device and the options (one InputError each),
    then wraps its cache mode."""
    if device.type != "cuda":
        raise InputError("--cuda-graphs needs a CUDA device")
    if not config.static_rows:
        raise InputError("--cuda-graphs needs --static-rows (every verification call of a block one shape; "
                         "pass both)")
    if config.compile:
        raise InputError("--cuda-graphs and --compile do not combine (not tried together on a GPU; torch.compile's "
                         "own CUDA graphs are its mode='reduce-overhead')")
    return GraphedCall(mode, CUDAGraphBackend(device))
