"""Model configuration: one dataclass whose fields are the family differences.

A config is read from a Hugging Face `config.json` of one of the supported families (LLaDA,
Dream, openPangu-Diffusion, LLaDA2.x, DiffusionGemma; docs/algorithms.md §7, docs/models.md) and can be written
back in that family's own layout, so tests can build real-layout checkpoints with random weights.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckpointError

FAMILIES = ("llada", "dream", "pangu", "llada2", "diffusion_gemma")
ATTENTION_MODES = ("bidirectional", "context_causal", "block_causal", "causal")
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_tanh")
# LLaDA2's attention block when neither config.json nor generation_config.json names one: the
# default block_length of the authors' generate() and of diffusers' LLaDA2Pipeline
LLADA2_BLOCK = 32


def family_of(model_type: str) -> str:
    """Map a checkpoint's `model_type` to a family, or raise naming the unknown type."""
    t = str(model_type).lower().replace("-", "_")
    if t == "llada":
        return "llada"
    if t == "dream":
        return "dream"
    if "pangu" in t:
        return "pangu"
    if t.startswith("llada2"):
        return "llada2"
    if t == "diffusion_gemma":
        return "diffusion_gemma"
    raise CheckpointError(
        f"unknown model_type {model_type!r}; supported: llada, Dream, PanguEmbedded (openPangu-Diffusion), "
        f"llada2_moe (LLaDA2.x), diffusion_gemma (DiffusionGemma)"
    )


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention shape (`ModelConfig.layer`): most families have one for every layer;
    DiffusionGemma's sliding-window and full-attention layers differ in all of these."""

    window: int | None          # a query sees keys fewer than this many positions back (None: no window)
    head_dim: int
    kv_heads: int
    rope: tuple                 # (rotary dim, θ, turned pairs or None): the arguments of transformer.rope_cos_sin
    k_is_v: bool                # no v projection: v is the k projection (before k's norm and RoPE)


