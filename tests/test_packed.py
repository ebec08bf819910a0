"""Packed whole-canvas calls (engine/cache.py `NoCache._packed`, docs/loop.md "Packed calls"): when the
rows of a batch span fewer columns than its canvas (rows of different lengths or progress, rows that
joined a running batch), a whole-canvas call runs each row's own columns only, and gives the same
logits and keys/values as the padded call at every column that is not padding."""
from __future__ import annotations

import pytest
import torch

from engine import DecodeConfig, Decoder
from engine.cache import NoCache, Window
from engine.live import LiveBatch
from models import ModelConfig, init_random, position_ids

FAMILIES = ["llada", "dream", "pangu", "llada2"]


def _model(family):
    cfg = ModelConfig.tiny(family, vocab_size=64, mask_token_id=63, eos_token_id=62)
    return init_random(cfg, seed=3, std=0.5).double()


def _canvas(mc, spans, N):
    """Rows with valid columns [a, b) each, random tokens, padding elsewhere."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(2, 60, (len(spans), N), generator=g)
    valid = torch.zeros(len(spans), N, dtype=torch.bool)
    for r, (a, b) in enumerate(spans):
        valid[r, a:b] = True
    return x.masked_fill(~valid, 0), valid, position_ids(mc, valid)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_call_is_the_padded_call_at_every_valid_column(family):
    model = _model(family)
    mc = model.config
    # left padding (short prompts), right padding (shorter generations): no row spans all 24 columns
    spans, N, lo = [(0, 16), (6, 24), (3, 19), (8, 20)], 24, 12
    x, valid, pos = _canvas(mc, spans, N)
    span = max(b - a for a, b in spans)
    mode = NoCache(model)
    widths = []
    forward = model.forward
    model.forward = lambda ids, *a, **k: widths.append(ids.shape[1]) or forward(ids, *a, **k)
    try:
        want, want_kv = mode._full(x, valid, pos, Window(10, 4, lo, 4), True)
        got, got_kv = mode._full(x, valid, pos, Window(10, 4, lo, 4, span=span), True)
    finally:
        model.forward = forward
    assert widths == [N, span]                        # the packed call ran `span` columns per row
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for (k0, v0), (k1, v1) in zip(want_kv, got_kv):
        for t0, t1 in ((k0, k1), (v0, v1)):
            torch.testing.assert_close(t1.transpose(1, 2)[valid], t0.transpose(1, 2)[valid], rtol=1e-12, atol=1e-12)


def test_the_attention_mask_with_per_row_indices_is_the_canvas_mask_gathered():
    from models import attention_mask
    for family in FAMILIES:
        mc = _model(family).config
        spans, N = [(0, 16), (6, 24), (3, 19)], 24
        _, valid, _ = _canvas(mc, spans, N)
        idx = torch.arange(N)
        full = attention_mask(mc, valid, 10, 12, 4, idx, idx)           # [R, 1, N, N]
        first = torch.tensor([a for a, _ in spans])
        cols = first[:, None] + torch.arange(18)                          # past N: padding of the call
        packed = attention_mask(mc, valid, 10, 12, 4, cols, cols)
        for r, (a, b) in enumerate(spans):
            n = b - a
            assert torch.equal(packed[r, 0, :n, :n], full[r, 0, a:b, a:b]), family
            assert not packed[r, 0, :, n:][~torch.eye(18, dtype=torch.bool)[:, n:]].any()   # padding: invisible


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_rows_of_different_lengths_decode_as_alone_and_run_packed(cache):
    """A static batch of mixed generation lengths packs its whole-canvas calls (the longest prompt and
    the longest generation are different rows) and every row decodes what it decodes alone."""
    model = _model("llada")
    prompts, lengths = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14]], [8, 32]
    dec = Decoder(model, DecodeConfig(method="confidence", threshold=0.5, block_length=8, cache=cache))
    alone = [dec.results(_run(dec, dec.start([p], [g])))[0].token_ids for p, g in zip(prompts, lengths)]
    widths = []
    forward = model.forward
    model.forward = lambda ids, *a, **k: widths.append(ids.shape[1]) or forward(ids, *a, **k)
    try:
        state = _run(dec, dec.start(prompts, lengths))
    finally:
        model.forward = forward
    assert [r.token_ids for r in dec.results(state)] == alone
    N, span = 8 + 32, 2 + 32
    assert span in widths and N not in widths           # no whole-canvas call ran the padded canvas


def _run(dec, state):
    while not state.done:
        dec.step(state)
    return state


def test_a_live_batch_packs_the_calls_of_rows_that_joined():
    """Joins lay a new row's prompt out to end at the batch's cursor, padding whichever side is
    shorter: a longer prompt joining widens the canvas to the left of the running row, whose calls
    (and the new row's) then run packed, never the whole widened canvas."""
    model = _model("llada")
    dec = Decoder(model, DecodeConfig(method="confidence", threshold=0.5, gen_length=16, block_length=8))
    short, long_ = [5, 6, 7], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    widths = []
    forward = model.forward
    model.forward = lambda ids, *a, **k: widths.append(ids.shape[1]) or forward(ids, *a, **k)
    try:
        live = LiveBatch(dec)
        a = live.add(short, gen_length=16)
        live.step()                                   # a's first call: its first block is open
        b = live.add(long_, gen_length=8)             # ends at a's cursor: 7 columns of padding before a
        done = {}
        while (u := live.step()) is not None:
            done.update(u.done)
    finally:
        model.forward = forward
    alone = [dec.results(_run(dec, dec.start([p], [g])))[0].token_ids for p, g in ((short, 16), (long_, 8))]
    assert [done[a].token_ids, done[b].token_ids] == alone
    canvas, span = 7 + 3 + 16, max(3 + 16, 10 + 8)
    assert widths[0] == 3 + 16 and max(widths[1:]) == span < canvas   # packed: never the widened canvas


def test_serve_sim_compares_the_schedulers_on_the_same_requests(capsys):
    """bench.serve_sim: both schedulers answer every request with the same tokens, and its table
    and JSON report the cost of each; bad options are one line."""
    import json

    from bench import serve_sim
    from support import run_main
    args = ["--clients", "3", "--requests", "5", "--rounds", "1", "--cache", "none", "--max-tokens", "16", "8",
            "--block-length", "8", "--modes", "continuous", "static", "by-length", "serial"]
    rows = {}
    for unpad in ("off", "on"):
        rc, out, err = run_main(serve_sim.main, args + ["--unpad", unpad], capsys)
        assert rc == 0, err
        rows[unpad] = row = json.loads(out.strip().splitlines()[-1])["rows"][0]
        assert row["identical"] and row["clients"] == 3
        for mode in ("continuous", "static", "by-length", "serial"):
            assert row[mode]["requests"] == 5 and row[mode]["columns_per_request"] > 0 and \
                row[mode]["calls_per_request"] > 0
            r = row[mode]       # the TTFT spread: a bimodal static distribution shows in p10 / p90 and the mean
            assert 0 < r["p10_ttft"] <= r["p50_ttft"] <= r["p90_ttft"] and r["p10_ttft"] <= r["mean_ttft"] <= r["p90_ttft"]
    cols = {u: {m: rows[u][m]["columns_per_request"] for m in ("continuous", "static", "by-length", "serial")}
            for u in rows}
    assert cols["off"]["by-length"] < cols["off"]["continuous"]        # every column runs: the 16-token rectangle
    # on real positions only, a request costs its own columns whatever it is batched with
    assert cols["on"]["continuous"] == cols["on"]["static"] == cols["on"]["by-length"] < cols["off"]["continuous"]
    assert cols["on"]["serial"] == cols["off"]["serial"] == cols["on"]["static"]     # serial: the floor
    rc, _, err = run_main(serve_sim.main, ["--method", "confidence:threshold=7", "--requests", "2"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error:")
    # --profile: per mode, its functions by own time; the model's matmuls among them, the JSON still last
    rc, out, err = run_main(serve_sim.main, args[:-4] + ["continuous", "static", "--profile", "4"], capsys)
    assert rc == 0, err
    heads = [line for line in out.splitlines() if line.startswith("profile: cache none, 3 clients")]
    assert [h.split(", ")[2] for h in heads] == ["continuous", "static"]
    tables = out.split("profile: ")[1:]
    assert all(len([r for r in t.splitlines() if r.startswith("| `")]) == 4 and "linear" in t for t in tables)
    assert json.loads(out.strip().splitlines()[-1])["rows"][0]["identical"]
    assert serve_sim.function_name("/a/models/transformer.py", 94, "apply_rope") == "models/transformer.py:94(apply_rope)"
    assert serve_sim.function_name("<frozen importlib._bootstrap>", 1, "_load") == "<frozen importlib._bootstrap>:1(_load)"
    assert serve_sim.function_name("~", 0, "<built-in method torch.cat>") == "<built-in method torch.cat>"


@pytest.mark.parametrize("family", ["llada", "dream", "pangu"])
def test_a_packed_block_caches_each_rows_keys_only(family):
    """`dual` on a packed block: the cache holds span - block columns per row (each row's visible
    keys first), not the canvas's, and every row still decodes what it decodes alone."""
    model = _model(family)
    prompts, lengths, L = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14]], [8, 32], 8
    dec = Decoder(model, DecodeConfig(method="confidence", threshold=0.5, block_length=L, cache="dual"))
    alone = [dec.results(_run(dec, dec.start([p], [g])))[0].token_ids for p, g in zip(prompts, lengths)]
    cached = []
    forward = model.forward
    model.forward = lambda ids, *a, cache=None, **k: (cache is not None and cached.append(cache.length)) \
        or forward(ids, *a, cache=cache, **k)
    try:
        state = _run(dec, dec.start(prompts, lengths))
    finally:
        model.forward = forward
    assert [r.token_ids for r in dec.results(state)] == alone
    span, canvas, shift = 2 + 32, 8 + 32, model.config.logit_shift
    assert cached and max(cached) <= span - L < canvas - L - shift


@pytest.mark.parametrize("family", ["dream", "pangu"])
def test_a_packed_dual_block_with_rows_that_start_at_the_block(family):
    """--align sequence on a shifted model: a short prompt starts at the block, so the column before
    it (the shift's) is not the row's. Its packed dual cache then has no prefix, and its suffix keys
    are all kept (before, the first suffix key was skipped and the longest row's last one cut)."""
    model = _model(family)
    prompts, lengths = [[5, 4, 1], [35, 58, 18, 51, 48, 3, 14], [34, 23, 17, 49, 11, 52, 6, 16, 13]], [8, 24, 24]
    dec = Decoder(model, DecodeConfig(method="psd", policy_name="localleap", depth=2, block_length=8, cache="dual",
                                      align="sequence"))
    alone = [dec.results(_run(dec, dec.start([p], [g])))[0] for p, g in zip(prompts, lengths)]
    got = dec.results(_run(dec, dec.start(prompts, lengths)))
    assert [(r.token_ids, r.calls) for r in got] == [(r.token_ids, r.calls) for r in alone]
    for r, a in zip(got, alone):
        assert r.commit_prob == pytest.approx(a.commit_prob, abs=1e-5)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_a_join_that_spans_more_without_widening_the_canvas(cache):
    """A row joining an open packed block may span more columns than any running row while fitting
    the canvas as it is (no padding added): the block's calls take the wider span from then on."""
    model = _model("llada")
    dec = Decoder(model, DecodeConfig(method="confidence", threshold=0.5, block_length=8, cache=cache))
    a, b, c = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
    state = dec.start([a, b], [8, 24], live=True)          # canvas 10 + 24, spans 18 and 26: packed
    assert dec.step(state)                                 # the first block's first call
    dec.join(state, [c], [24])                             # spans 34 = the canvas: nothing widens
    while dec.step(state) or state.batch.cursor < state.batch.end:
        pass
    got = [r.token_ids for r in dec.results(state)]
    alone = [dec.results(_run(dec, dec.start([p], [g])))[0].token_ids for p, g in ((a, 8), (b, 24), (c, 24))]
    assert got == alone
