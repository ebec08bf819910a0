"""psd_kernels: Triton kernels for the PSD decoding hot path, with plain-torch references.

The backend is chosen once at import: Triton when CUDA is available, the torch reference
otherwise. Override with the environment variable ``PSD_KERNELS_BACKEND`` (``triton`` or
``reference``) or per call with ``backend=``. Importing this package never imports triton;
the first Triton call does. ``top1`` on float64 logits always takes the reference path (the
kernel accumulates in float32; float64 is the parity switch of the engine).

    top1(logits, exclude_id=None, out=None, *, score="prob", temperature=0.0, noise=None)
    rank_positions(conf, masked, out=None)
    position_ranks(conf, masked, out=None)
    assemble_drafts(block, masked, pred, conf, node_ranks, out=None)
    shared_prefix_attention(q, k_shared, v_shared, k_own, v_own, scale=None, shared_mask=None, out=None,
                            *, own_mask=None, row_map=None)
    plan_rows(row_map, cache_rows)                       (once per model call; row_map= of every layer)
    merge_attention(out_a, lse_a, out_b, lse_b)          (plain torch, both backends)
    moe(x, w_gate, w_up, w_down, topk_ids, topk_weights, out=None)

``moe`` on float64 takes the reference path as ``top1`` does.
"""
from __future__ import annotations

import importlib
import os

import torch

from . import reference
from .reference import RowPlan, merge_attention

__all__ = [
    "BACKEND",
    "top1",
    "rank_positions",
    "position_ranks",
    "assemble_drafts",
    "shared_prefix_attention",
    "merge_attention",
    "plan_rows",
    "RowPlan",
    "moe",
]

_BACKENDS = ("triton", "reference")
# public function -> module of psd_kernels.ops holding its Triton launcher
_TRITON_MODULE = {
    "top1": "top1",
    "rank_positions": "draft",
    "position_ranks": "draft",
    "assemble_drafts": "draft",
    "shared_prefix_attention": "sparse_attn",
    "moe": "moe",
}


def _default_backend() -> str:
    env = os.environ.get("PSD_KERNELS_BACKEND", "").strip().lower()
    if env:
        if env not in _BACKENDS:
            raise ValueError(f"PSD_KERNELS_BACKEND={env!r}; expected one of {_BACKENDS}")
        return env
    return "triton" if torch.cuda.is_available() else "reference"


BACKEND = _default_backend()


def _impl(name: str, backend: str | None):
    b = BACKEND if backend is None else backend
    if b == "reference":
        return getattr(reference, name)
    if b == "triton":
        # imported lazily: triton is optional on CPU
        module = importlib.import_module(f".ops.{_TRITON_MODULE[name]}", __name__)
        return getattr(module, name)
    raise ValueError(f"unknown psd_kernels backend {b!r}; expected one of {_BACKENDS}")


def top1(logits, exclude_id=None, out=None, *, score="prob", temperature=0.0, noise=None, backend=None):
    if isinstance(logits, torch.Tensor) and logits.dtype == torch.float64:
        backend = "reference"  # the float64 parity switch: the kernel accumulates in float32
    return _impl("top1", backend)(logits, exclude_id, out, score=score, temperature=temperature, noise=noise)


def rank_positions(conf, masked, out=None, *, backend=None):
    return _impl("rank_positions", backend)(conf, masked, out)


def position_ranks(conf, masked, out=None, *, backend=None):
    return _impl("position_ranks", backend)(conf, masked, out)


def assemble_drafts(block, masked, pred, conf, node_ranks, out=None, *, backend=None):
    return _impl("assemble_drafts", backend)(block, masked, pred, conf, node_ranks, out)


def shared_prefix_attention(
    q, k_shared, v_shared, k_own, v_own, scale=None, shared_mask=None, out=None, *, own_mask=None, row_map=None,
    backend=None
):
    return _impl("shared_prefix_attention", backend)(q, k_shared, v_shared, k_own, v_own, scale, shared_mask, out,
                                                     own_mask=own_mask, row_map=row_map)


def plan_rows(row_map, cache_rows, *, backend=None):
    """The ``RowPlan`` of one call's rows (``row_map`` int64 [R]) over ``cache_rows`` cache rows,
    to pass as ``shared_prefix_attention(..., row_map=plan)`` in every layer of the call.
    Computed on the device with no host read for the Triton backend; the reference backend's
    padded layout reads four ints once (free on CPU). ``backend=``: as for the kernels."""
    b = BACKEND if backend is None else backend
    if b not in _BACKENDS:
        raise ValueError(f"unknown psd_kernels backend {b!r}; expected one of {_BACKENDS}")
    return reference.plan_rows(row_map, cache_rows, padded=b == "reference")


def moe(x, w_gate, w_up, w_down, topk_ids, topk_weights, out=None, *, backend=None):
    if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
        backend = "reference"  # the float64 parity switch: the kernels accumulate in float32
    return _impl("moe", backend)(x, w_gate, w_up, w_down, topk_ids, topk_weights, out)


for _f in (top1, rank_positions, position_ranks, assemble_drafts, shared_prefix_attention, moe):
    _f.__doc__ = getattr(reference, _f.__name__).__doc__ + "\n    ``backend=``: 'triton' or 'reference' for this call (default: ``BACKEND``).\n"
del _f
