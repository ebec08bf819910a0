"""Counting host synchronisations (see tests/test_hot_path.py): `SyncCounter` sees every torch call
that needs a tensor's value on the host; `Profile` splits the count per model call into "inside
the call" and "since the previous call" (one decode step). Shared by test_hot_path.py and the
policy contracts (contracts.py)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

T = torch.Tensor
# calls that need a tensor's value on the host
ALWAYS = {
    T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.__complex__, T.__format__, T.__repr__,
    T.__array__, T.cpu, T.numpy, T.nonzero, torch.nonzero, T.argwhere, torch.argwhere, T.masked_select,
    torch.masked_select, T.unique, torch.unique, T.unique_consecutive, torch.unique_consecutive, T.bincount,
    torch.bincount, T.equal, torch.equal, T.allclose, torch.allclose, T.is_nonzero, torch.is_nonzero,
}
# indexing with a boolean mask runs nonzero; repeat_interleave by a tensor sizes its output
MASK_INDEXED = {T.__getitem__, T.__setitem__, T.index_put_, T.index_put, torch.index_put}


def _is_mask(i) -> bool:
    if isinstance(i, (tuple, list)):
        return any(_is_mask(j) for j in i)
    return isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)


class SyncCounter(TorchFunctionMode):
    """Counts host synchronisations; `paused` suspends counting (kernel launches)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.calls: list[str] = []
        self.paused = 0

    def _is_sync(self, func, args, kwargs) -> bool:
        if func in ALWAYS:
            return True
        if func in MASK_INDEXED:
            return len(args) > 1 and _is_mask(args[1])
        if func in (T.repeat_interleave, torch.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and self._is_sync(func, args, kwargs):
            self.count += 1
            self.calls.append(getattr(func, "__qualname__", str(func)))
        return func(*args, **kwargs)


class Launches:
    """Wraps a Triton kernel object: counts launches, and pauses the sync counter inside them."""

    def __init__(self, kernel, counter: SyncCounter | None):
        self.kernel, self.counter, self.n = kernel, counter, 0

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.n += 1
            if self.counter is not None:
                self.counter.paused += 1
            try:
                return launch(*args, **kwargs)
            finally:
                if self.counter is not None:
                    self.counter.paused -= 1
        return run


def _pause_triton_kernels(monkeypatch, counter):
    from psd_kernels.ops import draft, moe, sparse_attn, top1

    for module in (draft, moe, sparse_attn, top1):
        for name in dir(module):      # the launched kernels (not the jit helpers they call)
            obj = getattr(module, name)
            if name.endswith("_kernel") and type(obj).__name__ in ("JITFunction", "Autotuner", "InterpretedFunction"):
                monkeypatch.setattr(module, name, Launches(obj, counter))


class Profile:
    """Per model call: syncs inside it, syncs since the previous call (a decode step), and how
    many rows it ran."""

    def __init__(self, model, counter: SyncCounter):
        self.counter, self.inside, self.between, self.rows, self.cached = counter, [], [], [], []
        self._start = self._end = None
        self.handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                        model.register_forward_hook(self._post)]

    def _pre(self, module, args, kwargs):
        if self._end is not None:
            self.between.append(self.counter.count - self._end)
        self._start = self.counter.count
        self.rows.append(args[0].shape[0])
        cache = kwargs.get("cache", args[3] if len(args) > 3 else None)
        self.cached.append(cache is not None and cache.row_map is not None)

    def _post(self, module, args, out):
        self.inside.append(self.counter.count - self._start)
        self._end = self.counter.count

    def close(self):
        for h in self.handles:
            h.remove()


def check(prof: Profile):
    assert prof.inside and max(prof.inside) == 0, f"host syncs inside model calls: {prof.inside}"
    return max(prof.between)


# syncs per decode step: which rows go on and which drafts are valid (engine loop), plus the
# reference backend's RowPlan read (one per cached call) or a block boundary (close + open)
STEP_BOUND = 4
