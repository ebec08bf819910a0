"""The checkpoint's own tokenizer (`tokenizer.json`), with a decode that never crashes.

Real LLaDA has more embedding rows (126464) than tokenizer entries, so a model may emit ids the
tokenizer cannot map; `decode` drops them instead of raising.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        f = path / "tokenizer.json"
        if not f.is_file():
            raise CheckpointError(f"{f} not found")
        try:
            self._tok = _Tok.from_file(str(f))
        except Exception as e:  # the tokenizers library raises a generic Exception subclass
            raise CheckpointError(f"cannot read {f}: {e}") from None
        self.size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template, self._specials = None, {}
        cfg = path / "tokenizer_config.json"
        if cfg.is_file():
            try:
                tc = json.loads(cfg.read_text(encoding="utf-8"))
            except ValueError as e:
                raise CheckpointError(f"cannot read {cfg}: {e}") from None
            self.chat_template = tc.get("chat_template")
            self._specials = {k: tc[k] for k in ("bos_token", "eos_token") if isinstance(tc.get(k), str)}

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` exactly as given, with the tokenizer's own post-processing (e.g. BOS)."""
        return self._tok.encode(text).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each token's (start, end) character span in `text`."""
        enc = self._tok.encode(text)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if int(i) >= 0 and self._tok.id_to_token(int(i)) is not None]
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, prompt: str) -> str:
        """The prompt as one user turn of the checkpoint's chat template, ready for generation."""
        if not self.chat_template:
            raise CheckpointError("--chat needs a chat_template in tokenizer_config.json, and this checkpoint has none")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=[{"role": "user", "content": prompt}], add_generation_prompt=True,
            bos_token=self._specials.get("bos_token", ""), eos_token=self._specials.get("eos_token", ""))
