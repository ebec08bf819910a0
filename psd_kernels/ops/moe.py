"""Fused mixture-of-experts MLP: top-k routed SwiGLU experts as two grouped GEMMs (Triton).

The T·k (token, slot) pairs of a call are grouped by expert with device ops only: a stable
sort of the expert ids and a searchsorted give ``order`` (slots sorted by expert) and
``offsets`` (expert e owns ``order[offsets[e]:offsets[e + 1]]``), the ``RowPlan`` that
``plan_rows`` already makes for attention's cache rows. Each expert's rows are cut into
BLOCK_M tiles; the grid is the data-independent bound ⌈T·k / BLOCK_M⌉ + min(E, T·k) tiles
(every expert with rows adds at most one partial tile), and each program finds its expert and
tile from ``offsets`` in the kernel, so the launch reads nothing back to the host. Programs
past the last tile run no loop iteration and store nothing.

1. ``_moe_gate_up_kernel``: per tile of BLOCK_M slots of expert e and BLOCK_N of the I
   intermediate features, gathers the slots' token rows of x and accumulates x·W_gateᵀ and
   x·W_upᵀ together over H (one read of the x tile feeds both), then applies
   silu(g)·u in the epilogue and stores h [T·k, I] (x's dtype; fp32 accumulators).
2. ``_moe_down_kernel``: per tile of slots and BLOCK_N of the H outputs, h·W_downᵀ over I,
   scaled by the slot's routing weight in the epilogue, stored per slot as y [T·k, H] fp32.
3. ``_moe_sum_kernel``: out[t] = Σ_j y[t·k + j] in slot order, rounded once to x's dtype.
   A per-slot buffer and a sum instead of an atomic scatter-add: the result is deterministic
   and the k slots of a token are added in the same order on every call.

Traffic: each used expert's weights are read once per M tile (once for every tile when the
expert gets at most BLOCK_M slots, the decode case), x is gathered once per N tile, h and y
are written and read once. See docs/kernel_moe.md for the roofline.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import check_moe_args, plan_rows
from ._common import INTERPRET, check_device
from .sparse_attn import _find_tile

# experts scanned per step when a program looks for its tile (any E works; one step up to 256)
CHUNK_E = 256


@triton.jit
def _tile_rows(OFFS, ORDER, E, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """(expert, live, slot of each row, row mask) of program_id(0)'s tile of BLOCK_M slots."""
    e, t = _find_tile(OFFS, E, tl.program_id(0), 1, BLOCK_M, CHUNK)
    live = e < E
    e_safe = tl.minimum(e, E - 1).to(tl.int64)
    lo = tl.load(OFFS + e_safe)
    hi = tl.load(OFFS + e_safe + 1)
    offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
    # (the bound, not `live & ...`: the interpreter turns a scalar-and-vector bool into ints)
    row_ok = offs_m < tl.where(live, hi - lo, 0)
    slot = tl.load(ORDER + lo + offs_m, mask=row_ok, other=0).to(tl.int64)   # t·k + j
    return e_safe, live, slot, row_ok


