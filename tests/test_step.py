"""`Decoder.step`: one model call per step on one running batch (`Decoder.start`), rows joining at a
block boundary (`Decoder.join`) and leaving at a boundary or, retired, inside an open block
(`Decoder.leave`); `generate`, `stream` and `LiveBatch` are loops over it (docs/loop.md)."""
from __future__ import annotations

import pytest
import torch

from engine import DecodeConfig, Decoder, InputError
from models import ModelConfig, init_random

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62)
    return init_random(cfg, seed=5, std=0.5).double()


def _counting(model):
    """The model, wrapped to count its calls (forward passes)."""
    calls = []
    forward = model.forward

    def counted(*a, **k):
        calls.append(a[0].shape[0])
        return forward(*a, **k)

    model.forward = counted
    return calls, lambda: setattr(model, "forward", forward)


@pytest.mark.parametrize("options", [dict(method="confidence"), dict(method="psd", depth=3, cache="dual"),
                                     dict(method="ete", cache="prefix")], ids=str)
def test_a_loop_over_step_is_generate_and_each_true_step_is_one_call(model, options):
    dec = Decoder(model, DecodeConfig(gen_length=24, block_length=8, **options))
    want = dec.generate(PROMPTS)
    calls, restore = _counting(model)
    try:
        state, made, boundaries = dec.start(PROMPTS), 0, 0
        while not state.done:
            before = len(calls)
            if dec.step(state):
                made += 1
                assert len(calls) - before == 1          # exactly one model call
            else:
                boundaries += 1
                assert len(calls) == before and state.at_boundary
    finally:
        restore()
    got = dec.results(state)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.calls for r in got] == [r.calls for r in want] and made == len(calls)
    assert boundaries >= 3 - 1                           # every closed block but (maybe) an early end


def test_rows_join_at_a_boundary_and_decode_as_alone(model):
    dec = Decoder(model, DecodeConfig(method="confidence", gen_length=16, block_length=8))
    state = dec.start(PROMPTS[:1], [16], live=True)
    while dec.step(state):                               # the first block of the first row
        pass
    assert dec.step(state) and state.run is not None           # a block is open again
    while dec.step(state):
        pass
    dec.join(state, [PROMPTS[1]], [16])                  # at the boundary after the first row's second block
    while state.batch.cursor < state.batch.end:
        dec.step(state)
    got = dec.results(state)
    alone = [dec.generate([p])[0] for p in PROMPTS[:2]]
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]


def test_a_row_left_inside_a_block_takes_no_further_call(model):
    dec = Decoder(model, DecodeConfig(method="greedy", gen_length=16, block_length=8))
    state = dec.start(PROMPTS)
    assert dec.step(state)                                # the block's first call: every row
    dec.leave(state, [1])
    calls, restore = _counting(model)
    try:
        while not state.done:
            dec.step(state)
    finally:
        restore()
    assert calls and max(calls) <= 2                      # rows 0 and 2 only, in every later call
    others = dec.results(state, rows=[0, 2])
    assert [r.token_ids for r in others] == [r.token_ids for r in dec.generate([PROMPTS[0], PROMPTS[2]])]


def test_leave_at_a_boundary_drops_the_rows(model):
    dec = Decoder(model, DecodeConfig(method="greedy", gen_length=16, block_length=8))
    state = dec.start(PROMPTS, live=True)
    while dec.step(state):
        pass
    dec.leave(state, [0, 2])
    assert state.batch.x.shape[0] == 1
    while state.batch.cursor < state.batch.end:
        dec.step(state)
    assert dec.results(state)[0].token_ids == dec.generate([PROMPTS[1]])[0].token_ids
    dec.leave(state, [0])
    assert state.batch is None
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("method", [dict(method="confidence"), dict(method="psd", depth=3)], ids=str)
def test_rows_join_inside_an_open_block_and_decode_as_alone(model, cache, method):
    """A row joins between two steps of an open block (its first call made at once) — a longer
    prompt than the running row's (the canvas widens on the left) and a longer gen length (on the
    right) — and every row decodes as it would alone."""
    dec = Decoder(model, DecodeConfig(gen_length=16, block_length=8, cache=cache, **method))
    state = dec.start([PROMPTS[1]], [16], live=True)
    assert dec.step(state) and dec.step(state)           # inside the first block
    assert state.run is not None and dec.joins_inside_a_block
    calls, restore = _counting(model)
    try:
        dec.join(state, [PROMPTS[0], [30, 31, 32, 33, 34, 35, 36, 37, 38]], [24, 16])
    finally:
        restore()
    assert len(calls) == 1 and calls[0] == 2               # one call, of the two new rows
    assert state.run is not None and len(state.run.seqs) == 3
    while state.batch.cursor < state.batch.end:
        dec.step(state)
    got = dec.results(state)
    alone = [dec.generate([p])[0] for p in (PROMPTS[1], PROMPTS[0], [30, 31, 32, 33, 34, 35, 36, 37, 38])]
    alone[1] = Decoder(model, DecodeConfig(gen_length=24, block_length=8, cache=cache, **method)).generate(
        [PROMPTS[0]])[0]
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    assert [r.calls for r in got] == [r.calls for r in alone]


