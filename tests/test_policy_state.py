"""A policy's per-sequence state (engine.policies: `PolicyState`, `Policy.init_state`, `update`,
`validate_request`): a plugin policy that keeps state is its own module and one `register` call, with
no change to the loop, and its state follows its sequence through a batch, drafts and continuous
batching (rows leave and join between blocks)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import psd_kernels
from engine import DecodeConfig, Decoder, InputError, Method, Policy, generate, register
from engine.methods import unregister
from engine.policies import PolicyState
from models import ModelConfig, init_random
from support import run_live

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [30, 31]]
G, L = 32, 8
SCHEDULE = [(0, 32, 0), (1, 32, 2), (2, 16, 5), (3, 32, 6), (4, 24, 9)]   # (prompt, gen length, step added)


@dataclass(frozen=True)
class Alternating(Policy):
    """A user's stateful policy: it counts its steps per sequence (stage 1 steps that committed,
    over every block), starting from the sum of the prompt's ids, and commits the 1 + count % 3
    most confident masked positions. A row handed another row's count commits differently, so a
    mix-up of rows shows in the tokens and calls."""

    name = "alternating"

    def init_state(self, prompts, seed, gen_start, gen_len, width):
        return PolicyState(rows={"count": torch.tensor([sum(p) for p in prompts], device=gen_start.device)})

    def select(self, conf, masked, step, state):
        k = 1 + state["count"] % 3
        ranks, _ = psd_kernels.position_ranks(conf.float(), masked)
        return (ranks < k[:, None]) & masked

    def update(self, state, commit, step):
        return PolicyState(rows={"count": state["count"] + commit.any(-1).long()})

    @classmethod
    def validate_request(cls, cfg, prompt, gen_length):
        if len(prompt) > 20:
            raise InputError("alternating takes prompts of at most 20 tokens")


@pytest.fixture(scope="module")
def alternating():
    register(Method("alternating", "one to three tokens per step, in turn per sequence", Alternating,
                    is_policy=True))
    yield "alternating"
    unregister("alternating")


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62)
    return init_random(cfg, seed=5, std=0.5).double()


def _sig(r):
    return r.token_ids, r.calls, r.commit_call, r.commit_step, r.commit_source


def test_state_is_each_sequences_own_in_a_batch(model, alternating):
    batch = generate(model, PROMPTS, method=alternating, gen_length=G, block_length=L)
    for p, r in zip(PROMPTS, batch):
        assert _sig(r) == _sig(generate(model, [p], method=alternating, gen_length=G, block_length=L)[0])
        # call c commits after c - 1 counted steps, over every block (the count outlives a block),
        # except a block's last call, which takes what is left, and calls from the stop token's on
        # (the tokens after it are not in the result)
        last = {max(c for c, b in zip(r.commit_call, r.commit_block) if b == blk) for blk in set(r.commit_block)}
        end = r.commit_call[-1] if r.stopped else r.calls + 1
        for c in {c for c in r.commit_call if c < end} - last:
            assert r.commit_call.count(c) == 1 + (sum(p) + c - 1) % 3, (p, c)
    assert len({r.calls for r in batch}) > 1


@pytest.mark.parametrize("case", [dict(), dict(cache="dual"), dict(method="psd", depth=2),
                                  dict(method="psd", depth=3, cache="prefix")],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_state_follows_its_rows_through_a_live_batch(model, alternating, case):
    case = {"method": alternating, **case}
    if case["method"] == "psd":
        case["policy_name"] = alternating
    dec = Decoder(model, DecodeConfig(gen_length=G, block_length=L, **case))
    run = run_live(dec, PROMPTS, SCHEDULE, max_rows=3)
    assert sorted(run.done) == list(range(len(SCHEDULE))) and max(run.rows) >= 2
    for i, g, _ in SCHEDULE:
        alone = Decoder(model, DecodeConfig(gen_length=g, block_length=L, **case)).generate([PROMPTS[i]])[0]
        assert _sig(run.done[i]) == _sig(alone), (i, case)


def test_root_only_psd_carries_the_state_as_the_plain_policy(model, alternating):
    plain = generate(model, PROMPTS, method=alternating, gen_length=G, block_length=L)
    root = generate(model, PROMPTS, method="psd", policy_name=alternating, depth=0, acceptance="exact",
                    gen_length=G, block_length=L)
    assert [_sig(r) for r in root] == [_sig(r) for r in plain]


def test_exact_drafts_over_a_policy_that_steps_its_state_are_refused(model, alternating):
    """Drafts are verified with the state as it is, so exact PSD with drafts over a policy whose
    `update` changes its state decoded other tokens than the policy (5 of 5 prompts, one with more
    calls) under the label 'exact'. Refused; drafts with acceptance policy still run."""
    for kw in (dict(depth=2), dict(depth=3, cross_block=True)):
        with pytest.raises(InputError, match=f"{alternating} updates its state every step.*--acceptance policy"):
            generate(model, PROMPTS, method="psd", policy_name=alternating, acceptance="exact",
                     gen_length=G, block_length=L, **kw)
    res = generate(model, PROMPTS, method="psd", policy_name=alternating, depth=2, gen_length=G, block_length=L)
    assert all(r.tokens == len(r.token_ids) > 0 for r in res)


def test_the_policy_validates_each_request(model, alternating):
    with pytest.raises(InputError, match="at most 20 tokens"):
        generate(model, [list(range(1, 30))], method=alternating, gen_length=G, block_length=L)
    live = Decoder(model, DecodeConfig(method=alternating, gen_length=G, block_length=L))
    from engine.live import LiveBatch
    with pytest.raises(InputError, match="at most 20 tokens"):
        LiveBatch(live).add(list(range(1, 30)))