@dataclass
class ModelConfig:
    family: str = "llada"
    model_type: str = "llada"
    vocab_size: int = 64          # embedding rows (LLaDA: embedding_size, may exceed the tokenizer)
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    qkv_bias: bool = False
    o_bias: bool = False
    logit_shift: int = 0           # 1: the prediction for position i is read at i-1 (Dream, openPangu)
    attention: str = "bidirectional"
    tie_embeddings: bool = False
    max_length: int = 4096
    mask_token_id: int = 63
    eos_token_id: int = 62
    pad_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()   # EOS and every other id that ends a sequence (EOT, ...)
    position_mode: str = "absolute"        # with left padding: "absolute" index or "cumsum" of the mask
    # attention details (LLaDA2)
    qk_norm: bool = False                  # RMSNorm over each head's q and k before RoPE
    rotary_dim: int | None = None          # RoPE turns the first rotary_dim features of a head (None: all)
    attention_block: int | None = None     # block_causal: blocks of this many positions, counted from 0
    # mixture of experts (LLaDA2): num_experts 0 means every layer has the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0         # each routed expert's MLP size
    shared_intermediate_size: int = 0      # the shared experts' MLP size, all of them (0: none)
    first_dense_layers: int = 0            # leading layers that keep the dense MLP (first_k_dense_replace)
    n_group: int = 1                       # experts are chosen from the topk_group best of n_group groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True            # the k routing weights are renormalised to sum to 1 (then scaled)
    expert_bias: bool = False              # a per-expert score bias that steers the choice, not the weights
    moe_router: str = "sigmoid"            # "sigmoid": LLaDA2's grouped router; "softmax": Gemma 4's, experts
    #                                        beside a dense MLP (every layer), each with its own norms
    # DiffusionGemma (the Gemma 4 text backbone); the defaults are the other families' model
    hidden_act: str = "silu"               # the gated MLPs' activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    sandwich_norm: bool = False            # an RMSNorm on the attention's and the feed-forward's outputs too
    embedding_scale: float = 1.0           # token embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    logit_softcap: float | None = None     # logits = cap * tanh(logits / cap), in fp32
    attention_scale: float | None = None   # the q.k scale (None: 1/sqrt(head_dim); Gemma: 1, QK-norm sets it)
    v_norm: bool = False                   # an RMSNorm without weight over each head's v
    layer_types: tuple[str, ...] = ()      # "sliding_attention" / "full_attention" per layer (empty: all full)
    sliding_window: int | None = None      # a sliding layer's query sees keys fewer than this many positions back
    full_head_dim: int | None = None       # full-attention layers' head dim and kv heads when layer_types is set
    full_kv_heads: int | None = None
    full_rope_theta: float | None = None   # full-attention layers' RoPE θ and Gemma's proportional RoPE: the
    full_rotary_fraction: float = 1.0      # first fraction of the head's frequencies turn, the rest are 0
    full_k_is_v: bool = False              # full-attention layers have no v projection: v is the k projection
    encoder_decoder: bool = False          # an encoder mode (causal, writes KV) and a decoder mode (bidirectional
    #                                        canvas over the encoder's KV, self-conditioning input), one set of weights
    # gen_length / block_length suggested by generation_config.json: the CLI's, server's and
    # lm-eval adapter's default canvas sizes when the user gives none
    generation_defaults: dict = field(default_factory=dict, compare=False)
    # DiffusionGemma's denoising settings from generation_config.json (_dg_generation): what transformers'
    # generate decodes with by default; empty when the checkpoint has none (engine/uniform.py's defaults)
    diffusion: dict = field(default_factory=dict, compare=False)
    extra: dict = field(default_factory=dict, repr=False)  # the source config.json, for writing back

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise CheckpointError(f"unknown family {self.family!r}; expected one of {FAMILIES}")
        if self.attention not in ATTENTION_MODES:
            raise CheckpointError(f"unknown attention mode {self.attention!r}; expected one of {ATTENTION_MODES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise CheckpointError(f"{name} must be a positive integer, got {v!r}")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim {self.head_dim} is odd; rotary embeddings need an even head dimension")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise CheckpointError(f"rotary_dim {self.rotary_dim} must be even and within the head dimension "
                                  f"{self.head_dim}")
        if (self.attention == "block_causal") != (self.attention_block is not None):
            raise CheckpointError("attention_block (the block size) is set exactly when attention is block_causal")
        if self.attention_block is not None and self.attention_block <= 0:
            raise CheckpointError(f"attention_block must be a positive integer, got {self.attention_block!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise CheckpointError(f"unknown hidden_act {self.hidden_act!r}; expected one of {HIDDEN_ACTS}")
        if self.moe_router not in ("sigmoid", "softmax"):
            raise CheckpointError(f"unknown moe_router {self.moe_router!r}; expected 'sigmoid' or 'softmax'")
        if self.layer_types:
            self._check_layer_types()
        if not 0 < self.full_rotary_fraction <= 1:
            raise CheckpointError(f"full_rotary_fraction must be in (0, 1], got {self.full_rotary_fraction!r}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise CheckpointError(f"logit_softcap must be positive or None, got {self.logit_softcap!r}")
        if self.encoder_decoder and (not self.num_experts or self.moe_router != "softmax"):
            raise CheckpointError("an encoder-decoder (DiffusionGemma) model has the softmax-routed experts")
        if self.encoder_decoder and self.mask_token_id is not None:   # the engine decodes masked models then
            raise CheckpointError("an encoder-decoder (DiffusionGemma) model decodes from uniform noise: no mask token")
        if self.num_experts:
            _check_moe(self.num_experts, self.num_experts_per_tok, self.n_group, self.topk_group,
                       ("num_experts", "num_experts_per_tok", "n_group", "topk_group"), "")
            if self.moe_intermediate_size <= 0:
                raise CheckpointError(f"moe_intermediate_size must be a positive integer, got "
                                      f"{self.moe_intermediate_size!r}")
        self._check_tokens()

    def _check_layer_types(self) -> None:
        """Per-layer attention shapes (DiffusionGemma's sliding and full layers)."""
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise CheckpointError(f"layer_types must name one of {LAYER_TYPES} for each of the {self.num_layers} "
                                  f"layers, got {list(self.layer_types)}")
        if "sliding_attention" in self.layer_types and not (isinstance(self.sliding_window, int)
                                                            and self.sliding_window > 0):
            raise CheckpointError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        for name in ("full_head_dim", "full_kv_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise CheckpointError(f"{name} must be a positive integer when layer_types is set, got {v!r}")
        if self.full_head_dim % 2:
            raise CheckpointError(f"full_head_dim {self.full_head_dim} is odd; rotary embeddings need it even")
        if self.num_heads % self.full_kv_heads:
            raise CheckpointError(f"num_heads {self.num_heads} is not a multiple of full_kv_heads "
                                  f"{self.full_kv_heads}")

    def _check_tokens(self) -> None:
        """Every special id inside the vocabulary; the stop ids de-duplicated, EOS first."""
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise CheckpointError(f"{name} {v} is outside the vocabulary of size {self.vocab_size}")
        stops = tuple(dict.fromkeys((self.eos_token_id, *self.stop_token_ids)))
        bad = [s for s in stops if not 0 <= s < self.vocab_size]
        if bad:
            raise CheckpointError(f"stop token {bad[0]} is outside the vocabulary of size {self.vocab_size}")
        if self.mask_token_id in stops:
            raise CheckpointError(f"mask token {self.mask_token_id} is also a stop token")
        self.stop_token_ids = stops

    # ------------------------------------------------------------------ factories
    @classmethod
    def tiny(cls, family: str = "llada", **overrides) -> "ModelConfig":
        """A small config of the given family, for tests (real field semantics, tiny sizes)."""
        base = dict(
            llada=dict(family="llada", model_type="llada", rope_theta=5e5, rms_eps=1e-5,
                       num_heads=4, num_kv_heads=4),
            dream=dict(family="dream", model_type="Dream", rope_theta=1e6, rms_eps=1e-6, qkv_bias=True,
                       logit_shift=1, num_heads=4, num_kv_heads=2, position_mode="cumsum", tie_embeddings=False),
            pangu=dict(family="pangu", model_type="PanguEmbedded", rope_theta=1.6e7, rms_eps=1e-6, qkv_bias=True,
                       o_bias=True, logit_shift=1, num_heads=4, num_kv_heads=2, attention="context_causal",
                       position_mode="cumsum"),
            # layer 0 dense, layer 1 MoE: 8 experts in 4 groups, 2 groups chosen, 2 experts a token
            llada2=dict(family="llada2", model_type="llada2_moe", rope_theta=6e5, rms_eps=1e-6, num_heads=4,
                        num_kv_heads=2, qk_norm=True, rotary_dim=8, attention="block_causal", attention_block=4,
                        position_mode="cumsum", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_intermediate_size=32, first_dense_layers=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, expert_bias=True),
            # sliding, sliding, full (window 4; the full layer: head dim 32, one kv head, proportional RoPE on
            # a quarter of it, v = k); every layer a dense GeGLU beside 4 experts, 2 a token; no mask token
            diffusion_gemma=dict(family="diffusion_gemma", model_type="diffusion_gemma", rope_theta=1e4, rms_eps=1e-6,
                                 num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                                 attention="causal", position_mode="absolute", tie_embeddings=True,
                                 mask_token_id=None, eos_token_id=1, pad_token_id=0, qk_norm=True, v_norm=True,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_router="softmax",
                                 hidden_act="gelu_tanh", sandwich_norm=True, embedding_scale=64 ** 0.5,
                                 logit_softcap=30.0, attention_scale=1.0,
                                 layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                                 sliding_window=4, full_head_dim=32, full_kv_heads=1, full_rope_theta=1e6,
                                 full_rotary_fraction=0.25, full_k_is_v=True, encoder_decoder=True,
                                 generation_defaults={"block_length": 8}),
        )[family]
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf(cls, raw: dict, generation_config: dict | None = None, source: str = "config.json",
                gen_source: str = "generation_config.json") -> "ModelConfig":
        """Build from a parsed `config.json` (and optional `generation_config.json`).

        Every field is type-checked: a wrong type, a non-positive size, an inconsistent head
        count or an out-of-vocabulary token id raises `CheckpointError` naming `source` (the file),
        the field and what was expected, never a TypeError or a silently wrong model."""
        r = _Fields(raw, source)
        model_type = r.string("model_type")
        try:
            family = family_of(model_type)
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None
        r.what = f" (of a {family} model)"
        top = r
        quant = raw.get("quantization_config")
        if quant is not None:           # its 1-byte or packed tensors need scales this loader does not apply
            method = quant.get("quant_method") if isinstance(quant, dict) else None
            raise CheckpointError(f"{source}: a quantized checkpoint (quantization_config"
                                  f"{f', quant_method {method!r}' if method else ''}) is not supported: "
                                  f"use its bf16 or fp32 weights")
        if family == "diffusion_gemma":   # the text model's fields are in text_config; the rest is the vision tower
            r = _Fields(raw.get("text_config"), f"{source} text_config")
            r.what = top.what
        kw = _FROM_HF[family](r, family)
        _check_rope_scaling(r)
        if family != "diffusion_gemma":   # DiffusionGemma's rope_parameters is per layer type (_dg_ropes)
            _check_rope_parameters(r, kw)
        vocab, vocab_key = kw["vocab_size"], _VOCAB_KEY[family](raw)
        g = _Fields(generation_config, gen_source) if generation_config is not None else None
        mask, eos_list, pad_list, stops = _special_ids(raw, r, top, g, family, vocab, vocab_key, gen_source)
        gen_defaults, gen_eos = _generation_defaults(g, vocab, vocab_key, source)
        stops += gen_eos
        if family == "llada2" and kw["attention_block"] is None:
            kw["attention_block"] = gen_defaults.get("block_length", LLADA2_BLOCK)
        if family == "diffusion_gemma":     # the canvas (block) length is the engine's default block
            _dg_top_level(top)
            mask = None    # checked above but never used: it decodes from uniform noise (a mask id means masked)
            gen_defaults.setdefault("block_length", top.pos_int("canvas_length", 256))
            kw["diffusion"] = _dg_generation(g, vocab) if g is not None else {}
        return cls(
            family=family,
            model_type=model_type,
            mask_token_id=mask,
            eos_token_id=eos_list[0],
            pad_token_id=pad_list[0] if pad_list else None,
            stop_token_ids=tuple(stops),
            generation_defaults=gen_defaults,
            extra=dict(raw),
            **kw,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_path = path / "config.json"
        raw = read_json(cfg_path)
        gen_path = path / "generation_config.json"
        # present means read: a FIFO or a directory under that name is an error, never skipped or waited on
        gen = read_json(gen_path) if os.path.lexists(gen_path) else None
        return cls.from_hf(raw, gen, source=str(cfg_path), gen_source=str(gen_path))

    def to_hf(self) -> dict:
        """This config in its family's own config.json layout (the inverse of `from_hf`)."""
        if self.family == "diffusion_gemma":
            return _diffusion_gemma_to(self)
        out = dict(self.extra)
        out.update(_TO_HF[self.family](self))
        out.update(model_type=self.model_type, mask_token_id=self.mask_token_id, eos_token_id=self.eos_token_id)
        extra_stops = [s for s in self.stop_token_ids if s != self.eos_token_id]
        if extra_stops:
            out["eot_token_id"] = extra_stops[0] if len(extra_stops) == 1 else extra_stops
        if self.pad_token_id is not None:
            out["pad_token_id"] = self.pad_token_id
        return out

    def parameter_count(self) -> int:
        """The parameters of a model of this config (exact: the Transformer's own tensors). Counted
        per kind of layer, never layer by layer (an absurd layer count must fail fast, not loop)."""
        d = self.hidden_size
        dense = 3 * d * self.intermediate_size

        def attention(a: LayerAttention) -> int:
            q, kv, n_kv = self.num_heads * a.head_dim, a.kv_heads * a.head_dim, 1 if a.k_is_v else 2
            return (d * q + n_kv * d * kv + q * d + (q + n_kv * kv if self.qkv_bias else 0) + (d if self.o_bias else 0)
                    + (2 * a.head_dim if self.qk_norm else 0))

        if self.layer_types:
            first = {t: self.layer_types.index(t) for t in set(self.layer_types)}
            attn = sum(self.layer_types.count(t) * attention(self.layer(i)) for t, i in first.items())
        else:
            attn = self.num_layers * attention(self.layer(0))
        if self.moe_router == "softmax":      # a dense MLP + its norm, experts with two norms, the router's scales
            moe = dense + d + self.num_experts * (d + 3 * d * self.moe_intermediate_size + 1) + 3 * d
        else:
            moe = self.num_experts * (d + 3 * d * self.moe_intermediate_size + (1 if self.expert_bias else 0)) \
                + 3 * d * self.shared_intermediate_size
        n_moe = self.moe_layers()
        per_layer = (4 if self.sandwich_norm else 2) * d + (2 if self.encoder_decoder else 0)
        blocks = attn + self.num_layers * per_layer + (self.num_layers - n_moe) * dense + n_moe * moe
        self_cond = d + dense if self.encoder_decoder else 0
        return self.vocab_size * d * (1 if self.tie_embeddings else 2) + blocks + self_cond + d

    def layer(self, i: int) -> LayerAttention:
        """Layer i's attention shape: its window, head dim, kv heads, RoPE and v projection."""
        if self.layer_types and self.layer_types[i] == "full_attention":
            turned = int(self.full_rotary_fraction * self.full_head_dim // 2)
            return LayerAttention(None, self.full_head_dim, self.full_kv_heads,
                                  (self.full_head_dim, self.full_rope_theta or self.rope_theta, turned),
                                  self.full_k_is_v)
        window = self.sliding_window if self.layer_types else None
        return LayerAttention(window, self.head_dim, self.num_kv_heads,
                              (self.rotary_dim or self.head_dim, self.rope_theta, None), False)

    def moe_layers(self) -> int:
        """How many layers have the mixture-of-experts feed-forward (the last ones)."""
        return max(0, self.num_layers - self.first_dense_layers) if self.num_experts else 0

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_dense_layers

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


# ---------------------------------------------------------------------- per-family field maps
def _llada_from(r: "_Fields", family: str) -> dict:
    d, h = r.pos_int("d_model"), r.pos_int("n_heads")
    kv = r.pos_int("n_kv_heads", None) or h
    _check_heads(r, ("d_model", d), ("n_heads", h), ("n_kv_heads", kv), head_dim=None)
    _check_off(r, ("alibi", False), ("rope", True), ("input_emb_norm", False), ("scale_logits", False),
               ("attention_layer_norm", False), ("multi_query_attention", False))
    _check_kind(r, ("activation_type", "silu"), ("layer_norm_type", "rms"), ("block_type", "llama"),
                ("clip_qkv", None))
    bias = r.flag("include_bias", False)
    hidden = r.pos_int("mlp_hidden_size", None)
    if hidden is None:
        hidden = int(r.pos_num("mlp_ratio", 4) * d)
        if hidden <= 0:
            r.fail("mlp_ratio", "a ratio that gives a positive MLP size", r.raw["mlp_ratio"])
    emb = r.pos_int("embedding_size", None)
    vocab = r.pos_int("vocab_size", None if emb else _MISSING)
    return dict(
        vocab_size=emb or vocab,
        hidden_size=d, intermediate_size=hidden, num_layers=r.pos_int("n_layers"), num_heads=h,
        num_kv_heads=kv, head_dim=d // h, rope_theta=r.pos_num("rope_theta", 10000.0),
        rms_eps=r.pos_num("rms_norm_eps", 1e-5), qkv_bias=bias, o_bias=bias, logit_shift=0,
        attention="bidirectional", tie_embeddings=r.flag("weight_tying", False),
        max_length=r.pos_int("max_sequence_length", 4096), position_mode="absolute",
    )


def _llada_to(c: ModelConfig) -> dict:
    return dict(
        architectures=["LLaDAModelLM"], d_model=c.hidden_size, n_heads=c.num_heads, n_kv_heads=c.num_kv_heads,
        n_layers=c.num_layers, mlp_hidden_size=c.intermediate_size, mlp_ratio=c.intermediate_size // c.hidden_size,
        rope_theta=c.rope_theta, rms_norm_eps=c.rms_eps, vocab_size=c.vocab_size, embedding_size=c.vocab_size,
        include_bias=c.qkv_bias, weight_tying=c.tie_embeddings, max_sequence_length=c.max_length,
        activation_type="silu", block_type="llama", layer_norm_type="rms", rope=True, alibi=False,
    )


def _qwen_like_from(r: "_Fields", family: str) -> dict:
    d, h = r.pos_int("hidden_size"), r.pos_int("num_attention_heads")
    kv = r.pos_int("num_key_value_heads", None) or h
    head_dim = r.pos_int("head_dim", None)
    _check_heads(r, ("hidden_size", d), ("num_attention_heads", h), ("num_key_value_heads", kv), head_dim)
    _check_off(r, ("use_sliding_window", False))
    _check_kind(r, ("hidden_act", "silu"))
    pangu = family == "pangu"
    bias = r.flag("attention_bias", None)
    if bias is None:
        bias = r.flag("bias", True)
    return dict(
        vocab_size=r.pos_int("vocab_size"), hidden_size=d, intermediate_size=r.pos_int("intermediate_size"),
        num_layers=r.pos_int("num_hidden_layers"), num_heads=h, num_kv_heads=kv,
        head_dim=head_dim or d // h, rope_theta=r.pos_num("rope_theta", 10000.0),
        rms_eps=r.pos_num("rms_norm_eps", 1e-6), qkv_bias=bias if pangu else True,
        o_bias=bias if pangu else False, logit_shift=1,
        attention="context_causal" if pangu else "bidirectional",
        tie_embeddings=r.flag("tie_word_embeddings", False),
        max_length=r.pos_int("max_position_embeddings", 32768), position_mode="cumsum",
    )


def _qwen_like_to(c: ModelConfig) -> dict:
    out = dict(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        rope_theta=c.rope_theta, rms_norm_eps=c.rms_eps, vocab_size=c.vocab_size,
        tie_word_embeddings=c.tie_embeddings, max_position_embeddings=c.max_length, hidden_act="silu",
    )
    if c.family == "dream":
        out["architectures"] = ["DreamModel"]
    else:
        out.update(architectures=["PanguEmbeddedForCausalLM"], bias=c.qkv_bias)
    return out


def _llada2_from(r: "_Fields", family: str) -> dict:
    """LLaDA2.x (`llada2_moe`, LLaDA2MoeModelLM): a BailingMoeV2-style MoE transformer. Absent
    fields take the defaults of the authors' configuration class (LLaDA2MoeConfig)."""
    d, h = r.pos_int("hidden_size"), r.pos_int("num_attention_heads")
    kv = r.pos_int("num_key_value_heads", None) or h
    head_dim = r.pos_int("head_dim", None)
    _check_heads(r, ("hidden_size", d), ("num_attention_heads", h), ("num_key_value_heads", kv), head_dim)
    hd = head_dim or d // h
    # use_bias adds biases the two reference implementations place differently (SGLang: every
    # linear layer; the authors' modeling file: the output projection only); no checkpoint has it
    _check_off(r, ("use_bias", False), ("norm_head", False))
    act = r.string("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{r.source}: hidden_act {act!r} is not supported by this engine (SwiGLU needs 'silu')")
    score = r.string("score_function", "sigmoid")
    if score != "sigmoid":
        raise CheckpointError(f"{r.source}: score_function {score!r} is not supported by this engine (LLaDA2 "
                              f"routes with 'sigmoid' scores)")
    factor = r.pos_num("partial_rotary_factor", 0.5)
    rotary = int(hd * factor)
    if factor > 1 or rotary < 2 or rotary % 2:
        raise CheckpointError(f"{r.source}: partial_rotary_factor {factor:g} of the head dimension {hd} gives "
                              f"{rotary} rotary features; a positive even number at most {hd} is needed")
    n_layers = r.pos_int("num_hidden_layers")
    experts, k = r.pos_int("num_experts"), r.pos_int("num_experts_per_tok")
    n_group, topk_group = r.count("n_group", 8), r.count("topk_group", 4)
    if (n_group == 0) != (topk_group == 0):
        raise CheckpointError(f"{r.source}: n_group {n_group} and topk_group {topk_group} must both be 0 (no "
                              f"expert groups) or both positive")
    n_group, topk_group = n_group or 1, topk_group or 1
    _check_moe(experts, k, n_group, topk_group, ("num_experts", "num_experts_per_tok", "n_group", "topk_group"),
               f"{r.source}: ")
    moe_size = r.pos_int("moe_intermediate_size")
    dense_layers = r.count("first_k_dense_replace", 0)
    if dense_layers > n_layers:
        raise CheckpointError(f"{r.source}: first_k_dense_replace {dense_layers} exceeds num_hidden_layers {n_layers}")
    shared = r.count("num_shared_experts", 0) * r.pos_int("moe_shared_expert_intermediate_size", moe_size)
    inter = r.pos_int("intermediate_size", _MISSING if dense_layers else None)
    block = r.pos_int("block_length", None)
    return dict(
        vocab_size=r.pos_int("vocab_size"), hidden_size=d, intermediate_size=inter or moe_size,
        num_layers=n_layers, num_heads=h, num_kv_heads=kv, head_dim=hd,
        rope_theta=r.pos_num("rope_theta", 10000.0), rms_eps=r.pos_num("rms_norm_eps", 1e-5),
        qkv_bias=r.flag("use_qkv_bias", False), o_bias=False, logit_shift=0,
        attention="block_causal", attention_block=block, tie_embeddings=r.flag("tie_word_embeddings", False),
        max_length=r.pos_int("max_position_embeddings", 16384), position_mode="cumsum",
        qk_norm=r.flag("use_qk_norm", True), rotary_dim=rotary,
        num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=moe_size, shared_intermediate_size=shared,
        first_dense_layers=dense_layers, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=r.pos_num("routed_scaling_factor", 2.5), norm_topk_prob=r.flag("norm_topk_prob", True),
        expert_bias=r.flag("moe_router_enable_expert_bias", True),
    )


def _llada2_to(c: ModelConfig) -> dict:
    out = dict(
        architectures=["LLaDA2MoeModelLM"], hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_eps, vocab_size=c.vocab_size,
        tie_word_embeddings=c.tie_embeddings, max_position_embeddings=c.max_length, hidden_act="silu",
        use_qkv_bias=c.qkv_bias, use_bias=False, use_qk_norm=c.qk_norm, norm_head=False,
        partial_rotary_factor=(c.rotary_dim or c.head_dim) / c.head_dim, rope_scaling=None,
        num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size, num_shared_experts=c.shared_intermediate_size // c.moe_intermediate_size,
        first_k_dense_replace=c.first_dense_layers, n_group=c.n_group, topk_group=c.topk_group,
        routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob, score_function="sigmoid",
        moe_router_enable_expert_bias=c.expert_bias, router_dtype="fp32",
    )
    if c.shared_intermediate_size % c.moe_intermediate_size:     # one shared expert of its own size (SGLang's field)
        out.update(num_shared_experts=1, moe_shared_expert_intermediate_size=c.shared_intermediate_size)
    if c.attention_block != LLADA2_BLOCK:
        out["block_length"] = c.attention_block
    return out


# DiffusionGemma: what transformers' DiffusionGemmaTextConfig fills in when a field is absent
_DG_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
_DG_LAYER_KEYS = ("head_dim", "num_key_value_heads")       # what a per_layer_config entry may override
_MAX_DG_LAYERS = 1 << 16


def _special_ids(raw: dict, r: "_Fields", top: "_Fields", g, family: str, vocab: int, vocab_key: str,
                 gen_source: str) -> tuple:
    """(mask id or None, EOS ids, pad ids, stop ids) of a config.json (`r`: its text model's
    fields, `top`: the file's), each inside the vocabulary; LLaDA2's and DiffusionGemma's may come
    from generation_config.json (`g`)."""
    source = top.source
    generation_config = g.raw if g is not None else None
    # LLaDA2's config.json may leave the mask and EOS ids to generation_config.json
    if family == "llada2":
        r.what = f" (of a llada2 model; {gen_source} may give it instead)"
    mask_from, eos_from = (g if family == "llada2" and g is not None and raw.get(key) is None
                           and generation_config.get(key) is not None else r
                           for key in ("mask_token_id", "eos_token_id"))
    # DiffusionGemma starts its canvas from random tokens: a mask id is optional (None when absent)
    if family == "diffusion_gemma":    # text_config, the top level or generation_config.json; else None
        mask_from = next((f for f in (r, top, g) if f is not None and f.raw.get("mask_token_id") is not None), r)
        mask = mask_from.token_id("mask_token_id") if mask_from.raw.get("mask_token_id") is not None else None
    else:
        mask = mask_from.token_id("mask_token_id")
    eos_list = eos_from.token_ids("eos_token_id", required=True)
    pad_list = r.token_ids("pad_token_id")
    extra_stops = {key: r.token_ids(key) for key in ("eot_token_id", "stop_token_ids")}
    stops = eos_list + [t for ids in extra_stops.values() for t in ids]
    for key, ids, f in (("mask_token_id", [mask] if mask is not None else [], mask_from),
                        ("eos_token_id", eos_list, eos_from),
                        ("pad_token_id", pad_list[:1], r), *((k, v, r) for k, v in extra_stops.items())):
        for t in ids:
            if t >= vocab:
                raise CheckpointError(f"{f.source}: {key} {t} is outside the vocabulary of size {vocab} "
                                      f"({vocab_key}{'' if f is r else f' of {source}'})")
    return mask, eos_list, pad_list, stops


# the decoding sizes a checkpoint's generation_config.json may suggest (used where no flag gives one)
SUGGESTED = ("gen_length", "block_length")


def _generation_defaults(g, vocab: int, vocab_key: str, source: str) -> tuple[dict, list[int]]:
    """(the sizes generation_config.json suggests, its EOS ids), each checked; ({}, []) without one."""
    if g is None:
        return {}, []
    gen_source = g.source
    gen_eos = g.token_ids("eos_token_id")
    for t in gen_eos:
        if t >= vocab:
            raise CheckpointError(f"{gen_source}: eos_token_id {t} is outside the vocabulary of size {vocab} "
                                  f"({vocab_key} of {source})")
    suggested = {key: g.pos_int(key, None) for key in SUGGESTED}
    gen_defaults = {k: v for k, v in suggested.items() if v is not None}
    return gen_defaults, gen_eos


def _dg_generation(g: "_Fields", vocab: int) -> dict:
    """The denoising settings of a DiffusionGemma generation_config.json (the keys of transformers'
    DiffusionGemmaGenerationConfig, `sampler_config` as it serialises it), each checked; only the keys
    present. `eos_token_id` is the list of ids that end a sequence ([] = none: transformers then
    never stops at EOS), `pad_token_id` the id written after it."""
    out = {}
    for key in ("max_denoising_steps", "stability_threshold"):
        if g.raw.get(key) is not None:
            out[key] = g.count(key) if key == "stability_threshold" else g.pos_int(key)
    for key in ("t_min", "t_max", "confidence_threshold"):
        if g.raw.get(key) is not None:
            v = g.raw[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                g.fail(key, "a finite number >= 0", v)
            out[key] = float(v)
    sampler = g.raw.get("sampler_config")
    if sampler is not None:
        if not isinstance(sampler, dict) or sampler.get("_cls_name", "EntropyBoundSamplerConfig") != \
                "EntropyBoundSamplerConfig":
            g.fail("sampler_config", "an EntropyBoundSamplerConfig (the only sampler DiffusionGemma has)", sampler)
        out["entropy_bound"] = _Fields(sampler, g.source).pos_num("entropy_bound")
    out["eos_token_id"] = g.token_ids("eos_token_id")
    pad = g.token_ids("pad_token_id")
    out["pad_token_id"] = pad[0] if pad else None
    for key, ids in (("eos_token_id", out["eos_token_id"]), ("pad_token_id", pad[:1])):
        for t in ids:
            if t >= vocab:
                raise CheckpointError(f"{g.source}: {key} {t} is outside the vocabulary of size {vocab}")
    return out


def _dg_layer_types(r: "_Fields", n_layers: int) -> list[str]:
    """Each layer's attention type (transformers' default: five sliding layers, then a full one;
    the last layer always full, as transformers forces it)."""
    types = r.raw.get("layer_types")
    if types is None:                      # transformers' default: five sliding layers, then a full one
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        r.fail("layer_types", f"a list of {n_layers} of {LAYER_TYPES}", types)
    return types[:-1] + ["full_attention"]          # transformers forces the last layer to full attention


def _dg_ropes(r: "_Fields", types: list[str]) -> dict:
    """Per layer type, (RoPE theta, rotary fraction): sliding layers default RoPE, full layers
    proportional (Gemma's partial rotary)."""
    rope = r.raw.get("rope_parameters")
    rope = _DG_ROPE if rope is None else rope
    if not isinstance(rope, dict):
        r.fail("rope_parameters", "an object per layer type", rope)
    other = sorted(k for k in rope if k not in LAYER_TYPES)
    if other:                 # e.g. one flat RoPE for all layers: transformers fails on it; not read as defaults
        raise CheckpointError(f"{r.source}: rope_parameters names {other[0]!r}; it holds one object per layer type "
                              f"({', '.join(LAYER_TYPES)}), as DiffusionGemmaTextConfig writes it")
    ropes = {}
    for kind in set(types):
        p = rope.get(kind, _DG_ROPE[kind])
        f = _Fields(p, f"{r.source} rope_parameters[{kind!r}]")
        rope_type = f.string("rope_type", "default")
        theta = f.pos_num("rope_theta", _DG_ROPE[kind]["rope_theta"])
        fraction = f.pos_num("partial_rotary_factor", 1.0)
        if f.pos_num("factor", 1.0) != 1.0:
            raise CheckpointError(f"{f.source}: factor {p['factor']} is not supported by this engine (it "
                                  f"implements unscaled RoPE)")
        if (kind, rope_type) not in (("sliding_attention", "default"), ("full_attention", "proportional"),
                                     ("full_attention", "default")) or (rope_type == "default" and fraction != 1):
            raise CheckpointError(f"{f.source}: rope_type {rope_type!r} with partial_rotary_factor {fraction:g} is "
                                  f"not supported by this engine for {kind} layers")
        if fraction > 1:
            f.fail("partial_rotary_factor", "at most 1", p["partial_rotary_factor"])
        ropes[kind] = (theta, fraction)
    return ropes


def _dg_full_shape(r: "_Fields", types: list[str], n_layers: int, hd: int, kv: int) -> tuple[int, int]:
    """The full-attention layers' (head dim, kv heads): per_layer_config as transformers writes it,
    or the Gemma 4 fields global_head_dim / num_global_key_value_heads."""
    # the full-attention layers' shape: per_layer_config (as transformers writes it) or the Gemma 4 fields
    full_hd, full_kv = r.pos_int("global_head_dim", 512), r.pos_int("num_global_key_value_heads", kv)
    per_layer = r.raw.get("per_layer_config")
    if per_layer is not None:
        if not isinstance(per_layer, dict):
            r.fail("per_layer_config", "an object of layer index to overrides", per_layer)
        full_hd, full_kv = hd, kv
        seen = {}
        for key, over in per_layer.items():
            f = _Fields(over, f"{r.source} per_layer_config[{key!r}]")
            if not (isinstance(key, str) and key.isdigit() and int(key) < n_layers):
                raise CheckpointError(f"{r.source}: per_layer_config names layer {key!r}; the model has {n_layers}")
            extra = sorted(set(over) - set(_DG_LAYER_KEYS))
            if extra:
                raise CheckpointError(f"{f.source}: overriding {extra[0]!r} is not supported by this engine (only "
                                      f"{', '.join(_DG_LAYER_KEYS)})")
            seen[int(key)] = (f.pos_int("head_dim", hd), f.pos_int("num_key_value_heads", kv))
        shapes = {seen.get(i, (hd, kv)) for i, t in enumerate(types) if t == "full_attention"}
        if any(i in seen and seen[i] != (hd, kv) for i, t in enumerate(types) if t == "sliding_attention") \
                or len(shapes) != 1:
            raise CheckpointError(f"{r.source}: per_layer_config must give every full_attention layer the same "
                                  f"head_dim and num_key_value_heads and leave sliding layers alone (this engine has "
                                  f"one shape per layer type)")
        return shapes.pop()
    return full_hd, full_kv


def _diffusion_gemma_from(r: "_Fields", family: str) -> dict:
    """DiffusionGemma (`diffusion_gemma`, DiffusionGemmaForBlockDiffusion): the Gemma 4 MoE text
    backbone, read from `text_config` with the defaults of transformers' DiffusionGemmaTextConfig."""
    d, h = r.pos_int("hidden_size", 2304), r.pos_int("num_attention_heads", 8)
    kv, hd = r.pos_int("num_key_value_heads", 4), r.pos_int("head_dim", 256)
    _check_heads(r, ("hidden_size", d), ("num_attention_heads", h), ("num_key_value_heads", kv), hd)
    n_layers = r.pos_int("num_hidden_layers", 30)
    act = r.string("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{r.source}: hidden_activation {act!r} is not supported by this engine "
                              f"(DiffusionGemma's MLPs are GeGLU: 'gelu_pytorch_tanh')")
    bidi = r.raw.get("use_bidirectional_attention")
    if bidi not in (None, "vision"):       # "vision" only changes image tokens, which this engine never sees
        raise CheckpointError(f"{r.source}: use_bidirectional_attention {_show(bidi)} is not supported by this "
                              f"engine (its encoder is causal over text: null or 'vision')")
    if n_layers > _MAX_DG_LAYERS:         # a per-layer list of that many is built below: fail before it
        raise CheckpointError(f"{r.source}: num_hidden_layers {n_layers} is more than this engine builds "
                              f"({_MAX_DG_LAYERS})")
    types = _dg_layer_types(r, n_layers)
    ropes = _dg_ropes(r, types)
    full_hd, full_kv = _dg_full_shape(r, types, n_layers, hd, kv)
    _check_heads(r, ("hidden_size", d), ("num_attention_heads", h), ("the full layers' num_key_value_heads", full_kv),
                 full_hd)
    if r.flag("attention_bias", False):   # transformers ties the encoder's weights to the decoder's, not biases
        raise CheckpointError(f"{r.source}: attention_bias=true is not supported by this engine (transformers keeps "
                              f"separate encoder and decoder biases, and this engine runs one backbone; Gemma 4 "
                              f"checkpoints have none)")
    experts, k = r.pos_int("num_experts"), r.pos_int("top_k_experts")
    _check_moe(experts, k, 1, 1, ("num_experts", "top_k_experts", "n_group", "topk_group"), f"{r.source}: ")
    # absent: transformers' 30.0; null: no capping (transformers would fail on it)
    cap = r.pos_num("final_logit_softcapping", 30.0) if r.raw.get("final_logit_softcapping", 0) is not None else None
    full = ropes.get("full_attention", (1e6, 1.0))
    return dict(
        vocab_size=r.pos_int("vocab_size", 262_144), hidden_size=d, intermediate_size=r.pos_int("intermediate_size", 9216),
        num_layers=n_layers, num_heads=h, num_kv_heads=kv, head_dim=hd,
        rope_theta=ropes.get("sliding_attention", (1e4, 1.0))[0], rms_eps=r.pos_num("rms_norm_eps", 1e-6),
        qkv_bias=False, o_bias=False, logit_shift=0,
        attention="causal", tie_embeddings=True, max_length=r.pos_int("max_position_embeddings", 131_072),
        position_mode="absolute", qk_norm=True, v_norm=True, num_experts=experts,
        num_experts_per_tok=k, moe_intermediate_size=r.pos_int("moe_intermediate_size"),
        n_group=1, topk_group=1, moe_router="softmax", hidden_act="gelu_tanh", sandwich_norm=True,
        embedding_scale=d ** 0.5, logit_softcap=cap, attention_scale=1.0, layer_types=tuple(types),
        sliding_window=r.pos_int("sliding_window", 512), full_head_dim=full_hd, full_kv_heads=full_kv,
        full_rope_theta=full[0], full_rotary_fraction=full[1], full_k_is_v=True, encoder_decoder=True,
    )


def _dg_top_level(top: "_Fields") -> None:
    """DiffusionGemma's top-level fields the text model depends on."""
    if not top.flag("tie_word_embeddings", True):
        raise CheckpointError(f"{top.source}: tie_word_embeddings=false unties the encoder from the decoder; this "
                              f"engine runs one backbone in both modes (shared weights)")


def _diffusion_gemma_to(c: ModelConfig) -> dict:
    out = dict(c.extra)
    text = dict(out.get("text_config") or {})
    text.pop("per_layer_config", None)
    text.update(
        model_type="diffusion_gemma_text", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, global_head_dim=c.full_head_dim,
        num_global_key_value_heads=c.full_kv_heads, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=c.max_length, rms_norm_eps=c.rms_eps, attention_bias=c.qkv_bias,
        sliding_window=c.sliding_window, layer_types=list(c.layer_types), final_logit_softcapping=c.logit_softcap,
        num_experts=c.num_experts, top_k_experts=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                         "full_attention": {"rope_type": "proportional", "rope_theta": c.full_rope_theta,
                                            "partial_rotary_factor": c.full_rotary_fraction}},
        tie_word_embeddings=True, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
    )
    if c.mask_token_id is not None:
        text["mask_token_id"] = c.mask_token_id
    extra_stops = [s for s in c.stop_token_ids if s != c.eos_token_id]
    if extra_stops:
        text["eot_token_id"] = extra_stops[0] if len(extra_stops) == 1 else extra_stops
    out.update(architectures=["DiffusionGemmaForBlockDiffusion"], model_type=c.model_type, text_config=text,
               tie_word_embeddings=True)
    out.setdefault("canvas_length", c.generation_defaults.get("block_length", 256))
    # a vision tower as small as transformers allows: the engine never loads one, and a reader that builds
    # the whole model (transformers) should not build Gemma 4's real one around a tiny text model
    out.setdefault("vision_config", dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         head_dim=8))
    return out


def _check_moe(experts: int, k: int, n_group: int, topk_group: int, names: tuple, where: str) -> None:
    """Grouped top-k routing must be able to choose: equal groups, topk_group of them, and enough
    experts inside the chosen groups for k (each group is ranked by the sum of its top two scores,
    so a group that can lose needs two experts)."""
    ne, nk, ng, ntg = names
    if k > experts:
        raise CheckpointError(f"{where}{nk} {k} exceeds {ne} {experts}")
    if experts % n_group:
        raise CheckpointError(f"{where}{ng} {n_group} does not divide {ne} {experts} (expert groups are equal)")
    if topk_group > n_group:
        raise CheckpointError(f"{where}{ntg} {topk_group} exceeds {ng} {n_group}")
    size = experts // n_group
    if k > topk_group * size:
        raise CheckpointError(f"{where}{nk} {k} exceeds the {topk_group * size} experts of the {ntg} {topk_group} "
                              f"groups chosen ({size} experts a group)")
    if topk_group < n_group and size < 2:
        raise CheckpointError(f"{where}{ng} {n_group} leaves one expert a group; groups are ranked by their top "
                              f"two scores, so each needs at least two")


_FROM_HF = {"llada": _llada_from, "dream": _qwen_like_from, "pangu": _qwen_like_from, "llada2": _llada2_from,
            "diffusion_gemma": _diffusion_gemma_from}
# the config.json field that sets the number of embedding rows, for messages
_VOCAB_KEY = {"llada": lambda raw: "embedding_size" if raw.get("embedding_size") else "vocab_size",
              "dream": lambda raw: "vocab_size", "pangu": lambda raw: "vocab_size", "llada2": lambda raw: "vocab_size",
              "diffusion_gemma": lambda raw: "text_config vocab_size"}
_TO_HF = {"llada": _llada_to, "dream": _qwen_like_to, "pangu": _qwen_like_to, "llada2": _llada2_to}


_MISSING = object()


def _show(v) -> str:
    """A JSON value as a user would recognise it in their file, with its JSON type."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"{str(v).lower()} (a boolean)"
    if isinstance(v, str):
        return f"{v[:60]!r} (a string)"
    if isinstance(v, (int, float)):
        return f"{v!r} (a number)"
    text = json.dumps(v)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({'a list' if isinstance(v, list) else 'an object'})"


def _json_type(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


class _Fields:
    """Typed reads of one parsed JSON object; every error names the file, the field and what was
    expected. A default of `_MISSING` makes a field required; null counts as absent otherwise."""

    def __init__(self, raw, source: str):
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source} must hold a JSON object, got {_json_type(raw)}")
        self.raw, self.source, self.what = raw, source, ""

    def fail(self, key: str, expected: str, value):
        raise CheckpointError(f"{self.source}: field {key!r} must be {expected}, got {_show(value)}")

    def _get(self, key: str, default):
        v = self.raw.get(key)
        if v is None:
            if default is _MISSING:
                if key in self.raw:
                    self.fail(key, "set", None)
                raise CheckpointError(f"{self.source} lacks the required field {key!r}{self.what}")
            return default, False
        return v, True

    def string(self, key: str, default=_MISSING):
        v, given = self._get(key, default)
        if given and not isinstance(v, str):
            self.fail(key, "a string", v)
        return v

    def pos_int(self, key: str, default=_MISSING):
        v, given = self._get(key, default)
        if given and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            self.fail(key, "a positive integer", v)
        return v

    def count(self, key: str, default=_MISSING):
        """A non-negative integer (a number of things that may be none)."""
        v, given = self._get(key, default)
        if given and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            self.fail(key, "a non-negative integer", v)
        return v

    def pos_num(self, key: str, default=_MISSING):
        v, given = self._get(key, default)
        if given and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            self.fail(key, "a positive number", v)
        return float(v) if v is not None else v

    def flag(self, key: str, default=_MISSING):
        v, given = self._get(key, default)
        if given and not isinstance(v, bool):
            self.fail(key, "true or false", v)
        return v

    def token_id(self, key: str) -> int:
        v, _ = self._get(key, _MISSING)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            self.fail(key, "a non-negative integer token id", v)
        return v

    def token_ids(self, key: str, required: bool = False) -> list[int]:
        """An id or a list of ids (as Hugging Face writes eos_token_id); [] when absent."""
        v, given = self._get(key, _MISSING if required else None)
        if not given:
            return []
        ids = v if isinstance(v, list) else [v]
        if (not ids and required) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            self.fail(key, "a non-negative integer or a list of them", v)
        return list(ids)


def _check_heads(r: _Fields, hidden: tuple, heads: tuple, kv: tuple, head_dim: int | None) -> None:
    (hk, d), (nk, h), (kk, k) = hidden, heads, kv
    if h % k:
        raise CheckpointError(f"{r.source}: {nk} {h} is not a multiple of {kk} {k} (grouped-query attention "
                              f"needs whole groups)")
    if head_dim is None and d % h:
        raise CheckpointError(f"{r.source}: {hk} {d} is not divisible by {nk} {h}")
    hd = head_dim or d // h
    if hd % 2:
        raise CheckpointError(f"{r.source}: the head dimension {hd} ({'head_dim' if head_dim else f'{hk} / {nk}'}) "
                              f"is odd; rotary embeddings need it even")


def _check_off(r: _Fields, *switches: tuple) -> None:
    """Architecture switches this transformer does not implement must be absent or at their default."""
    for key, default in switches:
        v = r.flag(key, default)
        if v != default:
            raise CheckpointError(f"{r.source}: {key}={str(v).lower()} is not supported by this engine")


def _check_kind(r: _Fields, *kinds: tuple) -> None:
    """Switches given by value (an activation, a norm's or a block's kind, a clipping bound) must be
    absent, null or the one value this transformer implements: another would decode silently wrong."""
    for key, implemented in kinds:
        v = r.raw.get(key)
        if v is not None and v != implemented:
            what = f"only {implemented!r}" if implemented is not None else "none"
            raise CheckpointError(f"{r.source}: {key} {v!r} is not supported by this engine ({what})")


def _check_rope_scaling(r: _Fields) -> None:
    """The transformer implements plain RoPE; a scaled variant would be silently wrong."""
    rs = r.raw.get("rope_scaling")
    if rs is None:
        return
    if not isinstance(rs, dict):
        r.fail("rope_scaling", "an object or null", rs)
    kind = rs.get("rope_type", rs.get("type"))
    if rs and kind != "default":
        raise CheckpointError(f"{r.source}: rope_scaling of type {kind!r} is not supported by this engine "
                              f"(it implements plain RoPE); got {_show(rs)}")


def _check_rope_parameters(r: _Fields, kw: dict) -> None:
    """transformers 5 writes a config's RoPE as `rope_parameters` and reads it in place of `rope_scaling`
    and `rope_theta` (which it may leave out: then the θ given here is the model's, set in `kw`): it must
    say what those fields say (plain RoPE at `rope_theta` over the rotary features), or a model decoded
    here would differ from the one the file describes."""
    rp = r.raw.get("rope_parameters")
    if rp is None or rp == {}:
        return
    if not isinstance(rp, dict):
        r.fail("rope_parameters", "an object or null", rp)
    f = _Fields(rp, f"{r.source} rope_parameters")
    if "rope_theta" not in r.raw and "rope_theta" in rp:
        kw["rope_theta"] = f.pos_num("rope_theta")
    hd, rotary, theta = kw["head_dim"], kw.get("rotary_dim") or kw["head_dim"], kw["rope_theta"]
    kind = f.string("rope_type", None) or f.string("type", "default")
    if kind != "default" or f.pos_num("rope_theta", theta) != theta or any(isinstance(v, dict) for v in rp.values()) \
            or int(hd * f.pos_num("partial_rotary_factor", rotary / hd)) != rotary:
        raise CheckpointError(f"{r.source}: rope_parameters {_show(rp)} is not supported by this engine (it "
                              f"implements plain RoPE with theta {theta:g} over {rotary} of the {hd} features of a "
                              f"head, as rope_theta and the other fields say)")


# ---------------------------------------------------------------------- what the engine keeps between runs
def cache_dir(kind: str, env: str) -> Path | None:
    """Where the engine keeps `kind` between processes (measured cost curves, converted tokenizers):
    $`env` if set ("off", "0", "none" or empty: nowhere), else $XDG_CACHE_HOME/psd-engine/`kind`
    (default ~/.cache/psd-engine/`kind`). Everything kept there is derived and may be deleted."""
    value = os.environ.get(env)
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0", "none") else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:                   # no home directory to be found: nothing is kept
            return None
    return Path(base) / "psd-engine" / kind


def keep_file(path: Path, data: bytes) -> None:
    """Write a cache file `path` (best effort: a read-only or full disk only costs the work again next
    time). Written to a temporary file, then renamed: readers never see half of it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        pass


# ---------------------------------------------------------------------- files a user names
# The most bytes any file a user names is read into memory with (a config, an index, a tokenizer,
# a cost profile, a draft graph, a prompts or task data file; a gzip file's content counts
# decompressed): real ones are KBs to a few tens of MB, and `/dev/zero` must not read forever.
MAX_FILE_BYTES = 256 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a plain file")


def _named(what: str, path) -> str:
    return f"{what} {path}" if what else str(path)


def check_regular(path, what: str = "", error=CheckpointError, limit: int = MAX_FILE_BYTES) -> os.stat_result:
    """The stat of `path` if it is a regular file of at most `limit` bytes, else `error` (one line
    naming `what` and the path). Nothing is opened: a FIFO or a device never blocks or streams."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"cannot read {_named(what, path)}: not found") from None
    except OSError as e:
        raise error(f"cannot read {_named(what, path)}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{_named(what, path)} is not a regular file ({_kind(st.st_mode)})")
    if st.st_size > limit:
        raise error(f"{_named(what, path)} is too large: {st.st_size} bytes, at most {limit} ({limit >> 20} MiB) "
                    f"are read")
    return st


LFS_POINTER = b"version https://git-lfs.github.com/spec/"     # what a clone without git-lfs holds


def lfs_message(named: str) -> str:
    return f"{named} is a Git LFS pointer, not the file itself (a clone without git-lfs): run `git lfs pull` there"


def read_bytes(path, what: str = "", error=CheckpointError, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a file a user named, checked first (`check_regular`) and then opened without
    blocking (a file swapped for a FIFO after the check fails instead of hanging); never more than
    `limit` bytes are read."""
    check_regular(path, what, error, limit)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"cannot read {_named(what, path)}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):           # replaced between the check and the open
            raise error(f"{_named(what, path)} is not a regular file ({_kind(st.st_mode)})")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:                           # it grew after the check
            raise error(f"{_named(what, path)} is too large: over {limit} bytes")
        data = b"".join(chunks)
        if data.startswith(LFS_POINTER):
            raise error(lfs_message(_named(what, path)))
        return data
    except OSError as e:
        raise error(f"cannot read {_named(what, path)}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def read_text(path, what: str = "", error=CheckpointError, limit: int = MAX_FILE_BYTES) -> str:
    """A checked file's text (UTF-8; anything else is `error`)."""
    data = read_bytes(path, what, error, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"cannot read {_named(what, path)}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def read_json(path, what: str = "", error=CheckpointError, limit: int = MAX_FILE_BYTES):
    """The parsed JSON of a checked file; every failure is one `error` line naming the file."""
    text = read_text(path, what, error, limit)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"cannot read {_named(what, path)}: not valid JSON ({e})") from None
    except RecursionError:
        raise error(f"cannot read {_named(what, path)}: JSON nested too deeply") from None
    except ValueError as e:                        # e.g. an integer of too many digits
        raise error(f"cannot read {_named(what, path)}: {e}") from None
