"""psd_kernels moe: Triton grouped-GEMM kernels vs reference, reference vs a dense oracle, inputs."""
from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F

import psd_kernels
from psd_kernels import reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
# bf16: the kernel rounds silu(g)·u to bf16 before the down projection (the reference keeps
# fp32), then both round the fp32 sum once; the outputs here are O(1)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def make_weights(E, H, I, dtype, gen, device):
    def r(*shape, fan_in):
        return (torch.randn(shape, generator=gen) / fan_in ** 0.5).to(dtype).to(device)

    return r(E, I, H, fan_in=H), r(E, I, H, fan_in=H), r(E, H, I, fan_in=I) * 4


def route(T, E, k, kind, gen, device):
    """(topk_ids, topk_weights) of T tokens: random distinct experts per row, or a pattern."""
    ids = torch.rand(T, E, generator=gen).argsort(-1)[:, :k]           # k distinct experts per row
    if kind == "one_expert":           # every slot of every token to the last expert
        ids = torch.full((T, k), E - 1, dtype=torch.int64)
    elif kind == "ties" and k > 1:     # a row may name one expert in two slots, with equal weights
        ids[:, 1] = ids[:, 0]
        ids[::2, -1] = ids[::2, 0]
    elif kind == "empty_experts":      # only experts 1 and E - 2 get slots
        ids = torch.where(torch.rand(T, k, generator=gen) < 0.5, 1, E - 2)
    w = torch.rand(T, k, generator=gen) + 0.1
    if kind == "ties" and k > 1:
        w[:, 1] = w[:, 0]
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def dense_oracle(x, w_gate, w_up, w_down, ids, w):
    """float64, one token and slot at a time: the definition, no grouping."""
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        xt = x[t].double().cpu()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(w_gate[e].double().cpu() @ xt) * (w_up[e].double().cpu() @ xt)
            out[t] += float(w[t, j]) * (w_down[e].double().cpu() @ h)
    return out


def run_triton(x, *args):
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)   # poisoned
    got = psd_kernels.moe(x, *args, out=out, backend="triton")
    assert got is out
    return out


def cpu(ts):
    return [t.cpu() for t in ts]


# ------------------------------------------------------------------------------------------
# reference vs the definition
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "one_expert", "ties", "empty_experts"])
@pytest.mark.parametrize("T, H, E, I, k", [(1, 16, 4, 8, 2), (13, 24, 6, 20, 3), (40, 32, 8, 16, 1)])
def test_reference_matches_dense_oracle(T, H, E, I, k, kind):
    gen = torch.Generator().manual_seed(T * 100 + E + len(kind))
    x = torch.randn(T, H, generator=gen)
    ws = make_weights(E, H, I, torch.float32, gen, "cpu")
    ids, w = route(T, E, k, kind, gen, "cpu")
    got = reference.moe(x, *ws, ids, w)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got.double(), dense_oracle(x, *ws, ids, w), rtol=1e-5, atol=1e-5)
    got64 = psd_kernels.moe(x.double(), *(t.double() for t in ws), ids, w, backend="reference")
    torch.testing.assert_close(got64, dense_oracle(x, *ws, ids, w), rtol=1e-12, atol=1e-12)


def test_reference_16bit_inputs_are_fp32_math_rounded_once():
    gen = torch.Generator().manual_seed(3)
    T, H, E, I, k = 9, 16, 5, 12, 2
    x = torch.randn(T, H, generator=gen).bfloat16()
    ws = make_weights(E, H, I, torch.bfloat16, gen, "cpu")
    ids, w = route(T, E, k, "random", gen, "cpu")
    got = reference.moe(x, *ws, ids, w)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, dense_oracle(x, *ws, ids, w).float().bfloat16())


# ------------------------------------------------------------------------------------------
# Triton vs reference (interpreter on CPU, compiled on a GPU)
# ------------------------------------------------------------------------------------------
# T = 37 and 70 are not multiples of BLOCK_M (16 under the interpreter); one_expert at T = 70, k = 2
# gives one expert 9 tiles; H = 48 and I = 40 are not powers of two and cross the 32-wide tiles.
CASES = [
    (1, 32, 4, 32, 2, "random"),          # T = 1: one token, decode-sized
    (37, 48, 6, 40, 3, "random"),
    (70, 48, 5, 40, 2, "one_expert"),
    (37, 32, 7, 24, 4, "ties"),
    (37, 48, 9, 40, 2, "empty_experts"),
]


