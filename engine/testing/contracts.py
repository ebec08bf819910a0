"""The contracts every stage-1 policy keeps, as one test class (docs/algorithms.md §2-§3).

`tests/test_contracts.py` runs `PolicyContract` for every policy of the method table
(`engine.methods.policy_methods()`), with each policy's own defaults. A policy defined anywhere else
gets every check by subclassing it in its own test module, with a `policy_case` fixture that
registers the policy and returns `(method name, options)`:

    class TestMyPolicyContract(PolicyContract):
        @pytest.fixture
        def policy_case(self, my_registration):
            return "mypolicy", {"my_option": 0.5}

Each check compares runs of the one decoding loop against each other: the plain policy is the
reference, and PSD (root-only, chains, a DAG, exact mode, static rows, drafts across blocks),
batching, streaming and the KV caches must reproduce it; the policy's own rule (only masked
positions, progress) and the loop's host reads per step are checked directly.
"""
from __future__ import annotations

import pytest
import torch

from engine import DecodeConfig, DraftGraph, generate
from engine.errors import InputError
from engine.loop import Decoder
from engine.methods import METHODS
from engine.policies import policy_select
from .hostsync import STEP_BOUND, Profile, SyncCounter, check
from models import ModelConfig, init_random

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]]
G, L = 32, 8
DAG = DraftGraph([[], [0], [1], [0, 1], [0, 2], [0, 1, 2], [2]])


@pytest.fixture(scope="module", params=["llada", "dream"])
def contract_model(request):
    """A bidirectional model loud enough that drafts are accepted and EOS comes mid-generation."""
    return init_random(ModelConfig.tiny(request.param, vocab_size=64, mask_token_id=63, eos_token_id=62),
                       seed=5, std=0.5)


@pytest.fixture(scope="module")
def causal_model():
    """A context-causal model (openPangu's attention) in float64: its caches are exact."""
    return init_random(ModelConfig.tiny("pangu"), seed=4, std=0.3).double()


def _one_family(model) -> None:
    """Checks of the loop's bookkeeping, not of a family's layout (logit shift, positions): one
    family covers them, the other would run the same assertions again."""
    if model.config.family != "llada":
        pytest.skip("a family-independent contract: checked once, on llada")


def _sig(results, *fields):
    return [tuple(getattr(r, f) for f in ("token_ids", "calls") + fields) for r in results]


def _psd(method, opts, **kw):
    """PSD over the policy `method` with its options."""
    return dict(method="psd", policy_name=method, **opts, **kw)


def _refuses_exact_drafts(method, opts, **kw) -> bool:
    """A policy whose state each step changes (`Policy.steps_its_state`): exact PSD with drafts over
    it is refused, as a config error naming it (checked here), rather than decoding other tokens."""
    if not METHODS[method].policy.steps_its_state():
        return False
    with pytest.raises(InputError, match=f"{METHODS[method].policy.name} updates its state every step"):
        DecodeConfig(**_psd(method, opts, depth=3, acceptance="exact", **kw)).validate()
    return True


