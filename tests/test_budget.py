"""`--draft-budget auto` (engine/budget.py): the node set per block from a cost model and online
acceptance rates. The choice is tested on given costs (never on this machine's timings): no
drafts where every extra row costs a full call and acceptance is low, the whole graph where rows
are free; exact mode stays token-identical to the plain policy whatever the budget picks."""
from __future__ import annotations

import json

import pytest
import torch

import engine
from engine import DecodeConfig, Decoder, DraftGraph, InputError
from engine.budget import DraftBudget
from engine.cost import CostModel
from engine.cli import main as cli_main
from models import load_model
from models.random_checkpoint import make_checkpoint

L, G = 8, 32
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]
LINEAR = CostModel([1, 1000], [1.0, 1000.0])          # every extra row costs a full call
FREE = CostModel([1, 1000], [5.0, 5.0])               # rows are free
HALF = CostModel([1, 2, 4, 8, 16, 32, 64], [4, 5, 7, 11, 19, 35, 67])   # something in between


def _budget(graph, cost):
    return DraftBudget(graph, lambda g: None, torch.device("cpu"), cost)


# ---------------------------------------------------------------------- the choice itself
def test_linear_cost_and_low_acceptance_choose_no_drafts():
    g = DraftGraph.chain(3)
    b = _budget(g, LINEAR)
    assert b.choose(rows=1, q=[1.0, 0.2, 0.2, 0.2], c=1.0) == [0]
    assert b.choose(rows=8, q=[1.0, 0.2, 0.2, 0.2], c=1.0, tokens=[0, 10, 0, 0, 0], calls=[0, 10, 0, 0, 0]) == [0]


def test_linear_cost_never_pays_even_with_certain_acceptance_for_one_token_steps():
    """(c + G) / (m · t) with c = 1 and G ≤ m − 1: no set beats the root alone (ties to the smaller)."""
    b = _budget(DraftGraph.chain(3), LINEAR)
    assert b.choose(rows=4, q=[1.0, 1.0, 1.0, 1.0], c=1.0, tokens=[0, 4, 0, 0, 0], calls=[0, 4, 0, 0, 0]) == [0]


def test_free_rows_choose_the_whole_graph():
    g = DraftGraph([[], [0], [1], [0, 1], [0, 1, 2], [0, 2]])
    b = _budget(g, FREE)
    assert b.choose(rows=8, q=[1.0] + [0.3] * 5, c=2.0) == list(range(len(g)))


def test_chosen_sets_are_parent_closed():
    g = DraftGraph([[], [0], [1], [0, 1], [0, 1, 2], [0, 2], [3]])
    b = _budget(g, HALF)
    for q in ([1.0, .9, .1, .8, .7, .2, .05], [1.0, .3, .9, .2, .1, .1, .9]):
        for nodes, _, _ in b.candidates(q):
            assert 0 in nodes
            for k in nodes:
                assert all(p in nodes for p in g.parents[k]), (nodes, k)


def test_measured_tokens_per_call_override_the_estimate():
    """A set whose blocks committed many tokens per call is kept although the additive estimate
    alone would not pay for it; one that committed few is dropped."""
    b = _budget(DraftGraph.chain(1), CostModel([1, 2], [1.0, 1.6]))
    q = [1.0, 0.8]
    assert b.choose(1, q, c=4.0, tokens=[0, 400, 0], calls=[0, 100, 0]) == [0, 1]        # untried, optimistic 4·1.8/1.6 > 4: try it
    assert b.choose(1, q, c=4.0, tokens=[0, 400, 900], calls=[0, 100, 100]) == [0, 1]    # 9 > 1.6 · 4
    assert b.choose(1, q, c=4.0, tokens=[0, 400, 500], calls=[0, 100, 100]) == [0]       # 5 < 1.6 · 4


def test_the_cheapest_untried_set_is_tried_first():
    """Of the untried sets that could pay, the cheapest call is tried (not the whole graph); a node
    is never counted as likelier than a non-root parent of it."""
    b = _budget(DraftGraph.chain(3), HALF)
    assert b.choose(1, [1.0, 0.8, 0.8, 0.8], c=2.0, tokens=[0, 200, 0, 0, 0], calls=[0, 100, 0, 0, 0]) == [0, 1]
    assert b.candidates([1.0, 0.1, 0.8, 0.8])[-1][2] == pytest.approx(0.3)
    # node 1 tried and rarely accepted: the larger sets are not worth a try either
    assert b.choose(1, [1.0, 0.1, 0.8, 0.8], c=2.0, tokens=[0, 200, 210, 0, 0], calls=[0, 100, 100, 0, 0]) == [0]
    # rows that cost nothing: the whole graph at once
    assert _budget(DraftGraph.chain(3), FREE).choose(8, [1.0, 0.8, 0.8, 0.8], c=2.0) == [0, 1, 2, 3]


