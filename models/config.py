"""Model configuration: one dataclass whose fields are the family differences.

A config is read from a Hugging Face `config.json` of one of the supported families (LLaDA,
Dream, openPangu-Diffusion; ALGORITHMS.md §7) and can be written back in that family's own
layout, so tests can build real-layout checkpoints with random weights.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckpointError

FAMILIES = ("llada", "dream", "pangu")
ATTENTION_MODES = ("bidirectional", "context_causal")


def family_of(model_type: str) -> str:
    """Map a checkpoint's `model_type` to a family, or raise naming the unknown type."""
    t = str(model_type).lower().replace("-", "_")
    if t == "llada":
        return "llada"
    if t == "dream":
        return "dream"
    if "pangu" in t:
        return "pangu"
    raise CheckpointError(
        f"unknown model_type {model_type!r}; supported: llada, Dream, PanguEmbedded (openPangu-Diffusion)"
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
    extra: dict = field(default_factory=dict, repr=False)  # the source config.json, for writing back

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise CheckpointError(f"unknown family {self.family!r}; expected one of {FAMILIES}")
        if self.attention not in ATTENTION_MODES:
            raise CheckpointError(f"unknown attention mode {self.attention!r}; expected one of {ATTENTION_MODES}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        for name in ("mask_token_id", "eos_token_id"):
            v = getattr(self, name)
            if not 0 <= v < self.vocab_size:
                raise CheckpointError(f"{name} {v} is outside the vocabulary of size {self.vocab_size}")
        stops = tuple(dict.fromkeys((self.eos_token_id, *self.stop_token_ids)))
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
        )[family]
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf(cls, raw: dict, generation_config: dict | None = None) -> "ModelConfig":
        """Build from a parsed `config.json` (and optional `generation_config.json`)."""
        if "model_type" not in raw:
            raise CheckpointError("config.json has no model_type")
        family = family_of(raw["model_type"])
        try:
            kw = _FROM_HF[family](raw)
        except KeyError as e:
            raise CheckpointError(f"config.json of a {family} model lacks the field {e.args[0]!r}") from None
        eos = _first(raw.get("eos_token_id"))
        if eos is None:
            raise CheckpointError("config.json has no eos_token_id")
        if raw.get("mask_token_id") is None:
            raise CheckpointError("config.json has no mask_token_id")
        stops = list(_as_list(raw.get("eos_token_id")))
        for key in ("eot_token_id", "stop_token_ids"):
            stops += _as_list(raw.get(key))
        if generation_config:
            stops += _as_list(generation_config.get("eos_token_id"))
        return cls(
            family=family,
            model_type=raw["model_type"],
            mask_token_id=int(raw["mask_token_id"]),
            eos_token_id=int(eos),
            pad_token_id=_first(raw.get("pad_token_id")),
            stop_token_ids=tuple(int(s) for s in stops),
            extra=dict(raw),
            **kw,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        raw = _read_json(path / "config.json")
        gen_path = path / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else None
        return cls.from_hf(raw, gen)

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

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


# ---------------------------------------------------------------------- per-family field maps
def _llada_from(r: dict) -> dict:
    d, h = r["d_model"], r["n_heads"]
    bias = bool(r.get("include_bias", False))
    hidden = r.get("mlp_hidden_size") or int(r.get("mlp_ratio", 4) * d)
    return dict(
        vocab_size=int(r.get("embedding_size") or r["vocab_size"]),
        hidden_size=d, intermediate_size=int(hidden), num_layers=r["n_layers"], num_heads=h,
        num_kv_heads=r.get("n_kv_heads") or h, head_dim=d // h, rope_theta=float(r.get("rope_theta", 10000.0)),
        rms_eps=float(r.get("rms_norm_eps", 1e-5)), qkv_bias=bias, o_bias=bias, logit_shift=0,
        attention="bidirectional", tie_embeddings=bool(r.get("weight_tying", False)),
        max_length=int(r.get("max_sequence_length", 4096)), position_mode="absolute",
    )


def _llada_to(c: ModelConfig) -> dict:
    return dict(
        architectures=["LLaDAModelLM"], d_model=c.hidden_size, n_heads=c.num_heads, n_kv_heads=c.num_kv_heads,
        n_layers=c.num_layers, mlp_hidden_size=c.intermediate_size, mlp_ratio=c.intermediate_size // c.hidden_size,
        rope_theta=c.rope_theta, rms_norm_eps=c.rms_eps, vocab_size=c.vocab_size, embedding_size=c.vocab_size,
        include_bias=c.qkv_bias, weight_tying=c.tie_embeddings, max_sequence_length=c.max_length,
        activation_type="silu", block_type="llama", layer_norm_type="rms", rope=True, alibi=False,
    )


def _qwen_like_from(r: dict, family: str) -> dict:
    d, h = r["hidden_size"], r["num_attention_heads"]
    pangu = family == "pangu"
    bias = bool(r.get("attention_bias", r.get("bias", True)))
    return dict(
        vocab_size=int(r["vocab_size"]), hidden_size=d, intermediate_size=r["intermediate_size"],
        num_layers=r["num_hidden_layers"], num_heads=h, num_kv_heads=r.get("num_key_value_heads") or h,
        head_dim=r.get("head_dim") or d // h, rope_theta=float(r.get("rope_theta", 10000.0)),
        rms_eps=float(r.get("rms_norm_eps", 1e-6)), qkv_bias=bias if pangu else True,
        o_bias=bias if pangu else False, logit_shift=1,
        attention="context_causal" if pangu else "bidirectional",
        tie_embeddings=bool(r.get("tie_word_embeddings", False)),
        max_length=int(r.get("max_position_embeddings", 32768)), position_mode="cumsum",
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


_FROM_HF = {"llada": _llada_from, "dream": lambda r: _qwen_like_from(r, "dream"),
            "pangu": lambda r: _qwen_like_from(r, "pangu")}
_TO_HF = {"llada": _llada_to, "dream": _qwen_like_to, "pangu": _qwen_like_to}


def _as_list(v) -> list:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _first(v):
    lst = _as_list(v)
    return lst[0] if lst else None


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
