"""Helpers shared by the launchers: interpreter detection, device checks, output buffers."""
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
    if not INTERPRET and any(d.type != "cuda" for d in devices):
        raise ValueError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1); use backend='reference' on CPU")


def check_out(t, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"out buffer {name} must be a tensor")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"out buffer {name} must be {dtype} {tuple(shape)} on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
        )
    return t


def check_out_pair(out, names: tuple[str, str]) -> None:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(f"out must be a pair ({names[0]}, {names[1]})")
