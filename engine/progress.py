"""The stopping rule (docs/algorithms.md §5), written once, and the progress guard that makes
every decode end whatever the model outputs (§8)."""
from __future__ import annotations

import torch

from .errors import DecodingError
from .state import BlockRun

NONFINITE, NO_PROGRESS = 1, 2


def stopped_at(blk: torch.Tensor, masked: torch.Tensor, stop_ids: torch.Tensor, valid: torch.Tensor | None = None):
    """(stopped [R] bool, first stop position in the window [R]): a stop token is committed with
    nothing masked before it (`valid`: the row's own positions; padding after a shorter row's
    generation in a live batch is not a token of it)."""
    W = blk.shape[1]
    idx = torch.arange(W, device=blk.device)
    is_stop = torch.isin(blk, stop_ids) & ~masked
    if valid is not None:
        is_stop &= valid
    first = torch.where(is_stop, idx, W).min(-1).values
    masked_before = (masked & (idx < first[:, None])).any(-1)
    return (first < W) & ~masked_before, first


def apply_stopping(run: BlockRun, stop_ids: torch.Tensor, mask_id: int, rows=slice(None)) -> torch.Tensor:
    """A row stops at a committed stop token with nothing masked before it, and stays pending
    while its block has masked positions. Returns the rows' masks [R, W]."""
    blk = run.block(rows)
    masked = blk == mask_id
    stopped, first = stopped_at(blk, masked, stop_ids, generated(run, rows))
    stopped &= run.pending[rows]
    run.stop_at[rows] = torch.where(stopped, run.win.lo + first, run.stop_at[rows])     # a canvas column
    run.pending[rows] = run.pending[rows] & ~stopped & masked[:, :run.win.block_length].any(-1)
    return masked


def generated(run: BlockRun, rows=slice(None)) -> torch.Tensor:
    """[R, W] the window's columns that hold the row's own generated positions: valid, and not its
    prompt (a block holds the prompt's end with --align sequence)."""
    col = torch.arange(run.win.lo, run.win.hi, device=run.x.device)
    return (col[None] >= run.gen_start[rows, None]) & run.valid[rows, run.win.lo:run.win.hi]


def settle_edits(run: BlockRun, policy, stop_ids, mask_id: int, masked_before, written, gen) -> torch.Tensor:
    """The stopping rule and a block's end under token editing (docs/algorithms.md §8), after a stage 1
    that wrote `written` [R, W] (commits and edits; `gen`: generated columns). A committed token may
    still change, so a row stops when its step writes a stop token and the first stop token of the
    block has nothing masked before it (LLaDA2's check), or when its block closes holding a stop
    token. The block stays open while masks are left or the policy keeps editing
    (`Policy.keeps_editing`). Returns the rows' masks [R, W]."""
    blk = run.block()
    masked = blk == mask_id
    stopped, first = stopped_at(blk, masked, stop_ids, gen)
    pending = run.pending
    filling = masked_before.any(-1)
    run.post = run.post + (pending & ~filling).long()
    edited = (written & ~masked_before).any(-1)
    more = masked[:, :run.win.block_length].any(-1) | policy.keeps_editing(run.step, filling, edited, run.post)
    now = stopped & (written & torch.isin(blk, stop_ids)).any(-1)            # this step wrote a stop token
    stop = pending & (now | (stopped & ~more))                                # or the block closes with one
    run.stop_at = torch.where(stop, run.win.lo + first, run.stop_at)
    run.pending = pending & ~stop & more
    return masked


def guard_progress(run: BlockRun, was_pending, masked_before, masked_after, may_idle) -> None:
    """A row whose latest output holds NaN/Inf, or whose step committed nothing where its policy
    had to commit (`may_idle` [R]: rows whose policy may skip this step, e.g. Dream's schedule),
    stops here and fails the run when its block closes (no extra host read per step)."""
    finite = torch.isfinite(run.conf).all(-1)
    why = torch.where(was_pending & ~finite, NONFINITE,
                      torch.where(was_pending & ~may_idle & (masked_before == masked_after).all(-1),
                                  NO_PROGRESS, 0))
    new = (why > 0) & (run.failed == 0)
    run.failed = torch.where(new, why, run.failed)
    run.failed_call = torch.where(new, run.calls, run.failed_call)
    run.pending &= run.failed == 0


def raise_failure(run: BlockRun):
    """A DecodingError for the open block's first failed row, raised where the batch is whole (its
    `sequence`: that batch row): the others go on once it leaves (`Decoder.leave`)."""
    row = int((run.failed > 0).nonzero()[0, 0])
    seq, call, why = int(run.seqs[row]), int(run.failed_call[row]), int(run.failed[row])
    if why == NONFINITE:
        raise DecodingError(f"the model's output at call {call} of sequence {seq} (block {run.index}) holds "
                            f"NaN/Inf; its weights or inputs are unusable", sequence=seq)
    raise DecodingError(f"decoding made no progress at call {call} of sequence {seq} (block {run.index}): "
                        f"the policy committed no token where it had to (the model predicted only the mask "
                        f"token, or the policy let the block idle past its step bound, Policy.step_bound)",
                        sequence=seq)