@needs_triton
@pytest.mark.parametrize("T, H, E, I, k, kind", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(T, H, E, I, k, kind, dtype, device):
    gen = torch.Generator().manual_seed(T * 1000 + H * 10 + E + len(kind))
    x = torch.randn(T, H, generator=gen).to(dtype).to(device)
    ws = make_weights(E, H, I, dtype, gen, device)
    ids, w = route(T, E, k, kind, gen, device)
    got = run_triton(x, *ws, ids, w)
    want = reference.moe(*cpu((x, *ws, ids, w)))
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


@needs_triton
@pytest.mark.parametrize("kind", ["random", "empty_experts"])
def test_tile_search_across_expert_chunks(kind, device, monkeypatch):
    """Experts scanned 4 at a time (256 on the GPU) and the k-sum in 16-column blocks: the tile
    search's running prefix crosses chunks, and H = 40 ends in a partial sum block."""
    ops = importlib.import_module("psd_kernels.ops.moe")
    monkeypatch.setattr(ops, "CHUNK_E", 4)
    monkeypatch.setattr(ops, "SUM_BLOCK_H", 16)
    gen = torch.Generator().manual_seed(10 + len(kind))
    T, H, E, I, k = 29, 40, 11, 24, 3
    x = torch.randn(T, H, generator=gen).to(device)
    ws = make_weights(E, H, I, torch.float32, gen, device)
    ids, w = route(T, E, k, kind, gen, device)
    got = run_triton(x, *ws, ids, w)
    torch.testing.assert_close(got.cpu(), reference.moe(*cpu((x, *ws, ids, w))), **TOL[torch.float32])


@needs_triton
def test_fp16_and_16bit_routing_weights(device):
    gen = torch.Generator().manual_seed(8)
    T, H, E, I, k = 21, 32, 4, 24, 2
    x = torch.randn(T, H, generator=gen).half().to(device)
    ws = make_weights(E, H, I, torch.float16, gen, device)
    ids, w = route(T, E, k, "random", gen, device)
    got = run_triton(x, *ws, ids, w.bfloat16())
    torch.testing.assert_close(got.cpu(), reference.moe(*cpu((x, *ws, ids, w.bfloat16()))), **TOL[torch.float16])


@needs_triton
def test_strided_inputs_and_out(device):
    """x a column slice, gate and up views of one fused [E, 2I, H] tensor (a checkpoint's
    gate_up_proj), w_down transposed storage, ids/weights column slices, out transposed."""
    gen = torch.Generator().manual_seed(4)
    T, H, E, I, k = 19, 40, 5, 24, 2
    x = torch.randn(T, H + 8, generator=gen).to(device)[:, 3:3 + H]
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(device)
    w_gate, w_up = gate_up[:, :I], gate_up[:, I:]
    w_down = (torch.randn(E, I, H, generator=gen) / I ** 0.5).to(device).transpose(1, 2)   # [E, H, I]
    ids, w = route(T, E, k + 1, "random", gen, device)
    ids, w = ids[:, 1:], w[:, 1:]
    out = torch.full((H, T), float("nan"), device=device).t()
    got = psd_kernels.moe(x, w_gate, w_up, w_down, ids, w, out=out, backend="triton")
    assert got is out
    want = reference.moe(*cpu((x, w_gate, w_up, w_down, ids, w)))
    torch.testing.assert_close(out.cpu(), want, **TOL[torch.float32])


@needs_triton
@pytest.mark.parametrize("T", [2, 7])
def test_one_column_slices_of_ids_and_weights(T, device):
    """k = 1 columns of wider [T, 3] routing tensors: their reshape is a strided view, which the
    kernels read at unit stride (another token's weight, or its expert dropped)."""
    gen = torch.Generator().manual_seed(6)
    H, E, I = 16, 6, 8
    x = torch.randn(T, H, generator=gen).to(device)
    ws = [(torch.randn(E, *shape, generator=gen) / 4).to(device) for shape in ((I, H), (I, H), (H, I))]
    ids, w = route(T, E, 1, "random", gen, device)
    ids = torch.cat((ids, torch.full_like(ids, -1)), 1)[:, :1]        # beside it in memory: no expert
    w = torch.cat((w + 0.5, torch.full_like(w, 9.0)), 1)[:, :1]       # beside it: another weight
    got = run_triton(x, *ws, ids, w)
    torch.testing.assert_close(got.cpu(), reference.moe(*cpu((x, *ws, ids, w))), **TOL[torch.float32])


@needs_triton
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_sizes(backend, device):
    gen = torch.Generator().manual_seed(6)
    H, E, I = 16, 3, 8
    ws = make_weights(E, H, I, torch.float32, gen, device)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=device)
    got = psd_kernels.moe(torch.randn(0, H, device=device), *ws, ids, torch.zeros(0, 2, device=device),
                          backend=backend)
    assert got.shape == (0, H)
    # no intermediate features: every expert outputs 0 (and out= is written, not left poisoned)
    x = torch.randn(3, H, device=device)
    no_i = make_weights(E, H, 0, torch.float32, gen, device)
    out = torch.full((3, H), float("nan"), device=device)
    psd_kernels.moe(x, *no_i, torch.ones(3, 2, dtype=torch.int64, device=device), torch.ones(3, 2, device=device),
                    out=out, backend=backend)
    assert torch.equal(out.cpu(), torch.zeros(3, H))


