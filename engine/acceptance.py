"""Choosing the kept draft after the batched verification call (docs/algorithms.md §3).

All functions are pure tensor functions over R rows and K graph nodes (a Python loop over nodes
and parents only, never over positions), so they can be property-tested on synthetic verifier
outputs.

Inputs shared by every selection:
    drafts  [R, K, L] int64  each node's block (the root is the state after stage 1)
    in_node [R, K, L] bool   positions node k speculated (S_k mapped through σ)
    valid   [R, K]    bool   node k could be instantiated this step (all its ranks exist)
    vpred, vconf [R, K, L]   the verifier's top-1 and confidence for every node's block
    step    [R]       int64  the root's step index inside the block (topk's schedule)
    width   int or None      --cross-block: positions from `width` on are the next block's
                             (hierarchical selection only; None: every position is the block's)
    state   PolicyState or None  the rows' policy state, columns cut to the L positions (hierarchical only)
Each returns (kept node [R], its step index [R], accepted [R, K]); a kept node holding
next-block positions reports its step index inside the next block.

The loop sees one interface: a `Selection` is built once per decoder from the method's table
entry and called with the verifier outputs above, whatever the method.
"""
from __future__ import annotations

import torch

from .graph import DraftGraph
from .policies import Policy, PolicyState, policy_select


def _deepest(accepted: torch.Tensor, node_size: torch.Tensor) -> torch.Tensor:
    """Deepest accepted node (max |S_k|), ties to the first in topological order."""
    K = accepted.shape[1]
    key = torch.where(accepted, node_size[None] * (K + 1) - torch.arange(K, device=accepted.device), -1)
    return key.argmax(-1)


def hierarchical(policy: Policy, graph: DraftGraph, mask_id: int, drafts, in_node, valid, vpred, vconf, step,
                 exact: bool = False, width: int | None = None, state: PolicyState | None = None):
    """Node k is accepted if some accepted parent p has, for every i in S_k \\ S_p, the drafted
    token equal to the verifier's x̂_{p,i} and i ∈ π(draft_p, out_p) (policy mode), or
    S_k \\ S_p = π(draft_p, out_p) with all tokens agreeing (exact, lossless mode).

    With `width` (--cross-block, docs/algorithms.md §8) positions from `width` on belong to the
    next block. There π(draft_p, out_p) is the policy's step on the next block's part of p's
    output, at p's step inside the next block (0 while p holds none of it), and only where p
    completes its block (the plain loop enters the next block only then); elsewhere it is empty."""
    R, K, L = drafts.shape
    W = L if width is None else width
    accepted = torch.zeros(R, K, dtype=torch.bool, device=drafts.device)
    accepted[:, 0] = True
    node_step = step[:, None].repeat(1, K)
    if W < L:
        ahead = in_node[:, :, W:].any(-1)                          # [R, K] the node drafts the next block
        done = (drafts[:, :, :W] != mask_id).all(-1)               # [R, K] its block is complete
    for k in range(1, K):
        acc_k = torch.zeros(R, dtype=torch.bool, device=drafts.device)
        for p in graph.parents[k]:
            new = in_node[:, k] & ~in_node[:, p]
            tok_ok = (~new | (drafts[:, k] == vpred[:, p])).all(-1)
            commit_p = policy_select(policy, vconf[:, p, :W], drafts[:, p, :W] == mask_id, node_step[:, p],
                                     None if state is None else state.take(span=slice(0, W)))
            next_step = node_step[:, p] + 1
            if W < L:
                at = torch.where(ahead[:, p], node_step[:, p], 0)
                nxt = policy_select(policy, vconf[:, p, W:], drafts[:, p, W:] == mask_id, at,
                                    None if state is None else state.take(span=slice(W, None))) & done[:, p, None]
                commit_p = torch.cat((commit_p, nxt), -1)
                next_step = torch.where(ahead[:, k], at + 1, next_step)
            crit = (new == commit_p).all(-1) if exact else (~new | commit_p).all(-1)
            ok = accepted[:, p] & valid[:, k] & tok_ok & crit
            node_step[:, k] = torch.where(ok & ~acc_k, next_step, node_step[:, k])
            acc_k |= ok
        accepted[:, k] = acc_k
    node_size = torch.tensor([len(s) for s in graph.nodes], device=drafts.device)
    best = _deepest(accepted, node_size)
    return best, node_step.gather(1, best[:, None])[:, 0], accepted


