"""Continuous batching (engine.live.LiveBatch): sequences join a running batch at block boundaries
and leave when done or cancelled; each decodes exactly as it would alone (float64, temperature 0)
for every method family and cache mode, and the streamed pieces are its tokens."""
from __future__ import annotations

import pytest

from engine import DecodeConfig, Decoder, InputError, generate
from engine.live import LiveBatch
from models import ModelConfig, init_random
from support import run_live

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [30, 31]]
G, L = 32, 8
# (prompt index, gen length, the step at which it is added): joins mid-block are queued to the next boundary
SCHEDULE = [(0, 32, 0), (1, 32, 2), (2, 16, 5), (3, 32, 6), (4, 24, 9)]

CASES = [
    dict(method="greedy"),
    dict(method="psd", policy_name="confidence", depth=3),
    dict(method="psd", policy_name="random", depth=2),
    dict(method="psd", policy_name="topk", steps=16, acceptance="exact", depth=3),
    dict(method="ete"),
    dict(method="lopa"),
    dict(method="confidence", cache="dual"),
    dict(method="psd", policy_name="left", depth=3, cache="prefix"),
    dict(method="greedy", cache="prefix"),
    dict(method="confidence", cache="prefix"),
]


@pytest.fixture(scope="module", params=["llada", "dream", "pangu"])
def model(request):
    cfg = ModelConfig.tiny(request.param, vocab_size=64, mask_token_id=63, eos_token_id=62)
    return init_random(cfg, seed=5, std=0.5).double()


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_each_sequence_decodes_as_it_would_alone(model, case):
    dec = Decoder(model, DecodeConfig(gen_length=G, block_length=L, **case))
    run = run_live(dec, PROMPTS, SCHEDULE, max_rows=3)
    done, pieces, rows = run.done, run.pieces, run.rows
    assert sorted(done) == list(range(len(SCHEDULE)))
    assert max(rows) <= 3 and max(rows) >= 2                     # rows were batched together, never more than 3
    for i, g, _ in SCHEDULE:
        # a sequence of its own length keeps the decoder's steps per block (topk's schedule is per block)
        own = {**case, "steps": case["steps"] * g // G} if "steps" in case else case
        alone = Decoder(model, DecodeConfig(gen_length=g, block_length=L, **own)).generate([PROMPTS[i]])[0]
        got = done[i]
        assert (got.token_ids, got.calls, got.commit_call, got.commit_step, got.commit_source) == \
            (alone.token_ids, alone.calls, alone.commit_call, alone.commit_step, alone.commit_source), (i, case)
        assert got.commit_prob == pytest.approx(alone.commit_prob, abs=1e-5)      # float32 confidences
        assert pieces.get(i, []) == got.token_ids


def test_cross_block_drafts_in_a_live_batch(model):
    if model.config.attention != "bidirectional":
        pytest.skip("--cross-block needs a bidirectional model")
    case = dict(method="psd", policy_name="confidence", depth=3, cross_block=True)
    dec = Decoder(model, DecodeConfig(gen_length=G, block_length=L, **case))
    done = run_live(dec, PROMPTS, SCHEDULE).done
    for i, g, _ in SCHEDULE:
        alone = Decoder(model, DecodeConfig(gen_length=g, block_length=L, **case)).generate([PROMPTS[i]])[0]
        assert (done[i].token_ids, done[i].calls) == (alone.token_ids, alone.calls)


def test_a_late_short_request_finishes_before_an_earlier_long_one():
    m = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5,
                    std=0.02)       # quiet: nothing stops early, so lengths decide
    dec = Decoder(m, DecodeConfig(method="greedy", gen_length=64, block_length=8))
    run = run_live(dec, PROMPTS, [(0, 64, 0), (1, 8, 3)])
    done, order = run.done, run.order
    assert order == [1, 0]
    assert done[1].tokens == 8 and done[0].tokens == 64


