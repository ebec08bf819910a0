"""Rank and draft on the current block (Triton): PSD's ordering σ and stage 2 as index kernels.

Every kernel ranks the masked positions of one row by confidence (descending, lower position
first on ties) with an all-pairs count: rank_i = #{masked j : c_j > c_i or (c_j = c_i and j < i)}.
A block is a few dozen positions, so the O(L²) count is a handful of vector compares held in
registers, needs no sort, and is exactly the tie rule of the reference's stable sort.
The torch path sorts twice, gathers, builds a [B, K, L, D] hit tensor and selects; these
kernels read the B·L inputs once and write only their outputs, in one launch each:
``rank_positions`` writes σ (the position of every rank), ``position_ranks`` its inverse (the
rank of every position), ``assemble_drafts`` the K draft blocks of the draft graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import check_draft_args, check_rank_args, drafts_out, rank_out
from ._common import check_device


@triton.jit
def _row_ranks(conf_row, masked_row, stride_cl, stride_ml, L, BLOCK_L: tl.constexpr, BLOCK_J: tl.constexpr):
    """Rank of every position of one row (-1 where unmasked) and the row's masked count."""
    offs = tl.arange(0, BLOCK_L)
    in_row = offs < L
    c = tl.load(conf_row + offs * stride_cl, mask=in_row, other=0.0)
    msk = tl.load(masked_row + offs * stride_ml, mask=in_row, other=0) != 0
    rank = tl.zeros([BLOCK_L], dtype=tl.int32)
    # the j axis is chunked so the [BLOCK_L, BLOCK_J] compare tile stays register-sized for long blocks
    for j0 in range(0, L, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        in_j = offs_j < L
        cj = tl.load(conf_row + offs_j * stride_cl, mask=in_j, other=0.0)
        mj = tl.load(masked_row + offs_j * stride_ml, mask=in_j, other=0) != 0
        ahead = (cj[None, :] > c[:, None]) | ((cj[None, :] == c[:, None]) & (offs_j[None, :] < offs[:, None]))
        rank += tl.sum((ahead & mj[None, :]).to(tl.int32), 1)
    rank = tl.where(msk, rank, -1)
    n_masked = tl.sum(msk.to(tl.int32), 0)
    return offs, in_row, c, msk, rank, n_masked


@triton.jit
def _rank_positions_kernel(
    CONF, MASKED, ORDER, NMASKED,
    stride_cb, stride_cl, stride_mb, stride_ml, stride_ob, stride_ol, stride_n,
    L,
    BLOCK_L: tl.constexpr, BLOCK_J: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs, in_row, c, msk, rank, n = _row_ranks(
        CONF + b * stride_cb, MASKED + b * stride_mb, stride_cl, stride_ml, L, BLOCK_L, BLOCK_J
    )
    order_row = ORDER + b * stride_ob
    # masked ranks are a permutation of 0..n-1, so the scatter and the -1 tail never overlap
    tl.store(order_row + rank * stride_ol, offs.to(tl.int64), mask=msk)
    tl.store(order_row + offs * stride_ol, tl.full([BLOCK_L], -1, tl.int64), mask=in_row & (offs >= n))
    tl.store(NMASKED + b * stride_n, n.to(tl.int64))


@triton.jit
def _position_ranks_kernel(
    CONF, MASKED, RANKS, NMASKED,
    stride_cb, stride_cl, stride_mb, stride_ml, stride_rb, stride_rl, stride_n,
    L,
    BLOCK_L: tl.constexpr, BLOCK_J: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs, in_row, c, msk, rank, n = _row_ranks(
        CONF + b * stride_cb, MASKED + b * stride_mb, stride_cl, stride_ml, L, BLOCK_L, BLOCK_J
    )
    # _row_ranks already gives -1 at unmasked positions: one dense store, no scatter
    tl.store(RANKS + b * stride_rb + offs * stride_rl, rank.to(tl.int64), mask=in_row)
    tl.store(NMASKED + b * stride_n, n.to(tl.int64))


@triton.jit
def _assemble_drafts_kernel(
    BLOCK, MASKED, PRED, CONF, RANKS, DRAFTS, VALID,
    stride_bb, stride_bl, stride_mb, stride_ml, stride_pb, stride_pl, stride_cb, stride_cl,
    stride_rk, stride_rd,
    stride_db, stride_dk, stride_dl, stride_vb, stride_vk,
    L, K, D,
    BLOCK_L: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs, in_row, c, msk, rank, n = _row_ranks(
        CONF + b * stride_cb, MASKED + b * stride_mb, stride_cl, stride_ml, L, BLOCK_L, BLOCK_J
    )
    blk = tl.load(BLOCK + b * stride_bb + offs * stride_bl, mask=in_row, other=0)
    prd = tl.load(PRED + b * stride_pb + offs * stride_pl, mask=in_row, other=0)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_k = offs_k < K
    hit = tl.zeros([BLOCK_K, BLOCK_L], dtype=tl.int1)
    ok = in_k
    for d in range(D):
        r = tl.load(RANKS + offs_k * stride_rk + d * stride_rd, mask=in_k, other=-1)
        # unmasked positions carry rank -1: `msk` stops them matching the -1 padding
        hit = hit | ((rank[None, :] == r[:, None]) & msk[None, :])
        ok = ok & (r < n)  # padding (-1) is below any count
    drafts = tl.where(hit, prd[None, :], blk[None, :])
    d_ptrs = DRAFTS + b * stride_db + offs_k[:, None].to(tl.int64) * stride_dk + offs[None, :] * stride_dl
    tl.store(d_ptrs, drafts, mask=in_k[:, None] & in_row[None, :])
    tl.store(VALID + b * stride_vb + offs_k * stride_vk, ok.to(tl.uint8), mask=in_k)


_TILE = 4096  # elements of the largest 2-D tile a program holds


def launch_config(L: int, K: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_L, BLOCK_J, BLOCK_K, num_warps) for blocks of L positions and K graph nodes."""
    block_l = triton.next_power_of_2(max(L, 1))
    block_j = max(1, min(block_l, _TILE // block_l))
    block_k = max(1, min(triton.next_power_of_2(max(K, 1)), _TILE // block_l))
    tile = block_l * max(block_j, block_k)
    num_warps = max(1, min(8, tile // 256))
    return block_l, block_j, block_k, num_warps


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # bool and uint8 share a layout; kernels read/write bytes


def _launch_ranking(kernel, name: str, conf: torch.Tensor, masked: torch.Tensor,
                    out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared launcher of the two ranking kernels: checks, `(name [B, L], n_masked [B])`
    outputs (allocated or the caller's), one program per row."""
    B, L = check_rank_args(conf, masked)
    check_device(conf, masked)
    if out is None:
        result = torch.empty(B, L, dtype=torch.int64, device=conf.device)
        n_masked = torch.empty(B, dtype=torch.int64, device=conf.device)
    else:
        result, n_masked = rank_out(out, conf, name)
    if B == 0:
        return result, n_masked
    if L == 0:
        n_masked.zero_()
        return result, n_masked
    block_l, block_j, _, num_warps = launch_config(L)
    m = _u8(masked)
    kernel[(B,)](
        conf, m, result, n_masked,
        conf.stride(0), conf.stride(1), m.stride(0), m.stride(1), result.stride(0), result.stride(1), n_masked.stride(0),
        L,
        BLOCK_L=block_l, BLOCK_J=block_j, num_warps=num_warps,
    )
    return result, n_masked


def rank_positions(
    conf: torch.Tensor,
    masked: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_ranking(_rank_positions_kernel, "order", conf, masked, out)


def position_ranks(
    conf: torch.Tensor,
    masked: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_ranking(_position_ranks_kernel, "ranks", conf, masked, out)


def assemble_drafts(
    block: torch.Tensor,
    masked: torch.Tensor,
    pred: torch.Tensor,
    conf: torch.Tensor,
    node_ranks: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, L, K, D = check_draft_args(block, masked, pred, conf, node_ranks)
    check_device(block, masked, pred, conf, node_ranks)
    if out is None:
        drafts = torch.empty(B, K, L, dtype=torch.int64, device=block.device)
        valid = torch.empty(B, K, dtype=torch.bool, device=block.device)
    else:
        drafts, valid = drafts_out(out, block, K)
    if B == 0 or K == 0:
        return drafts, valid
    if L == 0:
        valid.copy_((node_ranks < 0).all(-1).expand(B, K))
        return drafts, valid
    block_l, block_j, block_k, num_warps = launch_config(L, K)
    m, v = _u8(masked), _u8(valid)
    _assemble_drafts_kernel[(B, triton.cdiv(K, block_k))](
        block, m, pred, conf, node_ranks, drafts, v,
        block.stride(0), block.stride(1), m.stride(0), m.stride(1), pred.stride(0), pred.stride(1),
        conf.stride(0), conf.stride(1), node_ranks.stride(0), node_ranks.stride(1),
        drafts.stride(0), drafts.stride(1), drafts.stride(2), v.stride(0), v.stride(1),
        L, K, D,
        BLOCK_L=block_l, BLOCK_J=block_j, BLOCK_K=block_k, num_warps=num_warps,
    )
    return drafts, valid


rank_positions.__doc__ = "Triton twin of ``reference.rank_positions`` (one program per row)."
position_ranks.__doc__ = "Triton twin of ``reference.position_ranks`` (one program per row)."
assemble_drafts.__doc__ = "Triton twin of ``reference.assemble_drafts`` (one launch: rows × node tiles)."
