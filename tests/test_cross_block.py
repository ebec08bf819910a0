"""`--cross-block` (engine/ahead.py): a verification call also predicts the next block, so a row
whose kept draft completes its block enters the next block without that block's first call.
The next block's output it reuses is the one that call would compute (same canvas, bidirectional
attention), so tokens are unchanged: exact mode stays token-identical to the plain policy, policy
mode to PSD without the option; only calls fall."""
from __future__ import annotations

import pytest

import engine
from engine import DecodeConfig, InputError
from models import ModelConfig, init_random

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13]]
G, L = 64, 8


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request):
    # weights loud enough that drafts are often accepted, and no early EOS on most rows
    return init_random(ModelConfig.tiny(request.param, vocab_size=64, mask_token_id=63, eos_token_id=62),
                       seed=5, std=0.5)


CASES = [("confidence", dict(threshold=0.3)), ("greedy", {}), ("topk", dict(steps=32))]


@pytest.mark.parametrize("policy,opts", CASES)
def test_exact_cross_block_is_the_plain_policy_with_fewer_calls(model, policy, opts):
    plain = engine.generate(model, PROMPTS, method=policy, gen_length=G, block_length=L, **opts)
    psd = dict(method="psd", policy_name=policy, acceptance="exact", depth=3, gen_length=G, block_length=L, **opts)
    without = engine.generate(model, PROMPTS, **psd)
    cross = engine.generate(model, PROMPTS, cross_block=True, **psd)
    assert [r.token_ids for r in cross] == [r.token_ids for r in plain]
    assert all(c.calls <= w.calls for c, w in zip(cross, without))
    assert sum(c.calls for c in cross) < sum(w.calls for w in without)      # some block was completed by a draft


@pytest.mark.parametrize("policy,opts", CASES)
def test_policy_mode_keeps_psds_tokens(model, policy, opts):
    psd = dict(method="psd", policy_name=policy, depth=3, gen_length=G, block_length=L, **opts)
    without = engine.generate(model, PROMPTS, **psd)
    cross = engine.generate(model, PROMPTS, cross_block=True, **psd)
    assert [r.token_ids for r in cross] == [r.token_ids for r in without]
    assert [r.commit_source for r in cross] == [r.commit_source for r in without]


def test_spiffy_with_budget_and_cross_block_is_greedy(model):
    from engine.cost import CostModel

    plain = engine.generate(model, PROMPTS, method="greedy", gen_length=G, block_length=L)
    dec = engine.Decoder(model, DecodeConfig(method="spiffy", depth=3, cross_block=True, draft_budget="auto",
                                             gen_length=G, block_length=L), cost_model=CostModel([1, 64], [1, 2]))
    assert [r.token_ids for r in dec.generate(PROMPTS)] == [r.token_ids for r in plain]


def test_streaming_pieces_still_concatenate_to_the_result(model):
    dec = engine.Decoder(model, DecodeConfig(method="psd", policy_name="greedy", depth=3, cross_block=True,
                                             gen_length=G, block_length=L))
    pieces = [[] for _ in PROMPTS]
    for update in dec.stream(PROMPTS):
        for p, piece in zip(pieces, update.pieces):
            p += piece
    assert pieces == [r.token_ids for r in update.results]


def test_cross_block_needs_the_none_cache_and_a_bidirectional_model():
    with pytest.raises(InputError, match="needs --cache none"):
        DecodeConfig(method="psd", cross_block=True, cache="dual").validate()
    with pytest.raises(InputError, match="applies to spiffy and psd, not to confidence"):
        DecodeConfig(method="confidence", cross_block=True).validate()
    pangu = init_random(ModelConfig.tiny("pangu"), seed=1)
    with pytest.raises(InputError, match="bidirectional model"):
        engine.generate(pangu, [[1, 2]], method="psd", cross_block=True, gen_length=16, block_length=8)


def test_cli_switch(capsys):
    from engine.cli import main

    assert main(["--method", "psd", "--cross-block", "--gen-length", "64", "--json", "Question: 14+27? Answer: "]) == 0
    assert main(["--method", "psd", "--cross-block", "--cache", "dual", "t5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --cross-block needs --cache none")
