"""`min_tokens` (engine option, OpenAI's field of that name): no stop token in a sequence's first N
generated positions, for every method of the table, per row of a batch whose rows start at
different columns (continuous batching), and the server's stop sequences after N tokens only.

The model here is a random one whose EOS logit is raised far above every other at every position
(a forward hook), so without the option every answer is EOS at once, and with it the first stop
token is exactly at position N: a bar placed one column off, or on the wrong row, shows."""
from __future__ import annotations

import pytest

from engine import DecodeConfig, Decoder, InputError, generate
from engine.methods import METHODS
from models import ModelConfig, Tokenizer, init_random
from support import run_live

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
G, L, EOS = 32, 8, 62


@pytest.fixture(scope="module", params=["llada", "dream"])
def eos_model(request):
    """A tiny model that predicts EOS everywhere, with confidence near 1."""
    model = init_random(ModelConfig.tiny(request.param, vocab_size=64, mask_token_id=63, eos_token_id=EOS),
                        seed=5, std=0.5).double()

    def loud_eos(module, args, out):
        logits = out[0].clone()
        logits[..., EOS] += 50.0
        return (logits, *out[1:])

    model.register_forward_hook(loud_eos)
    return model


def _stop_at(tokens) -> int:
    return next((i for i, t in enumerate(tokens) if t == EOS), -1)


@pytest.mark.parametrize("method", list(METHODS))
def test_first_stop_token_is_at_min_tokens_for_every_method(eos_model, method):
    opts = dict(gen_length=G, block_length=L, conf_dtype="float64")
    plain = generate(eos_model, PROMPTS, method=method, **opts)
    assert all(r.token_ids == [EOS] for r in plain)                  # the model's own answer: stop at once
    for m in (1, 5, 8, 13):
        res = generate(eos_model, PROMPTS, method=method, min_tokens=m, **opts)
        for r in res:
            assert _stop_at(r.token_ids) == m and len(r.token_ids) == m + 1 and r.stopped, (method, m, r.token_ids)
            assert r.tokens == m + 1 and len(r.commit_prob) == m + 1


def test_min_tokens_of_gen_length_is_ignore_eos_and_zero_is_off(eos_model):
    opts = dict(method="psd", depth=3, gen_length=G, block_length=L, conf_dtype="float64")
    full = generate(eos_model, PROMPTS, ignore_eos=True, **opts)
    assert all(len(r.token_ids) == G and EOS not in r.token_ids for r in full)
    for m in (G, G + 5, 10 ** 30):                  # any bar past the canvas (an absurd one too) bars it all
        got = generate(eos_model, PROMPTS, min_tokens=m, **opts)
        assert [(r.token_ids, r.calls) for r in got] == [(r.token_ids, r.calls) for r in full]
    assert [r.token_ids for r in generate(eos_model, PROMPTS, min_tokens=0, **opts)] == \
        [r.token_ids for r in generate(eos_model, PROMPTS, **opts)]
    with pytest.raises(InputError, match="--min-tokens must be >= 0"):
        generate(eos_model, PROMPTS, min_tokens=-1, **opts)
    with pytest.raises(InputError, match="--min-tokens must be int"):
        generate(eos_model, PROMPTS, min_tokens=2.0, **opts)


@pytest.mark.parametrize("case", [dict(method="confidence", threshold=0.9), dict(method="psd", depth=3, cache="dual"),
                                  dict(method="psd", depth=2, cross_block=True)],
                         ids=["confidence", "psd-dual", "psd-cross-block"])
def test_each_row_of_a_live_batch_is_barred_from_its_own_start(eos_model, case):
    """Rows joining a running batch start generating at other columns than the first rows: each
    is barred over its own first N positions and decodes as it would alone."""
    m = 11
    dec = Decoder(eos_model, DecodeConfig(gen_length=G, block_length=L, min_tokens=m, conf_dtype="float64", **case))
    done = run_live(dec, PROMPTS, [(0, None, 0), (1, None, 2), (2, None, 5)]).done   # joins mid-decode
    assert sorted(done) == [0, 1, 2]
    for i, r in done.items():
        alone = Decoder(eos_model, dec.dc).generate([PROMPTS[i]])[0]
        assert _stop_at(r.token_ids) == m and r.token_ids == alone.token_ids and r.calls == alone.calls


def test_stop_sequences_count_after_min_tokens():
    """A stop sequence completed by one of the first min_tokens tokens does not end the answer."""
    from engine.serve.answer import Answer

    tok = Tokenizer("models/default")
    ids = tok.encode("ab. cd. ef. gh")
    pieces = [tok.decode([t]) for t in ids]
    first = next(n for n in range(1, len(ids) + 1) if "." in "".join(pieces[:n]))     # completes the first "."
    second = next(n for n in range(first + 1, len(ids) + 1) if "".join(pieces[:n]).count(".") == 2)
    for m, text, count in [(0, "ab", first), (first, "ab", first), (first + 1, "ab. cd", second),
                           (len(ids) + 1, "ab. cd. ef. gh", len(ids))]:
        answer = Answer(tok, 100, ["."], [], m)
        shown = "".join(answer.add([t], [0.5]) for t in ids) + answer.finish()
        assert (shown, answer.completion_tokens) == (text, count), m
        assert answer.finish_reason == ("length" if m > len(ids) else "stop")


def test_min_tokens_counts_characters_of_byte_tokens(tmp_path):
    """A byte-fallback tokenizer shows an incomplete character as one U+FFFD per byte (and a character
    it completed as U+FFFDs again while a later one is incomplete): a stop sequence completed by the
    min_tokens-th token or later still ends the answer, one completed before it never does."""
    from engine.serve.answer import Answer
    from support import byte_fallback_tokenizer

    tok = byte_fallback_tokenizer(tmp_path)
    ids = tok.encode("€x y", special=False)[1:]           # <0xE2> <0x82> <0xAC> x ▁ y: "x" is the 4th token
    for m, text, reason in [(3, "", "stop"), (4, "", "stop"), (5, "€x y", "length")]:
        answer = Answer(tok, 100, ["€x"], [], m)
        shown = "".join(answer.add([t]) for t in ids) + answer.finish()
        assert (shown, answer.finish_reason) == (text, reason), m
    ids = tok.encode("éé", special=False)[1:]             # C3 A9 C3 A9: the second "é" ends with the 4th token
    answer = Answer(tok, 100, ["é"], [], 4)
    shown = answer.add(ids[:2]) + answer.add(ids[2:]) + answer.finish()
    assert (shown, answer.finish_reason, answer.completion_tokens) == ("é", "stop", 4)
