"""Model configuration: one dataclass whose fields are the family differences.

A config is read from a Hugging Face `config.json` of one of the supported families (LLaDA,
Dream, openPangu-Diffusion, LLaDA2.x; docs/algorithms.md §7, docs/models.md) and can be written
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

FAMILIES = ("llada", "dream", "pangu", "llada2")
ATTENTION_MODES = ("bidirectional", "context_causal", "block_causal")
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
    raise CheckpointError(
        f"unknown model_type {model_type!r}; supported: llada, Dream, PanguEmbedded (openPangu-Diffusion), "
        f"llada2_moe (LLaDA2.x)"
    )


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
    # gen_length / block_length suggested by generation_config.json: the CLI's, server's and
    # lm-eval adapter's default canvas sizes when the user gives none
    generation_defaults: dict = field(default_factory=dict, compare=False)
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
        if self.num_experts:
            _check_moe(self.num_experts, self.num_experts_per_tok, self.n_group, self.topk_group,
                       ("num_experts", "num_experts_per_tok", "n_group", "topk_group"), "")
            if self.moe_intermediate_size <= 0:
                raise CheckpointError(f"moe_intermediate_size must be a positive integer, got "
                                      f"{self.moe_intermediate_size!r}")
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
        kw = _FROM_HF[family](r, family)
        _check_rope_scaling(r)
        vocab, vocab_key = kw["vocab_size"], _VOCAB_KEY[family](raw)
        g = _Fields(generation_config, gen_source) if generation_config is not None else None
        # LLaDA2's config.json may leave the mask and EOS ids to generation_config.json
        if family == "llada2":
            r.what = f" (of a llada2 model; {gen_source} may give it instead)"
        mask_from, eos_from = (g if family == "llada2" and g is not None and raw.get(key) is None
                               and generation_config.get(key) is not None else r
                               for key in ("mask_token_id", "eos_token_id"))
        mask = mask_from.token_id("mask_token_id")
        eos_list = eos_from.token_ids("eos_token_id", required=True)
        pad_list = r.token_ids("pad_token_id")
        extra_stops = {key: r.token_ids(key) for key in ("eot_token_id", "stop_token_ids")}
        stops = eos_list + [t for ids in extra_stops.values() for t in ids]
        for key, ids, f in (("mask_token_id", [mask], mask_from), ("eos_token_id", eos_list, eos_from),
                            ("pad_token_id", pad_list[:1], r), *((k, v, r) for k, v in extra_stops.items())):
            for t in ids:
                if t >= vocab:
                    raise CheckpointError(f"{f.source}: {key} {t} is outside the vocabulary of size {vocab} "
                                          f"({vocab_key}{'' if f is r else f' of {source}'})")
        gen_defaults = {}
        if g is not None:
            gen_eos = g.token_ids("eos_token_id")
            for t in gen_eos:
                if t >= vocab:
                    raise CheckpointError(f"{gen_source}: eos_token_id {t} is outside the vocabulary of size {vocab} "
                                          f"({vocab_key} of {source})")
            suggested = {key: g.pos_int(key, None) for key in ("gen_length", "block_length")}
            gen_defaults = {k: v for k, v in suggested.items() if v is not None}
            stops += gen_eos
        if family == "llada2" and kw["attention_block"] is None:
            kw["attention_block"] = gen_defaults.get("block_length", LLADA2_BLOCK)
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
        """The parameters of a model of this config (exact: the Transformer's own tensors)."""
        d, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0) + (d if self.o_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        dense = 3 * d * self.intermediate_size
        moe = self.num_experts * (d + 3 * d * self.moe_intermediate_size + (1 if self.expert_bias else 0)) \
            + 3 * d * self.shared_intermediate_size
        n_moe = self.moe_layers()
        blocks = self.num_layers * (attn + 2 * d) + (self.num_layers - n_moe) * dense + n_moe * moe
        return self.vocab_size * d * (1 if self.tie_embeddings else 2) + blocks + d

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
    _check_off(r, ("alibi", False), ("rope", True))
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


_FROM_HF = {"llada": _llada_from, "dream": _qwen_like_from, "pangu": _qwen_like_from, "llada2": _llada2_from}
# the config.json field that sets the number of embedding rows, for messages
_VOCAB_KEY = {"llada": lambda raw: "embedding_size" if raw.get("embedding_size") else "vocab_size",
              "dream": lambda raw: "vocab_size", "pangu": lambda raw: "vocab_size", "llada2": lambda raw: "vocab_size"}
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
        return b"".join(chunks)
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


def _read_json(path: Path):
    return read_json(path)