@triton.jit
def _moe_gate_up_kernel(
    X, WG, WU, HOUT, ORDER, OFFS,
    stride_xt, stride_xh,
    stride_ge, stride_gi, stride_gh,
    stride_ue, stride_ui, stride_uh,
    stride_hn, stride_hi,
    E, K_TOP, H, I,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e, live, slot, row_ok = _tile_rows(OFFS, ORDER, E, BLOCK_M, CHUNK)
    tok = slot // K_TOP
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    x_rows = X + tok[:, None] * stride_xt
    g_cols = WG + e * stride_ge + offs_n[None, :].to(tl.int64) * stride_gi      # [1, BLOCK_N]: Wᵀ tiles
    u_cols = WU + e * stride_ue + offs_n[None, :].to(tl.int64) * stride_ui
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.where(live, H, 0)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(x_rows + offs_k[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        bg = tl.load(g_cols + offs_k[:, None] * stride_gh, mask=w_mask, other=0.0)   # [BLOCK_K, BLOCK_N]
        bu = tl.load(u_cols + offs_k[:, None] * stride_uh, mask=w_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u           # silu(g) · u, in fp32
    h_ptrs = HOUT + slot[:, None] * stride_hn + offs_n[None, :] * stride_hi
    tl.store(h_ptrs, h.to(HOUT.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    HIN, WD, TW, Y, ORDER, OFFS,
    stride_hn, stride_hi,
    stride_de, stride_dh, stride_di,
    stride_yn,
    E, H, I,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e, live, slot, row_ok = _tile_rows(OFFS, ORDER, E, BLOCK_M, CHUNK)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    h_rows = HIN + slot[:, None] * stride_hn
    d_cols = WD + e * stride_de + offs_n[None, :].to(tl.int64) * stride_dh
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.where(live, I, 0)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        a = tl.load(h_rows + offs_k[None, :] * stride_hi, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(d_cols + offs_k[:, None] * stride_di, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    w = tl.load(TW + slot, mask=row_ok, other=0.0).to(tl.float32)      # routing weight of the slot
    tl.store(Y + slot[:, None] * stride_yn + offs_n[None, :], acc * w[:, None],
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(
    Y, IDS, OUT,
    stride_yn, stride_ot, stride_oh,
    E, K_TOP, H,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in range(0, K_TOP):
        s = t * K_TOP + j
        e = tl.load(IDS + s)
        # a slot whose id is outside [0, E) belongs to no expert: its row of y was never written
        # (a bound, not `ok & valid`: the interpreter turns a scalar-and-vector bool into ints)
        h_end = tl.where((e >= 0) & (e < E), H, 0)
        acc += tl.load(Y + s * stride_yn + offs, mask=offs < h_end, other=0.0)
    tl.store(OUT + t * stride_ot + offs * stride_oh, acc.to(OUT.dtype.element_ty), mask=ok)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The interpreter runs one fixed tile shape: small tiles make the tests' small H and I cross
# tile boundaries, and numpy pays per program, not per lane.
INTERPRET_TILES = (16, 32, 32)
SUM_BLOCK_H = 1024


def launch_config(N: int, E: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for N = T·k slots over E experts (Triton's default
    3 pipeline stages, which the compile check lowers).

    BLOCK_M follows the mean number of slots per used expert: 16 (the smallest tl.dot tile) in
    decode, where each expert sees a few tokens and the kernels stream weights, up to 64 when
    experts get enough rows for the tile to reuse each weight tile from registers. Decode tiles
    take 32 columns: one token's 8 experts × I / 32 is 128 gate/up programs at I = 512, about
    one per SM of an H100, where 64 columns would leave half the SMs idle."""
    if INTERPRET:
        bm, bn, bk = INTERPRET_TILES
        return bm, bn, bk, 4
    rows = triton.cdiv(N, max(1, min(E, N)))
    bm = min(64, max(16, triton.next_power_of_2(rows)))
    bk = 64 if dtype != torch.float32 else 32
    bn = 128 if bm >= 64 else 64 if bm == 32 else 32
    return bm, bn, bk, 4 if bm < 64 else 8


def moe(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    T, H, E, I, k = check_moe_args(x, w_gate, w_up, w_down, topk_ids, topk_weights, out)
    if x.dtype not in _DTYPES:
        raise ValueError(f"triton moe takes float16/bfloat16/float32, got {x.dtype}; use backend='reference'")
    check_device(x, w_gate, w_up, w_down, topk_ids, topk_weights, out)
    o = torch.empty(T, H, dtype=x.dtype, device=x.device) if out is None else out
    N = T * k
    if N == 0 or H == 0 or I == 0:       # I = 0: every expert outputs 0
        return o.zero_()
    ids = topk_ids.reshape(N).contiguous()    # slot s = t·k + j; the kernels read them at unit stride
    tw = topk_weights.reshape(N).contiguous()
    plan = plan_rows(ids, E, padded=False)    # device ops: a stable sort and a searchsorted
    dev = x.device
    # h in x's dtype (the next GEMM's operand); y per slot in fp32, summed over k in slot order
    h = torch.empty(N, I, dtype=x.dtype, device=dev)
    y = torch.empty(N, H, dtype=torch.float32, device=dev)
    bm, bn, bk, warps = launch_config(N, E, x.dtype)
    meta = dict(
        # the interpreter's dot mishandles 16-bit floats, so it gets fp32 tiles
        UPCAST=INTERPRET or x.dtype == torch.float32,
        # fp32 inputs use exact fp32 products (tf32 would miss the reference by ~1e-3)
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        CHUNK=CHUNK_E, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
    )
    tiles = triton.cdiv(N, bm) + min(E, N)   # every expert with slots adds at most one partial tile
    _moe_gate_up_kernel[(tiles, triton.cdiv(I, bn))](
        x, w_gate, w_up, h, plan.order, plan.offsets,
        *x.stride(), *w_gate.stride(), *w_up.stride(), *h.stride(),
        E, k, H, I, **meta,
    )
    _moe_down_kernel[(tiles, triton.cdiv(H, bn))](
        h, w_down, tw, y, plan.order, plan.offsets,
        *h.stride(), *w_down.stride(), y.stride(0),
        E, H, I, **meta,
    )
    block_h = min(SUM_BLOCK_H, triton.next_power_of_2(H))
    _moe_sum_kernel[(T, triton.cdiv(H, block_h))](
        y, ids, o, y.stride(0), *o.stride(), E, k, H, BLOCK_H=block_h, num_warps=4,
    )
    return o


moe.__doc__ = """Triton twin of ``reference.moe`` (same signature and math to fp32 rounding; 16-bit
inputs round the intermediate silu(g)·u to x's dtype before the down projection). Three
launches (gate+up with SiLU-and-multiply fused, down with the routing weight fused, a sum over
the k slots) after the grouping's sort and searchsorted; reads nothing back to the host. An id
outside [0, E) is not checked (that would be a host read): its slot contributes nothing."""