def test_cancelled_sequence_leaves_and_the_others_are_unchanged(model):
    case = dict(method="psd", policy_name="confidence", depth=3)
    dec = Decoder(model, DecodeConfig(gen_length=G, block_length=L, **case))
    run = run_live(dec, PROMPTS, SCHEDULE, cancel=(3, 8))
    done, live = run.done, run.live
    assert 3 not in done and sorted(done) == [0, 1, 2, 4]
    for i, g, _ in SCHEDULE:
        if i != 3:
            alone = Decoder(model, DecodeConfig(gen_length=g, block_length=L, **case)).generate([PROMPTS[i]])[0]
            assert done[i].token_ids == alone.token_ids
    assert live.idle


def _rows_per_call(m):
    """(list of canvases per model call, the hook to remove): one entry per forward."""
    calls = []
    hook = m.register_forward_pre_hook(lambda mod, args, kw: calls.append((args[0] if args else kw["ids"]).shape[0]),
                                       with_kwargs=True)
    return calls, hook


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_a_cancelled_row_takes_no_further_call(cache):
    """Issue 31 item 4: cancelled mid-block, a row is in no model call after the one running when the
    client went (not merely gone at the block boundary); the other row decodes as it would alone."""
    m = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5, std=0.02)
    dec = Decoder(m, DecodeConfig(method="greedy", gen_length=16, block_length=8, cache=cache))
    live = LiveBatch(dec)
    a, b = live.add([1, 2, 3], gen_length=16), live.add([4, 5, 6], gen_length=16)
    calls, hook = _rows_per_call(m)
    try:
        live.step()                                  # the block's first call: both rows
        live.step()                                  # one greedy step: both rows
        assert calls == [2, 2]
        live.cancel(b)
        done, pieces = {}, {}
        while (u := live.step()) is not None:
            done.update(u.done)
            for h, p in u.pieces.items():
                pieces.setdefault(h, []).extend(p)
    finally:
        hook.remove()
    assert set(calls[2:]) == {1}                     # every later call: row a alone
    assert b not in done and b not in pieces and live.idle
    alone = Decoder(m, DecodeConfig(method="greedy", gen_length=16, block_length=8, cache=cache)).generate([[1, 2, 3]])[0]
    assert (done[a].token_ids, done[a].calls) == (alone.token_ids, alone.calls)


def test_a_finished_sequence_is_answered_in_the_call_it_ends():
    """Issue 31 item 4: a sequence is answered (its result, with its last tokens) by the step that commits
    its last tokens, not at the block boundary; the result is the one it would have alone."""
    cfg = ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62)
    m = init_random(cfg, seed=5, std=0.02)
    dc = DecodeConfig(method="psd", policy_name="confidence", depth=3, gen_length=8, block_length=8, cache="dual")
    dec = Decoder(m, dc)
    live = LiveBatch(dec)
    short, long_ = live.add([1, 2, 3], gen_length=8), live.add([9, 8, 7, 6], gen_length=32)
    calls, hook = _rows_per_call(m)
    got, step_done, step_last_piece = [], None, None
    try:
        n = 0
        while (u := live.step()) is not None:
            n += 1
            if short in u.pieces:
                got += u.pieces[short]
                step_last_piece = n
            if short in u.done:
                step_done, res = n, u.done[short]
    finally:
        hook.remove()
    alone = Decoder(m, dc).generate([[1, 2, 3]])[0]
    assert step_done == step_last_piece and got == res.token_ids == alone.token_ids
    assert (res.calls, res.commit_call, res.commit_step) == (alone.calls, alone.commit_call, alone.commit_step)
    # its last call's output is committed at the start of the next step (stage 1), whose update answers it,
    # whatever the long row still does in block 0 (before: at that block's end)
    assert step_done == alone.calls + 1


def test_the_canvas_stays_bounded_however_long_it_runs():
    m = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5, std=0.02)
    dec = Decoder(m, DecodeConfig(method="greedy", gen_length=16, block_length=8))
    live = LiveBatch(dec, max_rows=2)
    widths, done = [], 0                      # the canvas every model call sees (cache none: the whole of it)
    hook = m.register_forward_pre_hook(lambda mod, args, kw: widths.append((args[0] if args else kw["ids"]).shape[1]),
                                       with_kwargs=True)
    try:
        for n in range(12):                   # a stream of requests, two at a time
            live.add([1 + n % 7, 2, 3], gen_length=16)
            for _ in range(6):
                u = live.step()
                if u is None:
                    break
                done += len(u.done)
        while (u := live.step()) is not None:
            done += len(u.done)
    finally:
        hook.remove()
    assert done == 12 and len(widths) > 12
    assert max(widths) <= 3 + 16 + 8           # one prompt, one generation, at most a block of offset


