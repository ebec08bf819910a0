"""Cache modes (docs/algorithms.md §6): what one model call runs, behind one interface.

    none    every call runs the whole canvas
    prefix  the first call of a block runs the whole canvas and caches the keys/values before the
            block; later calls run the block and what follows it (bidirectional models; a
            context-causal block never sees what follows) over that cache
    dual    the block alone, over a cached prefix and (bidirectional models) a cached suffix

Each mode has `start` (the first call of a block; returns its logits and the block's cache) and
`call` (a later call of rows over that cache). Drafts of one sequence share its cache row:
`rows` maps every row of a call to the cache row of its sequence. The cached modes keep their
keys/values in the mode's `store` (engine/kvstore.py): allocated once, rewritten block after
block of a batch, freed when the batch ends (`release`); `widen` and `appending` are how rows
joining an open block reach it (`Decoder.join`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from models import Tokens, attention_mask

from .kvstore import KVStore, join_caches


@dataclass(frozen=True)
class Window:
    """Where the current block sits on the canvas, and how wide a step's window is."""

    prompt_width: int       # canvas index where generation starts (prompts are left-padded to it)
    block_length: int
    lo: int                 # canvas index of the block
    width: int              # positions a step may commit: the block, or ETE's several blocks
    ahead: int = 0          # positions after them a call also predicts (--cross-block: the next block)
    span: int = 0           # at most this many columns from each row's first valid one hold all of its
                            # valid ones (Batch.span; 0: unknown): a whole-canvas call runs packed

    @property
    def hi(self) -> int:
        return self.lo + self.width

    def mask(self, mc, valid, q_idx, k_idx):
        return attention_mask(mc, valid, self.prompt_width, self.lo, self.block_length, q_idx, k_idx)


class NoCache:
    name = "none"
    store = None                          # no keys/values kept between calls

    def __init__(self, model):
        self.model, self.mc = model, model.config

    def packs(self, win: Window, n: int) -> bool:
        """Does a whole-canvas call of `n` columns run packed (`_packed`)?"""
        return 0 < win.span < n and getattr(self.model, "tp", None) is None

    def _full(self, x, valid, pos, win: Window, return_kv: bool):
        """The whole canvas; logits for the window (read at i - logit shift), and with `return_kv`
        every layer's keys/values on the canvas's columns. Packed when the rows' valid columns span
        fewer than the canvas's (`Window.span`), so padding that aligns rows of different lengths and
        progress costs no compute (docs/loop.md, "Packed calls")."""
        N = x.shape[1]
        if self.packs(win, N):
            logits, kvs, first = self._packed(x, valid, pos, win, return_kv)
            if kvs is not None:    # each canvas column's packed one (outside a row's span: invisible keys)
                kvs = _packed_at(kvs, torch.arange(N, device=x.device) - first[:, None], win.span)
            return logits, kvs
        idx = torch.arange(N, device=x.device)
        return self.model(x, pos, win.mask(self.mc, valid, idx, idx), out_start=win.lo - self.mc.logit_shift,
                          out_len=win.width + win.ahead, return_kv=return_kv, tokens=self._tokens(valid))

    def _tokens(self, real: torch.Tensor) -> Tokens | None:
        """The real positions of a whole-canvas call (`Transformer.unpads`: on a CPU its padding
        columns are run by no projection or MLP; one host read), or None: every column runs."""
        if not self.model.unpads:
            return None
        tokens = Tokens.of(real)
        return None if tokens.index.numel() == real.numel() else tokens      # no padding: nothing to skip

    def _packed(self, x, valid, pos, win: Window, return_kv: bool):
        """`_full` over `win.span` columns per row, row b's starting at its first valid column
        first[b]: the same tokens, positions and mask entries at every valid column (the queries past
        a row's canvas are padding). Returns (logits, keys/values on the packed columns, first)."""
        N, W = x.shape[1], win.span
        first = valid.to(torch.uint8).argmax(1)                                  # [R], on the device
        cols = first[:, None] + torch.arange(W, device=x.device)                 # [R, W] canvas columns
        at = cols.clamp(max=N - 1)
        logits, kvs = self.model(x.gather(1, at), pos.gather(1, at), win.mask(self.mc, valid, cols, cols),
                                 out_start=win.lo - self.mc.logit_shift - first, out_len=win.width + win.ahead,
                                 return_kv=return_kv, tokens=self._tokens(valid.gather(1, at) & (cols < N)))
        return logits, kvs, first

    def start(self, x, valid, pos, win: Window):
        return self._full(x, valid, pos, win, False)[0], None

    def call(self, x, valid, pos, win: Window, cache, rows):
        return self._full(x, valid, pos, win, False)[0]

    def appending(self, cache):
        """A context in which `start` adds rows to the open block's `cache` (rows joining it)."""
        return contextlib.nullcontext()

    def joined(self, a, b):
        """The cache of an open block's rows (`a`), then of rows that joined it (`b`, started while
        `appending(a)`): `BlockRun.joined`'s."""
        return None

    def release(self) -> None:
        """Free the K/V memory kept for the batch that just ended."""


