"""Transfer policies π (stage 1, "spatial"): which masked in-block positions to commit.

Every policy is a batched tensor function over rows (no Python loop over positions, no host
sync): given the block's confidences [R, L], the mask of still-masked positions and the step
index of each row inside its block, it returns a commit mask [R, L]. It commits at least one
position in every row that still has a masked one (docs/algorithms.md §2); ties in confidence go to
the lower position index.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

import psd_kernels

from .errors import DecodingError, InputError
from .options import Option, _short, _unit

NEG_INF = float("-inf")
SCHEDULES = ("llada", "dream")


def _unit_open(label, v):
    return None if 0.0 < v < 1.0 else f"{label} {v} is outside (0, 1)"


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


@dataclass
class PolicyState:
    """A policy's per-sequence state (`Policy.init_state`), which the loop carries with its rows and
    never reads: `rows` holds tensors [B, ...] (one entry per sequence), `columns` tensors [B, N, ...]
    in canvas columns (one entry per position: they move when the canvas is padded or trimmed, and
    an open block sees its window of them). Rows are taken, joined and written back with the
    batch's (engine.state), so the state follows its sequence through continuous batching."""

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    columns: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.rows[name] if name in self.rows else self.columns[name]

    def take(self, rows=slice(None), span=slice(None)) -> "PolicyState":
        """The state of rows `rows`, its columns cut to `span`."""
        return PolicyState({k: v[rows] for k, v in self.rows.items()},
                           {k: v[rows][:, span] for k, v in self.columns.items()})

    def put(self, rows, other: "PolicyState", span=slice(None)) -> None:
        """Write `other` (the state of rows `rows`, columns `span`) into this one."""
        for k, v in other.rows.items():
            self.rows[k][rows] = v
        for k, v in other.columns.items():
            self.columns[k][rows, span] = v

    def shift(self, left: int, right: int) -> "PolicyState":
        """Columns padded with zeros (`left` before, `right` after; cut where negative)."""
        def pad(v):
            N = v.shape[1]
            v = v[:, max(0, -left):N - max(0, -right)]
            return torch.cat([v.new_zeros(v.shape[0], max(0, left), *v.shape[2:]), v,
                              v.new_zeros(v.shape[0], max(0, right), *v.shape[2:])], 1)
        return PolicyState(dict(self.rows), {k: pad(v) for k, v in self.columns.items()})

    def join(self, other: "PolicyState") -> "PolicyState":
        """These rows, then `other`'s (columns already aligned)."""
        def cat(a, b):
            return {k: torch.cat((v, b[k].to(v.dtype))) for k, v in a.items()}
        return PolicyState(cat(self.rows, other.rows), cat(self.columns, other.columns))


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def policy_select(policy: "Policy", conf, masked, step, state: PolicyState | None = None) -> torch.Tensor:
    """`policy.select`, with the rows' `PolicyState` where the policy keeps one (a stateless policy's
    select keeps its three arguments, so a user's policy written for them still works), checked: a
    bool mask of `masked`'s shape (a [R, 1] or [R] result broadcast to whole blocks, silently), and
    only masked positions kept (a committed token is never overwritten by a commit)."""
    got = policy.select(conf, masked, step) if state is None else policy.select(conf, masked, step, state=state)
    if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or got.shape != masked.shape:
        what = f"a {got.dtype} tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else \
            f"a {type(got).__name__}"
        raise DecodingError(f"the policy {policy.name}'s select returned {what}; it must return a bool tensor "
                            f"of the masked positions' shape {tuple(masked.shape)}")
    return got & masked


def policy_key(policy: "Policy", conf, masked, step, state: PolicyState | None = None) -> torch.Tensor:
    """`policy.draft_key`, with the rows' `PolicyState` where the policy keeps one."""
    if state is None:
        return policy.draft_key(conf, masked, step)
    return policy.draft_key(conf, masked, step, state=state)


