"""Helpers shared by the launchers: interpreter detection, device checks. (The ``out=`` buffer checks,
shared with the reference backend, are in ``psd_kernels.reference``, which imports no triton.)"""
from __future__ import annotations

import torch
import triton

# triton.jit picks the interpreter at decoration time from the same knob, so reading it once
# at import keeps the launch heuristics consistent with the kernels actually in use.
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


def check_device(*tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"inputs are on several devices: {sorted(map(str, devices))}")
    if any(d.type == "meta" for d in devices):
        raise ValueError("inputs are meta tensors: they hold no data to compute on")
    if not INTERPRET and any(d.type != "cuda" for d in devices):
        raise ValueError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1); use backend='reference' on CPU")