class PrefixCache(NoCache):
    name = "prefix"

    def __init__(self, model):
        super().__init__(model)
        self.store = KVStore()            # the K/V memory of every block this mode opens

    def query_span(self, win: Window, n: int) -> tuple[int, int]:
        """Canvas span a cached call runs: one position before the window for a logit shift, the
        window, and (here, on bidirectional models) everything after it."""
        hi = n if self.mc.attention == "bidirectional" else win.hi
        return win.lo - self.mc.logit_shift, hi

    def cached_spans(self, win: Window, n: int) -> list[tuple[int, int]]:
        """The cached canvas columns, as (start, stop) spans in key order."""
        return [(0, self.query_span(win, n)[0])]

    def cached_positions(self, win: Window, n: int, device) -> torch.Tensor:
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.cached_spans(win, n)])

    def start(self, x, valid, pos, win: Window):
        N = x.shape[1]
        idx = self.cached_positions(win, N, x.device)
        probe = torch.tensor([win.lo], device=x.device)   # any block query: cache visibility is query-independent
        key_mask = win.mask(self.mc, valid, probe, idx)[:, 0, 0]
        if self.packs(win, N):       # the cached columns taken from the packed call's keys, not the whole canvas first
            logits, kvs, first = self._packed(x, valid, pos, win, True)
            kvs, spans = _packed_at(kvs, idx[None] - first[:, None], win.span), [(0, idx.numel())]
        else:
            logits, kvs = self._full(x, valid, pos, win, True)
            spans = self.cached_spans(win, N)
        # the cached columns of every layer, copied into the store's memory (no new tensors per block)
        return logits, self.store.write(kvs, spans, key_mask, N)

    def call(self, x, valid, pos, win: Window, cache, rows):
        self.store.check(cache)
        q_lo, q_hi = self.query_span(win, x.shape[1])
        q_idx = torch.arange(q_lo, q_hi, device=x.device)
        own = win.mask(self.mc, valid, q_idx, q_idx)
        # past its block a row shorter than the canvas may have padding its own keys must not see (a
        # prefix call runs to the canvas end; ETE's window spans blocks a shorter row does not have)
        bound = cache.for_rows(rows, own_masked=q_hi > win.lo + win.block_length)
        logits, _ = self.model(x[:, q_lo:q_hi], pos[:, q_lo:q_hi], own, cache=bound, out_start=0, out_len=win.width)
        return logits

    def appending(self, cache):
        return self.store.after(cache)

    def joined(self, a, b):
        return join_caches(a, b)

    def release(self) -> None:
        self.store.release()

    def _canvas_cols(self, win: Window, n: int) -> int:
        """Columns of a cache in canvas layout: every cached span of an `n`-column canvas."""
        return sum(b - a for a, b in self.cached_spans(win, n))

    def widen(self, cache, win: Window, n: int, left: int, rows: int = 0):
        """The open block's `cache` on a canvas widened to `n` columns, `left` of them before the
        old first (`win`: the block's window there); the new cached columns are invisible. The
        store makes room for `rows` rows (those about to join too) on that canvas."""
        back = self._canvas_cols(win, n) - cache.key_mask.shape[1] - left
        if not left and not back:                 # the canvas is as it was (a join changed the span only)
            return cache
        return self.store.widen(cache, left, back, cols_cap=n, rows_cap=rows)