@needs_triton
def test_ids_outside_the_experts(device):
    """The reference refuses them (its one host read sees them); the kernel cannot check without a
    sync, so such a slot adds nothing, as if its weight were 0."""
    gen = torch.Generator().manual_seed(7)
    T, H, E, I, k = 6, 16, 4, 16, 2
    x = torch.randn(T, H, generator=gen).to(device)
    ws = make_weights(E, H, I, torch.float32, gen, device)
    ids, w = route(T, E, k, "random", gen, device)
    bad = ids.clone()
    bad[1, 0], bad[4, 1] = E, -1
    with pytest.raises(ValueError, match="topk_ids holds experts -1..4, but there are 4"):
        reference.moe(*cpu((x, *ws, bad, w)))
    w0 = w.clone()
    w0[1, 0] = w0[4, 1] = 0.0
    got = run_triton(x, *ws, bad, w)
    torch.testing.assert_close(got.cpu(), reference.moe(*cpu((x, *ws, ids, w0))), **TOL[torch.float32])


@needs_triton
def test_launches_read_nothing_back(device, monkeypatch):
    """Three launches per call and no host read in the launcher (the grouping is device ops)."""
    from engine.testing.hostsync import Launches, SyncCounter

    ops = importlib.import_module("psd_kernels.ops.moe")
    counter = SyncCounter()
    kernels = {}
    for name in ("_moe_gate_up_kernel", "_moe_down_kernel", "_moe_sum_kernel"):
        kernels[name] = Launches(getattr(ops, name), counter)
        monkeypatch.setattr(ops, name, kernels[name])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 16, generator=gen).to(device)
    ws = make_weights(4, 16, 16, torch.float32, gen, device)
    ids, w = route(5, 4, 2, "random", gen, device)
    with counter:
        psd_kernels.moe(x, *ws, ids, w, backend="triton")
    assert counter.count == 0, counter.calls
    assert [kn.n for kn in kernels.values()] == [1, 1, 1]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_inputs(backend):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton not installed")
    gen = torch.Generator().manual_seed(1)
    T, H, E, I, k = 4, 8, 3, 6, 2
    x = torch.randn(T, H)
    wg, wu, wd = make_weights(E, H, I, torch.float32, gen, "cpu")
    ids, w = route(T, E, k, "random", gen, "cpu")
    cases = [
        ((x[0], wg, wu, wd, ids, w), "x must be a 2-D"),
        ((x, wg[0], wu, wd, ids, w), "w_gate must be a 3-D"),
        ((x, wg[:, :, :4], wu, wd, ids, w), "w_gate has shape"),
        ((x, wg, wu[:, :5], wd, ids, w), "w_up has shape"),
        ((x, wg, wu, wd.transpose(1, 2), ids, w), "w_down has shape"),
        ((x, wg.double(), wu, wd, ids, w), "one dtype and device"),
        ((x, wg, wu, wd, ids.int(), w), "topk_ids must be an int64"),
        ((x, wg, wu, wd, ids[:3], w), "topk_ids must be an int64"),
        ((x, wg, wu, wd, ids, w[:, :1]), "topk_weights must be"),
        ((x, wg, wu, wd, ids, w.long()), "topk_weights must be"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            psd_kernels.moe(*args, backend=backend)
    for bad_out in (torch.empty(T, H + 1), torch.empty(T, H, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="out must be"):
            psd_kernels.moe(x, wg, wu, wd, ids, w, out=bad_out, backend=backend)


def test_float64_takes_the_reference_path(monkeypatch):
    monkeypatch.setattr(psd_kernels, "BACKEND", "triton")
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    ws = [t.double() for t in make_weights(2, 8, 4, torch.float32, gen, "cpu")]
    ids, w = route(3, 2, 1, "random", gen, "cpu")
    assert torch.equal(psd_kernels.moe(x, *ws, ids, w), reference.moe(x, *ws, ids, w))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_model_sized_bf16(T):
    """LLaDA2-mini-like expert shapes (256 experts, top-8, H 2048, I 512) on the GPU, compiled:
    the launch heuristics' decode and prefill tiles (BLOCK_M 16 and 64)."""
    gen = torch.Generator().manual_seed(T)
    H, E, I, k = 2048, 256, 512, 8
    x = torch.randn(T, H, generator=gen).bfloat16().cuda()
    ws = make_weights(E, H, I, torch.bfloat16, gen, "cuda")
    ids, w = route(T, E, k, "random", gen, "cuda")
    got = run_triton(x, *ws, ids, w)
    torch.testing.assert_close(got, reference.moe(x, *ws, ids, w), **TOL[torch.bfloat16])


def test_compiles_for_sm90(compile_check):
    compile_check("moe")
