"""Shared-prefix block-sparse attention for K draft blocks (Triton, flash-attention style).

The K drafts of one step differ only in their L-position block; the cached prefix and suffix
(S positions, ``k_shared``/``v_shared``) are stored once. Viewed as one attention over
S + K·L keys, the mask is dense over the S shared columns and block-diagonal over the K·L own
columns. The kernel treats the K·G·L queries of one kv head (G = H / Hkv query heads per kv
head, rows ordered (draft, head-in-group, position)) as one query sequence: a program takes
BLOCK_M consecutive rows, streams the S shared keys once for all of them, then only the own
blocks of the drafts its rows belong to. Online softmax in fp32 (exp2 domain), output in q's
dtype, plus the natural log-sum-exp so partial results merge exactly (``merge_attention``).

Memory: nothing is allocated beyond ``out`` and ``lse``; replicating the cache per draft would
allocate and read K·Hkv·S·D elements per K/V, the kernel reads ⌈K·G·L / BLOCK_M⌉·Hkv·S·D.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..reference import check_attention_args
from ._common import INTERPRET, check_device, check_out, check_out_pair

_LOG2E = 1.4426950408889634


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
def _shared_prefix_attn_kernel(
    Q, KS, VS, KO, VO, SMASK, OMASK, O, LSE,
    stride_qk, stride_qh, stride_ql, stride_qd,
    stride_ksh, stride_kss, stride_ksd,
    stride_vsh, stride_vss, stride_vsd,
    stride_kok, stride_koh, stride_kol, stride_kod,
    stride_vok, stride_voh, stride_vol, stride_vod,
    stride_ok, stride_oh, stride_ol, stride_od,
    stride_lk, stride_lh, stride_ll,
    stride_mask,
    stride_omk, stride_omi, stride_omj,
    K, L, S, M, S_BUCKET, qk_scale,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_OWN_MASK: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # S_BUCKET (next power of two of S) is only an autotune key: keys on S itself would
    # re-tune every time the prefix grows.
    pid_m = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)  # kv head
    GL = GROUP * L
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    kq = offs_m // GL  # draft of each query row
    hq = g * GROUP + (offs_m // L) % GROUP  # query head
    lq = offs_m % L
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + kq.to(tl.int64)[:, None] * stride_qk + hq[:, None] * stride_qh + lq[:, None] * stride_ql \
        + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Shared keys: every row of the tile sees the same columns, read once for BLOCK_M rows.
    ks_base = KS + g * stride_ksh
    vs_base = VS + g * stride_vsh
    for n0 in range(0, S, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < S
        kt = tl.load(ks_base + offs_n[None, :].to(tl.int64) * stride_kss + offs_d[:, None] * stride_ksd,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(vs_base + offs_n[:, None].to(tl.int64) * stride_vss + offs_d[None, :] * stride_vsd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        keep = n_ok
        if HAS_MASK:
            keep = keep & (tl.load(SMASK + offs_n * stride_mask, mask=n_ok, other=0) != 0)
        m_i, l_i, acc = _attend_tile(q, kt, v, keep[None, :], m_i, l_i, acc, qk_scale, UPCAST, DOT_PRECISION)

    # Own keys, flattened (draft, position): only the drafts this tile's rows belong to, with
    # a block-diagonal mask inside the range.
    first = pid_m * BLOCK_M
    k_lo = first // GL
    k_hi = tl.minimum((first + BLOCK_M - 1) // GL, K - 1)
    n_end = (k_hi + 1) * L
    ko_base = KO + g * stride_koh
    vo_base = VO + g * stride_voh
    for n0 in range(k_lo * L, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_end
        kk = (offs_n // L).to(tl.int64)
        lk = offs_n % L
        kt = tl.load(ko_base + kk[None, :] * stride_kok + lk[None, :] * stride_kol + offs_d[:, None] * stride_kod,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(vo_base + kk[:, None] * stride_vok + lk[:, None] * stride_vol + offs_d[None, :] * stride_vod,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        keep2 = n_ok[None, :] & (kk[None, :] == kq[:, None])
        if HAS_OWN_MASK:   # own_mask[k, i, j] (stride_omk = 0 broadcasts one mask over the drafts)
            om = tl.load(OMASK + kq.to(tl.int64)[:, None] * stride_omk + lq[:, None] * stride_omi
                         + lk[None, :] * stride_omj, mask=keep2 & row_ok[:, None], other=0)
            keep2 = keep2 & (om != 0)
        m_i, l_i, acc = _attend_tile(q, kt, v, keep2, m_i, l_i, acc, qk_scale, UPCAST, DOT_PRECISION)

    # Without an own mask every real row saw its own L >= 1 keys, so l_i > 0; with one, a row may
    # see nothing (out 0, lse -inf, as the reference). Padded rows are not stored.
    seen = row_ok & (l_i > 0)
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # log2 -> natural log
    o_ptrs = O + kq.to(tl.int64)[:, None] * stride_ok + hq[:, None] * stride_oh + lq[:, None] * stride_ol \
        + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + kq.to(tl.int64) * stride_lk + hq * stride_lh + lq * stride_ll, lse, mask=row_ok)


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
        key=["M", "S_BUCKET", "HEAD_DIM", "GROUP"],
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
) -> tuple[torch.Tensor, torch.Tensor]:
    K, H, L, D, Hkv, S = check_attention_args(q, k_shared, v_shared, k_own, v_own, shared_mask, own_mask)
    if q.dtype not in _DTYPES:
        raise ValueError(f"triton shared_prefix_attention takes float16/bfloat16/float32, got {q.dtype}")
    check_device(q, k_shared, v_shared, k_own, v_own, shared_mask, own_mask)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if out is None:
        o = torch.empty(K, H, L, D, dtype=q.dtype, device=q.device)
        lse = torch.empty(K, H, L, dtype=torch.float32, device=q.device)
    else:
        check_out_pair(out, ("out", "lse"))
        o = check_out(out[0], "out", (K, H, L, D), q.dtype, q.device)
        lse = check_out(out[1], "lse", (K, H, L), torch.float32, q.device)
    G = H // Hkv
    M = K * G * L
    if M == 0 or D == 0:
        return o, lse
    mask = shared_mask.view(torch.uint8) if shared_mask is not None else q  # q: never read
    omask = own_mask.view(torch.uint8) if own_mask is not None else q
    om_strides = (own_mask.stride(0) if own_mask.shape[0] > 1 else 0, *own_mask.stride()[1:]) \
        if own_mask is not None else (0, 0, 0)
    args = (
        q, k_shared, v_shared, k_own, v_own, mask, omask, o, lse,
        *q.stride(), *k_shared.stride(), *v_shared.stride(), *k_own.stride(), *v_own.stride(),
        *o.stride(), *lse.stride(),
        mask.stride(0) if shared_mask is not None else 0,
        *om_strides,
        K, L, S, M, triton.next_power_of_2(S) if S else 0, scale * _LOG2E,
    )
    meta = dict(
        HEAD_DIM=D, GROUP=G, HAS_MASK=shared_mask is not None, HAS_OWN_MASK=own_mask is not None,
        # the interpreter's dot mishandles 16-bit floats, so it gets fp32 tiles
        UPCAST=INTERPRET or q.dtype == torch.float32,
        # fp32 inputs use exact fp32 products (tf32 would miss the reference by ~1e-3)
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    if INTERPRET:
        bm = INTERPRET_CONFIG["BLOCK_M"]
        _kernel[(triton.cdiv(M, bm), Hkv)](*args, **meta, **INTERPRET_CONFIG)
    else:
        _kernel[lambda META: (triton.cdiv(M, META["BLOCK_M"]), Hkv)](*args, **meta)
    return o, lse


shared_prefix_attention.__doc__ = """Triton twin of ``reference.shared_prefix_attention`` (same
signature; one launch over (⌈K·G·L / BLOCK_M⌉, Hkv) programs; never copies the shared cache)."""
