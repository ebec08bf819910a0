"""`--cross-block` (engine/ahead.py, docs/algorithms.md §8): draft nodes that cover the rest of
a block continue into the next block, ranked by the same output's next-block confidences, and are
accepted against the policy's step on the next-block output of a parent that completes the block
(the output the next block's first call would compute); a row whose kept draft completes its
block enters the next one with that output and no call. Exact mode stays token-identical to the
plain policy; only calls fall."""
from __future__ import annotations

import pytest
import torch

import engine
from engine.methods import policy_methods
from engine import DecodeConfig, InputError
from models import ModelConfig, init_random

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13]]
G, L = 64, 8


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request):
    # weights loud enough that drafts are often accepted, and no early EOS on most rows
    return init_random(ModelConfig.tiny(request.param, vocab_size=64, mask_token_id=63, eos_token_id=62),
                       seed=5, std=0.5)


def test_exact_cross_block_saves_calls():
    """(Exactness over every policy: engine/testing/contracts.py.) Completing a block by a draft saves calls."""
    psd = dict(method="psd", policy_name="confidence", threshold=0.3, acceptance="exact", depth=3,
               gen_length=G, block_length=L)
    without = engine.generate(model_for_savings(), PROMPTS, **psd)
    cross = engine.generate(model_for_savings(), PROMPTS, cross_block=True, **psd)
    assert all(c.calls <= w.calls for c, w in zip(cross, without))
    assert sum(c.calls for c in cross) < sum(w.calls for w in without)      # some block was completed by a draft


def model_for_savings():
    return init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5, std=0.5)


def _crossings(result) -> int:
    """Verification calls whose kept draft committed tokens in two blocks (impossible without drafts
    that cross the boundary: every other draft lies inside one block)."""
    blocks: dict[int, set[int]] = {}
    for call, src, blk in zip(result.commit_call, result.commit_source, result.commit_block):
        if src == 1:
            blocks.setdefault(call, set()).add(blk)
    return sum(len(b) > 1 for b in blocks.values())


@pytest.mark.slow
def test_exact_drafts_cross_the_block_boundary(model):
    """Over every policy of the table (its defaults): some kept draft commits tokens in two blocks,
    and none does without the option."""
    crossings = 0
    for policy in policy_methods():
        psd = dict(method="psd", policy_name=policy, acceptance="exact", depth=3, gen_length=G, block_length=L)
        plain = engine.generate(model, PROMPTS, method=policy, gen_length=G, block_length=L)
        cross = engine.generate(model, PROMPTS, cross_block=True, **psd)
        assert [r.token_ids for r in cross] == [r.token_ids for r in plain], policy
        crossings += sum(_crossings(r) for r in cross)
        assert sum(_crossings(r) for r in engine.generate(model, PROMPTS, **psd)) == 0
    assert crossings > 0


@pytest.mark.parametrize("acceptance", ["exact", "policy"])
def test_greedy_chain_is_greedy_in_both_modes(model, acceptance):
    """With greedy and a chain graph both modes accept the same nodes, so both are greedy."""
    plain = engine.generate(model, PROMPTS, method="greedy", gen_length=G, block_length=L)
    cross = engine.generate(model, PROMPTS, method="psd", policy_name="greedy", acceptance=acceptance, depth=4,
                            cross_block=True, gen_length=G, block_length=L)
    assert [r.token_ids for r in cross] == [r.token_ids for r in plain]
    assert sum(_crossings(r) for r in cross) > 0


def _stopped_by_crossing_draft(result) -> bool:
    """The row's stop token was committed by a kept draft that also committed tokens of the block before."""
    i = result.tokens - 1
    same = [j for j in range(result.tokens) if result.commit_call[j] == result.commit_call[i]
            and result.commit_source[j] == 1 and result.commit_block[j] == result.commit_block[i] - 1]
    return result.stopped and result.commit_source[i] == 1 and bool(same)


