"""Policies choose their own draft order (docs/algorithms.md §2-§3): stage 2 ranks future steps by
`Policy.draft_key`, confidence by default; `left` drafts left to right, `random` drafts the order
its own draw will take; `--draft-order confidence` keeps the old confidence order for comparison.
The random policy's draw is seeded, per sequence, and uniform over positions."""
from __future__ import annotations

import collections

import pytest
import torch

from engine import DecodeConfig, Decoder, InputError, generate
from engine.policies import LeftToRight, PolicyState, Random, policy_select, rank_of, sequence_noise
from models import ModelConfig, init_random

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]]
G, L = 32, 8


@pytest.fixture(scope="module")
def model():
    return init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62),
                       seed=5, std=0.5)


def _traced(model, **cfg):
    """(ranks [A, W], conf, masked) of every step after stage 1, as stage 2 ranked them."""
    seen = []
    dec = Decoder(model, DecodeConfig(gen_length=G, block_length=L, **cfg),
                  trace=lambda rows, block, step, ranks, pred: seen.append(ranks.clone()))
    dec.generate(PROMPTS)
    assert seen
    return seen


# ---------------------------------------------------------------------- the rules
def test_left_commits_the_leftmost_and_the_confident_run_after_it():
    conf = torch.tensor([[0.1, 0.95, 0.99, 0.2, 0.99],
                         [0.3, 0.1, 0.95, 0.95, 0.95],
                         [0.99, 0.99, 0.99, 0.99, 0.99]])
    masked = torch.tensor([[False, True, True, True, True],
                           [True, True, True, False, True],
                           [False, False, False, False, False]])
    sel = LeftToRight(0.9).select(conf, masked, torch.zeros(3, dtype=torch.long))
    assert sel.tolist() == [[False, True, True, False, False],      # the run stops at a low confidence
                            [True, False, False, False, False],     # the first is taken whatever its confidence
                            [False] * 5]                            # nothing masked, nothing committed


def _two_runs(row: list[int]) -> bool:
    """Positions in rank order are masked ones, then unmasked ones, each part left to right: does
    the order split into (at most) two increasing runs?"""
    pos = sorted(range(len(row)), key=lambda i: row[i])
    breaks = sum(1 for a, b in zip(pos, pos[1:]) if b < a)
    return breaks <= 1


def test_left_drafts_left_to_right_and_confidence_order_is_kept_on_request(model):
    own = _traced(model, method="psd", policy_name="left", depth=3)
    assert all(_two_runs(row) for ranks in own for row in ranks.tolist())
    by_conf = _traced(model, method="psd", policy_name="left", depth=3, draft_order="confidence")
    assert not all(_two_runs(row) for ranks in by_conf for row in ranks.tolist())


def test_left_key_ranks_masked_positions_by_position():
    g = torch.Generator().manual_seed(1)
    conf = torch.rand(4, L, generator=g)
    m = torch.rand(4, L, generator=g) < 0.6
    m[:, 0] = True
    ranks = rank_of(LeftToRight().draft_key(conf, m, torch.zeros(4, dtype=torch.long)), m)
    for r in range(4):
        masked_pos = [i for i in range(L) if m[r, i]]
        assert [ranks[r, i].item() for i in masked_pos] == list(range(len(masked_pos)))


def test_random_drafts_the_order_its_own_draw_takes():
    """Over a block, topk-random's steps commit positions in descending noise: exactly the key it
    drafts with, so every step of a chain is the next steps' own choice."""
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(3, L, generator=g)
    conf = torch.rand(3, L, generator=g)
    pol = Random(L, L)                                  # one token per step
    masked = torch.ones(3, L, dtype=torch.bool)
    order = []
    for s in range(L):
        sel = policy_select(pol, conf, masked, torch.full((3,), s), PolicyState(columns={"noise": noise}))
        order.append(sel.long().argmax(-1))
        masked &= ~sel
    order = torch.stack(order, -1)                      # [3, L] committed position per step
    key_ranks = rank_of(pol.draft_key(conf, torch.ones(3, L, dtype=torch.bool), None, state=PolicyState(columns={"noise": noise})),
                        torch.ones(3, L, dtype=torch.bool))
    assert torch.equal(order, key_ranks.argsort(-1))


