"""Builders for small real-layout checkpoint directories with random weights (used by tests)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from models import ModelConfig, init_random, save_checkpoint


def make_tokenizer(path: Path, vocab_size: int, specials: dict[int, str]) -> None:
    """A word-level tokenizer.json whose ids coincide with the model's: word `t{i}` is id i."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {specials.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(path / "tokenizer.json"))


def make_checkpoint(path: Path, family: str = "llada", seed: int = 0, std: float = 0.3, eos_bias: float = 0.0,
                    shard_bytes: int | None = None, tokenizer_size: int | None = None, **overrides):
    """Write a tiny random checkpoint of `family` in its real layout; returns (path, model).

    `eos_bias` adds a multiple of the mean output row to the EOS row so that EOS becomes likely
    somewhere mid-generation. `tokenizer_size` < vocab makes the tokenizer smaller than the
    embedding (as real LLaDA's)."""
    cfg = ModelConfig.tiny(family, **overrides)
    model = init_random(cfg, seed=seed, std=std)
    if eos_bias:
        w = model.tok_embeddings.weight if model.output is None else model.output.weight
        with torch.no_grad():
            w[cfg.eos_token_id] += eos_bias * w.mean(0) + eos_bias * 0.05 * w[1]
    path = Path(path)
    save_checkpoint(model, path, shard_bytes=shard_bytes)
    specials = {cfg.mask_token_id: "<|mask|>", cfg.eos_token_id: "<|eos|>"}
    make_tokenizer(path, tokenizer_size or cfg.vocab_size, {k: v for k, v in specials.items() if k < (tokenizer_size or cfg.vocab_size)})
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}<|assistant|>"}))
    return path, model
