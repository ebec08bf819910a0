"""The state the loop carries between model calls: the whole batch, and the rows of one block."""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
    commit_call: torch.Tensor      # [S, W]
    commit_step: torch.Tensor
    commit_source: torch.Tensor
    depth_hist: torch.Tensor       # [S, D + 1]
    failed: torch.Tensor           # [S] 0, or why the row stopped making progress (see Decoder._guard)
    failed_call: torch.Tensor      # [S] the call whose output it could not use, -1 while none
    nodes_hist: torch.Tensor       # [S, K + 1]
    plan: object                   # engine.budget.Plan: the draft nodes this block verifies

    @property
    def gen_start(self) -> int:
        """Generation index of the window's first position."""
        return self.win.lo - self.win.prompt_width

    def block(self, rows=slice(None)) -> torch.Tensor:
        return self.x[rows, self.win.lo:self.win.hi]
