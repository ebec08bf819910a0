"""`top_logprobs k` (engine option; the server's `logprobs: k` / `top_logprobs: k`): per committed
token, the k most likely tokens and their probabilities in the output that committed it
(`SequenceResult.commit_top`), for every method, through streaming and continuous batching.

At temperature 0 every policy commits the top-1 prediction of the output it commits from, so the
first alternative of each token must be that token with exactly its `commit_prob`: an alternative
taken from another output (the verifier's instead of the drafting one, another row, another
column) breaks the equality."""
from __future__ import annotations

import pytest

from engine import DecodeConfig, Decoder, InputError, generate
from engine.methods import METHODS
from models import ModelConfig, init_random
from support import run_live

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]]
G, L, K = 32, 8, 3


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request):
    return init_random(ModelConfig.tiny(request.param, vocab_size=64, mask_token_id=63, eos_token_id=62),
                       seed=5, std=0.5).double()


def _check_alternatives(res, k=K, prob_scores=True):
    """`prob_scores`: commit_prob is the committed token's probability (a method that decodes with
    another score, eb's entropy, records that score there: only the token is compared then)."""
    for r in res:
        assert len(r.commit_top) == len(r.token_ids)
        for t, p, top in zip(r.token_ids, r.commit_prob, r.commit_top):
            assert len(top) == k and (top[0] == (t, p) if prob_scores else top[0][0] == t), (t, p, top)
            probs = [q for _, q in top]
            assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-9
            assert len({i for i, _ in top}) == k and 63 not in {i for i, _ in top}     # never the mask token


def _same(a, b) -> bool:
    """Equal alternatives: the same ids, probabilities within float32 rounding (a batch and a
    single run round differently)."""
    return len(a) == len(b) and all(
        [i for i, _ in x] == [i for i, _ in y] and [p for _, p in x] == pytest.approx([p for _, p in y], abs=1e-5)
        for x, y in zip(a, b))


@pytest.mark.parametrize("method", list(METHODS))
def test_first_alternative_is_the_committed_token_for_every_method(model, method):
    opts = dict(gen_length=G, block_length=L, conf_dtype="float64")
    plain = generate(model, PROMPTS, method=method, **opts)
    res = generate(model, PROMPTS, method=method, top_logprobs=K, **opts)
    assert [(r.token_ids, r.calls, r.commit_prob) for r in res] == [(r.token_ids, r.calls, r.commit_prob) for r in plain]
    assert all(r.commit_top is None for r in plain)
    _check_alternatives(res, prob_scores=DecodeConfig(method=method, **opts).validate().confidence_score == "prob")


@pytest.mark.parametrize("case", [dict(method="psd", depth=3, cache="dual", static_rows=True),
                                  dict(method="psd", policy_name="random", depth=2, cache="prefix")],
                         ids=["psd-dual-static-rows", "psd-random-prefix"])
def test_alternatives_stream_and_survive_continuous_batching(model, case):
    if case.get("cache") == "prefix" and model.config.attention != "context_causal":
        case = {**case, "cache": "dual"}
    dc = DecodeConfig(gen_length=G, block_length=L, conf_dtype="float64", top_logprobs=K, **case)
    alone = [Decoder(model, dc).generate([p])[0] for p in PROMPTS]
    _check_alternatives(alone)
    updates = list(Decoder(model, dc).stream(PROMPTS))
    for b, r in enumerate(alone):
        assert _same([t for u in updates for t in u.tops[b]], r.commit_top)
    assert [t for u in updates for t in u.tops[0]] == updates[-1].results[0].commit_top     # the stream's own
    run = run_live(Decoder(model, dc), PROMPTS, [(0, None, 0), (1, None, 2), (2, None, 5)])   # joins mid-decode
    done, tops = run.done, run.tops
    assert sorted(done) == [0, 1, 2]
    for i, r in done.items():
        assert r.token_ids == alone[i].token_ids and _same(r.commit_top, alone[i].commit_top)
        assert tops[i] == r.commit_top


def test_top_logprobs_bounds():
    model = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=1)
    r = generate(model, PROMPTS[:1], method="greedy", gen_length=8, block_length=8, top_logprobs=20)[0]
    assert all(len(top) == 20 for top in r.commit_top)
    for bad, words in [(21, "--top-logprobs must be <= 20"), (-1, "--top-logprobs must be >= 0")]:
        with pytest.raises(InputError, match=words):
            generate(model, PROMPTS[:1], gen_length=8, block_length=8, top_logprobs=bad)
    with pytest.raises(InputError, match="not supported with --cross-block"):
        generate(model, PROMPTS[:1], method="psd", gen_length=16, block_length=8, top_logprobs=2, cross_block=True)