class PolicyContract:
    """Mix-in: every test takes the `policy_case` fixture, (method name, options)."""

    def test_root_only_psd_is_the_plain_policy(self, policy_case, contract_model):
        method, opts = policy_case
        for cache in ("none", "dual"):
            kw = dict(gen_length=G, block_length=L, cache=cache)
            plain = generate(contract_model, PROMPTS, method=method, **opts, **kw)
            for acceptance in ("policy", "exact"):
                root = generate(contract_model, PROMPTS, **_psd(method, opts, graph=DraftGraph.root_only(),
                                                                 acceptance=acceptance, **kw))
                assert _sig(root, "commit_call", "commit_step") == _sig(plain, "commit_call", "commit_step")

    def test_exact_psd_is_the_plain_policy_with_no_more_calls(self, policy_case, contract_model):
        method, opts = policy_case
        kw = dict(gen_length=G, block_length=L)
        if _refuses_exact_drafts(method, opts, **kw):
            return
        plain = generate(contract_model, PROMPTS, method=method, **opts, **kw)
        accepted = 0
        for graph in (DraftGraph.chain(3), DAG):
            exact = generate(contract_model, PROMPTS, **_psd(method, opts, graph=graph, acceptance="exact", **kw))
            assert [r.token_ids for r in exact] == [r.token_ids for r in plain], graph
            assert all(e.calls <= p.calls for e, p in zip(exact, plain)), graph
            assert all(e.stopped == p.stopped for e, p in zip(exact, plain))
            kept = sum(c for r in exact for d, c in r.accepted_depth.items() if d > 0)
            if kept > sum(len(set(r.commit_block)) for r in exact):
                # more acceptances than blocks: one did not just complete a block, so calls drop
                assert sum(r.calls for r in exact) < sum(r.calls for r in plain), graph
            accepted += kept
        assert accepted > 0          # the drafts were exercised, not all rejected

    def test_policy_mode_psd_runs_and_accounts(self, policy_case, contract_model):
        _one_family(contract_model)
        method, opts = policy_case
        res = generate(contract_model, PROMPTS, **_psd(method, opts, depth=3, gen_length=G, block_length=L))
        for r in res:
            assert r.tokens == len(r.token_ids) == len(r.commit_call) and 0 < r.calls <= G
            assert sum(r.accepted_depth.values()) <= r.calls and r.rows_per_call >= 1

    @pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
    def test_static_rows_change_nothing(self, policy_case, contract_model, cache):
        """Padding every verification call to one shape keeps tokens, calls and rows per call
        (which counts the drafts verified, not the padding)."""
        method, opts = policy_case
        kw = dict(gen_length=G, block_length=L, cache=cache)
        alone = dict(method=method, **opts)
        plain = generate(contract_model, PROMPTS, **alone, **kw)
        runs = (alone, _psd(method, opts, depth=3)) + \
            (() if _refuses_exact_drafts(method, opts) else (_psd(method, opts, depth=3, acceptance="exact"),))
        for run in runs:
            want = plain if run is alone else generate(contract_model, PROMPTS, **run, **kw)
            got = generate(contract_model, PROMPTS, static_rows=True, **run, **kw)
            assert _sig(got, "rows_per_call") == _sig(want, "rows_per_call"), run
            if run.get("acceptance") == "exact":
                assert [r.token_ids for r in got] == [r.token_ids for r in plain]

    def test_exact_cross_block_drafts_are_the_plain_policy(self, policy_case, contract_model):
        method, opts = policy_case
        kw = dict(gen_length=G, block_length=L)
        if _refuses_exact_drafts(method, opts, cross_block=True, **kw):
            return
        plain = generate(contract_model, PROMPTS, method=method, **opts, **kw)
        cross = generate(contract_model, PROMPTS, **_psd(method, opts, depth=3, acceptance="exact",
                                                          cross_block=True, **kw))
        assert [r.token_ids for r in cross] == [r.token_ids for r in plain]
        assert all(c.calls <= p.calls for c, p in zip(cross, plain))

    def test_a_batch_is_its_rows_one_by_one(self, policy_case, contract_model):
        method, opts = policy_case
        for run in (dict(method=method, **opts), _psd(method, opts, depth=3)):
            batch = generate(contract_model, PROMPTS, gen_length=G, block_length=L, **run)
            single = [generate(contract_model, [p], gen_length=G, block_length=L, **run)[0] for p in PROMPTS]
            assert _sig(batch, "commit_call") == _sig(single, "commit_call"), run

    def test_stream_pieces_are_the_result(self, policy_case, contract_model):
        _one_family(contract_model)
        method, opts = policy_case
        for run in (dict(method=method, **opts), _psd(method, opts, depth=3)):
            dec = Decoder(contract_model, DecodeConfig(gen_length=G, block_length=L, **run))
            updates = list(dec.stream(PROMPTS))
            results = updates[-1].results
            pieces = [sum((u.pieces[i] for u in updates), []) for i in range(len(PROMPTS))]
            assert pieces == [r.token_ids for r in results]
            assert _sig(results) == _sig(generate(contract_model, PROMPTS, gen_length=G, block_length=L, **run))

    def test_caches_are_exact_on_a_context_causal_model(self, policy_case, causal_model):
        method, opts = policy_case
        for run in (dict(method=method, **opts), _psd(method, opts, depth=3)):
            kw = dict(gen_length=24, block_length=8, **run)
            ref = generate(causal_model, PROMPTS, cache="none", **kw)
            for cache in ("prefix", "dual"):
                assert _sig(generate(causal_model, PROMPTS, cache=cache, **kw)) == _sig(ref), (run, cache)

    def test_select_commits_only_masked_positions_and_progresses(self, policy_case):
        method, opts = policy_case
        policy = DecodeConfig(method=method, gen_length=G, block_length=L, **opts).validate().policy()
        g = torch.Generator().manual_seed(3)
        for _ in range(5):
            conf = torch.rand(7, L, generator=g)
            masked = torch.rand(7, L, generator=g) < 0.6
            masked[3] = False                                  # a row with nothing left commits nothing
            step = torch.randint(0, L, (7,), generator=g)
            state = policy.init_state([[i + 1, 2] for i in range(7)], 0, torch.zeros(7, dtype=torch.long),
                                      torch.full((7,), L), L)          # its own per-sequence state, if any
            sel = policy_select(policy, conf, masked, step, state)
            assert sel.dtype == torch.bool and sel.shape == masked.shape
            assert not (sel & ~masked).any()
            idle = policy.may_idle(step)
            assert ((sel.sum(-1) >= 1) | idle | ~masked.any(-1)).all()

    def test_host_reads_per_step_are_a_constant(self, policy_case):
        """Counted at run time (hostsync.SyncCounter): no read inside a model call, and between two
        calls at most a constant, for the plain policy and PSD over it, whatever the batch."""
        method, opts = policy_case
        steps = set()
        for run in (dict(method=method, **opts), _psd(method, opts, depth=3)):
            for batch in (1, 3):
                model = init_random(ModelConfig.tiny("llada", num_layers=2), seed=7, std=0.3)
                dec = Decoder(model, DecodeConfig(gen_length=16, block_length=8, cache="dual", **run))
                counter = SyncCounter()
                prof = Profile(model, counter)
                try:
                    with counter:
                        dec.generate(PROMPTS[:batch])
                finally:
                    prof.close()
                steps.add(check(prof) if prof.between else 0)
        assert max(steps) <= STEP_BOUND, steps

    def test_the_policy_is_in_the_method_table(self, policy_case):
        method, _ = policy_case
        assert METHODS[method].is_policy