def threshold_only(tau: float, graph: DraftGraph, mask_id: int, drafts, in_node, valid, vpred, vconf, step):
    """FDM reconstruction: node k is accepted from an accepted parent p when every newly drafted
    position has verifier confidence >= tau in p's output, whatever token p predicts there."""
    R, K, L = drafts.shape
    accepted = torch.zeros(R, K, dtype=torch.bool, device=drafts.device)
    accepted[:, 0] = True
    for k in range(1, K):
        for p in graph.parents[k]:
            new = in_node[:, k] & ~in_node[:, p]
            ok = accepted[:, p] & valid[:, k] & (~new | (vconf[:, p] >= tau)).all(-1)
            accepted[:, k] |= ok
    node_size = torch.tensor([len(s) for s in graph.nodes], device=drafts.device)
    best = _deepest(accepted, node_size)
    return best, step + node_size[best], accepted


def best_score(mask_id: int, drafts, valid, vconf, step):
    """LoPA: every valid branch is scored by the mean verifier confidence over its still-masked
    in-block positions (a branch with none left scores +inf: it finishes the block); the best
    branch is kept, ties to the lower branch index."""
    masked = drafts == mask_id                                                 # [R, K, L]
    n = masked.sum(-1)
    mean = torch.where(masked, vconf, 0).sum(-1) / n.clamp_min(1)
    score = torch.where(n == 0, float("inf"), mean.float())
    score = torch.where(valid, score, float("-inf"))
    best = score.argmax(-1)                                                    # first max on ties
    accepted = torch.zeros_like(valid)
    accepted[torch.arange(len(best), device=best.device), best] = True
    return best, step + 1, accepted


class Selection:
    """`select(drafts, in_node, valid, vpred, vconf, step, width=None, state=None) -> (kept [R],
    step of kept [R], accepted [R, K])`.
    `build(cfg, policy, graph, mask_id)` makes one from a decoding config."""

    def __call__(self, drafts, in_node, valid, vpred, vconf, step, width=None, state=None):
        raise NotImplementedError


class Hierarchical(Selection):
    """PSD / Spiffy: the deepest node reachable through accepted parents (policy or exact mode)."""

    def __init__(self, policy: Policy, graph: DraftGraph, mask_id: int, exact: bool):
        self.policy, self.graph, self.mask_id, self.exact = policy, graph, mask_id, exact

    @classmethod
    def build(cls, cfg, policy, graph, mask_id):
        return cls(policy, graph, mask_id, cfg.exact)

    def __call__(self, drafts, in_node, valid, vpred, vconf, step, width=None, state=None):
        return hierarchical(self.policy, self.graph, self.mask_id, drafts, in_node, valid, vpred, vconf, step,
                            exact=self.exact, width=width, state=state)


class BestScore(Selection):
    """LoPA: the branch with the best mean verifier confidence."""

    def __init__(self, mask_id: int):
        self.mask_id = mask_id

    @classmethod
    def build(cls, cfg, policy, graph, mask_id):
        return cls(mask_id)

    def __call__(self, drafts, in_node, valid, vpred, vconf, step, width=None, state=None):
        return best_score(self.mask_id, drafts, valid, vconf, step)


class DraftConfidence(Selection):
    """FDM reconstruction: future steps kept while their drafted positions stay above τ."""

    def __init__(self, tau: float, graph: DraftGraph, mask_id: int):
        self.tau, self.graph, self.mask_id = tau, graph, mask_id

    @classmethod
    def build(cls, cfg, policy, graph, mask_id):
        return cls(cfg.spec.resolved(cfg, "threshold"), graph, mask_id)     # fdm's τ: its default when not given

    def __call__(self, drafts, in_node, valid, vpred, vconf, step, width=None, state=None):
        return threshold_only(self.tau, self.graph, self.mask_id, drafts, in_node, valid, vpred, vconf, step)
