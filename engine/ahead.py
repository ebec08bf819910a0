"""`--cross-block` (docs/algorithms.md §8): a call that completes a block also predicts the next.

With the `none` cache every call runs the whole canvas, so a verification call can return the
next block's output too (`Window.ahead`). Where the draft a row keeps completes its block, that
output is the one the next block's first call would compute (the same canvas, and on a
bidirectional model the same attention), so the row enters the next block without that call:
an accepted draft that completes a block now saves a call, and exact mode stays lossless.
"""
from __future__ import annotations

import torch


def first_output(decoder, batch, seqs, x, valid, pos, win):
    """The block's first output for rows `seqs`: carried over where the previous block was
    completed by a kept draft, else from a call of the other rows. Returns (pred, conf [S, W],
    (next-block pred, conf) or (None, None), cache, called [S] long)."""
    carried = batch.carry_ok[seqs]
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
        pred_f, conf_f = decoder._predict(logits)
        conf = conf.to(conf_f.dtype)
        pred[fresh], conf[fresh] = pred_f[:, :W], conf_f[:, :W]
        if win.ahead:
            ahead = (ahead[0], ahead[1].to(conf_f.dtype))
            ahead[0][fresh], ahead[1][fresh] = pred_f[:, W:], conf_f[:, W:]
    return pred, conf, ahead, cache, (~carried).long()


def keep_ahead(run, act, pair, best, pred, conf, drafts, mask_id: int) -> None:
    """After a verification call: the kept draft's next-block output, and whether it completes the block."""
    A, K = drafts.shape[:2]
    W = run.win.width
    ar = torch.arange(A, device=drafts.device)
    row = pair.new_zeros(A * K).index_copy_(0, pair, torch.arange(len(pair), device=pair.device)).view(A, K)
    kept = row[ar, best]
    run.ahead_pred[act], run.ahead_conf[act] = pred[kept, W:], conf[kept, W:].to(run.ahead_conf.dtype)
    run.carry[act] = (drafts[ar, best] != mask_id).all(-1)


def carry_over(batch, run) -> None:
    """At the end of a block: what the next block may reuse (nothing on the last block)."""
    seqs = run.seqs
    if not run.win.ahead:
        batch.carry_ok[seqs] = False
        return
    batch.carry_ok[seqs] = run.carry & (run.stop_at < 0)
    batch.carry_pred[seqs] = run.ahead_pred
    if batch.carry_conf.dtype != run.ahead_conf.dtype:        # the dtype of the outputs (float32/64)
        batch.carry_conf = batch.carry_conf.to(run.ahead_conf.dtype)
    batch.carry_conf[seqs] = run.ahead_conf