def _simulate(b, blocks, true_ms, tpc, c=2.0, calls=10, load=None):
    """Drive a budget whose cost was "measured" (b.cost set by hand) through `blocks` blocks of
    one row: a block of m nodes takes `calls` verification calls of true_ms[m] each (times
    load[block], default 1) and commits tpc[m] tokens per call (node 1 accepted in tpc[2] - c of
    its calls). The node counts chosen."""
    for i in range(blocks):
        m = len(b.next_nodes(1))
        b.size_tokens[m] += calls * tpc[m]
        b.size_calls[m] += calls
        b.tokens1 += calls * c
        b.steps1 += calls
        if m > 1:
            b.tried[1] += calls
            b.accepted[1] += calls * (tpc[m] - c)
        b.record(m, 1, calls * true_ms[m] * (load or {}).get(i, 1.0), float(calls))
    return b.chosen


def _timed(graph, cost):
    b = DraftBudget(graph, lambda g: None, torch.device("cpu"))      # no cost given: measured, corrected
    assert b.timed
    b.cost = cost                                                     # as if measured (under load)
    return b


def test_a_curve_that_makes_drafts_look_free_is_overruled_by_the_block_times():
    """The curve (measured under load) says 2 nodes cost what 1 does; the blocks take twice as long
    with 2 and commit only 20% more per call. After one try, the policy alone is timed by its own
    blocks and kept: without that it borrows the 2-node blocks' correction and stays on drafts."""
    b = _timed(DraftGraph.chain(1), CostModel([1, 1000], [10.0, 10.0]))
    chosen = _simulate(b, 12, true_ms={1: 10.0, 2: 20.0}, tpc={1: 2.0, 2: 2.4})
    assert chosen[:3] == [2, 1, 1] and set(chosen[2:]) == {1}, chosen
    assert b.call_ms(1, 2) == pytest.approx(2 * b.call_ms(1, 1))


def test_drafts_that_pay_are_kept_and_the_policy_alone_is_retimed_rarely():
    """Where drafts pay (2 nodes cost 1.2x and commit 1.75x per call), auto keeps them; the policy
    alone is timed after the first block of drafts, then after 8, 16, 32, 32 ... of them."""
    from engine.budget import RECHECK_MAX

    b = _timed(DraftGraph.chain(1), CostModel([1, 1000], [10.0, 10.0]))
    chosen = _simulate(b, 200, true_ms={1: 10.0, 2: 12.0}, tpc={1: 2.0, 2: 3.5})
    alone = [i for i, m in enumerate(chosen) if m == 1]
    assert alone == [1, 10, 27, 60, 93, 126, 159, 192], alone
    assert len(alone) <= 3 + 200 // (RECHECK_MAX + 1)
    # given costs are used as they are: no re-timing
    fixed = DraftBudget(DraftGraph.chain(1), lambda g: None, torch.device("cpu"), CostModel([1, 1000], [10.0, 10.0]))
    assert set(_simulate(fixed, 20, true_ms={1: 10.0, 2: 12.0}, tpc={1: 2.0, 2: 3.5})) == {2}


def test_one_block_timed_under_load_does_not_decide_for_good():
    """The policy alone's first timing falls in a loaded moment (1.6x): drafts that do not pay
    (2 nodes 1.4x the time, 1.2x the tokens per call) look better and run until the next timing
    (after 8 blocks of drafts), which at normal load moves auto back for good: each size is costed
    by its fastest block, as the curve keeps the fastest call."""
    b = _timed(DraftGraph.chain(1), CostModel([1, 1000], [10.0, 10.0]))
    chosen = _simulate(b, 40, true_ms={1: 10.0, 2: 14.0}, tpc={1: 2.0, 2: 2.4}, load={1: 1.6})
    assert chosen[:2] == [2, 1] and set(chosen[2:10]) == {2} and set(chosen[10:]) == {1}, chosen