# ---------------------------------------------------------------------- what the order buys
@pytest.mark.parametrize("policy", ["left", "random"])
def test_own_order_needs_fewer_calls_than_confidence_order(model, policy):
    """PSD over a policy whose order is not confidence: drafts in its own order are accepted, so
    the same tokens (exact mode) take fewer calls than with confidence-ordered drafts."""
    plain = generate(model, PROMPTS, method=policy, gen_length=G, block_length=L)
    runs = {}
    for order in ("policy", "confidence"):
        runs[order] = generate(model, PROMPTS, method="psd", policy_name=policy, depth=3, acceptance="exact",
                               draft_order=order, gen_length=G, block_length=L)
        assert [r.token_ids for r in runs[order]] == [r.token_ids for r in plain]
    own, by_conf = (sum(r.calls for r in runs[o]) for o in ("policy", "confidence"))
    assert own < by_conf, (own, by_conf)


def test_confidence_policies_draft_as_before(model):
    """A policy that keeps the default key drafts exactly as with --draft-order confidence."""
    for policy in ("confidence", "topk", "greedy", "localleap"):
        a = generate(model, PROMPTS, method="psd", policy_name=policy, depth=3, gen_length=G, block_length=L)
        b = generate(model, PROMPTS, method="psd", policy_name=policy, depth=3, draft_order="confidence",
                     gen_length=G, block_length=L)
        assert [(r.token_ids, r.calls, r.commit_call) for r in a] == [(r.token_ids, r.calls, r.commit_call) for r in b]


# ---------------------------------------------------------------------- the random policy's draw
def test_random_is_seeded_and_the_seed_matters(model):
    a = generate(model, PROMPTS, method="random", gen_length=G, block_length=L, seed=1)
    b = generate(model, PROMPTS, method="random", gen_length=G, block_length=L, seed=1)
    c = generate(model, PROMPTS, method="random", gen_length=G, block_length=L, seed=2)
    assert [r.commit_call for r in a] == [r.commit_call for r in b]
    assert [r.commit_call for r in a] != [r.commit_call for r in c]


def test_random_draw_is_the_sequences_own():
    """A sequence's draw depends on its prompt and the seed, not on its place in the batch."""
    one = sequence_noise([[3, 4]], 7, 16)
    many = sequence_noise([[9], [3, 4], [3, 4, 5]], 7, 16)
    assert torch.equal(one[0], many[1])
    assert not torch.equal(many[1], many[2])
    assert not torch.equal(one, sequence_noise([[3, 4]], 8, 16))


def test_random_first_position_is_uniform():
    """The first committed position of a block, over many seeds, is uniform over the block (a
    chi-square bound far above chance: a rule that favoured confidence or position order fails)."""
    pol, n = Random(L, L), 800
    conf = torch.linspace(0, 1, L).expand(n, L)          # confidence would always pick the last position
    noise = torch.cat([sequence_noise([[1, 2]], s, L) for s in range(n)])
    first = policy_select(pol, conf, torch.ones(n, L, dtype=torch.bool), torch.zeros(n, dtype=torch.long),
                          PolicyState(columns={"noise": noise}))
    counts = collections.Counter(first.long().argmax(-1).tolist())
    expect = n / L
    chi2 = sum((counts.get(i, 0) - expect) ** 2 / expect for i in range(L))
    assert chi2 < 30, counts                              # 7 degrees of freedom: p < 1e-4 at 30


def test_random_select_without_its_draw_is_an_error():
    with pytest.raises(InputError, match="noise"):
        Random(L, L).select(torch.rand(1, L), torch.ones(1, L, dtype=torch.bool), torch.zeros(1, dtype=torch.long))


def test_draft_order_applies_to_psd_only():
    with pytest.raises(InputError, match="draft order"):
        DecodeConfig(method="spiffy", draft_order="confidence").validate()
    with pytest.raises(InputError, match="draft order"):
        DecodeConfig(method="psd", draft_order="sideways").validate()