@pytest.mark.parametrize("family,eos", [("llada", 15), ("llada", 20), ("llada", 26), ("dream", 45)])
def test_stop_tokens_drafted_into_the_next_block(family, eos):
    """Rows whose stop token comes from a draft that crossed a block boundary end where the plain
    policy ends them (the stop rule runs on the next block's drafted part), with fewer calls."""
    m = init_random(ModelConfig.tiny(family, vocab_size=64, mask_token_id=63, eos_token_id=eos), seed=5, std=0.5)
    prompts = PROMPTS + [[20, 21], [30], [40, 41, 42]]
    plain = engine.generate(m, prompts, method="greedy", gen_length=G, block_length=4)
    cross = engine.generate(m, prompts, method="spiffy", depth=3, cross_block=True, gen_length=G, block_length=4)
    assert [(r.token_ids, r.stopped) for r in cross] == [(r.token_ids, r.stopped) for r in plain]
    assert all(c.calls <= p.calls for c, p in zip(cross, plain))
    assert any(_stopped_by_crossing_draft(r) for r in cross)


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


# ---------------------------------------------------------------------- the two pieces, directly
M, STOP = 9, 8


def _run(rows):
    """A stand-in for engine.state.BlockRun holding what ahead.draft_across reads: block and next
    block of 4 positions each, per row (block, pred, conf, next-block pred, conf, output covers it)."""
    from types import SimpleNamespace

    from engine.cache import Window

    t = lambda i, dt=torch.long: torch.tensor([r[i] for r in rows], dtype=dt)   # noqa: E731
    x = torch.cat((t(0), torch.full((len(rows), 4), M)), -1)
    return SimpleNamespace(win=Window(0, 4, 0, 4, 4), x=x, pred=t(1), conf=t(2, torch.float32),
                           ahead_pred=t(3), ahead_conf=t(4, torch.float32), ahead_ok=t(5, torch.bool),
                           step=torch.zeros(len(rows), dtype=torch.long), policy_state=None)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_draft_across_maps_ranks_past_the_block_onto_the_next_one(backend, monkeypatch):
    import psd_kernels
    from engine.ahead import draft_across
    from engine.graph import DraftGraph

    monkeypatch.setattr(psd_kernels, "BACKEND", backend)       # triton: the interpreter on CPU (conftest)

    nodes = [[], [0], [0, 1], [0, 2], [0, 1, 2], [0, 1, 2, 3]]
    graph = DraftGraph(nodes)
    k = {tuple(sorted(s)): i for i, s in enumerate(graph.nodes)}
    nxt = ([20, 21, 22, 23], [0.1, 0.7, 0.3, 0.2])            # next-block order: positions 1, 2, 3, 0
    run = _run([([1, M, 2, M], [5, 6, 7, 3], [0, 0.5, 0, 0.9], *nxt, True),      # σ: 3, 1 (m = 2)
                ([1, M, 2, M], [5, 6, 7, 3], [0, 0.5, 0, 0.9], *nxt, False),     # no next-block output yet
                ([1, M, 2, M], [5, STOP, 7, 3], [0, 0.5, 0, 0.9], *nxt, True)])  # its block would end the row
    masked = run.x[:, :4] == M
    drafts, in_node, valid = draft_across(run, torch.arange(3), masked, graph.node_ranks(), torch.tensor([STOP]), M)
    assert drafts[0, k[0, 1, 2, 3]].tolist() == [1, 6, 2, 3, M, 21, 22, M]
    assert drafts[0, k[0, 1, 2]].tolist() == [1, 6, 2, 3, M, 21, M, M]
    assert in_node[0, k[0, 1, 2]].tolist() == [False, True, False, True, False, True, False, False]
    want = {(): [True] * 3, (0,): [True] * 3, (0, 1): [True] * 3,
            (0, 2): [False] * 3,                     # rank 2 is past the block but rank 1 is missing
            (0, 1, 2): [True, False, False], (0, 1, 2, 3): [True, False, False]}
    for s, v in want.items():
        assert valid[:, k[s]].tolist() == v, s


