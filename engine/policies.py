"""Transfer policies π (stage 1, "spatial"): which masked in-block positions to commit.

Every policy is a batched tensor function over rows (no Python loop over positions, no host
sync): given the block's confidences [R, L], the mask of still-masked positions and the step
index of each row inside its block, it returns a commit mask [R, L]. It commits at least one
position in every row that still has a masked one (docs/algorithms.md §2); ties in confidence go to
the lower position index.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

import psd_kernels

from .errors import InputError

NEG_INF = float("-inf")


def masked_conf(conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Confidence with non-masked positions at -inf, so they are never ranked or chosen."""
    return torch.where(masked, conf, torch.full_like(conf, NEG_INF))


def rank_of(conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Rank [R, L] of every position: masked ones by confidence descending, lower index first on
    ties (σ, as `psd_kernels.position_ranks` computes it); unmasked ones rank after every masked
    one, in position order."""
    ranks, n_masked = psd_kernels.position_ranks(conf.float(), masked)
    after = n_masked[:, None] + (~masked).long().cumsum(-1) - 1
    return torch.where(masked, ranks, after)


def _top1_mask(conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    best = masked_conf(conf, masked).argmax(-1, keepdim=True)       # first index on ties
    return torch.zeros_like(masked).scatter_(-1, best, True) & masked


def _at_least_one(commit: torch.Tensor, conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    return torch.where(commit.any(-1, keepdim=True), commit, _top1_mask(conf, masked))


def num_transfer_tokens(block_len: int, steps_per_block: int) -> list[int]:
    """LLaDA's get_num_transfer_tokens for a fully masked block: the count split evenly over the
    steps, the remainder going to the first steps."""
    base, rem = divmod(block_len, steps_per_block)
    return [base + (1 if i < rem else 0) for i in range(steps_per_block)]


@dataclass(frozen=True)
class Policy:
    """Base: `select(conf, masked, step) -> commit` with conf float [R, L], masked bool [R, L],
    step int64 [R] (this row's step index inside the current block).

    `params` maps the decoding options a policy takes (engine/options.py) to its fields; a field's
    default is the option's default for this policy. `declares` holds the `Option`s of parameters
    no other policy has (registered with the policy's method). `from_config` builds the policy
    from a `DecodeConfig`; override it where a field is derived from several options."""

    name: ClassVar[str] = "base"
    params: ClassVar[dict[str, str]] = {}
    declares: ClassVar[tuple] = ()

    @classmethod
    def from_config(cls, cfg) -> "Policy":
        values = {field: getattr(cfg, opt) for opt, field in cls.params.items()}
        return cls(**{f: v for f, v in values.items() if v is not None})

    @classmethod
    def check(cls, cfg) -> None:
        """Raise InputError where `cfg` cannot drive this policy (beyond each option's own range)."""

    @classmethod
    def defaults(cls) -> dict:
        """Option name -> this policy's default value (for help texts)."""
        fields = cls.__dataclass_fields__
        return {opt: fields[f].default for opt, f in cls.params.items()
                if f in fields and fields[f].default is not dataclasses.MISSING}

    def select(self, conf: torch.Tensor, masked: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class Greedy(Policy):
    name = "greedy"

    def select(self, conf, masked, step):
        return _top1_mask(conf, masked)


@dataclass(frozen=True)
class TopK(Policy):
    """LLaDA reference schedule: k_t tokens at step t of the block (at least one)."""

    block_len: int
    steps_per_block: int
    name = "topk"
    params = {"steps": "steps_per_block"}

    @classmethod
    def from_config(cls, cfg):
        steps = cfg.gen_length if cfg.steps is None else cfg.steps
        return cls(cfg.block_length, steps // cfg.num_blocks)

    @classmethod
    def check(cls, cfg):
        steps = cfg.gen_length if cfg.steps is None else cfg.steps
        if steps < cfg.num_blocks or steps % cfg.num_blocks:
            raise InputError(f"steps {steps} must be a positive multiple of the number of blocks {cfg.num_blocks}")

    def select(self, conf, masked, step):
        sched = torch.tensor(num_transfer_tokens(self.block_len, self.steps_per_block), device=conf.device)
        k = sched[step.clamp(max=self.steps_per_block - 1)].clamp_min(1)      # [R]
        ranks, _ = psd_kernels.position_ranks(conf.float(), masked)
        return (ranks < k[:, None]) & masked

    def describe(self):
        return f"topk(steps/block={self.steps_per_block})"


@dataclass(frozen=True)
class Confidence(Policy):
    """Fast-dLLM threshold: every masked position with c >= tau, else the most confident one."""

    tau: float = 0.9
    name = "confidence"
    params = {"threshold": "tau"}

    def select(self, conf, masked, step):
        return _at_least_one(masked & (conf >= self.tau), conf, masked)

    def describe(self):
        return f"confidence(tau={self.tau})"


@dataclass(frozen=True)
class LocalLeap(Policy):
    """Anchors c >= kappa, plus positions with c >= tau within distance W of an anchor."""

    kappa: float = 0.9
    tau: float = 0.75
    window: int = 4
    name = "localleap"
    params = {"kappa": "kappa", "threshold": "tau", "window": "window"}

    def select(self, conf, masked, step):
        anchors = masked & (conf >= self.kappa)
        # dilation of the anchor set by W in both directions, within the block
        near = F.max_pool1d(anchors[:, None].float(), 2 * self.window + 1, stride=1, padding=self.window)[:, 0] > 0
        commit = anchors | (masked & (conf >= self.tau) & near)
        return _at_least_one(commit, conf, masked)

    def describe(self):
        return f"localleap(kappa={self.kappa},tau={self.tau},W={self.window})"


@dataclass(frozen=True)
class CrossBlock(Confidence):
    """ETE reconstruction (docs/methods.md): over a window of several blocks, every masked position
    with c >= tau; if none lies in the current block (the first `block_len` positions), also the
    current block's most confident one, so the block always advances."""

    block_len: int = 32
    name = "ete"

    @classmethod
    def from_config(cls, cfg):
        return cls(Confidence.from_config(cfg).tau, cfg.block_length)

    def select(self, conf, masked, step):
        commit = masked & (conf >= self.tau)
        L = self.block_len
        blk_m = masked[:, :L]
        need = blk_m.any(-1, keepdim=True) & ~commit[:, :L].any(-1, keepdim=True)
        first = torch.zeros_like(masked)
        first[:, :L] = _top1_mask(conf[:, :L], blk_m)
        return commit | (first & need)

    def describe(self):
        return f"ete(tau={self.tau})"