def test_cross_block_rows_join_inside_an_open_block(model):
    """--cross-block: the running row opened its block (its first output may be a carried one later);
    a row of a gen length whose window has the same next block joins now with its own first call,
    and both decode as alone, calls included."""
    opts = dict(method="psd", depth=3, cross_block=True, block_length=8)
    dec = Decoder(model, DecodeConfig(gen_length=24, **opts))
    state = dec.start([PROMPTS[1]], [24], live=True)
    for _ in range(4):                                   # into the second block: the first may carry over
        dec.step(state)
    assert state.run is not None and state.run.win.ahead == 8 and dec.can_join(state, [PROMPTS[0]], [24])
    assert dec.join(state, [PROMPTS[0]], [24]) and len(state.run.seqs) == 2
    while state.batch.cursor < state.batch.end:
        dec.step(state)
    alone = [dec.generate([p])[0] for p in (PROMPTS[1], PROMPTS[0])]
    got = dec.results(state)
    assert [(r.token_ids, r.calls) for r in got] == [(r.token_ids, r.calls) for r in alone]


def test_a_budget_decoder_joins_inside_a_block_with_the_blocks_plan(model):
    """--draft-budget auto: a row joins the open block under the plan the budget chose for it (no
    second plan, no probe call), the block is counted but not timed (the join's call is in it), and
    every row's tokens are its tokens alone (exact acceptance: any plan gives the policy's tokens)."""
    dec = Decoder(model, DecodeConfig(method="psd", depth=2, draft_budget="auto", gen_length=16, block_length=8))
    state = dec.start([PROMPTS[1]], [16], live=True)
    assert dec.step(state) and dec.joins_inside_a_block and dec.can_join(state, [PROMPTS[0]], [16])
    plan, planned = state.run.plan, len(dec.budget.chosen)
    calls, restore = _counting(model)
    try:
        assert dec.join(state, [PROMPTS[0]], [16])                 # the new row's first call, now
    finally:
        restore()
    assert calls == [1] and state.run.plan is plan and len(dec.budget.chosen) == planned
    assert dec.budget._open[1] is None                           # not timed
    while state.batch.cursor < state.batch.end:
        dec.step(state)
    alone = [dec.generate([p])[0].token_ids for p in (PROMPTS[1], PROMPTS[0])]
    assert [r.token_ids for r in dec.results(state)] == alone


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_a_row_that_widens_the_window_joins_at_the_boundary(model, cache):
    """ETE's window (3 blocks here) ends at the canvas's end: inside the last blocks of a 16-token
    row it is 2 blocks wide, and a 32-token row would open it 3 wide. `can_join` says no, `join`
    refuses with the state as it was, a row that fits joins at once, and at the boundary the long
    one joins; every row decodes as alone."""
    dec = Decoder(model, DecodeConfig(method="ete", gen_length=16, block_length=8, cache=cache))
    state = dec.start([PROMPTS[1]], [16], live=True)
    assert dec.step(state) and state.run.win.width == 16
    assert not dec.can_join(state, [PROMPTS[0]], [32]) and dec.can_join(state, [PROMPTS[2]], [16])
    with pytest.raises(InputError, match="block boundary"):
        dec.join(state, [PROMPTS[0]], [32])
    assert state.sent == [0] and state.batch.x.shape[0] == 1 and len(state.run.seqs) == 1
    assert dec.join(state, [PROMPTS[2]], [16])                 # fits: its first call now
    while state.run is not None:
        dec.step(state)
    assert dec.can_join(state, [PROMPTS[0]], [32])
    dec.join(state, [PROMPTS[0]], [32])
    while state.batch.cursor < state.batch.end:
        dec.step(state)
    want = [dec.generate([p])[0].token_ids for p in (PROMPTS[1], PROMPTS[2])]
    want.append(Decoder(model, DecodeConfig(method="ete", gen_length=32, block_length=8, cache=cache)).generate(
        [PROMPTS[0]])[0].token_ids)
    assert [r.token_ids for r in dec.results(state)] == want


