"""The entropy-bound policy `eb` (EB-Sampler, docs/algorithms.md §2): its rule on hand-made
entropies, its limits (γ = 0, growing γ), its option's checks, and PSD over it in exact mode equal
to it token for token on LLaDA- and Dream-layout models. The contracts every policy keeps run for
it from the method table (tests/test_contracts.py)."""
from __future__ import annotations

import itertools

import pytest
import torch

from bench.eval import parse_method
from engine import DecodeConfig, DraftGraph, InputError, generate
from engine.cli import main as cli_main
from engine.policies import EntropyBound
from models import ModelConfig, init_random

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]]
G, L = 32, 8
STEP = torch.zeros(1, dtype=torch.long)


def commit(entropies, gamma, masked=None):
    """The positions eb commits for one row of entropies (conf = -H, the entropy score)."""
    h = torch.tensor([entropies], dtype=torch.float32)
    m = torch.ones_like(h, dtype=torch.bool) if masked is None else torch.tensor([masked])
    sel = EntropyBound(gamma).select(-h, m, STEP)
    return sorted(torch.nonzero(sel[0]).flatten().tolist())


def reference(entropies, masked, gamma):
    """The rule written out: the longest prefix U of the masked positions by entropy ascending
    (lower index on ties) with sum(U) - max(U) <= γ, in float64."""
    order = sorted((h, i) for i, (h, m) in enumerate(zip(entropies, masked)) if m)
    best = 0
    for k in range(1, len(order) + 1):
        hs = [h for h, _ in order[:k]]
        if sum(hs) - max(hs) <= gamma:
            best = k
    return sorted(i for _, i in order[:best])


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request):
    return init_random(ModelConfig.tiny(request.param, vocab_size=64, mask_token_id=63, eos_token_id=62),
                       seed=5, std=0.5)


def test_the_rule_on_hand_made_entropies():
    h = [0.5, 0.125, 0.25, 1.0, 0.0625]       # dyadic: every partial sum is exact in float32
    # ascending 0.0625 (4), 0.125 (1), 0.25 (2), 0.5 (0), 1.0 (3); sums before the last: 0, .0625, .1875, .4375
    assert commit(h, 0.0) == [4]
    assert commit(h, 0.0625) == [1, 4]
    assert commit(h, 0.1875) == [1, 2, 4]                  # the bound is inclusive
    assert commit(h, 0.18) == [1, 4]
    assert commit(h, 0.4375) == [0, 1, 2, 4]
    assert commit(h, 0.9375) == [0, 1, 2, 3, 4]
    assert commit(h, 100.0) == [0, 1, 2, 3, 4]
    # committed positions are never candidates, however low their entropy
    assert commit(h, 0.375, masked=[True, True, True, True, False]) == [0, 1, 2]
    assert commit(h, 0.1875, masked=[True, True, True, True, False]) == [1, 2]


def test_ties_go_to_the_lower_position_and_one_is_always_committed():
    assert commit([0.25] * 4, 0.25) == [0, 1]              # sums before the last: 0, .25, .5
    assert commit([0.25] * 4, 0.0) == [0]
    assert commit([3.0, 5.0, 2.0, 2.0], 0.0) == [2]        # nothing fits a bound of 0 but the first: one token
    assert commit([7.0], 0.0) == [0]
    # a position of zero entropy adds nothing: γ = 0 takes every such one and the next
    assert commit([0.0, 1.5, 0.0, 0.0, 2.0], 0.0) == [0, 1, 2, 3]
    # a row with nothing masked commits nothing
    assert commit([0.1, 0.2], 10.0, masked=[False, False]) == []


def test_the_rule_against_its_definition_on_random_entropies():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 12, (1,), generator=g))
        h = (torch.randint(0, 64, (n,), generator=g) / 32).tolist()       # ties are frequent
        masked = (torch.rand(n, generator=g) < 0.7).tolist()
        gamma = float(torch.randint(0, 40, (1,), generator=g)) / 16
        assert commit(h, gamma, masked) == reference(h, masked, gamma), (h, masked, gamma)


def test_a_larger_bound_never_commits_fewer():
    g = torch.Generator().manual_seed(1)
    conf = -torch.rand(64, L, generator=g) * 3                  # -H, H in [0, 3) nats
    masked = torch.rand(64, L, generator=g) < 0.8
    bounds = [0.0, 0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 3.0 * L]
    sels = [EntropyBound(b).select(conf, masked, torch.zeros(64, dtype=torch.long)) for b in bounds]
    for small, large in itertools.pairwise(sels):
        assert not (small & ~large).any()                       # nested, so never fewer
    assert (sels[0].sum(-1) == masked.any(-1).long()).all()     # γ = 0: one per row (no zero entropy here)
    assert (sels[-1] == masked).all()