class DualCache(PrefixCache):
    """With packed calls (`NoCache.packs`) the cache is packed too: each row's visible keys (its
    prefix, then on bidirectional models its suffix) first, in canvas order, then invisible slots, so
    a block's later calls attend over `span - block - shift` columns, not the aligned canvas's."""

    name = "dual"

    def __init__(self, model):
        super().__init__(model)
        self.packed = False              # the open block's cache has the packed layout

    def _packed_cols(self, win: Window, n: int) -> int:
        """Cache columns of a packed block: a row in the block has its block's columns valid, so at
        most span - block length of its columns are cached (span - block - shift where the column
        before the block is the row's too, but with --align sequence a row may start at the block)."""
        return min(win.span - win.block_length, self._canvas_cols(win, n))

    def start(self, x, valid, pos, win: Window):
        N, held = x.shape[1], self.store.appending_to
        if not self.packs(win, N) or (held is not None and not self.packed):
            if held is None:                 # a new block's layout; rows joining one follow its layout
                self.packed = False
            return super().start(x, valid, pos, win)
        logits, kvs, first = self._packed(x, valid, pos, win, True)
        C = held.cols if held is not None else self._packed_cols(win, N)
        lo = win.lo - self.mc.logit_shift
        j = torch.arange(C, device=x.device)
        # slot j of row b: its prefix's j-th visible key, then its suffix (canvas col hi on), as packed
        # columns; a row that starts inside the queried span (--align sequence) has no prefix
        pre = (lo - first).clamp(min=0)[:, None]
        col = torch.where(j < pre, j, j - pre + (win.hi - first)[:, None])
        probe = torch.full((x.shape[0], 1), win.lo, device=x.device)   # any block query: visibility is query-independent
        key_mask = win.mask(self.mc, valid, probe, first[:, None] + col)[:, 0, 0]
        cache = self.store.write(_packed_at(kvs, col, win.span), [(0, C)], key_mask, C)
        self.packed = True
        return logits, cache

    def widen(self, cache, win: Window, n: int, left: int, rows: int = 0):
        """A packed cache does not move when the canvas widens: it gains the columns the joining
        rows' caches need (invisible for the running rows)."""
        if not self.packed:
            return super().widen(cache, win, n, left, rows)
        cols = self._packed_cols(win, n) if self.packs(win, n) else self._canvas_cols(win, n)
        if cols <= cache.key_mask.shape[1]:
            return cache
        return self.store.widen(cache, 0, cols - cache.key_mask.shape[1], cols_cap=cols, rows_cap=rows)

    def query_span(self, win: Window, n: int) -> tuple[int, int]:
        return win.lo - self.mc.logit_shift, win.hi

    def cached_spans(self, win: Window, n: int) -> list[tuple[int, int]]:
        prefix = super().cached_spans(win, n)
        if self.mc.attention != "bidirectional":   # the suffix is invisible to a context-causal block
            return prefix
        return prefix + [(win.hi, n)]


def _packed_at(kvs, cols: torch.Tensor, span: int) -> list:
    """Every layer's packed keys/values at packed columns `cols` [R, C] of each row (clamped into the
    row's `span` columns: a column outside it is one of its invisible keys)."""
    cols = cols.clamp(0, span - 1)
    return [tuple(_columns(t, cols) for t in kv) for kv in kvs]


def _columns(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t [R, H, T, D] at columns idx [R, C] of each row: [R, H, C, D]."""
    return t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


CACHE_MODES = {mode.name: mode for mode in (NoCache, PrefixCache, DualCache)}