def test_bad_sequences_are_refused_when_added():
    m = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5)
    live = LiveBatch(Decoder(m, DecodeConfig(method="greedy", gen_length=16, block_length=8)))
    with pytest.raises(InputError, match="multiple of the block length"):
        live.add([1, 2], gen_length=12)
    with pytest.raises(InputError, match="mask token"):
        live.add([1, 63])
    with pytest.raises(InputError, match="max_rows"):
        LiveBatch(live.dec, max_rows=0)
    assert live.step() is None and live.idle


WINDOWED = [
    dict(method="ete"), dict(method="ete", cache="prefix"), dict(method="ete", cache="dual"),
    dict(method="ete", k=2, cache="dual", threshold=0.3),
    dict(method="psd", policy_name="confidence", depth=3, cross_block=True),
    dict(method="psd", policy_name="confidence", depth=2, draft_budget="auto", cache="dual"),
]


@pytest.mark.parametrize("case", WINDOWED, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("seed", range(3))
def test_random_joins_of_mixed_lengths_decode_as_alone(case, seed):
    """Random schedules (lengths 8-32, arrivals at any step, so joins inside open blocks and at
    boundaries) for the modes whose block window depends on the canvas (ETE's blocks, --cross-block's
    next block) or whose plan is per block (--draft-budget auto): a row whose window would differ
    from the open block's waits for the boundary (`Decoder.can_join`), and every sequence decodes as
    it would alone. Before, ETE crashed here and, with prefix/dual, a shorter row of a mixed batch
    attended its padding."""
    import random

    rnd = random.Random(seed)
    m = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5, std=0.5)
    m = m.double()
    schedule = sorted([(i, rnd.choice([8, 16, 24, 32]), rnd.randrange(0, 12)) for i in range(len(PROMPTS))],
                      key=lambda s: s[2])
    dec = Decoder(m, DecodeConfig(gen_length=G, block_length=L, **case))
    done = run_live(dec, PROMPTS, schedule, max_rows=4).done
    for i, g, _ in schedule:
        alone = Decoder(m, DecodeConfig(gen_length=g, block_length=L, **case)).generate([PROMPTS[i]])[0]
        assert done[i].token_ids == alone.token_ids, (i, g, schedule)
        if "draft_budget" not in case:               # auto's plans (so its calls) depend on what it timed
            assert done[i].calls == alone.calls, (i, g, schedule)


