"""The state the loop carries between model calls: the whole batch, and the rows of one block."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models import position_ids

from .cache import Window


@dataclass
class Batch:
    """The canvas of every sequence and its running statistics (on the model's device)."""

    x: torch.Tensor                # [B, N] left-padded prompts, then the generation
    valid: torch.Tensor            # [B, N] False at left padding
    pos: torch.Tensor              # [B, N] position ids
    prompt_width: int              # P: canvas index where generation starts
    calls: torch.Tensor            # [B] model calls each sequence took part in
    rows: torch.Tensor             # [B] canvases evaluated for it (drafts count)
    stop_at: torch.Tensor          # [B] generation index of the stop token, -1 while none
    commit_call: torch.Tensor      # [B, G] per generated token: the call that committed it
    commit_step: torch.Tensor      # [B, G] its step inside the block
    commit_source: torch.Tensor    # [B, G] 0 = stage 1, 1 = an accepted draft
    depth_hist: torch.Tensor       # [B, D + 1] accepted depth per verification call
    nodes_hist: torch.Tensor       # [B, K + 1] graph nodes verified per verification call (draft budget)
    carry_pred: torch.Tensor       # [B, L] --cross-block: the next block's prediction by the call that
    carry_conf: torch.Tensor       # [B, L]   completed this one (a kept draft), valid where carry_ok
    carry_ok: torch.Tensor         # [B] bool
    carry_step: torch.Tensor       # [B] the step inside the next block its kept draft reached
    noise: torch.Tensor | None = None   # [B, G] a random policy's draw per generated position (Policy.random)


@dataclass
class BlockRun:
    """The rows decoding one block, between two model calls. Every tensor has one row per
    sequence still on this block ([S, ...]); the window holds W positions."""

    index: int
    seqs: torch.Tensor             # [S] batch index of each row
    win: Window
    x: torch.Tensor                # [S, N] canvases
    valid: torch.Tensor
    pos: torch.Tensor
    cache: object                  # the block's KV cache (None without a cache mode)
    pred: torch.Tensor             # [S, W] latest verifier output: top-1 tokens
    conf: torch.Tensor             # [S, W] and their confidences
    calls: torch.Tensor            # [S] running totals, as in Batch
    rows: torch.Tensor
    step: torch.Tensor             # [S] step index inside the block
    stop_at: torch.Tensor          # [S]
    pending: torch.Tensor          # [S] still needs a call on this block
    commit_call: torch.Tensor      # [S, W + ahead] (--cross-block: drafts reach the next block)
    commit_step: torch.Tensor
    commit_source: torch.Tensor
    depth_hist: torch.Tensor       # [S, D + 1]
    failed: torch.Tensor           # [S] 0, or why the row stopped making progress (engine.progress.guard_progress)
    failed_call: torch.Tensor      # [S] the call whose output it could not use, -1 while none
    nodes_hist: torch.Tensor       # [S, K + 1]
    plan: object                   # engine.graph.Plan: the draft nodes this block verifies
    ahead_pred: torch.Tensor | None = None   # [S, L] --cross-block: the latest output's next-block part
    ahead_conf: torch.Tensor | None = None
    carry: torch.Tensor | None = None        # [S] bool: that output is of the completed block
    ahead_step: torch.Tensor | None = None   # [S] the kept draft's step inside the next block (0: none)
    ahead_ok: torch.Tensor | None = None     # [S] bool: ahead_* hold the latest output's next block
    noise: torch.Tensor | None = None        # [S, W + ahead] a random policy's draw (Batch.noise)

    @property
    def gen_start(self) -> int:
        """Generation index of the window's first position."""
        return self.win.lo - self.win.prompt_width

    def block(self, rows=slice(None)) -> torch.Tensor:
        return self.x[rows, self.win.lo:self.win.hi]


def new_batch(mc, prompts: list[list[int]], gen_length: int, block_length: int, depth: int, nodes: int,
              device) -> Batch:
    """Prompts left-padded to one width, then `gen_length` masks; every statistic at zero."""
    G, B, P = gen_length, len(prompts), max(len(p) for p in prompts)
    pad = mc.pad_token_id if mc.pad_token_id is not None else mc.eos_token_id
    x = torch.full((B, P + G), pad, dtype=torch.long, device=device)
    valid = torch.zeros(B, P + G, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        x[b, P - len(p):P] = torch.tensor(p, device=device)
        valid[b, P - len(p):] = True
    x[:, P:] = mc.mask_token_id

    def zeros(*shape, dtype=torch.long):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return Batch(x=x, valid=valid, pos=position_ids(mc, valid), prompt_width=P, calls=zeros(B), rows=zeros(B),
                 stop_at=zeros(B) - 1, commit_call=zeros(B, G) - 1, commit_step=zeros(B, G) - 1,
                 commit_source=zeros(B, G), depth_hist=zeros(B, depth + 1), nodes_hist=zeros(B, nodes + 1),
                 carry_pred=zeros(B, block_length), carry_conf=zeros(B, block_length, dtype=torch.float32),
                 carry_ok=zeros(B, dtype=torch.bool), carry_step=zeros(B))
