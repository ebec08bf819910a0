"""PSD (docs/algorithms.md §3-§4): lossless modes, acceptance properties, draft graphs, calibration,
and the LoPA / ETE / FDM baselines' invariants."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import DraftGraph, InputError, generate
from engine import acceptance
from engine.calibrate import main as calibrate_main
from engine.calibrate import record_reveal_sets, select_nodes
from engine.config import DecodeConfig
from engine.methods import policy_methods
from engine.policies import Greedy, policy_select
from models import load_model
from models.random_checkpoint import make_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]]
G, L = 32, 8


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=1, eos_bias=8.0)
    return load_model(path)


GRAPHS = [DraftGraph.chain(1), DraftGraph.chain(4), DraftGraph([[], [0], [1], [0, 1], [0, 2], [0, 1, 2], [2]])]


def _accepted(r):
    return sum(c for d, c in r.accepted_depth.items() if d > 0)


def _sig(res):
    return [(r.token_ids, r.calls) for r in res]


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_spiffy_equals_greedy_with_fewer_calls(model, cache):
    plain = generate(model, PROMPTS, method="greedy", gen_length=G, block_length=L, cache=cache)
    for graph in GRAPHS:
        spec = generate(model, PROMPTS, method="spiffy", graph=graph, gen_length=G, block_length=L, cache=cache)
        for p, s in zip(plain, spec):
            assert s.token_ids == p.token_ids
            assert s.calls <= p.calls
        # an accepted draft saves a call unless it is the one that completes its block
        assert sum(_accepted(s) for s in spec) > 0
        assert sum(s.calls for s in spec) < sum(p.calls for p in plain)


def test_psd_policy_mode_runs_and_reports(model):
    res = generate(model, PROMPTS, method="psd", policy_name="confidence", threshold=0.3, depth=3,
                   gen_length=G, block_length=L)
    for r in res:
        assert r.rows_per_call > 1
        assert sum(r.accepted_depth.values()) == r.calls - len(set(r.commit_block)) or r.stopped
        assert set(r.commit_source) <= {0, 1}
        assert model.config.mask_token_id not in r.token_ids


# ---------------------------------------------------------------------- acceptance properties
# every policy of the method table, as its defaults build it (lossless PSD over each: engine/testing/contracts.py)
POLICIES = [DecodeConfig(method=m, gen_length=6, block_length=6).validate().policy() for m in policy_methods()]
MASK = 99


@st.composite
def verifier_case(draw):
    L = draw(st.integers(2, 6))
    n_nodes = draw(st.integers(1, 6))
    sets = {frozenset()}
    while len(sets) < n_nodes + 1:
        sets.add(frozenset(draw(st.lists(st.integers(0, L - 1), min_size=1, max_size=min(3, L), unique=True))))
    graph = DraftGraph([sorted(s) for s in sets])
    R = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)
    masked = torch.rand(R, L, generator=g) < 0.8
    masked[:, 0] = True
    blk = torch.where(masked, MASK, torch.randint(0, 4, (R, L), generator=g))
    pred = torch.randint(0, 3, (R, L), generator=g)        # few tokens: agreement is frequent
    conf = torch.rand(R, L, generator=g)
    policy = POLICIES[draw(st.integers(0, len(POLICIES) - 1))]
    ranks = torch.argsort(torch.where(masked, -conf, 2.0), dim=-1, stable=True).argsort(-1)
    nr = graph.node_ranks()
    in_node = (ranks[:, None, :, None] == nr[None, :, None, :]).any(-1) & masked[:, None]
    valid = ((nr < masked.sum(-1)[:, None, None]) | (nr < 0)).all(-1)
    drafts = torch.where(in_node, pred[:, None], blk[:, None])
    K = len(graph)
    vpred = torch.randint(0, 3, (R, K, L), generator=g)
    vconf = torch.rand(R, K, L, generator=g)
    exact = draw(st.booleans())
    # the policy's own per-sequence state (random: its draw; None for a stateless policy)
    state = policy.init_state([[seed, r] for r in range(R)], seed, torch.zeros(R, dtype=torch.long),
                              torch.full((R,), L), L)
    return graph, policy, drafts, in_node, valid, vpred, vconf, exact, state


@settings(max_examples=150, deadline=None)
@given(verifier_case())
def test_hierarchical_acceptance_properties(case):
    graph, policy, drafts, in_node, valid, vpred, vconf, exact, state = case
    R, K, L = drafts.shape
    step = torch.zeros(R, dtype=torch.long)
    best, _, acc = acceptance.hierarchical(policy, graph, MASK, drafts, in_node, valid, vpred, vconf, step, exact=exact,
                                           state=state)
    sizes = [len(s) for s in graph.nodes]
    for r in range(R):
        assert acc[r, 0]
        for k in range(1, K):
            if not acc[r, k]:
                continue
            assert valid[r, k]
            # parent-closed: some accepted parent justifies every newly drafted token
            ok_parent = False
            for p in graph.parents[k]:
                if not acc[r, p]:
                    continue
                new = in_node[r, k] & ~in_node[r, p]
                commit = policy_select(policy, vconf[r, p][None], (drafts[r, p] == MASK)[None],
                                       torch.zeros(1, dtype=torch.long),
                                       None if state is None else state.take(slice(r, r + 1)))[0]
                tokens_ok = bool((drafts[r, k][new] == vpred[r, p][new]).all())
                crit = bool(torch.equal(new, commit)) if exact else bool(commit[new].all())
                ok_parent |= tokens_ok and crit
            assert ok_parent
        # the kept node is the deepest accepted one (first in topological order on ties)
        depth = max(sizes[k] for k in range(K) if acc[r, k])
        assert acc[r, best[r]] and sizes[best[r]] == depth
        assert best[r] == min(k for k in range(K) if acc[r, k] and sizes[k] == depth)


def test_acceptance_rejects_disagreeing_token():
    graph = DraftGraph.chain(1)
    drafts = torch.tensor([[[MASK, MASK], [7, MASK]]])
    in_node = torch.tensor([[[False, False], [True, False]]])
    valid = torch.tensor([[True, True]])
    vconf = torch.tensor([[[0.99, 0.1], [0.2, 0.2]]])
    step = torch.zeros(1, dtype=torch.long)
    for tok, want in ((7, 1), (8, 0)):
        vpred = torch.tensor([[[tok, 3], [1, 1]]])
        best, _, _ = acceptance.hierarchical(Greedy(), graph, MASK, drafts, in_node, valid, vpred, vconf, step)
        assert best.item() == want


# ---------------------------------------------------------------------- draft graphs
def test_graph_structure_and_json(tmp_path):
    g = DraftGraph([[0, 1], [], [1], [0]])
    assert [sorted(s) for s in g.nodes] == [[], [1], [0], [0, 1]]          # by size, stable
    assert g.parents[3] == [0, 1, 2] and g.depth == 2
    g.save(tmp_path / "g.json")
    assert [sorted(s) for s in DraftGraph.load(tmp_path / "g.json").nodes] == [sorted(s) for s in g.nodes]
    (tmp_path / "plain.json").write_text("[[], [0], [0, 1]]")
    assert len(DraftGraph.load(tmp_path / "plain.json")) == 3
    assert [sorted(s) for s in DraftGraph.chain(3).nodes] == [[], [0], [0, 1], [0, 1, 2]]


@pytest.mark.parametrize("content,msg", [
    ('{"a": 1}', "not a list of rank lists"),
    ("[[0], [1]]", "has no root"),
    ("[[], [0], [0]]", "repeats the node [0]"),
    ("[[], [-1]]", "not a non-negative int"),
    ('[[], ["a"]]', "not a non-negative int"),
    ("[[], 3]", "is not a list of ranks"),
    ("[[], [1, 1]]", "repeats a rank"),
    ("not json", "cannot read draft graph file"),
])
def test_malformed_graph_files(tmp_path, content, msg):
    f = tmp_path / "g.json"
    f.write_text(content)
    with pytest.raises(InputError, match=re.escape(msg)):
        DraftGraph.load(f)


def test_missing_graph_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        DraftGraph.load(tmp_path / "none.json")


# ---------------------------------------------------------------------- calibration
def test_select_nodes_is_parent_closed_and_degree1_scored():
    freq = {frozenset({0}): 10, frozenset({0, 1}): 6, frozenset({0, 2}): 5, frozenset({1}): 1,
            frozenset({0, 1, 2}): 4, frozenset({0, 1, 3}): 1, frozenset({2, 5}): 9}
    from collections import Counter

    g = select_nodes(Counter(freq), 5)
    nodes = [frozenset(s) for s in g.nodes]
    assert len(nodes) == 5 and frozenset() in nodes
    for s in nodes:
        assert len(s) <= 1 or any(s - {r} in nodes for r in s)
    assert frozenset({0}) in nodes and frozenset({0, 1}) in nodes


def test_calibration_end_to_end(tmp_path, model, capsys):
    cfg = DecodeConfig(method="greedy", gen_length=G, block_length=L)
    freq = record_reveal_sets(model, PROMPTS, cfg, depth=3)
    assert freq and all(len(s) <= 3 for s in freq)
    graph = select_nodes(freq, 5)
    res = generate(model, PROMPTS, method="spiffy", graph=graph, gen_length=G, block_length=L)
    plain = generate(model, PROMPTS, method="greedy", gen_length=G, block_length=L)
    assert [r.token_ids for r in res] == [r.token_ids for r in plain]


def test_calibrate_cli(tmp_path, capsys):
    path, _ = make_checkpoint(tmp_path / "m", "llada", seed=1, eos_bias=8.0)
    prompts = tmp_path / "p.txt"
    prompts.write_text("t5 t6 t7\nt8 t9\nt10 t11 t12 t13\n")
    out = tmp_path / "g.json"
    code = calibrate_main(["--model", str(path), "--depth", "3", "--nodes", "4", "--prompts", str(prompts),
                           "--out", str(out), "--gen-length", "16", "--block-length", "8"])
    assert code == 0
    body = json.loads(out.read_text())
    assert body["nodes"][0] == [] and len(body["nodes"]) <= 4
    assert calibrate_main(["--model", str(path), "--prompts", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "cannot read prompts file" in capsys.readouterr().err

    # the checkpoint's generation_config.json sizes where no flag gives them, as engine.generate takes them
    (path / "generation_config.json").write_text(json.dumps({"gen_length": 16, "block_length": 8}))
    assert calibrate_main(["--model", str(path), "--depth", "3", "--nodes", "4", "--prompts", str(prompts),
                           "--out", str(tmp_path / "g2.json")]) == 0
    assert json.loads((tmp_path / "g2.json").read_text()) == body


# ---------------------------------------------------------------------- baselines
def test_lopa_k1_and_ete_k1_are_confidence(model):
    kw = dict(gen_length=G, block_length=L, threshold=0.3)
    conf = _sig(generate(model, PROMPTS, method="confidence", **kw))
    assert _sig(generate(model, PROMPTS, method="lopa", k=1, **kw)) == conf
    assert _sig(generate(model, PROMPTS, method="ete", k=1, **kw)) == conf


def test_lopa_keeps_best_mean_confidence_branch():
    drafts = torch.tensor([[[MASK, MASK, 5], [4, MASK, 5], [MASK, 4, 5]]])
    valid = torch.tensor([[True, True, True]])
    vconf = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.9, 0.0], [0.7, 0.0, 0.0]]])
    best, _, _ = acceptance.best_score(MASK, drafts, valid, vconf, torch.zeros(1, dtype=torch.long))
    assert best.item() == 1
    valid[0, 1] = False
    best, _, _ = acceptance.best_score(MASK, drafts, valid, vconf, torch.zeros(1, dtype=torch.long))
    assert best.item() == 2


def test_lopa_scores_k_branches_in_one_call(model):
    res = generate(model, PROMPTS, method="lopa", k=4, threshold=0.3, gen_length=G, block_length=L)
    for r in res:
        assert 1 < r.rows_per_call <= 4


def test_ete_commits_across_blocks(model):
    res = generate(model, PROMPTS, method="ete", k=3, threshold=0.3, gen_length=G, block_length=L)
    conf = generate(model, PROMPTS, method="confidence", threshold=0.3, gen_length=G, block_length=L)
    crossed = 0
    for r in res:
        assert model.config.mask_token_id not in r.token_ids and r.rows_per_call == 1
        # a token committed by a call made while an earlier block was still open
        first_call_of_block = {}
        for i, (c, b) in enumerate(zip(r.commit_call, r.commit_block)):
            first_call_of_block[b] = min(first_call_of_block.get(b, c), c)
        crossed += any(first_call_of_block[b] < max(r.commit_call[j] for j in range(r.tokens) if r.commit_block[j] == b - 1)
                       for b in first_call_of_block if b > 0 and b - 1 in first_call_of_block)
    assert crossed >= 1
    assert sum(r.calls for r in res) <= sum(r.calls for r in conf) + len(PROMPTS)


def test_fdm_keeps_drafts_above_threshold_without_agreement(model):
    res = generate(model, PROMPTS, method="fdm", k=3, threshold=0.2, gen_length=G, block_length=L)
    greedy = generate(model, PROMPTS, method="greedy", gen_length=G, block_length=L)
    assert sum(r.calls for r in res) < sum(r.calls for r in greedy)
    assert all(1 < r.rows_per_call <= 4 for r in res)
    # with an unreachable threshold nothing is kept beyond stage 1: it is greedy
    strict = generate(model, PROMPTS, method="fdm", k=3, threshold=1.0, gen_length=G, block_length=L)
    assert [r.token_ids for r in strict] == [r.token_ids for r in greedy]


def test_method_options_validated():
    from models import ModelConfig, init_random

    m = init_random(ModelConfig.tiny("llada"))
    with pytest.raises(InputError, match="a draft graph applies to spiffy and psd"):
        generate(m, PROMPTS, method="confidence", graph=DraftGraph.chain(2), gen_length=8, block_length=8)
    with pytest.raises(InputError, match="unknown policy"):
        generate(m, PROMPTS, method="psd", policy_name="lopa", gen_length=8, block_length=8)
    with pytest.raises(InputError, match="k must be >= 1"):
        generate(m, PROMPTS, method="lopa", k=0, gen_length=8, block_length=8)


def test_aggregate_statistics(model):
    from engine import aggregate

    res = generate(model, PROMPTS, method="psd", policy_name="confidence", threshold=0.3, depth=3,
                   gen_length=G, block_length=L)
    agg = aggregate(res)
    assert agg["tokens"] == sum(r.tokens for r in res) and agg["calls"] == sum(r.calls for r in res)
    assert agg["tpf"] == pytest.approx(agg["tokens"] / agg["calls"])
    assert agg["draft_token_share"] == pytest.approx(sum(sum(r.commit_source) for r in res) / agg["tokens"])
    assert sum(agg["accepted_depth"].values()) == sum(sum(r.accepted_depth.values()) for r in res)


DEFAULT = Path(__file__).resolve().parent.parent / "models" / "default"


@pytest.mark.skipif(not (DEFAULT / "config.json").is_file(), reason="no shipped model")
@pytest.mark.slow
def test_lossless_on_the_shipped_model():
    from bench.tasks import get_task
    from models import Tokenizer

    model, tok, task = load_model(DEFAULT), Tokenizer(DEFAULT), get_task("math")
    prompts = [tok.encode(task.format_prompt(p)) for p in task.load(limit=4)]
    kw = dict(gen_length=64, block_length=32)
    pairs = [(dict(method="greedy"), dict(method="spiffy", depth=3))]
    for pol, opts in (("confidence", {"threshold": 0.9}), ("topk", {"steps": 16}), ("localleap", {})):
        pairs.append((dict(method=pol, **opts), dict(method="psd", policy_name=pol, depth=3, acceptance="exact", **opts)))
    for plain, spec in pairs:
        a, b = generate(model, prompts, **plain, **kw), generate(model, prompts, **spec, **kw)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        assert sum(r.calls for r in b) <= sum(r.calls for r in a)
        if plain["method"] in ("greedy", "confidence"):     # drafts are accepted often enough to save calls
            assert sum(r.calls for r in b) < sum(r.calls for r in a)