@pytest.mark.parametrize("family", ["dream", "pangu"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_sequence_alignment_with_a_prompt_inside_one_block_on_shifted_models(family, cache):
    """--align sequence with every prompt shorter than a block put the grid's first block at column
    0, and a shifted model (its prediction for column lo read at lo - 1) failed on any call: the grid
    now starts one block later. Alone, batched with a longer prompt and joined live, each sequence
    decodes the same."""
    cfg = ModelConfig.tiny(family, vocab_size=64, mask_token_id=63, eos_token_id=62)
    m = init_random(cfg, seed=5, std=0.5).double()
    opts = dict(method="confidence", threshold=0.3, block_length=L, align="sequence", cache=cache)
    dec = Decoder(m, DecodeConfig(gen_length=16, **opts))
    short, long_ = [11, 12, 13], list(range(1, 20))
    alone = [dec.generate([p])[0] for p in (short, long_)]
    assert all(r.tokens > 0 for r in alone)
    assert [r.token_ids for r in dec.generate([short, long_])] == [r.token_ids for r in alone]
    done = run_live(dec, [short, long_], [(0, 16, 0), (1, 16, 2)]).done
    assert [done[0].token_ids, done[1].token_ids] == [r.token_ids for r in alone]


# gen lengths off the block grid (L = 8): (prompt index, gen length, the step at which it is added)
OFF_GRID = [(0, 13, 0), (1, 30, 2), (2, 5, 5), (3, 17, 6), (4, 24, 9)]
OFF_GRID_CASES = [dict(method="confidence", threshold=0.5), dict(method="greedy", cache="dual"),
                  dict(method="psd", policy_name="confidence", depth=3, cache="prefix")]


def _decodes_as_alone(m, opts, schedule):
    """Every sequence of `schedule` through a LiveBatch (its own gen length, joining mid-run) equals
    the plain generate API on it alone."""
    run = run_live(Decoder(m, DecodeConfig(gen_length=G, **opts)), PROMPTS, schedule, max_rows=3)
    assert max(run.rows) >= 2
    for i, g, _ in schedule:
        alone, got = generate(m, [PROMPTS[i]], gen_length=g, **opts)[0], run.done[i]
        assert (got.token_ids, got.calls, got.commit_call, got.commit_step) == \
            (alone.token_ids, alone.calls, alone.commit_call, alone.commit_step), (i, g, opts)
        assert 0 < got.tokens <= g and run.pieces.get(i, []) == got.token_ids


@pytest.mark.parametrize("case", OFF_GRID_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_gen_lengths_off_the_block_grid_under_sequence_alignment(model, case):
    """`--align sequence` takes any gen length in the plain API; `LiveBatch.add` refused one that is
    no multiple of the block length. Each sequence now decodes as the plain API decodes it alone."""
    _decodes_as_alone(model, dict(block_length=L, align="sequence", **case), OFF_GRID)


def test_gen_lengths_off_the_block_grid_where_auto_is_sequence():
    """On a block-causal model (llada2) `--align auto` is `sequence`: LiveBatch takes the gen lengths
    the plain API takes there; on a bidirectional one it refuses them, as the plain API does."""
    m = init_random(ModelConfig.tiny("llada2", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5, std=0.5)
    _decodes_as_alone(m.double(), dict(block_length=L, **OFF_GRID_CASES[0]), OFF_GRID)
    dense = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5)
    live = LiveBatch(Decoder(dense, DecodeConfig(method="greedy", gen_length=16, block_length=L)))
    with pytest.raises(InputError, match=r"gen length 13 is not a multiple of the block length 8 \(--align sequence"):
        live.add([1, 2], gen_length=13)
    with pytest.raises(InputError, match="gen length 0 must be a positive integer"):
        live.add([1, 2], gen_length=0)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_gone_row_frees_its_slot_inside_an_open_block(cache):
    """Issue 31 item 4 with a cache (rows on one block cursor): a cancelled row leaves the batch in
    the step it is cancelled, not at the block boundary (its cache row stays behind, unused, until
    the block closes); the waiting sequence that takes the slot joins the open block, and every
    sequence decodes as it would alone. (An answered row keeps its slot to the boundary here, where
    the next sequence's first call is shared with the block's: docs/serve.md.)"""
    m = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5, std=0.5)
    m = m.double()
    dc = DecodeConfig(method="confidence", threshold=0.5, gen_length=32, block_length=8, cache=cache)
    live = LiveBatch(Decoder(m, dc), max_rows=2)
    a, b = live.add(PROMPTS[0], gen_length=32), live.add(PROMPTS[3], gen_length=32)
    c = live.add(PROMPTS[1], gen_length=16)                     # waits: no room
    live.step(), live.step()
    assert live.state.run is not None and live.handles == [a, b]
    live.cancel(a)
    assert live.handles == [b] and live.state.run is not None    # gone now, the block still open
    u = live.step()                                              # c joins the open block (its first call)
    assert live.handles == [b, c] and u.rows == 2 and live.state.run is not None
    done = {}
    while u is not None:
        done.update(u.done)
        u = live.step()
    assert a not in done
    for h, i, g in ((b, 3, 32), (c, 1, 16)):
        alone = Decoder(m, dc.replace(gen_length=g)).generate([PROMPTS[i]])[0]
        assert (done[h].token_ids, done[h].calls, done[h].commit_call) == \
            (alone.token_ids, alone.calls, alone.commit_call), h