@pytest.mark.parametrize("family", ["dream", "pangu"])
def test_joining_inside_a_block_on_shifted_and_context_causal_models(family):
    cfg = ModelConfig.tiny(family, vocab_size=64, mask_token_id=63, eos_token_id=62)
    m = init_random(cfg, seed=5, std=0.5).double()
    for cache in ("none", "dual"):
        dec = Decoder(m, DecodeConfig(method="psd", depth=2, gen_length=16, block_length=8, cache=cache))
        state = dec.start([PROMPTS[1]], [16], live=True)
        assert dec.step(state) and dec.step(state)
        dec.join(state, [PROMPTS[0]], [16])
        while state.batch.cursor < state.batch.end:
            dec.step(state)
        alone = [dec.generate([p])[0].token_ids for p in (PROMPTS[1], PROMPTS[0])]
        assert [r.token_ids for r in dec.results(state)] == alone, cache


@pytest.mark.parametrize("options", [dict(method="confidence"), dict(method="psd", depth=3, cache="dual"),
                                     dict(method="ete", cache="prefix", top_logprobs=2)], ids=str)
def test_step_output_hands_out_what_became_final_once(model, options):
    """`StepOutput.final()` after every step: per row, pieces that concatenate to its token_ids
    (probs to its commit_prob), each token handed out once and only once final (every piece is
    the generation's next tokens, never revised); a step that made no call hands out nothing new
    unless a block closed."""
    dec = Decoder(model, DecodeConfig(gen_length=24, block_length=8, **options))
    state = dec.start(PROMPTS)
    got = [[] for _ in PROMPTS]
    probs = [[] for _ in PROMPTS]
    tops = [[] for _ in PROMPTS]
    while not state.done:
        out = dec.step(state)
        assert bool(out) == out.called and out.boundary == state.at_boundary and out.done == state.done
        f = out.final()
        assert out.final() is f and len(f.pieces) == len(PROMPTS) == len(f.ended)
        for b, piece in enumerate(f.pieces):
            got[b] += piece
            probs[b] += f.probs[b]
            tops[b] += f.tops[b] or []
        assert state.sent == [len(g) for g in got]
    results = dec.results(state)
    for b, r in enumerate(results):
        assert got[b] == r.token_ids[:len(got[b])]               # what was handed out is final
        assert probs[b] == r.commit_prob[:len(got[b])]
        if options.get("top_logprobs"):
            assert tops[b] == r.commit_top[:len(got[b])]
    assert any(len(g) == len(r.token_ids) for g, r in zip(got, results))


def test_step_output_is_read_only_before_the_state_changes(model):
    dec = Decoder(model, DecodeConfig(method="confidence", gen_length=16, block_length=8))
    state = dec.start(PROMPTS[:1], [16], live=True)
    first = dec.step(state)
    assert first.called and not first.boundary
    second = dec.step(state)
    with pytest.raises(RuntimeError, match="state changed"):
        first.final()                                   # a later step: stale
    joined = dec.join(state, PROMPTS[1:2], [16])        # inside the open block: the new row's first call
    with pytest.raises(RuntimeError):
        second.final()                                   # a join changed the rows
    assert joined.called and len(joined.final().pieces) == 2 and joined.final().pieces[1] == []
    while dec.step(state):
        pass
    assert state.at_boundary and len(state.sent) == 2
    dec.leave(state, [0])
    assert len(state.sent) == 1                          # the row's count left with it
