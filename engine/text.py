"""Text in, text out: a checkpoint loaded with its tokenizer (the Python side of `psd-generate`).

    import engine
    lm = engine.load()                        # the shipped model; or engine.load("path/to/checkpoint", dtype="bfloat16")
    lm.generate("Question: What is 2 + 3?\\nAnswer: ")                 # -> str
    lm.generate(["Question: ...", "Question: ..."], method="psd", threshold=0.9, cache="dual")   # -> list[str]
    lm.results(["..."])                       # -> list[SequenceResult], each with .text, .calls, .tpf

    engine.generate_text(["..."], model_dir=None, method="confidence")   # load + generate, once

Paths are used as given (a relative `model_dir` is relative to the current directory, as for any
Python file API); the default is the shipped model, found next to the installed `models` package,
so none of this depends on the current directory. Options are those of `engine.DecodeConfig`
(`method=` and its keywords); a checkpoint's `generation_config.json` sizes (gen_length,
block_length) apply where not given (None: not given), as on the command line. Prompts are
encoded exactly as given; `chat=True` wraps each in the checkpoint's chat template first. Bad
input raises `engine.InputError` or `models.CheckpointError` (one-line messages).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from models import CheckpointError, Tokenizer, Transformer

from .config import DecodeConfig, prompt_ids
from .uniform import for_model
from .errors import InputError
from .results import SequenceResult

__all__ = ["TextModel", "generate_text", "load"]


def _default_model_dir() -> Path:
    from .frontend import DEFAULT_MODEL_DIR

    return DEFAULT_MODEL_DIR


def _check_dir(model_dir) -> Path:
    from .frontend import hub_id_hint

    if not isinstance(model_dir, (str, os.PathLike)):
        raise InputError(f"model_dir must be a path, got {type(model_dir).__name__}")
    hint = hub_id_hint(os.fspath(model_dir), flag="model_dir")
    if hint is not None:
        raise CheckpointError(hint)
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist or is not a directory")
    return path


class TextModel:
    """A model and its tokenizer: `generate(texts)` decodes text prompts to text."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, model_dir: str | os.PathLike | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = None if model_dir is None else Path(model_dir)

    @property
    def config(self):
        """The checkpoint's `models.ModelConfig`."""
        return self.model.config

    def __repr__(self) -> str:
        return f"TextModel({str(self.model_dir) if self.model_dir else self.config.family!r}, device={self.model.device})"

    def decode_config(self, method: str | None = None, **options) -> DecodeConfig:
        """The validated `DecodeConfig` of `method` and `options`, with the checkpoint's
        generation_config.json sizes where `options` do not give them, as the model decodes it
        (`uniform.for_model`: a uniform-noise model's eb; no method: greedy, or that eb)."""
        from .frontend import with_suggestions

        options = with_suggestions(options, self.config.generation_defaults)      # as on the command line
        dc = DecodeConfig(**options) if method is None else DecodeConfig(method=method, **options)
        return for_model(self.config, dc)

    def encode(self, prompts, chat: bool = False) -> list[list[int]]:
        texts = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(texts, Sequence) or isinstance(texts, (bytes, bytearray)):
            raise InputError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
        out = []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InputError(f"prompt {i} is a {type(text).__name__}, not a string")
            if not text.strip():
                raise InputError(f"prompt {i} is empty")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise InputError(f"prompt {i} is not valid UTF-8 (it holds a lone surrogate)") from None
            try:
                out.append(prompt_ids(self.tokenizer, text, chat))
            except InputError as e:
                raise InputError(f"prompt {i}: {e}") from None
        return out

    def results(self, prompts: str | Sequence[str], *, chat: bool = False, method: str | None = None,
                **options) -> list[SequenceResult]:
        """One `SequenceResult` per prompt (`text` set: the generated text without special tokens),
        all prompts decoded as one batch."""
        from .loop import Decoder, check_prompts

        dc = self.decode_config(method, **options)
        ids = self.encode(prompts, chat)
        if not ids:
            return []
        check_prompts(self.config, dc, ids)
        out = Decoder(self.model, dc).generate(ids)
        for r in out:
            r.text = self.tokenizer.decode(r.token_ids)
        return out

    def generate(self, prompts: str | Sequence[str], *, chat: bool = False, method: str | None = None,
                 **options) -> str | list[str]:
        """The generated text of each prompt: a string for a string, a list for a list."""
        texts = [r.text for r in self.results(prompts, chat=chat, method=method, **options)]
        return texts[0] if isinstance(prompts, str) else texts


def load(model_dir: str | os.PathLike | None = None, *, dtype: str = "float32", device: str = "auto") -> TextModel:
    """A `TextModel` of the checkpoint directory `model_dir` (default: the shipped model), its
    weights in `dtype` on `device` (cpu, cuda, cuda:N or auto)."""
    from models import load_model

    from .frontend import resolve_device

    path = _check_dir(_default_model_dir() if model_dir is None else model_dir)
    tok = Tokenizer(path)
    model = load_model(path, dtype=dtype, device=resolve_device(device))
    return TextModel(model, tok, path)


def generate_text(prompts: str | Sequence[str], model_dir: str | os.PathLike | None = None, *,
                  dtype: str = "float32", device: str = "auto", chat: bool = False, method: str | None = None,
                  **options) -> str | list[str]:
    """`load(model_dir, dtype=, device=).generate(prompts, chat=, method=, **options)`: for one
    call; keep the `TextModel` of `load` to decode more than once without reloading."""
    return load(model_dir, dtype=dtype, device=device).generate(prompts, chat=chat, method=method, **options)
