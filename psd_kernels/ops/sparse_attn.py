"""Shared-prefix block-sparse attention for draft blocks over shared cache rows (Triton, flash-attention style).

The drafts of one sequence differ only in their L-position block; the sequence's cached prefix
and suffix (S positions, one cache row of ``k_shared``/``v_shared`` [C, Hkv, S, D]) is stored
once. Viewed as one attention over S + R·L keys per cache row, the mask is dense over the S
shared columns and block-diagonal over the own columns. ONE launch serves every row of a call
(every sequence of a batch and all their drafts, per layer): per kv head, the G·L query rows
of every row (G = H / Hkv query heads per kv head, rows ordered (row, head-in-group,
position)) are grouped by cache row, and a program takes BLOCK_M consecutive query rows of
ONE cache row, streams that cache row's S shared keys once for all of them, then only the own
blocks of the rows its query rows belong to. Online softmax in fp32 (exp2 domain), output in
q's dtype, plus the natural log-sum-exp so partial results merge exactly (``merge_attention``).

Layout metadata comes from a ``RowPlan`` (``psd_kernels.plan_rows``, device ops once per model
call): ``order`` (rows sorted by cache row) and ``offsets`` (the rows of cache row c). The grid
is the data-independent bound ⌈R·G·L / BLOCK_M⌉ + min(C, R) tiles per kv head; each program
finds its cache row and tile from ``offsets`` in the kernel (a prefix sum of the per-cache-row
tile counts), so the launch reads nothing back to the host. Programs past the last tile store
nothing.

Memory: nothing is allocated beyond ``out`` and ``lse``; replicating the cache per draft would
allocate and read R·Hkv·S·D elements per K/V, the kernel reads about ⌈n·G·L / BLOCK_M⌉·Hkv·S·D
per cache row of n rows.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..reference import RowPlan, attention_out, check_attention_args, plan_rows
from ._common import INTERPRET, check_device

_LOG2E = 1.4426950408889634
# cache rows scanned per step when a program looks for its tile (any C works; one step up to 64)
CHUNK_C = 64


@triton.jit
def _attend_tile(q, kt, v, keep, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a key tile: kt [D, N], v [N, D], keep [M, N] visibility."""
    if UPCAST:
        kt = kt.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # log2 domain
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen no visible key yet keep m = -inf; subtracting 0 instead keeps the
    # exponentials at 0 rather than NaN (-inf - -inf).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _find_tile(OFFS, C, pid, GL, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """(cache row, tile index inside it) of tile `pid`, cache row c owning ⌈n_c·GL / BLOCK_M⌉
    consecutive tiles; C when pid is past the last tile."""
    c = tl.zeros([], tl.int32)
    before = tl.zeros([], tl.int64)      # tiles of the cache rows before c
    total = tl.zeros([], tl.int64)       # tiles of the chunks scanned so far
    for c0 in range(0, C, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        ok = idx < C
        lo = tl.load(OFFS + idx, mask=ok, other=0)
        hi = tl.load(OFFS + idx + 1, mask=ok, other=0)
        tiles = ((hi - lo) * GL + BLOCK_M - 1) // BLOCK_M
        incl = total + tl.cumsum(tiles, 0)
        done = ok & (incl <= pid)        # cache rows wholly before tile pid
        c += tl.sum(done.to(tl.int32), 0)
        before = tl.maximum(before, tl.max(tl.where(done, incl, 0), 0))
        total += tl.sum(tiles, 0)
    return c, pid - before


@triton.jit
def _shared_prefix_attn_kernel(
    Q, KS, VS, KO, VO, SMASK, OMASK, O, LSE, ORDER, OFFS,
    stride_qk, stride_qh, stride_ql, stride_qd,
    stride_ksc, stride_ksh, stride_kss, stride_ksd,
    stride_vsc, stride_vsh, stride_vss, stride_vsd,
    stride_kok, stride_koh, stride_kol, stride_kod,
    stride_vok, stride_voh, stride_vol, stride_vod,
    stride_ok, stride_oh, stride_ol, stride_od,
    stride_lk, stride_lh, stride_ll,
    stride_mc, stride_mask,
    stride_omk, stride_omi, stride_omj,
    C, L, S, M_BUCKET, S_BUCKET, qk_scale,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_OWN_MASK: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # M_BUCKET and S_BUCKET (next powers of two of R·G·L and S) are only autotune keys: keys on
    # the sizes themselves would re-tune every time the rows of a call or the prefix change.
    g = tl.program_id(1).to(tl.int64)  # kv head
    GL = GROUP * L
    c, t = _find_tile(OFFS, C, tl.program_id(0), GL, BLOCK_M, CHUNK)
    live = c < C
    c_safe = tl.minimum(c, C - 1).to(tl.int64)
    row_lo = tl.load(OFFS + c_safe)            # this cache row's rows: order[row_lo:row_hi]
    row_hi = tl.load(OFFS + c_safe + 1)
    first = t * BLOCK_M                        # first query row of the tile, inside the cache row
    offs_m = first + tl.arange(0, BLOCK_M)
    # (the bound, not `live & ...`: the interpreter turns a scalar-and-vector bool into ints)
    row_ok = offs_m < tl.where(live, (row_hi - row_lo) * GL, 0)
    sq = row_lo + offs_m // GL                 # sorted row of each query row
    rq = tl.load(ORDER + sq, mask=row_ok, other=0)   # its row in q
    hq = g * GROUP + (offs_m // L) % GROUP     # query head
    lq = offs_m % L
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + rq[:, None] * stride_qk + hq[:, None] * stride_qh + lq[:, None] * stride_ql \
        + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Shared keys of cache row c: every row of the tile sees the same columns, read once for
    # BLOCK_M rows. A program past the last tile runs no iteration.
    ks_base = KS + c_safe * stride_ksc + g * stride_ksh
    vs_base = VS + c_safe * stride_vsc + g * stride_vsh
    s_end = tl.where(live, S, 0)
    for n0 in range(0, s_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < S
        kt = tl.load(ks_base + offs_n[None, :].to(tl.int64) * stride_kss + offs_d[:, None] * stride_ksd,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(vs_base + offs_n[:, None].to(tl.int64) * stride_vss + offs_d[None, :] * stride_vsd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        keep = n_ok
        if HAS_MASK:
            keep = keep & (tl.load(SMASK + c_safe * stride_mc + offs_n * stride_mask, mask=n_ok, other=0) != 0)
        m_i, l_i, acc = _attend_tile(q, kt, v, keep[None, :], m_i, l_i, acc, qk_scale, UPCAST, DOT_PRECISION)

    # Own keys, flattened (sorted row, position): only the rows this tile's query rows belong
    # to, with a block-diagonal mask inside the range.
    s_lo = (row_lo + first // GL).to(tl.int32)
    s_hi = tl.minimum(row_lo + (first + BLOCK_M - 1) // GL, row_hi - 1).to(tl.int32)
    n_beg = s_lo * L
    n_end = tl.where(live, (s_hi + 1) * L, n_beg)
    ko_base = KO + g * stride_koh
    vo_base = VO + g * stride_voh
    for n0 in range(n_beg, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_end
        sk = offs_n // L
        lk = offs_n % L
        rk = tl.load(ORDER + sk, mask=n_ok, other=0)      # the key's row in k_own
        kt = tl.load(ko_base + rk[None, :] * stride_kok + lk[None, :] * stride_kol + offs_d[:, None] * stride_kod,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(vo_base + rk[:, None] * stride_vok + lk[:, None] * stride_vol + offs_d[None, :] * stride_vod,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        keep2 = n_ok[None, :] & (sk[None, :] == sq[:, None])
        if HAS_OWN_MASK:   # own_mask[r, i, j] (stride_omk = 0 broadcasts one mask over the rows)
            om = tl.load(OMASK + rq[:, None] * stride_omk + lq[:, None] * stride_omi
                         + lk[None, :] * stride_omj, mask=keep2 & row_ok[:, None], other=0)
            keep2 = keep2 & (om != 0)
        m_i, l_i, acc = _attend_tile(q, kt, v, keep2, m_i, l_i, acc, qk_scale, UPCAST, DOT_PRECISION)

    # Without an own mask every real row saw its own L >= 1 keys, so l_i > 0; with one, a row may
    # see nothing (out 0, lse -inf, as the reference). Padded rows are not stored.
    seen = row_ok & (l_i > 0)
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # log2 -> natural log
    o_ptrs = O + rq[:, None] * stride_ok + hq[:, None] * stride_oh + lq[:, None] * stride_ol \
        + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + rq * stride_lk + hq * stride_lh + lq * stride_ll, lse, mask=row_ok)


def _prune_configs(configs, named_args, **kwargs):
    # a 128-row tile with head dim > 128 spills registers
    block_d = named_args.get("BLOCK_D", kwargs.get("BLOCK_D", 128))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] * max(block_d, 64) <= 128 * 128]
    return kept or configs[:1]


# The interpreter runs one fixed config (autotuning there would only time numpy); small tiles
# there also make the tests cross tile and chunk boundaries.
INTERPRET_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32}
_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=4, num_stages=2),
]
if INTERPRET:
    _kernel = _shared_prefix_attn_kernel
else:
    _kernel = triton.autotune(
        configs=_CONFIGS,
        key=["M_BUCKET", "S_BUCKET", "HEAD_DIM", "GROUP"],
        prune_configs_by={"early_config_prune": _prune_configs},
    )(_shared_prefix_attn_kernel)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def shared_prefix_attention(
    q: torch.Tensor,
    k_shared: torch.Tensor,
    v_shared: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    scale: float | None = None,
    shared_mask: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    own_mask: torch.Tensor | None = None,
    row_map: torch.Tensor | RowPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    R, H, L, D, Hkv, S, C = check_attention_args(q, k_shared, v_shared, k_own, v_own, shared_mask, own_mask,
                                                 row_map)
    if q.dtype not in _DTYPES:
        raise ValueError(f"triton shared_prefix_attention takes float16/bfloat16/float32, got {q.dtype}")
    plan = row_map if isinstance(row_map, RowPlan) else None
    check_device(q, k_shared, v_shared, k_own, v_own, shared_mask, own_mask,
                 plan.row_map if plan is not None else row_map)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o, lse = _outputs(out, q, (R, H, L, D))
    G = H // Hkv
    M = R * G * L
    if M == 0 or D == 0:
        return o, lse
    if plan is None:
        plan = _plan(row_map, R, C, q.device)
    args = _kernel_args(q, k_shared, v_shared, k_own, v_own, shared_mask, own_mask, o, lse, plan, C, L, S, M, scale)
    meta = dict(
        HEAD_DIM=D, GROUP=G, HAS_MASK=shared_mask is not None, HAS_OWN_MASK=own_mask is not None,
        # the interpreter's dot mishandles 16-bit floats, so it gets fp32 tiles
        UPCAST=INTERPRET or q.dtype == torch.float32,
        # fp32 inputs use exact fp32 products (tf32 would miss the reference by ~1e-3)
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        CHUNK=CHUNK_C, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    # a data-independent bound on the tiles: every cache row with rows adds at most one partial tile
    extra = min(C, R)
    if INTERPRET:
        bm = INTERPRET_CONFIG["BLOCK_M"]
        _kernel[(triton.cdiv(M, bm) + extra, Hkv)](*args, **meta, **INTERPRET_CONFIG)
    else:
        _kernel[lambda META: (triton.cdiv(M, META["BLOCK_M"]) + extra, Hkv)](*args, **meta)
    return o, lse


def _outputs(out, q: torch.Tensor, shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [R, H, L, D] in q's dtype, lse float32 [R, H, L]): fresh, or the caller's `out` pair checked."""
    R, H, L, D = shape
    if out is None:
        return (torch.empty(R, H, L, D, dtype=q.dtype, device=q.device),
                torch.empty(R, H, L, dtype=torch.float32, device=q.device))
    return attention_out(out, q)