def sequence_noise(prompts: list[list[int]], seed: int, length: int) -> torch.Tensor:
    """A random policy's draw [B, length]: uniform numbers per generated position, from a generator
    seeded by the seed and the prompt's token ids. A sequence's draw is its own, whatever else its
    batch holds (a batch decodes as its rows one by one), and the same seed repeats it; its own
    stream, so sampling (temperature) and the number of calls a method makes never shift it (PSD
    over the random policy sees the plain policy's draw). Drawn on the host, once per batch."""
    out = torch.empty(len(prompts), length)
    for b, ids in enumerate(prompts):
        digest = hashlib.sha256(f"{seed}:{','.join(map(str, ids))}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        out[b] = torch.rand(length, generator=gen)
    return out


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


def transfer_count(block_len: int, steps_per_block: int, step: torch.Tensor) -> torch.Tensor:
    """`num_transfer_tokens(block_len, steps_per_block)[step]` per row (a step past the last counts as
    the last), without the list: its length is the steps, which a user may set to billions."""
    base, rem = divmod(block_len, steps_per_block)
    return base + (step.clamp(max=steps_per_block - 1) < rem).long()


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
    score: ClassVar[str | None] = None   # the confidence score the rule reads (engine/sampling.py decodes
                                         # with it); None: whichever --score gives

    @classmethod
    def from_config(cls, cfg) -> "Policy":
        values = {field: getattr(cfg, opt) for opt, field in cls.params.items()}
        return cls(**{f: v for f, v in values.items() if v is not None})

    @classmethod
    def check(cls, cfg) -> None:
        """Raise InputError where `cfg` cannot drive this policy (beyond each option's own range)."""

    @classmethod
    def validate_request(cls, cfg, prompt: list[int], gen_length: int) -> None:
        """Raise InputError where this policy cannot decode one request (its prompt's token ids and
        gen length) under `cfg`; every front end reaches it through `engine.config.check_prompts`."""

    def init_state(self, prompts, seed: int, gen_start, gen_len, width: int) -> PolicyState | None:
        """The per-sequence state of a new batch's rows, or None (the policy keeps none, and its
        `select` / `draft_key` take three arguments). `prompts`: the rows' token ids; `gen_start`,
        `gen_len` [B]: each row's first generated column and length; `width`: the canvas columns N.
        The loop hands the rows' state to `select`, `draft_key` and `update` as `state=`."""
        return None

    def update(self, state: PolicyState | None, commit: torch.Tensor, step: torch.Tensor):
        """The state after a stage 1 that committed `commit` [R, W] (only rows still decoding the block
        commit anything; `step` [R]: the steps each row has now taken in its block). Drafts are
        verified against `select` with the state as it is; a kept draft's steps do not update it."""
        return state

    @classmethod
    def steps_its_state(cls) -> bool:
        """Whether each step changes this policy's state (it overrides `update`): drafts, verified
        with the state as it is, then cannot be its own next steps (exact acceptance is refused)."""
        return cls.update is not Policy.update

    @classmethod
    def defaults(cls) -> dict:
        """Option name -> this policy's default value (for help texts)."""
        fields = cls.__dataclass_fields__
        return {opt: fields[f].default for opt, f in cls.params.items()
                if f in fields and fields[f].default is not dataclasses.MISSING}

    def select(self, conf: torch.Tensor, masked: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """The commit mask [R, L]. A policy with state (`init_state`) is called with a keyword `state`:
        its rows' `PolicyState`, columns cut to the same L positions."""
        raise NotImplementedError

    def draft_key(self, conf: torch.Tensor, masked: torch.Tensor, step: torch.Tensor, **state) -> torch.Tensor:
        """The order stage 2 drafts future steps in: a float key [R, L], higher first, ties to the
        lower position (σ = `psd_kernels.position_ranks(key, masked)`). It should rank positions
        the way this policy's own next steps would commit them; by default, confidence."""
        return conf

    def may_idle(self, step: torch.Tensor) -> torch.Tensor:
        """Rows [R] whose step may commit nothing without that being a failure (none by default:
        a policy commits at least one masked position per step, §2). Honoured for the first
        `step_bound` steps of a block only, so no policy can keep a row open forever."""
        return torch.zeros_like(step, dtype=torch.bool)

    def step_bound(self, positions: int) -> int:
        """The steps a block of `positions` masked positions may take while `may_idle` lets a step
        commit nothing; an idle step past it is a failure (a plugin whose may_idle is always True
        ran forever). A policy whose own schedule takes more steps says so."""
        return 4 * positions + 64

    @property
    def edits(self) -> bool:
        """Whether this policy's steps also replace committed tokens (`edit`, `keeps_editing`)."""
        return False

    def describe(self) -> str:
        """The label in results and tables: the name, with every option's value (`mine(alpha=0.3)`),
        so two settings of a policy are two rows."""
        shown = ",".join(f"{opt}={_shown(getattr(self, attr))}" for opt, attr in self.params.items())
        return f"{self.name}({shown})" if shown else self.name


@dataclass(frozen=True)
class Greedy(Policy):
    name = "greedy"

    def select(self, conf, masked, step):
        return _top1_mask(conf, masked)


def dream_transfer_count(n_masked: torch.Tensor, step: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """Dream's `diffusion_generate` schedule: at step i of `steps` on the grid t = linspace(1, eps,
    steps + 1), int(n * (1 - t[i+1] / t[i])) of the n still-masked positions (float32 arithmetic,
    as Dream computes it), and every remaining one at the last step. May be 0."""
    t = torch.linspace(1, eps, steps + 1, device=n_masked.device)
    i = step.clamp(max=steps - 1)
    k = (n_masked.float() * (1 - t[i + 1] / t[i])).long()
    return torch.where(i >= steps - 1, n_masked, k)


@dataclass(frozen=True)
class TopK(Policy):
    """A fixed number of tokens per step, the most confident first. Schedule `llada`: LLaDA's even
    split of the block over its steps (at least one per step). Schedule `dream`: Dream's
    int(n·(1 − s/t)) on a linspace(1, eps) grid, which may commit nothing at a step (a call is
    still made, as in Dream's sampler); the step count bounds it, so it cannot stall."""

    block_len: int
    steps_per_block: int
    schedule: str = "llada"
    eps: float = 1e-3
    name = "topk"
    params = {"steps": "steps_per_block", "schedule": "schedule", "eps": "eps"}
    declares = (Option("schedule", str, "tokens per step: llada (even split, at least one) or dream "
                       "(int(n·(1 − s/t)) on a linspace(1, eps) grid, Dream's sampler)", choices=SCHEDULES),
                Option("eps", float, "the end of Dream's time grid (schedule dream)", check=_unit_open))

    @classmethod
    def from_config(cls, cfg):
        steps = cfg.gen_length if cfg.steps is None else cfg.steps
        extra = {k: v for k, v in (("schedule", cfg.schedule), ("eps", cfg.eps)) if v is not None}
        return cls(cfg.block_length, steps // cfg.num_blocks, **extra)

    @classmethod
    def check(cls, cfg):
        steps = cfg.gen_length if cfg.steps is None else cfg.steps
        if steps < cfg.num_blocks or steps % cfg.num_blocks:
            raise InputError(f"steps {steps} must be a positive multiple of the number of blocks {cfg.num_blocks}")
        if (cfg.schedule or cls.schedule) == "llada" and steps // cfg.num_blocks > cfg.block_length:
            raise InputError(f"steps {steps} over {cfg.num_blocks} blocks is {steps // cfg.num_blocks} steps a block, more "
                             f"than its {cfg.block_length} positions: the llada schedule commits at least one token a step, so a block takes at "
                             f"most {cfg.block_length} steps; give --steps {cfg.block_length * cfg.num_blocks} or fewer "
                             f"(schedule dream may idle)")
        if cfg.eps is not None and (cfg.schedule or cls.schedule) != "dream":
            raise InputError("eps applies to --schedule dream only")

    def step_bound(self, positions: int) -> int:
        return max(super().step_bound(positions), self.steps_per_block)

    def may_idle(self, step: torch.Tensor) -> torch.Tensor:
        """Rows whose step may commit nothing (Dream's schedule before its last step)."""
        return step < self.steps_per_block - 1 if self.schedule == "dream" else torch.zeros_like(step, dtype=torch.bool)

    def select(self, conf, masked, step):
        if self.schedule == "dream":
            k = dream_transfer_count(masked.sum(-1), step, self.steps_per_block, self.eps)
        else:
            k = transfer_count(self.block_len, self.steps_per_block, step).clamp_min(1)      # [R]
        ranks, _ = psd_kernels.position_ranks(conf.float(), masked)
        return (ranks < k[:, None]) & masked

    def describe(self):
        sched = "" if self.schedule == "llada" else f",dream eps={self.eps:g}"
        return f"topk(steps/block={self.steps_per_block}{sched})"


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
class Threshold(Policy):
    """LLaDA2.x's rule (the authors' generate(), diffusers' BlockRefinementScheduler): a block has
    `steps_per_block` steps and LLaDA's even split k_t of the block length over them; a step commits
    every masked position with c > τ when at least k_t of them pass, else the k_t most confident (all
    that are masked, if fewer). With more steps than positions the late k_t are 0 and such a step
    commits only what passes τ, maybe nothing (`may_idle`).

    Token editing (`edit_tau`, off by default): the same step also replaces every committed,
    non-prompt token of the block whose prediction is another token with c > edit_tau. A block then
    stays open after its last mask is filled while its steps are not used up, and for editing passes
    (calls that commit nothing, only edit) while the previous one edited, at most
    `max_post_steps` + 1 of them (`keeps_editing`, docs/algorithms.md §8)."""

    block_len: int
    steps_per_block: int
    tau: float = 0.95
    edit_tau: float | None = None
    max_post_steps: int = 16
    name = "threshold"
    params = {"threshold": "tau", "block_steps": "steps_per_block", "editing_threshold": "edit_tau",
              "max_post_steps": "max_post_steps"}
    declares = (Option("block_steps", int, "steps per block (LLaDA2's steps; at most the gen length; default the "
                       "block length)", check=lambda l, v: None if v >= 1 else f"{l} must be >= 1, got {v}",
                       label="block steps"),
                Option("editing_threshold", float, "token editing: a committed, non-prompt token of the open block "
                       "is replaced by the model's prediction when that is another token with confidence above "
                       "this (LLaDA2.1's editing; off when not given)", label="editing threshold", check=_unit),
                Option("max_post_steps", int, "with editing: at most this many + 1 editing passes after a block's "
                       "last mask is filled (LLaDA2's max_post_steps)", label="max post steps",
                       check=lambda l, v: None if v >= 0 else f"{l} must be >= 0, got {v}"))

    @classmethod
    def from_config(cls, cfg):
        steps = min(cfg.block_length if cfg.block_steps is None else cfg.block_steps, cfg.gen_length)
        extra = {f: getattr(cfg, o) for o, f in (("threshold", "tau"), ("editing_threshold", "edit_tau"),
                                                 ("max_post_steps", "max_post_steps")) if getattr(cfg, o) is not None}
        return cls(cfg.block_length, steps, **extra)

    @classmethod
    def check(cls, cfg):
        if cfg.max_post_steps is not None and cfg.editing_threshold is None:
            raise InputError("max post steps applies with an editing threshold only")

    def _k(self, step: torch.Tensor) -> torch.Tensor:
        return transfer_count(self.block_len, self.steps_per_block, step)

    def may_idle(self, step):
        return self._k(step) == 0

    def step_bound(self, positions: int) -> int:
        return max(super().step_bound(positions), self.steps_per_block + self.max_post_steps + 1)

    def select(self, conf, masked, step):
        k = self._k(step)                                                           # [R]
        high = masked & (conf > self.tau)
        ranks, _ = psd_kernels.position_ranks(conf.float(), masked)
        return torch.where((high.sum(-1) >= k)[:, None], high, (ranks < k[:, None]) & masked)

    @property
    def edits(self) -> bool:
        return self.edit_tau is not None

    def edit(self, conf, pred, block, editable):
        """The committed tokens this step replaces [R, L]: `editable` (committed, generated) positions whose
        prediction differs from their token with c > edit_tau."""
        return editable & (pred != block) & (conf > self.edit_tau)

    def keeps_editing(self, step, filling, edited, post):
        """Rows [R] whose block stays open for another call although nothing in it is masked: the step
        that filled its last mask (`filling`) was not its last (`step` counts the steps taken), or the
        editing pass just taken (`post` of them so far) edited a token and the passes are not used up."""
        return torch.where(filling, step < self.steps_per_block, edited & (post <= self.max_post_steps))

    def describe(self):
        edit = "" if self.edit_tau is None else f",edit={self.edit_tau},post={self.max_post_steps}"
        return f"threshold(tau={self.tau},steps/block={self.steps_per_block}{edit})"


def _bound(label, v):
    try:
        finite = math.isfinite(v)
    except OverflowError:          # an integer beyond any float is no finite bound
        finite = False
    return None if finite and v >= 0 else f"{label} must be finite and >= 0, got {_short(v)}"


@dataclass(frozen=True)
class EntropyBound(Policy):
    """EB-Sampler (Ben-Hamu et al. 2025, entropy bounded unmasking): order the masked positions by
    entropy, lowest first (ties to the lower index), and commit the longest prefix U of that order
    with sum_{i in U} H_i - max_{i in U} H_i <= γ. The first position always qualifies (its sum
    minus its max is 0), so a step commits at least one; γ = 0 is one token per step unless
    entropies are exactly 0; a larger γ never commits fewer.

    The rule reads entropies, so the policy decodes with the `entropy` score (`score`): its `conf`
    is sum p log p = -H (nats), whose descending order is the ascending order of H, which is also
    the order stage 2 drafts in (the default `draft_key`)."""

    gamma: float = 0.1
    name = "eb"
    score = "entropy"
    params = {"entropy_bound": "gamma"}
    declares = (Option("entropy_bound", float, "eb: commit the lowest-entropy masked positions while their "
                       "entropies' sum minus its largest stays <= this (nats; 0: one token per step)",
                       label="entropy bound", check=_bound, aliases=("gamma",)),
                # the uniform-noise paradigm's settings (engine/uniform.py; default: the checkpoint's
                # generation_config.json, else transformers'); refused on masked models
                Option("max_denoising_steps", int, "uniform-noise models (diffusion_gemma): steps per canvas at "
                       "most", label="max denoising steps", check=lambda l, v: None if v >= 1 else
                       f"{l} must be >= 1, got {v}", metavar="N"),
                Option("t_min", float, "uniform-noise models: the temperature at the last step (the schedule falls "
                       "linearly from t-max)", label="t-min", check=_bound),
                Option("t_max", float, "uniform-noise models: the temperature at the first step", label="t-max",
                       check=_bound),
                Option("stability_threshold", int, "uniform-noise models: a canvas stops when its argmax is the "
                       "same as the previous N steps' (and confident)", label="stability threshold",
                       check=lambda l, v: None if v >= 0 else f"{l} must be >= 0, got {v}", metavar="N"),
                Option("confidence_threshold", float, "uniform-noise models: ... and its mean entropy (nats) is "
                       "below this", label="confidence threshold",
                       check=lambda l, v: None if v > 0 and math.isfinite(v) else
                       f"{l} must be finite and > 0, got {v}"),
                )

    def select(self, conf, masked, step):
        # H = -conf >= 0 in exact arithmetic; the clamp keeps a rounding (or a caller's conf > 0) from
        # counting as negative entropy, and keeps the order (a monotone map)
        h = torch.where(masked, (-conf.float()).clamp_min(0), float("inf"))
        hs = h.sort(-1).values                                      # ascending; unmasked (+inf) last
        # a prefix of an ascending order has its max last, so its sum minus its max is the sum of the
        # entries before the last: an exclusive cumsum, not a subtraction (in float, (H_0 + H_1) - H_1
        # is 0 when H_0 is tiny beside H_1, and γ = 0 would commit two tokens)
        before = F.pad(torch.where(hs.isinf(), 0.0, hs)[:, :-1].cumsum(-1), (1, 0))
        real = torch.arange(hs.shape[-1], device=hs.device) < masked.sum(-1, keepdim=True)
        take = ((before <= self.gamma) & real).sum(-1)             # a prefix: `before` never decreases
        ranks, _ = psd_kernels.position_ranks(conf.float(), masked)
        return masked & (ranks < take[:, None])

    def describe(self):
        return f"eb(gamma={self.gamma})"


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
        w = min(self.window, conf.shape[-1] - 1)       # a wider window reaches no further than the whole row
        near = F.max_pool1d(anchors[:, None].float(), 2 * w + 1, stride=1, padding=w)[:, 0] > 0
        commit = anchors | (masked & (conf >= self.tau) & near)
        return _at_least_one(commit, conf, masked)

    def describe(self):
        return f"localleap(kappa={self.kappa},tau={self.tau},W={self.window})"


@dataclass(frozen=True)
class LeftToRight(Policy):
    """Semi-autoregressive: the left-most masked position, and the masked positions right after it
    while their confidence is >= τ (a run of confident tokens, as an AR model that may take several
    at once). Its own order is left to right, so it drafts left to right (`draft_key`)."""

    tau: float = 0.9
    name = "left"
    params = {"threshold": "tau"}

    def select(self, conf, masked, step):
        L = masked.shape[-1]
        idx = torch.arange(L, device=masked.device)
        first = torch.where(masked, idx, L).min(-1, keepdim=True).values             # [R, 1]
        # a position joins while every position from `first` to it is masked and confident
        ok = (masked & (conf >= self.tau)) | (idx == first)
        run = (ok | (idx < first)).long().cumprod(-1).bool()
        return run & (idx >= first) & masked

    def draft_key(self, conf, masked, step, **noise):
        L = conf.shape[-1]
        return -torch.arange(L, device=conf.device, dtype=torch.float32).expand(conf.shape[0], L)

    def describe(self):
        return f"left(tau={self.tau})"


@dataclass(frozen=True)
class Random(TopK):
    """LLaDA's `remasking='random'`: its step schedule, the positions drawn uniformly at random.
    Each sequence draws one uniform number per generated position when its batch starts (its
    state: `sequence_noise`, seeded by --seed and its prompt) and every step commits the
    still-masked positions with the largest draws: the same distribution as a fresh draw per step
    (the masked positions left are exchangeable), and the order the next steps will take is known,
    so drafts follow it."""

    name = "random"
    declares = ()

    def init_state(self, prompts, seed, gen_start, gen_len, width):
        """Each sequence's draw at its generated columns (columns: it moves with the canvas)."""
        G, starts, dev = int(gen_len.max()), gen_start.tolist(), gen_start.device
        noise = torch.zeros(len(prompts), width, device=dev)
        draw = sequence_noise(prompts, seed, G).to(dev)
        for b, g0 in enumerate(starts):
            n = min(G, width - g0)
            noise[b, g0:g0 + n] = draw[b, :n]
        return PolicyState(columns={"noise": noise})

    def select(self, conf, masked, step, state=None):
        if state is None:
            raise InputError("the random policy needs its state, the sequence's noise (the loop passes it)")
        return super().select(state["noise"], masked, step)

    def draft_key(self, conf, masked, step, state=None):
        return state["noise"]

    def describe(self):
        return "random" + super().describe()[4:]


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