def test_bound_zero_is_one_token_at_a_time_in_entropy_order(model):
    """γ = 0 commits the single lowest-entropy position per step: greedy over the entropy score."""
    kw = dict(gen_length=G, block_length=L)
    eb = generate(model, PROMPTS, method="eb", entropy_bound=0.0, **kw)
    greedy = generate(model, PROMPTS, method="greedy", score="entropy", **kw)
    assert [(r.token_ids, r.calls, r.commit_step) for r in eb] == \
        [(r.token_ids, r.calls, r.commit_step) for r in greedy]
    assert all(len(set(r.commit_call)) == len(r.commit_call) for r in eb)      # one token per call


def test_eb_decodes_with_entropies_and_a_large_bound_fills_a_block_per_call(model):
    kw = dict(gen_length=G, block_length=L, ignore_eos=True)
    res = generate(model, PROMPTS, method="eb", entropy_bound=1e6, **kw)
    assert all(r.calls == G // L for r in res)
    assert all(p <= 0 for r in res for p in r.commit_prob)     # sum p log p: the entropy score, not a probability
    mid = generate(model, PROMPTS, method="eb", **kw)           # the default bound, 0.1
    assert all(G // L < r.calls <= G for r in mid)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 3.0])
def test_exact_psd_over_eb_is_eb(model, gamma):
    accepted = 0
    for cache in ("none", "dual"):
        kw = dict(gen_length=G, block_length=L, cache=cache, entropy_bound=gamma)
        plain = generate(model, PROMPTS, method="eb", **kw)
        for graph in (DraftGraph.chain(2), DraftGraph.chain(4)):
            psd = generate(model, PROMPTS, method="psd", policy_name="eb", graph=graph, acceptance="exact", **kw)
            assert [r.token_ids for r in psd] == [r.token_ids for r in plain], (cache, graph)
            assert all(p.calls <= e.calls for p, e in zip(psd, plain))
            accepted += sum(c for r in psd for d, c in r.accepted_depth.items() if d > 0)
    assert accepted > 0


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), -float("inf"), 10 ** 400])
def test_the_bound_is_finite_and_not_negative(bad):
    with pytest.raises(InputError, match="entropy bound must be finite and >= 0"):
        DecodeConfig(method="eb", entropy_bound=bad).validate()


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "x"])
def test_cli_refuses_a_bad_bound_in_one_line(value, capsys):
    try:       # a value that is no float is argparse's error (it exits), a float out of range the config's
        code = cli_main(["Question: 1+1?\nAnswer: ", "--method", "eb", "--entropy-bound", value])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and ("entropy bound" in err[0] or "--entropy-bound" in err[0])


def test_the_option_and_the_score():
    assert DecodeConfig(method="eb").validate().policy() == EntropyBound(0.1)
    assert parse_method("eb:gamma=0.25") == ("eb", {"entropy_bound": 0.25})
    assert DecodeConfig(method="psd", policy_name="eb", entropy_bound=0.25).validate().describe() == \
        "psd(eb(gamma=0.25),d=3,policy)"
    for cfg in (DecodeConfig(method="eb"), DecodeConfig(method="eb", score="entropy"),
                DecodeConfig(method="psd", policy_name="eb")):
        assert cfg.validate().confidence_score == "entropy"
    assert DecodeConfig(method="confidence", score="margin").validate().confidence_score == "margin"
    with pytest.raises(InputError, match="eb reads the entropy score"):
        DecodeConfig(method="psd", policy_name="eb", score="prob").validate()
    with pytest.raises(InputError, match="entropy bound applies to eb and psd, not to confidence"):
        DecodeConfig(method="confidence", entropy_bound=0.1).validate()


def test_a_server_request_for_eb_with_logprobs_is_refused():
    """eb's per-token figures are -H, not probabilities: a request asking logprobs of them is one
    error line (the server's check reads the score the policy decodes with, not only `score`)."""
    from engine.serve.protocol import ApiError
    from engine.serve.request import Limits, parse_request
    from models import Tokenizer

    lim = Limits("default", ModelConfig.from_dir("models/default"), Tokenizer("models/default"),
                 defaults={"method": "greedy", "gen_length": 64, "block_length": 32}, max_choices=8, max_queue=16)
    body = {"model": "default", "prompt": "Question: 1 + 1 = ?\nAnswer: ", "max_tokens": 8, "method": "eb"}
    assert parse_request(body, False, lim)[0].config.confidence_score == "entropy"
    with pytest.raises(ApiError, match="decodes with score entropy"):
        parse_request({**body, "logprobs": 2}, False, lim)