def test_a_size_not_run_is_costed_between_the_sizes_that_ran():
    b = _timed(DraftGraph.chain(3), CostModel([1, 1000], [10.0, 10.0]))
    b.record(1, 1, 100.0, 10.0)                           # 1 node: 10 ms a call, as the curve says
    b.record(3, 1, 300.0, 10.0)                           # 3 nodes: 30 ms, the curve says 10
    b.rates()
    assert [round(b.call_ms(1, m), 6) for m in (1, 2, 3, 4)] == [10.0, 20.0, 30.0, 30.0]


def test_cost_model_interpolates_and_extrapolates():
    cm = CostModel([1, 4], [2.0, 5.0])
    assert cm.ms(1) == 2.0 and cm.ms(2) == pytest.approx(3.0) and cm.ms(8) == pytest.approx(10.0)
    with pytest.raises(InputError):
        CostModel([0], [1.0])


# ---------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("budget") / "m", "llada", seed=3, eos_bias=2.0)
    return load_model(path)


def _run(model, cost, **opts):
    dec = Decoder(model, DecodeConfig(gen_length=G, block_length=L, **opts), cost_model=cost)
    return dec, dec.generate(PROMPTS)


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_no_drafts_is_exactly_the_policy(model, cache):
    dec, res = _run(model, LINEAR, method="psd", policy_name="confidence", threshold=0.7, depth=3,
                    draft_budget="auto", cache=cache)
    plain = engine.generate(model, PROMPTS, method="confidence", threshold=0.7, gen_length=G, block_length=L,
                            cache=cache)
    assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    assert [r.calls for r in res] == [r.calls for r in plain]
    assert set(dec.budget.chosen) == {1}
    assert all(set(r.draft_nodes) == {1} for r in res)


def test_free_rows_verify_the_whole_graph(model):
    dec, res = _run(model, FREE, method="psd", policy_name="confidence", threshold=0.7, depth=3, draft_budget="auto")
    fixed = engine.generate(model, PROMPTS, method="psd", policy_name="confidence", threshold=0.7, depth=3,
                            gen_length=G, block_length=L)
    assert set(dec.budget.chosen) == {4}
    assert [r.token_ids for r in res] == [r.token_ids for r in fixed]
    assert [r.draft_nodes for r in res] == [r.draft_nodes for r in fixed]


@pytest.mark.parametrize("cost", [LINEAR, FREE, HALF], ids=["linear", "free", "half"])
@pytest.mark.parametrize("method,opts,plain", [
    ("psd", dict(policy_name="confidence", threshold=0.6, acceptance="exact"), dict(method="confidence", threshold=0.6)),
    ("psd", dict(policy_name="topk", steps=G, acceptance="exact"), dict(method="topk", steps=G)),
    ("spiffy", {}, dict(method="greedy")),
])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_exact_mode_is_token_identical_whatever_the_budget_picks(model, cost, method, opts, plain, cache):
    graph = DraftGraph([[], [0], [1], [0, 1], [0, 1, 2], [0, 2]])
    dec = Decoder(model, DecodeConfig(method=method, graph=graph, draft_budget="auto", gen_length=G, block_length=L,
                                      cache=cache, **opts), cost_model=cost)
    want = [r.token_ids for r in engine.generate(model, PROMPTS, gen_length=G, block_length=L, cache=cache, **plain)]
    for _ in range(3):                     # the rates move between runs: the choice may change, tokens not
        assert [r.token_ids for r in dec.generate(PROMPTS)] == want


def test_online_rates_are_counted(model):
    dec, res = _run(model, FREE, method="spiffy", depth=2, draft_budget="auto")
    tried, acc = dec.budget.tried.tolist(), dec.budget.accepted.tolist()
    assert tried[0] == 0 and tried[1] > 0 and all(0 <= a <= t for a, t in zip(acc[1:], tried[1:]))
    verify_calls = sum(sum(r.draft_nodes.values()) for r in res)
    assert tried[1] <= verify_calls


def test_calibrated_rates_are_the_prior(tmp_path):
    f = tmp_path / "g.json"
    f.write_text(json.dumps({"nodes": [[0, 1], [], [0]], "acceptance": [0.25, 1.0, 0.5]}))
    g = DraftGraph.load(f)
    assert g.acceptance == [1.0, 0.5, 0.25]
    b = _budget(g, LINEAR)
    assert b.prior == [pytest.approx(0.8), 0.5, 0.25]          # P(node) per call; the root's entry is unused
    f.write_text(json.dumps({"nodes": [[], [0]], "acceptance": [1.0]}))
    with pytest.raises(InputError, match="one rate in"):
        DraftGraph.load(f)