def _plan(row_map, R: int, C: int, device: torch.device) -> RowPlan:
    """The rows grouped by cache row (order, offsets), when the caller gave no RowPlan."""
    if row_map is None:        # every row reads cache row 0: rows in order, one group (no host data)
        order = torch.arange(R, device=device)
        offsets = torch.arange(2, device=device) * R
        return RowPlan(order, 1, order, offsets)
    return plan_rows(row_map, C, padded=False)


def _kernel_args(q, k_shared, v_shared, k_own, v_own, shared_mask, own_mask, o, lse, plan: RowPlan,
                 C: int, L: int, S: int, M: int, scale: float) -> tuple:
    """The kernel's positional arguments: tensors, strides (a [S] shared mask and a [1, L, L] own
    mask broadcast by stride 0; an absent mask is a never-read stand-in), sizes and autotune keys."""
    ks = k_shared if k_shared.dim() == 4 else k_shared[None]
    vs = v_shared if v_shared.dim() == 4 else v_shared[None]
    mask = shared_mask.view(torch.uint8) if shared_mask is not None else q  # q: never read
    m_strides = (0, 0)
    if shared_mask is not None:   # a [S] mask applies to every cache row
        m_strides = (shared_mask.stride(0), shared_mask.stride(1)) if shared_mask.dim() == 2 else (0, shared_mask.stride(0))
    omask = own_mask.view(torch.uint8) if own_mask is not None else q
    om_strides = (own_mask.stride(0) if own_mask.shape[0] > 1 else 0, *own_mask.stride()[1:]) \
        if own_mask is not None else (0, 0, 0)
    return (
        q, ks, vs, k_own, v_own, mask, omask, o, lse, plan.order, plan.offsets,
        *q.stride(), *ks.stride(), *vs.stride(), *k_own.stride(), *v_own.stride(),
        *o.stride(), *lse.stride(),
        *m_strides,
        *om_strides,
        C, L, S, triton.next_power_of_2(M), triton.next_power_of_2(S) if S else 0, scale * _LOG2E,
    )


shared_prefix_attention.__doc__ = """Triton twin of ``reference.shared_prefix_attention`` (same
signature; ONE launch over (⌈R·G·L / BLOCK_M⌉ + min(C, R), Hkv) programs for every row and cache
row of the call; never copies a cache row; reads nothing back to the host)."""
