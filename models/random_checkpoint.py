"""Small real-layout checkpoint directories with random weights: for tests, and for trying the
engine or an integration without any real weights.

    python -m models.random_checkpoint OUT_DIR [--family llada|dream|pangu|llada2|diffusion_gemma] [--seed N]

writes config.json, model.safetensors, tokenizer.json (word-level: word `t<i>` is token i) and a
tokenizer_config.json with a chat template, in the chosen family's real layout.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from .checkpoint import init_random, save_checkpoint
from .config import FAMILIES, ModelConfig
from .errors import CheckpointError


def make_tokenizer(path: Path, vocab_size: int, specials: dict[int, str]) -> None:
    """A word-level tokenizer.json whose ids coincide with the model's: word `t{i}` is id i for
    i < vocab_size, plus the special tokens at their own ids (possibly beyond vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size) if i not in specials}
    vocab.update({v: k for k, v in specials.items()})
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
    with torch.no_grad():
        for layer in model.layers:
            if getattr(layer.mlp, "expert_bias", None) is not None:
                # a bias of the scores' own scale: it reorders close experts instead of fixing
                # every token's choice (init_random's biases are 5 std, 1.5 here)
                layer.mlp.expert_bias.mul_(0.1 / (5 * std))
    if eos_bias:
        w = model.tok_embeddings.weight if model.output is None else model.output.weight
        with torch.no_grad():
            w[cfg.eos_token_id] += eos_bias * w.mean(0) + eos_bias * 0.05 * w[1]
    path = Path(path)
    save_checkpoint(model, path, shard_bytes=shard_bytes)
    specials = {cfg.mask_token_id: "<|mask|>", cfg.eos_token_id: "<|eos|>"}
    specials.pop(None, None)            # DiffusionGemma has no mask token (its canvas starts from random tokens)
    make_tokenizer(path, tokenizer_size or cfg.vocab_size, specials)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}<|assistant|>"}))
    return path, model


# what a checkpoint directory's reader consults that `make_checkpoint` does not write: removed by
# --overwrite, or a stale one would change the new checkpoint (an old generation_config.json's EOS,
# a chat_template.jinja, old weight shards)
NOT_WRITTEN = ("generation_config.json", "chat_template.jinja", "tokenizer.model", "special_tokens_map.json",
               "model-*-of-*.safetensors")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as the engine's commands (models/ sits below engine/)
        self.exit(2, f"error: {message} (see --help)\n")


def _check(args) -> None:
    if not 0 <= args.seed < 2 ** 63:
        raise CheckpointError(f"--seed must be in [0, 2**63), got {args.seed}")
    if not math.isfinite(args.eos_bias):
        raise CheckpointError(f"--eos-bias must be finite, got {args.eos_bias}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise CheckpointError(f"{out} is not empty (a checkpoint there would be replaced): choose a new "
                              f"directory, or --overwrite")


def _run(args) -> int:
    _check(args)
    out = Path(args.out)
    try:
        if out.is_dir():
            for pattern in NOT_WRITTEN:
                for stale in out.glob(pattern):
                    stale.unlink()
        path, model = make_checkpoint(out, args.family, seed=args.seed, eos_bias=args.eos_bias)
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {e.strerror or e}") from None
    n = sum(t.numel() for t in model.parameters())
    print(f"wrote a random {args.family} checkpoint ({n} parameters) to {path}")
    return 0


def main(argv=None) -> int:
    p = _Parser(prog="python -m models.random_checkpoint", description="write a tiny random checkpoint",
                allow_abbrev=False)
    p.add_argument("out", help="directory to write")
    p.add_argument("--family", default="llada", choices=FAMILIES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-bias", type=float, default=8.0, help="make EOS likely so generations stop early")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a directory that is not empty, replacing the checkpoint there (its config, "
                        "weights, tokenizer, generation config and chat template files; other files stay)")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