def test_measured_cost_is_used_when_none_is_given(model):
    dec, res = _run(model, None, method="psd", depth=2, draft_budget="auto", cache="dual")
    assert dec.budget.cost is not None and dec.budget.cost.source == "measured"
    assert all(t > 0 for t in dec.budget.cost.ms_at)


# ---------------------------------------------------------------------- the cost profile file
def _profile(path, cache="dual", block=L):
    path.write_text(json.dumps({"format": "psd-cost-profile/1", "curves": [
        {"device": "cpu", "model": "m", "dtype": "float32", "cache": cache, "block_length": block, "prefix": 16,
         "batch": 1, "rows": [1, 2, 4], "ms": [1.0, 2.0, 4.0], "ms_min": [1.0, 2.0, 4.0]},
        {"device": "cpu", "model": "m", "dtype": "float32", "cache": cache, "block_length": block, "prefix": 16,
         "batch": 4, "rows": [1, 2, 4], "ms": [4.0, 8.0, 16.0], "ms_min": [4.0, 8.0, 16.0]}]}))
    return str(path)


def test_cost_profile_is_read_and_matched(model, tmp_path):
    prof = _profile(tmp_path / "p.json")
    dec, res = _run(model, None, method="psd", depth=3, draft_budget="auto", cache="dual", cost_profile=prof)
    assert dec.budget.cost.n == [1.0, 2.0, 4.0, 8.0, 16.0] and set(dec.budget.chosen) == {1}
    with pytest.raises(InputError, match="no curve for cache none"):
        _run(model, None, method="psd", depth=3, draft_budget="auto", cache="none", cost_profile=prof)
    with pytest.raises(InputError, match="not found"):
        _run(model, None, method="psd", depth=3, draft_budget="auto", cost_profile=str(tmp_path / "none.json"))
    with pytest.raises(InputError, match="--draft-budget auto only"):
        DecodeConfig(method="psd", cost_profile=prof).validate()
    with pytest.raises(InputError, match="draft budget applies to spiffy and psd, not to confidence"):
        DecodeConfig(method="confidence", draft_budget="auto").validate()


def test_cli_budget_flags(model, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    code = cli_main(["--method", "psd", "--draft-budget", "auto", "--cost-profile", str(bad), "--gen-length", "32",
                     "--json", "t5 t6"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a psd-cost-profile/1 file" in err[0]
    assert cli_main(["--method", "psd", "--draft-budget", "auto", "--gen-length", "64", "--json",
                     "Question: 14+27? Answer: "]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "draft_nodes" in out and sum(out["draft_nodes"].values()) > 0


def test_measured_costs_are_kept_for_later_runs(model, tmp_path, monkeypatch):
    """With the store on, the first decoder of a shape measures and writes its curve; a later one
    (a later process: the in-process curves cleared) reads it and makes no measuring call; a file
    that is not a curve is measured again and replaced, never an error."""
    from engine import budget, cost

    monkeypatch.setenv("PSD_COST_CACHE", str(tmp_path / "store"))
    monkeypatch.setattr(budget, "_MEASURED", {})
    forward, calls = model.forward, []

    def counted(*a, **k):
        calls.append(1)
        return forward(*a, **k)

    monkeypatch.setattr(model, "forward", counted)
    dec, res = _run(model, None, method="psd", depth=2, draft_budget="auto", cache="dual")
    first = len(calls)
    files = list((tmp_path / "store").glob("*.json"))
    assert dec.budget.cost.source == "measured" and len(files) == 1
    monkeypatch.setattr(budget, "_MEASURED", {})
    calls.clear()
    dec2, res2 = _run(model, None, method="psd", depth=2, draft_budget="auto", cache="dual")
    assert dec2.budget.cost.source.startswith("measured earlier")
    assert dec2.budget.cost.ms_at == dec.budget.cost.ms_at
    assert [r.token_ids for r in res2] == [r.token_ids for r in res]
    assert len(calls) < first                                # the same decode, without the measuring calls
    files[0].write_text("{not json")
    monkeypatch.setattr(budget, "_MEASURED", {})
    dec3, _ = _run(model, None, method="psd", depth=2, draft_budget="auto", cache="dual")
    assert dec3.budget.cost.source == "measured" and cost.load_curve is not None
    assert json.loads(files[0].read_text())["format"] == cost.STORE_FORMAT
