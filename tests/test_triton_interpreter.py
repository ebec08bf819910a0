"""The suite's quicker Triton interpreter (tests/triton_interpreter.py) runs the same kernels: every
kernel family gives bitwise the outputs of triton's own interpreter, and the language is patched
once per module and launch instead of at every helper call."""
from __future__ import annotations

import pytest
import torch

import psd_kernels
from support import interpreted

pytestmark = pytest.mark.skipif(not interpreted(), reason="kernels run compiled (or without triton): no interpreter")


def _launches():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g)
    conf, masked = torch.rand(3, 40, generator=g), torch.rand(3, 40, generator=g) < 0.6
    q, ks, vs, ko, vo = (torch.randn(s, generator=g) for s in ((3, 2, 4, 16), (2, 1, 24, 16), (2, 1, 24, 16),
                                                              (3, 1, 4, 16), (3, 1, 4, 16)))
    row_map = torch.tensor([0, 1, 1])
    x, w_gate, w_up, w_down = (torch.randn(s, generator=g) for s in ((6, 16), (4, 32, 16), (4, 32, 16), (4, 16, 32)))
    topk_ids = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 1], [0, 3], [1, 0]])
    return {
        "top1": lambda: psd_kernels.top1(logits, backend="triton"),
        "position_ranks": lambda: psd_kernels.position_ranks(conf, masked, backend="triton"),
        "attention": lambda: psd_kernels.shared_prefix_attention(q, ks, vs, ko, vo, row_map=row_map,
                                                                 backend="triton"),
        "moe": lambda: psd_kernels.moe(x, w_gate, w_up, w_down, topk_ids, torch.full((6, 2), 0.5),
                                       backend="triton"),
    }


def _flat(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def test_the_quick_interpreter_is_installed_and_gives_triton_own_results(monkeypatch):
    import triton
    import triton_interpreter
    from triton.runtime import interpreter as ti

    if not triton_interpreter.install():
        pytest.skip(f"triton {triton.__version__}'s interpreter is not the one tests/triton_interpreter.py "
                    "knows: the suite runs on triton's own, at its full cost")
    patches = []
    orig = ti._patch_lang
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: patches.append(fn) or orig(fn))
    for name, launch in _launches().items():
        patches.clear()
        quick = _flat(launch())
        n_quick = len(patches)
        patches.clear()
        with triton_interpreter.plain():
            own = _flat(launch())
        assert len(quick) == len(own) > 0, name
        for a, b in zip(quick, own):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        # a launch's own patch and one per module of the helpers it calls (standard.py, ours), against one
        # per helper call (2 against 16 for top1, 10 against 114 for the three MoE launches, triton 3.9)
        assert 0 < 3 * n_quick <= len(patches), (name, n_quick, len(patches))
