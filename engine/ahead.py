"""`--cross-block` (docs/algorithms.md §8): drafts that finish a block and start the next.

With the `none` cache every call runs the whole canvas, so a call also returns the next block's
output (`Window.ahead`). Two things follow, both lossless in exact mode:

- Drafts cross the boundary. A node whose ranks cover every masked position left in the block
  continues into the next block: its ranks from the block's masked count on map to the next
  block's positions in the order of the same output's next-block confidences. It is accepted
  through a parent that completes the block, against the policy's step on that parent's
  next-block output, which is the output the next block's first call would compute.
- Where the kept draft completes its block, its verifier output of the next block *is* that
  first call's output (the same canvas; a bidirectional model): the row opens the next block with
  it, at the step its draft reached there, without a call.
"""
from __future__ import annotations

import torch

import psd_kernels

from .state import state_of


def first_output(decoder, batch, seqs, x, valid, pos, win, gens=None):
    """The block's first output for rows `seqs`: carried over where the previous block was
    completed by a kept draft, else from a call of the other rows. Returns (pred, conf [S, W],
    None: no alternatives (--top-logprobs is refused with --cross-block), (next-block pred, conf)
    or (None, None), cache, called [S] long, step [S] long). `gens`: the rows' generators (--sampler row)."""
    carried = batch.carry_ok[seqs]
    batch.carry_ok.zero_()                         # a carry serves the block right after it only
    fresh = (~carried).nonzero()[:, 0]                                  # a second small read per block
    W = win.width
    pred = batch.carry_pred[seqs, :W].clone()
    conf = batch.carry_conf[seqs, :W].clone()
    ahead = (None, None)
    if win.ahead:
        ahead = (pred.new_zeros(len(seqs), win.ahead), conf.new_zeros(len(seqs), win.ahead))
    cache = None
    if fresh.numel():
        logits, cache = decoder.cache_mode.start(x[fresh], valid[fresh], pos[fresh], win)
        pred_f, conf_f, _ = decoder.sampler.predict(logits, batch.gen_start[seqs[fresh]], win.lo,
                                                    decoder.sampler.rows_of(gens, fresh), valid[fresh])
        conf = conf.to(conf_f.dtype)
        pred[fresh], conf[fresh] = pred_f[:, :W], conf_f[:, :W]
        if win.ahead:
            ahead = (ahead[0], ahead[1].to(conf_f.dtype))
            ahead[0][fresh], ahead[1][fresh] = pred_f[:, W:], conf_f[:, W:]
    step = torch.where(carried, batch.carry_step[seqs], 0)
    return pred, conf, None, ahead, cache, (~carried).long(), step


def _by_confidence(conf, masked, step, state):
    return conf


def draft_across(run, act, masked, node_ranks, stop_ids, mask_id: int, draft_key=_by_confidence):
    """Stage 2 over the block and the next one, for the active rows: drafts [A, K, W + L], node
    membership [A, K, W + L] and valid [A, K]. σ is the block's masked positions by confidence,
    then the next block's by the next-block confidences of the same output; a node holding a rank
    at or beyond the block's masked count m is valid only if it holds every rank below m (it
    completes the block), the completed block holds no stop token (the row would end there), and
    the row's latest output covers the next block (a row that entered its block without a call
    has none until its first verification call). `draft_key(conf, masked, step, state)`: the key each
    part is ranked by (the decoder's: the policy's own draft order; by default confidence)."""
    W, L = run.win.width, run.win.ahead
    lo, hi = run.win.lo, run.win.hi
    blk = run.x[act, lo:hi + L]
    masked = torch.cat((masked[act], blk[:, W:] == mask_id), -1)
    # one ordering key: the block's masked positions above every next-block one, each part by rank
    here_key = draft_key(run.conf[act], masked[:, :W], run.step[act], state_of(run, act, slice(0, W)))
    there_key = draft_key(run.ahead_conf[act], masked[:, W:], torch.zeros_like(run.step[act]),
                          state_of(run, act, slice(W, None)))
    here, _ = psd_kernels.position_ranks(here_key.float(), masked[:, :W])
    there, _ = psd_kernels.position_ranks(there_key.float(), masked[:, W:])
    key = torch.cat((2 * (W + L) - here, (W + L) - there), -1).float()
    pred = torch.cat((run.pred[act], run.ahead_pred[act]), -1)
    drafts, valid = psd_kernels.assemble_drafts(blk, masked, pred, key, node_ranks)
    m = masked[:, :W].sum(-1)[:, None, None]                                   # [A, 1, 1]
    ranks = node_ranks[None]                                                   # [1, K, D]
    crosses = (ranks >= m).any(-1)                                             # [A, K]
    completes = ((ranks >= 0) & (ranks < m)).sum(-1) == m[..., 0]
    stops = torch.isin(drafts[:, :, :W], stop_ids).any(-1)
    valid &= ~crosses | (completes & ~stops & run.ahead_ok[act, None])
    return drafts, drafts != blk[:, None], valid


def keep_ahead(run, act, best, best_step, vpred, vconf, kept, mask_id: int) -> None:
    """After a verification call: the kept draft's next-block output, whether the draft completes
    its block (then that output is the next block's first), and its step inside the next block."""
    A = len(act)
    W = run.win.width
    ar = torch.arange(A, device=act.device)
    run.ahead_pred[act] = vpred[ar, best, W:]
    run.ahead_conf[act] = vconf[ar, best, W:].to(run.ahead_conf.dtype)
    run.ahead_ok[act] = True
    run.carry[act] = (kept[:, :W] != mask_id).all(-1)
    run.ahead_step[act] = torch.where((kept[:, W:] != mask_id).any(-1), best_step, 0)


def carry_over(batch, run) -> None:
    """At the end of a block: what the next block may reuse (nothing on the last block). A stop
    token the kept draft put into the next block ends the row at that block's first stage 1, the
    plain loop's next check, before any call."""
    seqs = run.seqs
    if not run.win.ahead:
        return
    batch.carry_ok[seqs] = run.carry & (run.stop_at < 0)
    batch.carry_pred[seqs] = run.ahead_pred
    if batch.carry_conf.dtype != run.ahead_conf.dtype:        # the dtype of the outputs (float32/64)
        batch.carry_conf = batch.carry_conf.to(run.ahead_conf.dtype)
    batch.carry_conf[seqs] = run.ahead_conf
    batch.carry_step[seqs] = run.ahead_step
