"""Rolling rows (docs/loop.md): in a live batch with cache none, every row keeps its own block
cursor. A row done with its block starts its next one with the next model call (its first call
riding on the others' verification call), a joining row's first call rides on the next call too,
and a row that is answered or cancelled leaves at once: no row ever idles. Each sequence decodes
exactly as it would alone (float64, temperature 0, and --sampler row at temperature > 0)."""
from __future__ import annotations

import random

import pytest

from engine import DecodeConfig, Decoder, InputError
from engine.live import LiveBatch
from models import ModelConfig, init_random

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], list(range(1, 14)), [30, 31], [40, 41, 42, 43, 44]]
L = 8


def _model(family: str):
    cfg = ModelConfig.tiny(family, vocab_size=64, mask_token_id=63, eos_token_id=62)
    return init_random(cfg, seed=5, std=0.5).double()


def _drive(model, live: LiveBatch, schedule):
    """Feed `schedule` [(prompt index, gen length, seed, arrival step)] into `live` and step it until
    idle. Returns (results by index, streamed pieces by index, canvases per model call, the model
    call each sequence was added before)."""
    calls = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kw: calls.append((args[0] if args else kw["ids"]).shape[0]), with_kwargs=True)
    done, pieces, added, handles = {}, {}, {}, {}
    pending, step = sorted(schedule, key=lambda s: s[3]), 0
    try:
        while True:
            while pending and pending[0][3] <= step:
                i, g, seed, _ = pending.pop(0)
                handles[live.add(PROMPTS[i], gen_length=g, seed=seed)] = i
                added[i] = len(calls)
            update = live.step()
            step += 1
            if update is None:
                if not pending:
                    break
                continue
            for h, p in update.pieces.items():
                pieces.setdefault(handles[h], []).extend(p)
            for h, r in update.done.items():
                done[handles[h]] = r
    finally:
        hook.remove()
    return done, pieces, calls, added


def _alone(model, dc: DecodeConfig, i: int, g: int, seed):
    dec = Decoder(model, dc.replace(gen_length=g))
    *_, last = dec.stream([PROMPTS[i]], seeds=None if seed is None else [seed])
    return last.results[0]


CASES = [
    ("llada", dict(method="confidence", threshold=0.5)),
    ("llada", dict(method="psd", policy_name="confidence", depth=3)),
    ("llada", dict(method="psd", policy_name="random", depth=2)),          # a per-sequence policy state
    ("llada", dict(method="lopa")),
    ("llada", dict(method="greedy", top_logprobs=2)),
    ("llada", dict(method="confidence", threshold=0.5, align="sequence")),
    ("llada", dict(method="confidence", threshold=0.6, temperature=0.7, sampler="row")),
    ("dream", dict(method="confidence", threshold=0.5, min_tokens=3)),
    ("dream", dict(method="psd", policy_name="confidence", depth=2, align="sequence")),
    ("pangu", dict(method="psd", policy_name="confidence", depth=3)),
    ("llada2", dict(method="confidence", threshold=0.5)),
]


