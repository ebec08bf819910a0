"""The text of one answer as its tokens arrive: cut at max_tokens, stop tokens and stop sequences."""
from __future__ import annotations

from models import Tokenizer


class Answer:
    """The text of one answer, from its final tokens as they arrive: cut to `max_tokens` tokens,
    at the first stop token (EOS, ...) and at the first stop sequence. `add` returns the text that
    became certain (an incomplete UTF-8 character and a possible start of a stop sequence wait),
    so the streamed pieces concatenate to the text of the whole answer."""

    def __init__(self, tok: Tokenizer, max_tokens: int, stop: list[str], stop_ids):
        self.tok, self.max_tokens, self.stop, self.stop_ids = tok, max_tokens, stop, set(stop_ids)
        self.tokens: list[int] = []
        self.shown = ""
        self.done = False
        self.finish_reason = None
        self.completion_tokens = 0

    def add(self, piece: list[int]) -> str:
        if self.done:
            return ""
        self.tokens += piece
        return self._update(final=False)

    def finish(self) -> str:
        """All tokens are in (the decoder ended): the rest of the text."""
        return "" if self.done else self._update(final=True)

    def _update(self, final: bool) -> str:
        toks = self.tokens[:self.max_tokens]
        eos = next((i for i, t in enumerate(toks) if t in self.stop_ids), None)
        if eos is not None:
            toks = toks[:eos + 1]
        text = self.tok.decode(toks)
        complete = final or eos is not None or len(self.tokens) >= self.max_tokens
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, complete = text[:cut], True
            self.finish_reason = "stop"
            self.completion_tokens = next((n for n in range(1, len(toks) + 1)
                                           if any(s in self.tok.decode(toks[:n]) for s in self.stop)), len(toks))
        elif complete:
            self.finish_reason = "stop" if eos is not None else "length"
            self.completion_tokens = len(toks)
        else:
            text = text.rstrip("\ufffd")          # an incomplete UTF-8 character waits for its bytes
            hold = max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                        if text.endswith(s[:n])), default=0)
            text = text[:len(text) - hold]
        new = ""
        if text.startswith(self.shown) and len(text) > len(self.shown):
            new, self.shown = text[len(self.shown):], text
        self.done = complete
        return new
