"""The uniform-noise paradigm (DiffusionGemma) in the loop's stages (docs/algorithms.md §9).

A model without a mask token diffuses from uniform noise: a block (canvas) starts as random tokens,
and every step runs the decoder over the canvas, samples a candidate token per position, keeps the
lowest-entropy candidates whose entropies' sum minus its largest stays within the entropy bound
(the entropy-bounded sampler), and redraws every other position at random. The loop
(engine/loop.py) runs the paradigm through its own stages:

    open a block    the encoder writes the new context (the prompt, then each finished canvas)
                    onto the batch's cache; the canvas is drawn; the first decoder call
    stage 1         temperature (a linear schedule over the steps), sample, accept, renoise,
                    adaptive stopping (stable argmax and low mean entropy); the step's
                    logits are the next call's self-conditioning input
    the next call   the decoder over the canvases of the rows still denoising
    close a block   the block's tokens are the last step's argmax; EOS and padding are
                    written as transformers' generate finalises a canvas

Draws: one generator seeded by `--seed`, drawn in transformers' order with its shapes (the
canvas [B, C] per block, then per step one multinomial over [B·C, V] and one renoise canvas
[B, C]), for every row of the batch while any row still decodes, so `generate(seed=S)` returns
the tokens of transformers' `generate` after `torch.manual_seed(S)` (tests/test_uniform.py). A
batch therefore decodes in lockstep, as transformers' does: a row whose sequence ended still
takes its calls while others go on (its denoising decides how many steps the batch's draws run),
and is not counted in its `calls`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from models import KVCache, attention_mask

from .cache import Window
from .errors import InputError
from .methods import UNIFORM_NOISE
from .state import BlockRun

# transformers' DiffusionGemmaGenerationConfig defaults, where generation_config.json gives none
DEFAULTS = dict(max_denoising_steps=48, entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1,
                confidence_threshold=0.005)
SETTINGS = tuple(DEFAULTS)
# options of the masked paradigm a uniform-noise model does not take (its sampling is the schedule above)
NOT_TAKEN = ("temperature", "top_k", "top_p", "ignore_eos", "min_tokens", "top_logprobs", "cache", "score",
             "conf_dtype", "static_rows", "compile", "cuda_graphs", "align")


@dataclass(frozen=True)
class Denoising:
    """The settings a uniform-noise model decodes with: an option given, else the checkpoint's
    generation_config.json (`ModelConfig.diffusion`), else transformers' defaults."""

    max_denoising_steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    stability_threshold: int | None
    confidence_threshold: float | None
    eos: tuple[int, ...]            # ids that end a sequence (none: it never ends early, as transformers)
    pad: int | None                 # written after EOS and over later canvases (None: nothing written)

    @classmethod
    def of(cls, mc, dc) -> "Denoising":
        given = {k: dc.given[k] for k in SETTINGS if k in dc.given}
        values = {**DEFAULTS, **{k: mc.diffusion[k] for k in SETTINGS if k in mc.diffusion}, **given}
        if values["t_max"] <= values["t_min"]:
            raise InputError(f"t-max {values['t_max']} must be above t-min {values['t_min']} (the temperature "
                             f"falls from t-max to t-min over the steps)")
        return cls(**values, eos=tuple(mc.diffusion.get("eos_token_id", ())), pad=mc.diffusion.get("pad_token_id"))


