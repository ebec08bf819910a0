"""A step that raises leaves a batch either whole or refused, never silently wrong.

- One sequence's DecodingError (NaN/Inf output, no progress) is raised where the batch is whole: it
  names the sequence (`DecodingError.sequence`, LiveBatch's `handle`), and once that sequence
  leaves, the others decode exactly as alone. A rolling batch used to raise it between stage 1 and
  the step's call, so the next step committed the same output twice (other tokens, fewer calls).
- An error inside a step's model call (or an interrupt) leaves the batch half committed: every later
  step is refused with one DecodingError instead of committing that output again.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import DecodeConfig, Decoder, DecodingError, generate
from engine.live import LiveBatch
from models import Tokenizer, load_model

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "default"
BAD = 999         # a token whose embedding is made NaN: a prompt holding it fails at its first call


@pytest.fixture(scope="module")
def model():
    m = load_model(SHIPPED, dtype="float32", device="cpu")
    with torch.no_grad():
        m.tok_embeddings.weight[BAD] = float("nan")
    return m


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer(SHIPPED)
    return [tok.encode("Question: Ann has 3 apples and buys 4 more. How many apples does Ann have now?\nAnswer: "),
            tok.encode("Question: A box holds 6 pens. How many pens do 5 boxes hold?\nAnswer: ")]


@pytest.mark.parametrize("rolling", [True, False])
@pytest.mark.parametrize("method", ["confidence", "psd"])
def test_a_failed_sequence_leaves_and_the_others_decode_as_alone(model, prompts, rolling, method):
    cfg = DecodeConfig(method=method, gen_length=16, block_length=8, cache="none", threshold=0.9)
    alone = generate(model, [prompts[1]], cfg)[0]
    live = LiveBatch(Decoder(model, cfg), rolling=rolling)
    good, bad = live.add(prompts[1]), live.add(prompts[0][:5] + [BAD])
    done, raised = {}, []
    while True:
        try:
            update = live.step()
        except DecodingError as e:
            raised.append((e.sequence, e.handle, str(e)))
            live.cancel(e.handle)
            continue
        if update is None:
            break
        done.update(update.done)
    assert len(raised) == 1 and raised[0][:2] == (1, bad) and "NaN/Inf" in raised[0][2], raised
    assert bad not in done
    got = done[good]
    assert (got.token_ids, got.calls, got.commit_call, got.commit_step) == \
        (alone.token_ids, alone.calls, alone.commit_call, alone.commit_step)


def test_an_error_inside_a_call_refuses_every_later_step(model, prompts, monkeypatch):
    dec = Decoder(model, DecodeConfig(method="confidence", gen_length=16, block_length=8, cache="none"))
    state = dec.start([prompts[1]])
    dec.step(state)                                  # the block's first call
    forward = type(model).forward

    def broken(self, *args, **kwargs):
        raise MemoryError("out of memory in the call")

    monkeypatch.setattr(type(model), "forward", broken)
    with pytest.raises(MemoryError):
        dec.step(state)                              # stage 1 ran, its call did not
    monkeypatch.setattr(type(model), "forward", forward)
    for _ in range(2):
        with pytest.raises(DecodingError, match=r"this batch cannot go on: a step stopped halfway "
                                                r"\(MemoryError: out of memory in the call\); start a new one") as e:
            dec.step(state)
        assert e.value.sequence is None
    assert generate(model, [prompts[1]], dec.dc)[0].token_ids       # the decoder itself is fine
