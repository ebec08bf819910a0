"""psd_kernels shared_prefix_attention / merge_attention: Triton vs reference, dense oracle, memory."""
from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import psd_kernels
from psd_kernels import reference
from support import interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
BACKENDS = ["reference"] + (["triton"] if HAS_TRITON else [])
# out: both sides round the same fp32 value to the output dtype; lse stays fp32 in both
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
       torch.float16: dict(rtol=1e-3, atol=1e-3)}
LSE_TOL = dict(rtol=1e-5, atol=1e-5)


def make_inputs(K, H, Hkv, L, S, D, dtype, gen, device):
    def r(*shape):
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    return r(K, H, L, D), r(Hkv, S, D), r(Hkv, S, D), r(K, Hkv, L, D), r(K, Hkv, L, D)


def dense_oracle(q, ks, vs, ko, vo, scale=None, shared_mask=None, own_mask=None):
    """Dense SDPA over the concatenated keys [shared | all K own blocks] with a materialised
    block mask: draft k sees the shared columns and only its own L columns."""
    K, H, L, D = q.shape
    Hkv, S, _ = ks.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    keys = torch.cat([ks.float(), ko.float().permute(1, 0, 2, 3).reshape(Hkv, K * L, D)], 1)  # [Hkv, S+K*L, D]
    vals = torch.cat([vs.float(), vo.float().permute(1, 0, 2, 3).reshape(Hkv, K * L, D)], 1)
    keys = keys.repeat_interleave(H // Hkv, 0)  # GQA: [H, S+K*L, D]
    vals = vals.repeat_interleave(H // Hkv, 0)
    queries = q.float().permute(1, 0, 2, 3).reshape(H, K * L, D)  # rows (draft, position)
    draft_of_row = torch.arange(K).repeat_interleave(L)
    own = draft_of_row[:, None] == draft_of_row[None, :]  # [K*L, K*L] block diagonal
    if own_mask is not None:                              # [K|1, L, L] inside each diagonal block
        own = own & torch.block_diag(*own_mask.cpu().expand(K, L, L).unbind(0))
    shared = torch.ones(K * L, S, dtype=torch.bool) if shared_mask is None else shared_mask.cpu().expand(K * L, S)
    mask = torch.cat([shared, own], 1)
    scores = (queries @ keys.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = (torch.softmax(scores, -1).nan_to_num(0.0) @ vals)   # a row that sees nothing: 0
    return out.view(H, K, L, D).permute(1, 0, 2, 3), lse.view(H, K, L).permute(1, 0, 2)


def run_triton(q, ks, vs, ko, vo, **kw):
    K, H, L, D = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((K, H, L), float("nan"), device=q.device)
    got = psd_kernels.shared_prefix_attention(q, ks, vs, ko, vo, out=(out, lse), backend="triton", **kw)
    assert got[0] is out and got[1] is lse
    return out, lse


def cpu(ts):
    return [t.cpu() if t is not None else None for t in ts]


# ------------------------------------------------------------------------------------------
# Triton vs reference
# ------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("K", [1, 3, 8])
@pytest.mark.parametrize("L", [1, 7, 32])
@pytest.mark.parametrize("S", [0, 1, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(K, L, S, dtype, device):
    gen = torch.Generator().manual_seed(K * 10000 + L * 100 + S)
    H, Hkv, D = 4, 2, 16
    inputs = make_inputs(K, H, Hkv, L, S, D, dtype, gen, device)
    out, lse = run_triton(*inputs)
    out_ref, lse_ref = reference.shared_prefix_attention(*cpu(inputs))
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), out_ref, **TOL[dtype])
    torch.testing.assert_close(lse.cpu(), lse_ref, **LSE_TOL)


@needs_triton
@pytest.mark.parametrize(
    "K, H, Hkv, L, S, D, dtype",
    [
        (3, 8, 1, 7, 100, 64, torch.float32),  # group 8: one tile spans several drafts and heads
        (2, 2, 2, 32, 37, 24, torch.float32),  # MHA, head dim not a power of two
        (4, 6, 3, 5, 40, 32, torch.float16),
        (2, 4, 2, 32, 70, 128, torch.bfloat16),  # a real head dim
    ],
)
def test_head_layouts(K, H, Hkv, L, S, D, dtype, device):
    gen = torch.Generator().manual_seed(H * 31 + D)
    inputs = make_inputs(K, H, Hkv, L, S, D, dtype, gen, device)
    out, lse = run_triton(*inputs, scale=0.3)
    out_ref, lse_ref = reference.shared_prefix_attention(*cpu(inputs), scale=0.3)
    torch.testing.assert_close(out.cpu(), out_ref, **TOL[dtype])
    torch.testing.assert_close(lse.cpu(), lse_ref, **LSE_TOL)


@needs_triton
@pytest.mark.parametrize("S", [1, 100])
@pytest.mark.parametrize("density", [0.0, 0.6])
def test_shared_mask(S, density, device):
    gen = torch.Generator().manual_seed(S + int(density * 10))
    K, H, Hkv, L, D = 3, 4, 2, 7, 16
    inputs = make_inputs(K, H, Hkv, L, S, D, torch.float32, gen, device)
    mask = (torch.rand(S, generator=gen) < density).to(device)
    out, lse = run_triton(*inputs, shared_mask=mask)
    out_ref, lse_ref = reference.shared_prefix_attention(*cpu(inputs), shared_mask=mask.cpu())
    torch.testing.assert_close(out.cpu(), out_ref, **TOL[torch.float32])
    torch.testing.assert_close(lse.cpu(), lse_ref, **LSE_TOL)
    if density == 0.0:  # nothing shared is visible: own block only
        q, ks, vs, ko, vo = cpu(inputs)
        empty = torch.empty(Hkv, 0, D)
        own_only = reference.shared_prefix_attention(q, empty, empty, ko, vo)
        torch.testing.assert_close(out.cpu(), own_only[0], **TOL[torch.float32])


def _own_masks(K, L, gen):
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    rand = torch.rand(K, L, L, generator=gen) < 0.5
    rand[:, 0] = False                                    # query 0 of every draft sees no own key
    return {"causal_broadcast": causal[None], "random_per_draft": rand}


@pytest.mark.parametrize("kind", ["causal_broadcast", "random_per_draft"])
@pytest.mark.parametrize("S", [0, 40])
def test_reference_own_mask_matches_dense_oracle(kind, S):
    gen = torch.Generator().manual_seed(S + len(kind))
    K, H, Hkv, L, D = 3, 4, 2, 7, 16
    q, ks, vs, ko, vo = make_inputs(K, H, Hkv, L, S, D, torch.float32, gen, "cpu")
    om = _own_masks(K, L, gen)[kind]
    shared_mask = (torch.rand(S, generator=gen) < 0.7) if S else None
    out, lse = reference.shared_prefix_attention(q, ks, vs, ko, vo, shared_mask=shared_mask, own_mask=om)
    o_ref, l_ref = dense_oracle(q, ks, vs, ko, vo, shared_mask=shared_mask, own_mask=om)
    torch.testing.assert_close(out, o_ref, **TOL[torch.float32])
    torch.testing.assert_close(lse, l_ref, **LSE_TOL)
    full = reference.shared_prefix_attention(q, ks, vs, ko, vo, shared_mask=shared_mask)[0]
    assert not torch.allclose(out, full, atol=1e-3)      # the mask does change the result
    if S == 0 and kind == "random_per_draft":            # query 0 sees nothing at all
        assert torch.all(out[:, :, 0] == 0) and torch.all(torch.isneginf(lse[:, :, 0]))


@needs_triton
@pytest.mark.parametrize("kind", ["causal_broadcast", "random_per_draft"])
@pytest.mark.parametrize("S", [0, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_own_mask_matches_reference(kind, S, dtype, device):
    gen = torch.Generator().manual_seed(3 * S + len(kind))
    K, H, Hkv, L, D = 3, 4, 2, 7, 16
    inputs = make_inputs(K, H, Hkv, L, S, D, dtype, gen, device)
    om = _own_masks(K, L, gen)[kind]
    shared_mask = (torch.rand(S, generator=gen) < 0.7) if S else None
    out, lse = run_triton(*inputs, shared_mask=None if shared_mask is None else shared_mask.to(device),
                          own_mask=om.to(device))
    out_ref, lse_ref = reference.shared_prefix_attention(*cpu(inputs), shared_mask=shared_mask, own_mask=om)
    torch.testing.assert_close(out.cpu(), out_ref, **TOL[dtype])
    torch.testing.assert_close(lse.cpu(), lse_ref, **LSE_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_own_mask_bad_input(backend, device):
    gen = torch.Generator().manual_seed(0)
    dev = device if backend == "triton" else "cpu"
    inputs = make_inputs(2, 4, 2, 5, 3, 16, torch.float32, gen, dev)
    for bad, msg in ((torch.ones(2, 5, 4, dtype=torch.bool), "own_mask has shape"),
                     (torch.ones(3, 5, 5, dtype=torch.bool), "own_mask has shape"),
                     (torch.ones(2, 5, 5), "own_mask must be a bool")):
        with pytest.raises(ValueError, match=msg):
            psd_kernels.shared_prefix_attention(*inputs, own_mask=bad.to(dev), backend=backend)


@needs_triton
def test_strided_cache_views(device):
    """The engine passes views into a larger cache buffer and head-major layouts; the kernel takes strides."""
    gen = torch.Generator().manual_seed(77)
    K, H, Hkv, L, S, D = 3, 4, 2, 7, 50, 16
    cache = torch.randn(2, S + 20, Hkv, D, generator=gen).to(device)  # [k|v, positions, heads, D]
    ks, vs = cache[0, :S].transpose(0, 1), cache[1, :S].transpose(0, 1)  # [Hkv, S, D], non-contiguous
    q = torch.randn(K, L, H, D, generator=gen).to(device).transpose(1, 2)  # [K, H, L, D] view
    own = torch.randn(K, L, 2, Hkv, D, generator=gen).to(device)
    ko, vo = own[:, :, 0].transpose(1, 2), own[:, :, 1].transpose(1, 2)
    out, lse = run_triton(q, ks, vs, ko, vo)
    out_ref, lse_ref = reference.shared_prefix_attention(*cpu((q, ks, vs, ko, vo)))
    torch.testing.assert_close(out.cpu(), out_ref, **TOL[torch.float32])
    torch.testing.assert_close(lse.cpu(), lse_ref, **LSE_TOL)


# ------------------------------------------------------------------------------------------
# several cache rows in one call: row_map / RowPlan
# ------------------------------------------------------------------------------------------
def make_rows(row_map, C, H, Hkv, L, S, D, dtype, gen, device):
    R = len(row_map)

    def r(*shape):
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    return (r(R, H, L, D), r(C, Hkv, S, D), r(C, Hkv, S, D), r(R, Hkv, L, D), r(R, Hkv, L, D),
            torch.tensor(row_map, dtype=torch.int64, device=device))


def naive_rows(q, ks, vs, ko, vo, row_map, scale=None, shared_mask=None, own_mask=None):
    """fp64 attention of every row on its own: [its cache row's S keys | its L own keys]."""
    q, ks, vs, ko, vo = (t.cpu().double() for t in (q, ks, vs, ko, vo))
    R, H, L, D = q.shape
    C, Hkv, S, _ = ks.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    outs, lses = [], []
    for r, c in enumerate(row_map.tolist()):
        keys = torch.cat([ks[c], ko[r]], 1).repeat_interleave(H // Hkv, 0)       # [H, S+L, D]
        vals = torch.cat([vs[c], vo[r]], 1).repeat_interleave(H // Hkv, 0)
        sm = torch.ones(S, dtype=torch.bool) if shared_mask is None else shared_mask.cpu().expand(C, S)[c]
        om = torch.ones(L, L, dtype=torch.bool) if own_mask is None else own_mask.cpu().expand(R, L, L)[r]
        mask = torch.cat([sm.expand(L, S), om], 1)
        s = (q[r] @ keys.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.softmax(s, -1).nan_to_num(0.0) @ vals)
    return torch.stack(outs), torch.stack(lses)


# (row_map, C): sequences with different numbers of draft rows, a cache row nobody reads,
# rows not grouped by cache row, one row per cache row, and more cache rows than one scan chunk
ROW_MAPS = {
    "uneven": ([0, 0, 0, 1, 2, 2, 2, 2, 2, 2], 3),
    "idle_cache_row": ([2, 2, 0, 0, 0], 4),
    "interleaved": ([1, 0, 1, 2, 0, 1], 3),
    "one_each": ([0, 1, 2, 3], 4),
    "many_cache_rows": ([c for c in range(70) for _ in range(1 + c % 3)], 70),
}


@needs_triton
@pytest.mark.parametrize("maps", list(ROW_MAPS))
@pytest.mark.parametrize("masks", ["none", "shared_per_row", "own_per_row", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_map_triton_matches_reference_and_naive(maps, masks, dtype, device):
    row_map, C = ROW_MAPS[maps]
    big = maps == "many_cache_rows"
    if big and interpreted() and masks in ("shared_per_row", "own_per_row"):
        pytest.skip("interpreter: masks 'both' cross the chunk boundary with each mask (5-8 s a case); "
                    "runs compiled on a GPU")
    H, Hkv, L, S, D = (2, 1, 2, 5, 16) if big else (6, 2, 7, 37, 24)       # GQA 3, odd sizes
    gen = torch.Generator().manual_seed(len(row_map) * 7 + C + len(masks))
    q, ks, vs, ko, vo, rm = make_rows(row_map, C, H, Hkv, L, S, D, dtype, gen, device)
    kw = {}
    if masks in ("shared_per_row", "both"):
        sm = torch.rand(C, S, generator=gen) < 0.6
        sm[0] = False                                     # cache row 0: no visible shared key
        kw["shared_mask"] = sm.to(device)
    if masks in ("own_per_row", "both"):
        om = torch.rand(len(row_map), L, L, generator=gen) < 0.5
        om[:, 0] = False                                  # own query 0 sees no own key
        kw["own_mask"] = om.to(device)
    out, lse = run_triton(q, ks, vs, ko, vo, row_map=rm, **kw)
    ref = reference.shared_prefix_attention(*cpu((q, ks, vs, ko, vo)), row_map=rm.cpu(),
                                            **{k: v.cpu() for k, v in kw.items()})
    torch.testing.assert_close(out.cpu(), ref[0], **TOL[dtype])
    torch.testing.assert_close(lse.cpu(), ref[1], **LSE_TOL)
    want = naive_rows(q, ks, vs, ko, vo, rm.cpu(), **kw)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(ref[0].double(), want[0], **tol)
    torch.testing.assert_close(ref[1].double(), want[1], rtol=1e-5, atol=1e-5)
    if masks == "both":          # a row of cache row 0 whose query 0 sees nothing at all
        r0 = row_map.index(0)
        assert torch.all(out[r0, :, 0].cpu() == 0) and torch.all(torch.isneginf(lse[r0, :, 0].cpu()))


@needs_triton
def test_row_map_broadcast_shared_mask_and_plans(device):
    """A [S] shared mask applies to every cache row; a RowPlan, a raw row_map and a plan made
    for the other backend give the same results."""
    gen = torch.Generator().manual_seed(5)
    row_map, C = ROW_MAPS["uneven"]
    q, ks, vs, ko, vo, rm = make_rows(row_map, C, 4, 2, 5, 30, 16, torch.float32, gen, device)
    sm = (torch.rand(30, generator=gen) < 0.5).to(device)
    causal = torch.ones(1, 5, 5, dtype=torch.bool, device=device).tril()
    kw = dict(shared_mask=sm, own_mask=causal)
    want = naive_rows(q, ks, vs, ko, vo, rm.cpu(), shared_mask=sm.cpu().expand(C, 30), own_mask=causal.cpu())
    for backend in BACKENDS:
        for plan in (rm, psd_kernels.plan_rows(rm, C, backend="triton"), psd_kernels.plan_rows(rm, C, backend="reference")):
            out, lse = psd_kernels.shared_prefix_attention(q, ks, vs, ko, vo, row_map=plan, backend=backend, **kw)
            torch.testing.assert_close(out.cpu().double(), want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse.cpu().double(), want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("maps", ["interleaved", "idle_cache_row"])
@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_row_map_matches_naive(maps, flash, dtype, monkeypatch):
    """Both CPU paths of the reference (the fused SDPA kernel and the matmul fallback used off
    CPU) against fp64 attention of every row on its own; with cache rows no row reads (left out
    of the padded layout: `RowPlan.used`) too."""
    monkeypatch.setattr(reference, "USE_FLASH_CPU", flash and reference.USE_FLASH_CPU)
    gen = torch.Generator().manual_seed(11)
    row_map, C = ROW_MAPS[maps]
    q, ks, vs, ko, vo, rm = make_rows(row_map, C, 8, 2, 9, 70, 32, dtype, gen, "cpu")
    sm = torch.rand(C, 70, generator=gen) < 0.7
    om = torch.rand(len(row_map), 9, 9, generator=gen) < 0.5
    for kw in (dict(shared_mask=sm), dict(shared_mask=sm, own_mask=om), dict(scale=0.2)):
        out, lse = reference.shared_prefix_attention(q, ks, vs, ko, vo, row_map=rm, **kw)
        want = naive_rows(q, ks, vs, ko, vo, rm, **kw)
        assert out.dtype == dtype and lse.dtype == torch.float32
        tol = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=1e-5, atol=1e-5),
               torch.bfloat16: TOL[torch.bfloat16]}[dtype]
        torch.testing.assert_close(out.double(), want[0], **tol)
        torch.testing.assert_close(lse.double(), want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_rows_do_not_depend_on_the_other_rows(dtype):
    """A row's output is bit-identical whether it is verified alone or among other rows and
    other sequences' rows (lossless PSD modes compare a draft's output with the plain call's)."""
    gen = torch.Generator().manual_seed(2)
    row_map = [0] * 40 + [1] * 3            # 40 rows x G x L query rows: other SDPA tilings than one row
    q, ks, vs, ko, vo, rm = make_rows(row_map, 2, 8, 2, 9, 600, 32, dtype, gen, "cpu")
    kw = dict(shared_mask=torch.rand(2, 600, generator=gen) < 0.8, own_mask=torch.rand(43, 9, 9, generator=gen) < 0.5)
    full = reference.shared_prefix_attention(q, ks, vs, ko, vo, row_map=rm, **kw)
    for sub in ([0], [39], [40], [5, 6, 7], [7, 41], list(range(20))):
        sub = torch.tensor(sub)
        part = reference.shared_prefix_attention(q[sub], ks, vs, ko[sub], vo[sub], row_map=rm[sub],
                                                 shared_mask=kw["shared_mask"], own_mask=kw["own_mask"][sub])
        assert torch.equal(part[0], full[0][sub]) and torch.equal(part[1], full[1][sub])


def test_reference_row_map_never_allocates_a_cache_copy_per_row():
    K, C, H, Hkv, L, S, D = 5, 2, 4, 2, 4, 101, 64
    gen = torch.Generator().manual_seed(0)
    q, ks, vs, ko, vo, rm = make_rows([0] * K + [1] * (K - 2), C, H, Hkv, L, S, D, torch.float32, gen, "cpu")
    with NumelRecorder() as rec:
        reference.shared_prefix_attention(q, ks, vs, ko, vo, row_map=rm, shared_mask=torch.rand(C, S, generator=gen) < 0.5)
    biggest = max(rec.created, key=lambda e: e[1])
    assert biggest[1] < K * S * D, f"{biggest[0]} created {biggest[1]} elements"


# ------------------------------------------------------------------------------------------
# reference semantics
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K, H, Hkv, L, S", [(1, 2, 2, 1, 0), (3, 4, 2, 7, 1), (8, 4, 1, 5, 100)])
@pytest.mark.parametrize("masked", [False, True])
def test_reference_equals_dense_sdpa(K, H, Hkv, L, S, masked):
    gen = torch.Generator().manual_seed(K + S)
    inputs = make_inputs(K, H, Hkv, L, S, 16, torch.float32, gen, "cpu")
    mask = (torch.rand(S, generator=gen) < 0.5) if masked else None
    out, lse = reference.shared_prefix_attention(*inputs, shared_mask=mask)
    out_d, lse_d = dense_oracle(*inputs, shared_mask=mask)
    torch.testing.assert_close(out, out_d, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_d, rtol=1e-5, atol=1e-5)


def test_drafts_are_independent():
    """Changing draft 1's own block changes draft 1's output only."""
    gen = torch.Generator().manual_seed(3)
    q, ks, vs, ko, vo = make_inputs(3, 4, 2, 6, 20, 16, torch.float32, gen, "cpu")
    base, _ = reference.shared_prefix_attention(q, ks, vs, ko, vo)
    ko2, vo2 = ko.clone(), vo.clone()
    ko2[1] += 1.0
    vo2[1] -= 2.0
    moved, _ = reference.shared_prefix_attention(q, ks, vs, ko2, vo2)
    assert torch.equal(moved[0], base[0]) and torch.equal(moved[2], base[2])
    assert not torch.allclose(moved[1], base[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_attention_recovers_full_attention(backend, device):
    """Shared part and own part computed by separate calls, merged by lse, equal the joint call."""
    gen = torch.Generator().manual_seed(12)
    K, H, Hkv, L, S, D = 3, 4, 2, 7, 40, 16
    q, ks, vs, ko, vo = make_inputs(K, H, Hkv, L, S, D, torch.float32, gen, device)
    full = psd_kernels.shared_prefix_attention(q, ks, vs, ko, vo, backend=backend)
    # part a: the first 25 shared keys plus the own blocks; part b: the other 15 shared keys
    part_a = psd_kernels.shared_prefix_attention(q, ks[:, :25], vs[:, :25], ko, vo, backend=backend)
    qg = q.view(K, Hkv, H // Hkv * L, D)  # the G query heads of kv head g share its keys
    scores = qg @ ks[None, :, 25:].transpose(-1, -2) / math.sqrt(D)  # [K, Hkv, G*L, 15]
    l_b = torch.logsumexp(scores, -1)
    o_b = torch.softmax(scores, -1) @ vs[None, :, 25:]
    merged = psd_kernels.merge_attention(part_a[0], part_a[1], o_b.view(K, H, L, D), l_b.view(K, H, L))
    torch.testing.assert_close(merged[0], full[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged[1], full[1], rtol=1e-5, atol=1e-5)


def test_merge_attention_empty_parts():
    gen = torch.Generator().manual_seed(13)
    o = torch.randn(2, 3, 4, generator=gen)
    lse = torch.randn(2, 3, generator=gen)
    none_o, none_lse = torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf"))
    m_o, m_lse = psd_kernels.merge_attention(none_o, none_lse, o, lse)
    assert torch.equal(m_o, o) and torch.equal(m_lse, lse)
    e_o, e_lse = psd_kernels.merge_attention(none_o, none_lse, none_o, none_lse)
    assert torch.equal(e_o, none_o) and bool(torch.isneginf(e_lse).all())
    with pytest.raises(ValueError, match="matching shapes"):
        psd_kernels.merge_attention(o, lse, o[:, :2], lse[:, :2])


# ------------------------------------------------------------------------------------------
# memory: one copy of the shared cache, never K
# ------------------------------------------------------------------------------------------
class NumelRecorder(TorchDispatchMode):
    """Records the numel of every tensor an op creates."""

    def __init__(self):
        super().__init__()
        self.created: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.created.append((str(func), t.numel()))
        return result


def _replicating_attention(q, ks, vs, ko, vo):
    """What the kernel avoids: a per-draft copy of the shared cache."""
    K = q.shape[0]
    keys = torch.cat([ks[None].expand(K, -1, -1, -1), ko], 2)  # [K, Hkv, S+L, D]: K copies
    vals = torch.cat([vs[None].expand(K, -1, -1, -1), vo], 2)
    G = q.shape[1] // ks.shape[0]
    return F.scaled_dot_product_attention(q, keys.repeat_interleave(G, 1), vals.repeat_interleave(G, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_never_allocates_k_copies_of_the_cache(dtype):
    # sizes chosen so that a per-draft cache copy (K·S·D per kv head) is larger than every
    # legitimate intermediate: scores H·K·L·S (G·Hkv·L < D), the cache cast Hkv·S·D (Hkv < K)
    K, H, Hkv, L, S, D = 5, 4, 2, 4, 101, 64
    gen = torch.Generator().manual_seed(0)
    inputs = make_inputs(K, H, Hkv, L, S, D, dtype, gen, "cpu")
    limit = K * S * D
    with NumelRecorder() as rec:
        reference.shared_prefix_attention(*inputs)
    biggest = max(rec.created, key=lambda e: e[1])
    assert biggest[1] < limit, f"{biggest[0]} created {biggest[1]} elements (a per-draft cache copy is {limit})"
    # the recorder does see a replicated cache (the check can fail)
    with NumelRecorder() as rec:
        _replicating_attention(*inputs)
    assert max(n for _, n in rec.created) >= K * Hkv * S * D


@pytest.mark.gpu
def test_triton_peak_memory_is_outputs_only():
    K, H, Hkv, L, S, D = 8, 32, 8, 32, 16384, 128
    gen = torch.Generator().manual_seed(0)
    inputs = make_inputs(K, H, Hkv, L, S, D, torch.bfloat16, gen, "cuda")
    psd_kernels.shared_prefix_attention(*inputs, backend="triton")  # autotune outside the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = psd_kernels.shared_prefix_attention(*inputs, backend="triton")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    outputs = out.numel() * out.element_size() + lse.numel() * 4
    assert extra <= outputs + (1 << 20), f"{extra} bytes beyond {outputs} of outputs"
    one_replica = K * Hkv * S * D * 2
    assert extra < one_replica // 8


# ------------------------------------------------------------------------------------------
# input checks
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs(backend, device):
    gen = torch.Generator().manual_seed(0)
    q, ks, vs, ko, vo = make_inputs(2, 4, 2, 3, 5, 8, torch.float32, gen, device)

    def call(*a, **kw):
        return psd_kernels.shared_prefix_attention(*a, backend=backend, **kw)

    with pytest.raises(ValueError, match="q must be a 4-D"):
        call(q[0], ks, vs, ko, vo)
    with pytest.raises(ValueError, match="k_shared must be a 3 or 4-D"):
        call(q, ks[None, None], vs, ko, vo)
    with pytest.raises(ValueError, match="v_shared has shape"):
        call(q, ks[None], vs, ko, vo)
    with pytest.raises(ValueError, match="give row_map"):
        call(q, ks[None].expand(2, -1, -1, -1), vs[None].expand(2, -1, -1, -1), ko, vo)
    two = (ks[None].expand(2, -1, -1, -1), vs[None].expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match="row_map must be an int64 tensor of shape"):
        call(q, *two, ko, vo, row_map=torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="row_map must be an int64 tensor of shape"):
        call(q, *two, ko, vo, row_map=torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="made for 3 cache rows"):
        call(q, *two, ko, vo, row_map=psd_kernels.plan_rows(torch.zeros(2, dtype=torch.int64, device=device), 3,
                                                             backend=backend))
    with pytest.raises(ValueError, match="shared_mask has shape"):
        call(q, *two, ko, vo, shared_mask=torch.ones(3, 5, dtype=torch.bool, device=device),
             row_map=torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call(q[:, :3], ks, vs, ko, vo)
    with pytest.raises(ValueError, match="all inputs need one dtype"):
        call(q, ks.half(), vs, ko, vo)
    with pytest.raises(ValueError, match="v_shared has shape"):
        call(q, ks, vs[:, :4], ko, vo)
    with pytest.raises(ValueError, match="k_own has shape"):
        call(q, ks, vs, ko[:1], vo)
    with pytest.raises(ValueError, match="head dim"):
        call(q, ks[..., :4], vs, ko, vo)
    with pytest.raises(ValueError, match="shared_mask must be a bool"):
        call(q, ks, vs, ko, vo, shared_mask=torch.ones(5, device=device))
    with pytest.raises(ValueError, match="shared_mask has shape"):
        call(q, ks, vs, ko, vo, shared_mask=torch.ones(4, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="floating point"):
        call(q.long(), ks.long(), vs.long(), ko.long(), vo.long())
    with pytest.raises(ValueError, match="head dim D must be >= 1"):       # was a ZeroDivisionError
        call(q[..., :0], ks[..., :0], vs[..., :0], ko[..., :0], vo[..., :0])


@pytest.mark.parametrize("flash", [True, False])
def test_reference_takes_inputs_without_a_unit_stride_in_the_head_dim(flash, monkeypatch):
    """The same values with the head dim not contiguous (a slice of an interleaved buffer, or the
    head dim outermost in memory) give the same attention: the CPU flash op assumed a unit stride
    and returned wrong values silently."""
    monkeypatch.setattr(reference, "USE_FLASH_CPU", flash)
    gen = torch.Generator().manual_seed(0)
    args = make_inputs(2, 2, 1, 3, 7, 8, torch.float32, gen, "cpu")
    want = reference.shared_prefix_attention(*args)
    for i in range(5):
        for f in (lambda t: torch.stack([t, torch.zeros_like(t)], -1).flatten(-2)[..., ::2],
                  lambda t: t.movedim(-1, 0).contiguous().movedim(0, -1)):
            moved = list(args)
            moved[i] = f(args[i])
            assert moved[i].stride(-1) != 1 and torch.equal(moved[i], args[i])
            got = reference.shared_prefix_attention(*moved)        # (the bug: off by 0.77 up to 1.6e6)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_plan_rows_checks():
    with pytest.raises(ValueError, match="row_map names cache rows 0..3, but there are 3"):
        reference.plan_rows(torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="row_map names cache rows -1..0"):
        reference.plan_rows(torch.tensor([-1, 0]), 3)
    with pytest.raises(ValueError, match="1-D int64"):
        reference.plan_rows(torch.tensor([[0]]), 3)
    with pytest.raises(ValueError, match="cache_rows must be a positive int"):
        reference.plan_rows(torch.tensor([0]), 0)
    with pytest.raises(ValueError, match="unknown psd_kernels backend"):
        psd_kernels.plan_rows(torch.tensor([0]), 1, backend="cuda")
    plan = reference.plan_rows(torch.tensor([2, 0, 2, 2]), 4)
    assert plan.max_rows == 3 and not plan.rect
    assert plan.order.tolist() == [1, 0, 2, 3] and plan.offsets.tolist() == [0, 1, 1, 4, 4]
    # cache rows 1 and 3 are read by no row: the padded layout holds rows 0 and 2 only ([2, 3] slots)
    assert plan.used.tolist() == [0, 2] and plan.slots.tolist() == [3, 0, 4, 5]
    assert reference.plan_rows(torch.tensor([2, 0, 1, 3]), 4).used is None          # every cache row read
    assert reference.plan_rows(torch.tensor([0, 0, 1, 1]), 2).rect
    assert reference.plan_rows(torch.tensor([1, 1, 0, 0]), 2).rect is False      # right counts, wrong order
    lean = reference.plan_rows(torch.tensor([2, 0, 2, 2]), 4, padded=False)
    assert lean.slots is None and lean.padded().slots.tolist() == plan.slots.tolist()


@needs_triton
def test_triton_bad_out(device):
    gen = torch.Generator().manual_seed(0)
    q, ks, vs, ko, vo = make_inputs(2, 4, 2, 3, 5, 8, torch.float32, gen, device)
    with pytest.raises(ValueError, match="out buffer lse"):
        psd_kernels.shared_prefix_attention(q, ks, vs, ko, vo, out=(torch.empty_like(q), torch.empty(2, 4, 3, 1, device=device)),
                                            backend="triton")


def _bad_outs(device):
    """(out, what the ValueError says) for out buffers of a [2, 4, 3, 8] float32 call that it must refuse."""
    o, lse = torch.empty(2, 4, 3, 8, device=device), torch.empty(2, 4, 3, device=device)
    return [
        ((o, lse.double()), "out buffer lse must be torch.float32 \\(2, 4, 3\\)"),
        ((o, lse[..., :1]), "out buffer lse"),
        ((o.bfloat16(), lse), "out buffer out must be torch.float32 \\(2, 4, 3, 8\\)"),
        ((o[..., :4], lse), "out buffer out"),
        ((o, torch.empty(2, 4, 3, device="meta")), "out buffer lse .* on meta"),
        ((None, lse), "out buffer out must be a tensor"),
        (o, "out must be a pair \\(out, lse\\)"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_bad_out_buffers_fail_alike_on_both_backends(case, device):
    """The reference checks out= as the Triton launcher does (it accepted e.g. a float64 lse):
    the same ValueError, message included, on both backends."""
    q, ks, vs, ko, vo = make_inputs(2, 4, 2, 3, 5, 8, torch.float32, torch.Generator().manual_seed(0), device)
    out, match = _bad_outs(device)[case]
    said = {}
    for backend in BACKENDS:
        with pytest.raises(ValueError) as e:
            psd_kernels.shared_prefix_attention(q, ks, vs, ko, vo, out=out, backend=backend)
        said[backend] = str(e.value)
    assert re.search(match, said["reference"]), said
    assert len(set(said.values())) == 1, said


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_buffers_receive_the_results(backend, device):
    q, ks, vs, ko, vo = make_inputs(2, 4, 2, 3, 5, 8, torch.float32, torch.Generator().manual_seed(1), device)
    o, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:-1], float("nan"), device=device)
    got = psd_kernels.shared_prefix_attention(q, ks, vs, ko, vo, out=[o, lse], backend=backend)
    assert got[0] is o and got[1] is lse
    want = reference.shared_prefix_attention(q, ks, vs, ko, vo)
    torch.testing.assert_close(o, want[0], **TOL[torch.float32])
    torch.testing.assert_close(lse, want[1], **LSE_TOL)


@pytest.mark.slow
def test_compiles_for_sm90(compile_check):
    compile_check("sparse_attn")