@pytest.mark.parametrize("family,case", CASES, ids=lambda c: c if isinstance(c, str) else
                         ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("seed", range(2))
def test_random_rolling_schedules_decode_as_alone_and_never_idle(family, case, seed):
    rnd = random.Random(seed)
    model = _model(family)
    dc = DecodeConfig(gen_length=32, block_length=L, **case)
    sampled = case.get("sampler") == "row"
    schedule = [(i, rnd.choice([8, 16, 24, 32]), 100 + i if sampled else None, rnd.randrange(0, 10))
                for i in range(len(PROMPTS))]
    live = LiveBatch(Decoder(model, dc))
    assert live.rolling
    done, pieces, calls, added = _drive(model, live, schedule)
    busy = set()
    for i, g, s, _ in schedule:
        alone, got = _alone(model, dc, i, g, s), done[i]
        assert (got.token_ids, got.calls, got.commit_call, got.commit_step, got.commit_source) == \
            (alone.token_ids, alone.calls, alone.commit_call, alone.commit_step, alone.commit_source), (i, schedule)
        assert got.commit_prob == pytest.approx(alone.commit_prob, abs=1e-5)      # float32 confidences
        if alone.commit_top is not None:             # --top-logprobs: the same ids, float32 probabilities
            assert [[t for t, _ in pos] for pos in got.commit_top] == [[t for t, _ in pos] for pos in alone.commit_top]
            assert [p for pos in got.commit_top for _, p in pos] == \
                pytest.approx([p for pos in alone.commit_top for _, p in pos], abs=1e-5)
        assert pieces.get(i, []) == got.token_ids
        busy |= set(range(added[i], added[i] + got.calls))     # its calls follow each other from its arrival
    # no row waits for another's block: the model was called exactly while some sequence had calls to take
    assert set(range(len(calls))) == busy, (schedule, calls)


def test_a_row_done_with_its_block_starts_the_next_with_the_next_call():
    """Two sequences from step 0 whose blocks take different numbers of steps: rolling, the batch
    makes as many calls as its longest sequence takes; with one block cursor for both, more (a
    row done with a block waits for the other's), and the same tokens either way."""
    model = _model("llada")
    dc = DecodeConfig(method="confidence", threshold=0.5, gen_length=32, block_length=L)
    schedule = [(1, 32, None, 0), (2, 32, None, 0)]
    counts, tokens = {}, {}
    for rolling in (True, False):
        done, _, calls, _ = _drive(model, LiveBatch(Decoder(model, dc), rolling=rolling), schedule)
        counts[rolling], tokens[rolling] = len(calls), [done[i].token_ids for i in (1, 2)]
        if rolling:
            longest = max(done[i].calls for i in (1, 2))
    assert counts[True] == longest < counts[False]
    assert tokens[True] == tokens[False]


def test_an_answered_row_leaves_at_once():
    model = _model("llada")
    live = LiveBatch(Decoder(model, DecodeConfig(method="greedy", gen_length=8, block_length=L)))
    short, long_ = live.add([1, 2, 3], gen_length=8), live.add([4, 5, 6], gen_length=32)
    while short not in (u := live.step()).done:
        pass
    assert live.running == 1 and live.state.run is not None        # the long row's block is still open
    assert long_ not in u.done


@pytest.mark.parametrize("case", [dict(cache="dual"), dict(method="ete"), dict(draft_budget="auto", method="psd"),
                                  dict(cross_block=True, method="psd")], ids=str)
def test_rolling_where_the_decoder_cannot_is_refused(case):
    dec = Decoder(_model("llada"), DecodeConfig(gen_length=16, block_length=L, **case))
    assert not dec.rolls and not LiveBatch(dec).rolling          # the default: one block cursor
    with pytest.raises(InputError, match="rolling rows need cache none"):
        LiveBatch(dec, rolling=True)
    with pytest.raises(InputError, match="rolling rows need cache none"):
        dec.start([[1, 2, 3]], rolling=True)


def test_a_cancelled_row_frees_its_slot_for_a_waiting_sequence_at_once():
    """max_rows 1: a cancelled sequence's row is free in the same step, so the waiting one takes
    the very next call (on one cursor it would wait for the block boundary) and decodes as alone."""
    model = _model("llada")
    dc = DecodeConfig(method="greedy", gen_length=32, block_length=L)
    live = LiveBatch(Decoder(model, dc), max_rows=1)
    first, second = live.add(PROMPTS[0], gen_length=32), live.add(PROMPTS[1], gen_length=16)
    live.step(), live.step()                                  # the first sequence's block is open
    live.cancel(first)
    assert live.running == 0 and live.waiting
    u = live.step()
    assert live.running == 1 and live.handles == [second] and u.rows == 1
    done = {}
    while u is not None:
        done.update(u.done)
        u = live.step()
    assert first not in done
    assert done[second].token_ids == _alone(model, dc, 1, 16, None).token_ids


@pytest.mark.parametrize("rolling", [True, False])
def test_a_shifted_model_keeps_the_column_before_the_block_when_the_canvas_is_trimmed(rolling):
    """Dream reads a block's first prediction one column before it. With --align sequence a prompt
    inside its first block starts at the block; when the only other row left, trimming the canvas
    to that row's first column put the block at column 0 (rolling: a crash on the next call)."""
    model = _model("dream")
    dc = DecodeConfig(method="confidence", threshold=0.5, gen_length=16, block_length=4, align="sequence")
    live = LiveBatch(Decoder(model, dc), rolling=rolling)
    live.add(list(range(1, 14)), gen_length=4)
    short = live.add([7], gen_length=16)
    done = {}
    while (u := live.step()) is not None:
        done.update(u.done)
    assert done[short].token_ids == Decoder(model, dc).generate([[7]])[0].token_ids