def uniform_config(mc, dc):
    """The `DecodeConfig` a uniform-noise model decodes: method eb (its entropy-bounded sampler),
    blocks of the model's canvas length, the gen length rounded up to whole canvases (transformers'
    `generate` decodes ceil(max_new_tokens / C) canvases and returns them all). InputError for an
    option the paradigm does not take."""
    C = mc.generation_defaults.get("block_length")
    if dc.method_given and dc.method != "eb":
        raise InputError(f"a {mc.family} model decodes with eb (its entropy-bounded sampler over uniform noise); "
                         f"method {dc.method} is for masked models (docs/algorithms.md §9)")
    for name in NOT_TAKEN:
        if name in dc.given:
            raise InputError(f"{name.replace('_', '-')} does not apply to a {mc.family} model (uniform noise: its "
                             f"sampling is --t-min/--t-max, --entropy-bound and the stopping thresholds)")
    if "block_length" in dc.given and dc.block_length != C:
        raise InputError(f"a {mc.family} model decodes canvases of its canvas_length {C}; block length "
                         f"{dc.block_length} differs")
    settings = Denoising.of(mc, dc)                 # resolved once: the config says what decodes (describe)
    given = {**{k: v for k, v in dc.given.items() if k not in ("block_length", "gen_length")},
             **{k: getattr(settings, k) for k in SETTINGS}}
    return dc.__class__("eb", **given, block_length=C, gen_length=-(-dc.gen_length // C) * C)


def for_model(mc, dc):
    """The validated `DecodeConfig` the model `mc` decodes `dc` with: the one check of a config
    against the model, which every front end runs once the model's config is known (a checkpoint's
    config.json, `ModelConfig.from_dir`, before its weights are read): `uniform_config` for a
    uniform-noise model; a masked model's is `dc` itself, which takes none of the uniform-noise
    settings and, where its blocks start at the generation (`--align generation`; `auto` on a model
    that is not block-causal), a gen length that is a multiple of the block length."""
    if mc.mask_token_id is None:
        return uniform_config(mc, dc).validate()
    refuse_settings(mc, dc)
    if dc.validate().gen_length % dc.block_length and not dc.aligned(mc):
        raise InputError(dc.unaligned())
    return dc


def refuse_settings(mc, dc) -> None:
    """A masked model takes none of the uniform-noise settings."""
    for name in UNIFORM_NOISE:
        if name in dc.given:
            raise InputError(f"{name.replace('_', '-')} applies to uniform-noise models (diffusion_gemma), "
                             f"not to a {mc.family} model")


@dataclass
class Canvas:
    """One open block's denoising state, for every row of the batch ([B, ...])."""

    canvas: torch.Tensor            # [B, C] the next call's input
    argmax: torch.Tensor            # [B, C] the latest step's argmax (the block's tokens when it closes)
    done: torch.Tensor              # [B] bool: denoising stopped (adaptive stopping)
    left: int                       # steps left, counted down as transformers' cur_step (N..1)
    called: torch.Tensor | None = None      # [A] the rows of the latest call
    raw: torch.Tensor | None = None         # [A, C, V] its logits
    sc: torch.Tensor | None = None          # [B, C, V] the latest step's processed logits (self-conditioning)
    history: torch.Tensor | None = None     # [k, B, C] the argmax of the last k steps (stability)


class UniformNoise:
    """The stages of the uniform-noise paradigm for one Decoder (one model, one config)."""

    def __init__(self, model, dc, mc):
        self.model, self.dc, self.mc = model, dc, mc
        self.s = Denoising.of(mc, dc)
        self.V = mc.vocab_size
        self.gen = torch.Generator(model.device).manual_seed(dc.seed)
        self.eos = torch.tensor(self.s.eos, dtype=torch.long, device=model.device)

    def settings(self) -> dict:
        return {f.name: getattr(self.s, f.name) for f in fields(self.s)}

    # ------------------------------------------------------------------ open a block
    def encode(self, batch, upto: int) -> None:
        """The encoder over the batch's columns not yet encoded, before `upto`: its KV joins the
        batch's cache (`Batch.memory`: (cache, columns encoded))."""
        cache, start = batch.memory if batch.memory is not None else (None, 0)
        if start >= upto:
            return
        ids, valid, pos = batch.x[:, start:upto], batch.valid[:, start:upto], batch.pos[:, start:upto]
        T = upto - start
        idx = torch.arange(T, device=ids.device)
        own = attention_mask(self.mc, valid, T, T, 1, idx, idx)          # causal over the new columns' own keys
        _, kvs = self.model(ids, pos, own, cache, return_kv=True)
        if cache is None:
            cache = KVCache(kvs, valid, positions=pos)
        else:
            cache = KVCache([(torch.cat((k, k2), 2), torch.cat((v, v2), 2)) for (k, v), (k2, v2) in
                             zip(cache.layers, kvs)], torch.cat((cache.key_mask, valid), 1),
                            positions=torch.cat((cache.positions, pos), 1))
        batch.memory = (cache, upto)

    def open_block(self, dec, batch) -> BlockRun | None:
        if not (batch.stop_at < 0).any():                      # one read per block
            return None
        L, lo = self.dc.block_length, batch.cursor
        B, dev = batch.x.shape[0], batch.x.device
        self.encode(batch, lo)
        canvas = torch.randint(0, self.V, (B, L), generator=self.gen, device=dev)

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        seqs = torch.arange(B, device=dev)
        span = slice(lo, lo + L)
        run = BlockRun(
            index=(lo - batch.prompt_width) // L, seqs=seqs, win=Window(batch.prompt_width, L, lo, L),
            gen_start=batch.gen_start, x=batch.x.clone(), valid=batch.valid, pos=batch.pos, cache=None,
            pred=zeros(B, L), conf=zeros(B, L, dtype=torch.float32), calls=batch.calls.clone(),
            rows=batch.rows.clone(), step=zeros(B), stop_at=batch.stop_at.clone(), pending=torch.ones(B, dtype=torch.bool, device=dev),
            commits=batch.commits.take(seqs, span),
            depth_hist=batch.depth_hist.clone(), failed=zeros(B), failed_call=zeros(B) - 1,
            nodes_hist=batch.nodes_hist.clone(), plan=dec.full_plan)
        run.noise = Canvas(canvas=canvas, argmax=canvas, done=zeros(B, dtype=torch.bool),
                           left=self.s.max_denoising_steps)
        run.cache = batch.memory[0]
        if batch.retired is not None:                  # rows that left (Decoder.leave) take no call; the
            run.pending &= ~batch.retired              # draws stay the batch's shapes
            if not run.pending.any():
                return None
        self.call(run, run.pending.nonzero()[:, 0])
        return run

    # ------------------------------------------------------------------ a decoder call
    def call(self, run: BlockRun, act: torch.Tensor) -> None:
        """The decoder over the canvases of rows `act` (indices into the batch), over the encoder's
        cache, with the previous step's logits as self-conditioning (none at a block's first step)."""
        st, lo, L = run.noise, run.win.lo, run.win.block_length
        cache = run.cache                                 # the batch's encoder cache, every row
        if act.numel() != cache.key_mask.shape[0]:
            cache = KVCache([(k[act], v[act]) for k, v in cache.layers], cache.key_mask[act],
                            positions=cache.positions[act])
        see_all = torch.ones(1, 1, L, L, dtype=torch.bool, device=act.device)
        sc = None if st.sc is None else st.sc[act]
        st.raw, _ = self.model(st.canvas[act], run.pos[act, lo:lo + L], see_all, cache, decoder=True, self_cond=sc)
        st.called = act
        live = run.stop_at[act] < 0                       # rows of an ended sequence are not counted
        run.calls[act] += live.long()
        run.rows[act] += live.long()
        run.step[act] += 1                                # the decoder calls each row took in this block

    # ------------------------------------------------------------------ stage 1
    def commit(self, run: BlockRun) -> None:
        """Temperature, sample, accept, renoise and stop on the latest call's logits; sets
        `run.pending` (the rows that take the next call)."""
        st, s, act = run.noise, self.s, run.noise.called
        B, L = st.canvas.shape
        t = torch.tensor(st.left, dtype=torch.int32)
        processed = st.raw / (s.t_min + (s.t_max - s.t_min) * (t / s.max_denoising_steps))
        probs = torch.ones(B, L, self.V, dtype=torch.float32, device=act.device)
        probs[act] = torch.softmax(processed, dim=-1, dtype=torch.float32)
        drawn = torch.multinomial(probs.view(-1, self.V), num_samples=1, generator=self.gen).view(B, L)
        argmax = processed.argmax(-1)
        entropy = torch.distributions.Categorical(logits=processed).entropy()        # [A, L]
        ordered, order = torch.sort(entropy, dim=-1, descending=False)
        within = torch.cumsum(ordered, dim=-1) - ordered <= s.entropy_bound       # transformers' float order
        accepted = torch.zeros_like(within).scatter(-1, order, within)
        noise = torch.randint(0, self.V, (B, L), generator=self.gen, device=act.device)
        st.canvas = st.canvas.clone()
        st.canvas[act] = torch.where(accepted, drawn[act], noise[act])
        st.argmax = st.argmax.clone()
        st.argmax[act] = argmax
        if st.sc is None:
            st.sc = torch.zeros(B, L, self.V, dtype=self.model.dtype, device=act.device)
        st.sc[act] = processed.to(self.model.dtype)
        self._stop(st, act, entropy)
        st.left -= 1
        run.pending = run.pending & ~st.done & (st.left >= 1)      # a retired row (Decoder.leave) stays out

    def _stop(self, st: Canvas, act, entropy) -> None:
        """Adaptive stopping: a row stops once its argmax equals that of the previous k steps
        (k = stability threshold) and its mean entropy is below the confidence threshold."""
        s = self.s
        if s.stability_threshold is None or s.confidence_threshold is None:
            return
        B, L = st.argmax.shape
        if s.stability_threshold == 0:
            stable = torch.ones(B, dtype=torch.bool, device=act.device)
        else:
            if st.history is None:     # a canvas takes max_denoising_steps steps at most, so no deeper
                depth = min(s.stability_threshold, s.max_denoising_steps)   # history is ever full: the same stops
                st.history = torch.full((depth, B, L), -1, dtype=torch.long, device=act.device)
            stable = (st.history == st.argmax[None]).all(-1).all(0)
            st.history = torch.roll(st.history, shifts=-1, dims=0)
            st.history[-1] = st.argmax
        confident = torch.zeros(B, dtype=torch.bool, device=act.device)
        confident[act] = torch.mean(entropy, dim=-1) < s.confidence_threshold
        st.done = st.done | (stable & confident)

    # ------------------------------------------------------------------ close a block
    def close(self, run: BlockRun) -> None:
        """The block's tokens: the last step's argmax; a sequence with a stop id in it ends at the
        first; padding as transformers writes it (after the EOS of a canvas that ended a sequence,
        over every later canvas of an ended one)."""
        st, lo, L = run.noise, run.win.lo, run.win.block_length
        tokens = st.argmax.clone()
        before = run.stop_at >= 0
        hit = torch.isin(tokens, self.eos)                 # (no stop ids: nowhere)
        this, first = hit.any(-1), hit.long().argmax(-1)
        if self.s.pad is not None and (before | this).any():
            tokens[before] = self.s.pad
            if this.any():
                is_eos = torch.isin(tokens, self.eos)
                seen = is_eos.cumsum(-1)
                tokens[(seen > 0) & ~((seen == 1) & is_eos)] = self.s.pad
        run.stop_at = torch.where(this & ~before, lo + first, run.stop_at)
        run.x[:, lo:lo + L] = tokens
        prob = st.sc.float().softmax(-1).gather(-1, st.argmax[..., None])[..., 0].double()
        fresh = ~before
        run.commits.write(fresh[:, None].expand(-1, L), cols=slice(0, L), call=run.calls[:, None],
                          step=run.step[:, None] - 1, prob=prob)
        run.pending = torch.zeros_like(run.pending)


def check_batchable(mc) -> None:
    """Continuous batching lets rows join a running batch; a uniform-noise model's draws are the
    batch's (see the module docstring), so a joining row would change every other row's tokens."""
    if mc.mask_token_id is None:
        raise InputError(f"continuous batching does not decode a {mc.family} model yet (its sampling draws are the "
                         f"whole batch's: a row that joins changes the others' tokens); use static batching")


__all__ = ["Canvas", "DEFAULTS", "Denoising", "UniformNoise", "check_batchable", "for_model", "refuse_settings",
           "uniform_config"]
