"""The text of one answer as its tokens arrive: cut at max_tokens, stop tokens and stop sequences
(those only after min_tokens tokens)."""
from __future__ import annotations

from models import Tokenizer


class Answer:
    """The text of one answer, from its final tokens as they arrive: cut to `max_tokens` tokens,
    at the first stop token (EOS, ...) and at the first stop sequence. `add` returns the text that
    became certain (an incomplete UTF-8 character and a possible start of a stop sequence wait),
    so the streamed pieces concatenate to the text of the whole answer. With `min_tokens`, as in
    vLLM, a stop sequence ends the answer only if the token that completes it is the
    `min_tokens`-th or later (the decoder itself predicts no stop token before that: the engine
    option of that name). `after_text`: the answer continues a text (a completion its prompt), so a
    SentencePiece-style decoder keeps its first space (`Tokenizer.continuation`); a chat message
    stands alone (`Tokenizer.decode`)."""

    def __init__(self, tok: Tokenizer, max_tokens: int, stop: list[str], stop_ids, min_tokens: int = 0,
                 after_text: bool = False):
        self.tok, self.max_tokens, self.stop, self.stop_ids = tok, max_tokens, stop, set(stop_ids)
        self.decode = tok.continuation if after_text else tok.decode
        self.min_tokens = min_tokens
        self.tokens: list[int] = []
        self.probs: list[float] = []     # each token's commit_prob (what logprobs report)
        self.tops: list = []             # each token's commit_top (its alternatives), or None
        self.reported = 0                # tokens whose logprobs were streamed
        self.shown = ""
        self.done = False
        self.finish_reason = None
        self.completion_tokens = 0
        self._heads: tuple = ((), [""])     # the first min_tokens - 1 tokens so far, the text of each prefix

    def add(self, piece: list[int], probs: list[float] | None = None, tops: list | None = None) -> str:
        if self.done:
            return ""
        self.tokens += piece
        self.probs += probs if probs is not None else [float("nan")] * len(piece)
        self.tops += tops if tops is not None else [None] * len(piece)
        return self._update(final=False)

    def unreported(self) -> tuple[list[int], list[float], list]:
        """The tokens (probabilities, alternatives) whose text is shown now and whose logprobs were not
        streamed yet: all of the answer's `completion_tokens` once it is complete, so the streamed
        logprobs concatenate to those of the whole answer."""
        if self.done:
            end = self.completion_tokens
        else:
            end = self.reported
            while end < len(self.tokens) and self.shown.startswith(self.decode(self.tokens[:end + 1])):
                end += 1
        ids, probs, tops = self.tokens[self.reported:end], self.probs[self.reported:end], self.tops[self.reported:end]
        self.reported = max(self.reported, end)
        return ids, probs, tops

    def finish(self) -> str:
        """All tokens are in (the decoder ended): the rest of the text."""
        return "" if self.done else self._update(final=True)

    def _update(self, final: bool) -> str:
        toks = self.tokens[:self.max_tokens]
        eos = next((i for i, t in enumerate(toks) if t in self.stop_ids), None)
        if eos is not None:
            toks = toks[:eos + 1]
        complete = final or eos is not None or len(self.tokens) >= self.max_tokens
        text = self.decode(toks if complete else toks[:self.tok.settled(toks)])
        floor = self._floor(toks, text)
        whole = text.rstrip("\ufffd")          # an incomplete UTF-8 character waits for its bytes
        safe = len(whole) - (0 if complete else self._hold(whole))   # a stop may still begin at `safe`
        cut = self._stop_at(text, floor)
        if 0 <= cut <= safe:          # no stop that begins before it can still complete: the earliest one
            text, complete = text[:cut], True
            self.finish_reason = "stop"
            self.completion_tokens = next((n for n in range(max(1, self.min_tokens), len(toks) + 1)
                                           if self._ends_at(self.decode(toks[:n]), cut, floor)), len(toks))
        elif complete:
            self.finish_reason = "stop" if eos is not None else "length"
            self.completion_tokens = len(toks)
        else:
            text = whole[:safe]
        new = ""
        if text.startswith(self.shown) and len(text) > len(self.shown):
            new, self.shown = text[len(self.shown):], text
        self.done = complete
        return new

    def _floor(self, toks: list[int], text: str) -> int:
        """How much of `text` the first `min_tokens` - 1 tokens complete (a stop sequence counts if it ends
        after it): the longest text of a prefix of them that `text` continues, without incomplete characters
        (a byte-fallback tokenizer shows a character it completed as U+FFFDs again while a later one is not)."""
        if self.min_tokens <= 1:
            return 0
        head = tuple(toks[:self.min_tokens - 1])
        old, texts = self._heads
        if head[:len(old)] != old:
            old, texts = (), [""]
        texts = texts + [self.decode(head[:k]).rstrip("\ufffd") for k in range(len(old) + 1, len(head) + 1)]
        self._heads = (head, texts)
        return max(len(t) for t in texts if text.startswith(t))

    def _hold(self, text: str) -> int:
        """The length of the longest end of `text` that is a proper start of a stop sequence."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)

    def _stop_at(self, text: str, floor: int) -> int:
        """Where the first stop sequence that ends after `floor` characters starts in `text`; -1 if none."""
        return min((i for i in (text.find(s, max(0, floor - len(s) + 1)) for s in self.stop) if i >= 0), default=-1)

    def _ends_at(self, text: str, cut: int, floor: int) -> bool:
        """Whether `text` holds a stop sequence at `cut` that ends after `floor` characters."""
        return any(text.startswith(s, cut) and cut + len(s) > floor for s in self.stop)