def _hier(policy, root_next, first_next_pred, first_next_conf, exact):
    """Chain {}, {0}, {0,1}, {0,1,2} over a block of 2 (one masked position left) and a next block
    of 2: {0} completes the block, {0,1} drafts next-block position 1, {0,1,2} also position 0."""
    from engine.acceptance import hierarchical
    from engine.graph import DraftGraph

    drafts = torch.tensor([[[4, M, M, M], [4, 5, M, M], [4, 5, M, 6], [4, 5, 7, 6]]])
    in_node = torch.tensor([[[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 0, 1], [0, 1, 1, 1]]], dtype=torch.bool)
    vpred = torch.tensor([[[4, 5, *root_next], [4, 5, *first_next_pred], [4, 5, 7, 6], [4, 5, 7, 6]]])
    vconf = torch.tensor([[[0.9, 0.9, 0.9, 0.9], [1, 1, *first_next_conf], [1, 1, 0.6, 0.9], [1, 1, 1, 1]]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    best, step, acc = hierarchical(policy, DraftGraph.chain(3), M, drafts, in_node, valid, vpred, vconf,
                                   torch.tensor([3]), exact=exact, width=2)
    return best.item(), step.item(), acc[0].tolist()


def test_acceptance_into_the_next_block():
    from engine.policies import Confidence, Greedy

    # greedy on {0}'s next-block output commits position 1 (token 6), then on {0,1}'s position 0 (token 7)
    assert _hier(Greedy(), [7, 6], [7, 6], [0.3, 0.8], exact=True) == (3, 2, [True] * 4)
    # {0}'s output disagrees on position 1: nothing past the block is accepted (step 4 of the block)
    assert _hier(Greedy(), [7, 6], [7, 9], [0.3, 0.8], exact=True) == (1, 4, [True, True, False, False])
    # the root agrees and its policy would commit there, but the root has not completed its block
    assert _hier(Confidence(0.05), [7, 6], [7, 9], [0.3, 0.8], exact=False)[0] == 1
    # {0}'s step commits both next positions: exact mode skips {0,1} (a subset), policy mode keeps it
    assert _hier(Confidence(0.5), [7, 6], [7, 6], [0.6, 0.8], exact=True) == (3, 1, [True, True, False, True])
    assert _hier(Confidence(0.5), [7, 6], [7, 6], [0.6, 0.8], exact=False) == (3, 1, [True] * 4)


@pytest.mark.parametrize("seed", range(40))
def test_random_configurations_stay_lossless(seed):
    """Random family, stop id, block length, policy, DAG graph (a chain plus random nodes),
    prompts, static rows: exact mode with --cross-block ends every row with the plain policy's
    tokens and stop flag, with no more calls."""
    import random

    from engine.graph import DraftGraph

    rng = random.Random(seed)
    m = init_random(ModelConfig.tiny(rng.choice(["llada", "dream"]), vocab_size=64, mask_token_id=63,
                                     eos_token_id=rng.choice([62, 41, 14, 20, 9])),
                    seed=rng.randrange(100), std=rng.choice([0.3, 0.5, 0.8]))
    blk = rng.choice([4, 8])
    gen = blk * rng.choice([2, 4, 6])
    policy, opts = rng.choice([("greedy", {}), ("confidence", dict(threshold=rng.choice([0.3, 0.6, 0.8]))),
                               ("topk", dict(steps=gen // blk * rng.choice([2, 3, 4]))), ("localleap", {})])
    nodes = {tuple(range(d)) for d in range(rng.randrange(1, min(blk, 5) + 1))}
    for _ in range(rng.randrange(1, 7)):
        nodes.add(tuple(sorted(rng.sample(range(blk), rng.randrange(1, min(blk, 5) + 1)))))
    prompts = [[rng.randrange(60) for _ in range(rng.randrange(1, 6))] for _ in range(rng.randrange(1, 5))]
    base = dict(gen_length=gen, block_length=blk, **opts)
    plain = engine.generate(m, prompts, method=policy, **base)
    cross = engine.generate(m, prompts, method="psd", policy_name=policy, acceptance="exact", cross_block=True,
                            graph=DraftGraph([list(n) for n in nodes]), static_rows=rng.random() < 0.3, **base)
    assert [(r.token_ids, r.stopped) for r in cross] == [(r.token_ids, r.stopped) for r in plain]
    assert all(c.calls <= p.calls for c, p in zip(cross, plain))
