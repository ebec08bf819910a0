"""One owner for the K/V memory of the cache modes (engine/cache.py; docs/loop.md, "The KV store").

A `KVStore` holds, in ONE flat allocation (the arena), a region per cached tensor (each layer's
keys and values) sized for `rows` cache rows of `cols` canvas columns, and a bool region for the
key masks. A block's first call (`write`) copies the cached columns of every layer's K/V straight
into the regions and returns a `models.KVCache` whose layers are views of them: contiguous
[S, Hkv, C, D] tensors with exactly the shape, strides, order and values the gathered copies had,
at region starts aligned as a fresh allocation is, so attention runs unchanged. The arena is
allocated at a batch's first block (rows x canvas columns, this dtype and device), reused by every
later block (prefix caches grow within it, dual caches keep their size), grown only when the batch
gets more rows or a wider canvas (rows joining, `Decoder.join`: the rows still in use move to the
new arena), and freed when the batch ends (`release`; a live batch never ends by itself).

Slots: the cache rows of a block are rows [row0, row0 + rows) of the layout with `cols` columns.
Rows that join an open block (`after`) are written right after the running block's rows, so the
joined cache is one longer view (`join_caches`), never a concatenation; a widened canvas
(`widen`) re-lays the rows out in place, its new columns invisible. Every write that starts a
block begins a new epoch: a cache of an earlier block is stale (`check` refuses it), because its
memory now holds the new block's keys. One store serves one running batch at a time.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from models import KVCache

ALIGN = 256          # bytes: every region starts where a fresh allocation would (CPU 64, CUDA 256)


@dataclass(frozen=True)
class Slots:
    """Where a KVCache lives in its store: rows [row0, row0 + rows) of the `cols`-column layout."""

    store: "KVStore"
    epoch: int
    row0: int
    rows: int
    cols: int


def _padded(t: torch.Tensor, left: int, back: int, fill) -> torch.Tensor:
    """`t` [rows, ..., C] along dim 2 for K/V, dim 1 for a mask, with `left` and `back` columns of
    `fill` around it (caches that live outside a store)."""
    dim = 2 if t.dim() == 4 else 1
    shape = list(t.shape)
    parts = []
    for n in (left, back):
        shape[dim] = n
        parts.append(torch.full(shape, fill, dtype=t.dtype, device=t.device))
    return torch.cat((parts[0], t, parts[1]), dim)


class KVStore:
    """The K/V memory of one cache mode: see the module docstring."""

    def __init__(self):
        self.arena: torch.Tensor | None = None      # [elements] of the K/V dtype
        self.masks: torch.Tensor | None = None      # [rows_cap * cols_cap] bool
        self.heads: list[tuple[int, int]] = []      # (Hkv, D) of each region: k0, v0, k1, v1, ...
        self.offsets: list[int] = []                 # element offset of each region in the arena
        self.rows_cap = self.cols_cap = 0
        self.epoch = 0
        self._after: Slots | None = None
        self.stats = {"allocations": 0, "bytes_allocated": 0, "writes": 0, "bytes_written": 0, "grown": 0}

    # ---------------------------------------------------------------- memory
    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.numel() * self.arena.element_size() + self.masks.numel()

    def _fits(self, heads, dtype, device, rows: int, cols: int) -> bool:
        a = self.arena
        return a is not None and a.dtype == dtype and a.device == device and self.heads == heads and \
            rows <= self.rows_cap and cols <= self.cols_cap

    def _view(self, i: int, row0: int, rows: int, cols: int) -> torch.Tensor:
        h, d = self.heads[i]
        start = self.offsets[i] + row0 * h * cols * d
        return self.arena[start:start + rows * h * cols * d].view(rows, h, cols, d)

    def _mask_view(self, row0: int, rows: int, cols: int) -> torch.Tensor:
        return self.masks[row0 * cols:(row0 + rows) * cols].view(rows, cols)

    def _reserve(self, heads, dtype, device, rows: int, cols: int, keep: Slots | None = None) -> None:
        """Room for `rows` x `cols`; a new arena if not (growing by half at least, so rows joining
        one by one do not reallocate each time), into which the rows of `keep` move."""
        if self._fits(heads, dtype, device, rows, cols):
            return
        same = self.arena is not None and self.arena.dtype == dtype and self.arena.device == device \
            and self.heads == heads
        if same:
            rows, cols = max(rows, self.rows_cap + self.rows_cap // 2), max(cols, self.cols_cap)
            self.stats["grown"] += 1
        per = ALIGN // torch.empty((), dtype=dtype).element_size()
        sizes = [-(-rows * h * cols * d // per) * per for h, d in heads]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        arena = torch.empty(sum(sizes), dtype=dtype, device=device)
        masks = torch.zeros(rows * cols, dtype=torch.bool, device=device)
        old = (self.arena, self.masks, self.offsets) if keep is not None and same else None
        self.arena, self.masks, self.heads, self.offsets = arena, masks, list(heads), offsets
        self.rows_cap, self.cols_cap = rows, cols
        self.stats["allocations"] += 1
        self.stats["bytes_allocated"] += arena.numel() * arena.element_size() + masks.numel()
        if old is not None:
            o_arena, o_masks, o_offsets = old
            for i, (h, d) in enumerate(heads):
                n = keep.rows * h * keep.cols * d
                start = o_offsets[i] + keep.row0 * h * keep.cols * d
                self._view(i, keep.row0, keep.rows, keep.cols).copy_(
                    o_arena[start:start + n].view(keep.rows, h, keep.cols, d))
            self._mask_view(keep.row0, keep.rows, keep.cols).copy_(
                o_masks[keep.row0 * keep.cols:(keep.row0 + keep.rows) * keep.cols].view(keep.rows, keep.cols))

    def release(self) -> None:
        """Free the arena (the batch ended; an idle decoder holds no K/V memory). Every cache it
        handed out is stale from now on."""
        self.arena = self.masks = None
        self.heads, self.offsets = [], []
        self.rows_cap = self.cols_cap = 0
        self.epoch += 1

    # ---------------------------------------------------------------- a block's cache
    def live(self, cache) -> Slots | None:
        """The slots of `cache` if it is this store's current memory, else None."""
        s = getattr(cache, "slots", None)
        return s if s is not None and s.store is self and s.epoch == self.epoch else None

    def check(self, cache) -> None:
        s = getattr(cache, "slots", None)
        if s is not None and s.epoch != s.store.epoch:
            raise RuntimeError("this KV cache is of an earlier block: its store now holds a later block's keys "
                               "(a Decoder with a KV cache runs one batch at a time: a Decoder per concurrent batch, or "
                               "one LiveBatch, whose sequences join and leave one running batch)")

    @property
    def appending_to(self) -> Slots | None:
        """Where the open block's rows are while rows join it (`after`), else None."""
        return self._after

    @contextlib.contextmanager
    def after(self, cache):
        """Writes inside this block go after `cache`'s rows (rows joining an open block) instead of
        starting a new block's layout."""
        self._after = self.live(cache)
        try:
            yield
        finally:
            self._after = None

    def write(self, kvs, spans, key_mask: torch.Tensor, cols_cap: int) -> KVCache:
        """The cache of the columns `spans` ([(start, stop)], in order) of every layer's (k, v)
        [S, Hkv, N, D]; `key_mask` [S, C]. The store is sized for `cols_cap` columns."""
        flat = [t for kv in kvs for t in kv]
        S, C = key_mask.shape
        if any(t.dtype != flat[0].dtype for t in flat):         # one arena holds one dtype
            return KVCache([tuple(torch.cat([t[:, :, a:b] for a, b in spans], 2) for t in kv) for kv in kvs],
                           key_mask)
        held = self._after if self._after is not None and self._after.row0 == 0 and self._after.cols == C else None
        row0 = 0 if held is None else held.rows
        if held is None:
            self.epoch += 1
        heads = [(t.shape[1], t.shape[3]) for t in flat]
        self._reserve(heads, flat[0].dtype, flat[0].device, row0 + S, max(C, cols_cap), keep=held)
        for i, t in enumerate(flat):
            dst, o = self._view(i, row0, S, C), 0
            for a, b in spans:
                dst.narrow(2, o, b - a).copy_(t.narrow(2, a, b - a))
                o += b - a
        self._mask_view(row0, S, C).copy_(key_mask)
        self.stats["writes"] += 1
        self.stats["bytes_written"] += sum(S * h * C * d for h, d in heads) * flat[0].element_size() + S * C
        return self._cache(row0, S, C)

    def _cache(self, row0: int, rows: int, cols: int) -> KVCache:
        n = len(self.heads)
        layers = [(self._view(i, row0, rows, cols), self._view(i + 1, row0, rows, cols)) for i in range(0, n, 2)]
        return KVCache(layers, self._mask_view(row0, rows, cols), slots=Slots(self, self.epoch, row0, rows, cols))

    def widen(self, cache: KVCache, left: int, back: int, cols_cap: int = 0, rows_cap: int = 0) -> KVCache:
        """`cache` with `left` invisible columns before its first and `back` after its last (rows
        with longer prompts joined the batch); re-laid out in the store when it lives there, which
        then has room for `rows_cap` rows (the rows about to join) of `cols_cap` columns (the new
        canvas), so the join and the later blocks need no second allocation."""
        s = self.live(cache)
        if s is None or s.row0 != 0:
            return dataclasses.replace(cache, layers=[(_padded(k, left, back, 0), _padded(v, left, back, 0))
                                                      for k, v in cache.layers],
                                       key_mask=_padded(cache.key_mask, left, back, False))
        C2 = s.cols + left + back
        old = [t.clone() for kv in cache.layers for t in kv] + [cache.key_mask.clone()]   # rows overlap their move
        self._reserve(self.heads, self.arena.dtype, self.arena.device, max(s.rows, rows_cap), max(C2, cols_cap))
        self.epoch += 1
        for i, src in enumerate(old[:-1]):
            dst = self._view(i, 0, s.rows, C2)
            dst.narrow(2, 0, left).zero_()
            dst.narrow(2, left, s.cols).copy_(src)
            dst.narrow(2, left + s.cols, back).zero_()
        m = self._mask_view(0, s.rows, C2)
        m.zero_()
        m.narrow(1, left, s.cols).copy_(old[-1])
        self.stats["bytes_written"] += sum(t.numel() * t.element_size() for t in old)
        return self._cache(0, s.rows, C2)


def join_caches(a: KVCache, b: KVCache) -> KVCache:
    """The cache rows of `a`, then `b`'s (`BlockRun.joined`): one view when `b` was written right
    after `a` in their store (`KVStore.after`), else the two concatenated."""
    sa, sb = getattr(a, "slots", None), getattr(b, "slots", None)
    if sa is not None and sb is not None and sa.store is sb.store and sa.store.live(a) and sa.store.live(b) \
            and sa.row0 == 0 and sb.row0 == sa.rows and sa.cols == sb.cols:
        return sa.store._cache(0, sa.rows + sb.rows, sa.cols)
    return dataclasses.replace(a, layers=[(torch.cat((k, k2)), torch.cat((v, v2)))
                                          for (k, v), (k2, v2) in zip(a.layers, b.layers)],
                               key_mask=torch.cat((a.key_mask, b.key_mask)), slots=None)
