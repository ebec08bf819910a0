"""The cache modes' KV store (engine/kvstore.py): one allocation reused block after block of a batch
(freed when it ends), caches that are views of it with the very keys/values (and layout) the gather gave,
rows joining an open block written after the running rows (one view, no concatenation), and a
cache of an earlier block refused."""
from __future__ import annotations

import pytest
import torch

from engine import DecodeConfig, Decoder
from engine.cache import CACHE_MODES, Window
from engine.kvstore import KVStore, join_caches
from models import KVCache, ModelConfig, init_random, position_ids

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]]


@pytest.fixture(scope="module", params=["llada", "pangu"])
def model(request):
    cfg = ModelConfig.tiny(request.param, vocab_size=64, mask_token_id=63, eos_token_id=62)
    return init_random(cfg, seed=5, std=0.5).double()


def _recording(dec):
    """Wrap the decoder's cache mode's `start` to keep every cache it returns."""
    seen, start = [], dec.cache_mode.start

    def recorded(*a, **k):
        logits, cache = start(*a, **k)
        seen.append(cache)
        return logits, cache

    dec.cache_mode.start = recorded
    return seen


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_one_allocation_serves_every_block_of_a_batch(model, cache):
    dec = Decoder(model, DecodeConfig(method="confidence", gen_length=32, block_length=8, cache=cache))
    seen = _recording(dec)
    first = dec.generate(PROMPTS)
    store = dec.cache_mode.store
    assert len(seen) >= 4 and store.stats["allocations"] == 1 and store.stats["writes"] == len(seen)
    assert store.arena is None                    # freed when the batch ended: an idle decoder holds none
    base, mask = seen[0].layers[0][0].data_ptr(), seen[0].key_mask.data_ptr()
    for c in seen:                     # every block's cache lives in the one arena, the mask in its bool region
        assert c.slots is not None and c.slots.store is store
        assert c.layers[0][0].data_ptr() == base and c.key_mask.data_ptr() == mask
    again = dec.generate(PROMPTS)      # the next batch: one allocation more, tokens unchanged
    assert store.stats["allocations"] == 2
    assert [r.token_ids for r in again] == [r.token_ids for r in first]


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_the_cache_is_the_gather_in_owned_memory(model, cache):
    """What attention reads is exactly what `k[:, :, idx]` gave: same values, shape and strides."""
    mode = CACHE_MODES[cache](model)
    x = torch.randint(0, 60, (3, 24))
    valid = torch.ones(3, 24, dtype=torch.bool)
    valid[1, :4] = False
    pos = position_ids(model.config, valid)
    for lo in (8, 16):
        win = Window(8, 8, lo, 8)
        _, kvs = mode._full(x, valid, pos, win, True)
        _, c = mode.start(x, valid, pos, win)
        idx = mode.cached_positions(win, 24, x.device)
        probe = torch.tensor([lo])
        assert torch.equal(c.key_mask, win.mask(model.config, valid, probe, idx)[:, 0, 0])
        for (k, v), (ck, cv) in zip(kvs, c.layers):
            for t, ct in ((k, ck), (v, cv)):
                want = t[:, :, idx]
                assert torch.equal(ct, want) and ct.stride() == want.stride() and ct.is_contiguous()
                assert ct.data_ptr() % 64 == 0
    assert mode.store.stats["allocations"] == 1


def test_a_cache_of_an_earlier_block_is_refused(model):
    mode = CACHE_MODES["dual"](model)
    x = torch.randint(0, 60, (2, 24))
    valid = torch.ones(2, 24, dtype=torch.bool)
    pos = position_ids(model.config, valid)
    _, old = mode.start(x, valid, pos, Window(8, 8, 8, 8))
    _, new = mode.start(x, valid, pos, Window(8, 8, 16, 8))
    rows = torch.arange(2)
    mode.call(x, valid, pos, Window(8, 8, 16, 8), new, rows)
    with pytest.raises(RuntimeError, match="earlier block"):
        mode.call(x, valid, pos, Window(8, 8, 8, 8), old, rows)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_second_batch_on_one_decoder_is_refused_with_what_to_do(model, cache):
    """One Decoder's store holds one batch: stepping the first batch after a second one started is a
    RuntimeError that says to use a Decoder per batch or a LiveBatch, never keys of the other batch."""
    dec = Decoder(model, DecodeConfig(method="confidence", gen_length=16, block_length=8, cache=cache))
    first, second = dec.start(PROMPTS[:1]), dec.start(PROMPTS[1:2])
    dec.step(first)
    dec.step(second)
    with pytest.raises(RuntimeError, match="a Decoder per concurrent batch, or one LiveBatch"):
        dec.step(first)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_rows_joining_an_open_block_extend_its_view(model, cache):
    """Two rows with longer prompts and gen lengths join one running row inside a block: their
    cache rows follow the running row's in the store (grown once, the running row moved), the
    joined cache is one view over all three, and every row decodes as alone."""
    dec = Decoder(model, DecodeConfig(method="psd", depth=3, gen_length=16, block_length=8, cache=cache))
    longer = [30, 31, 32, 33, 34, 35, 36, 37, 38]
    state = dec.start([PROMPTS[1]], [16], live=True)
    assert dec.step(state) and dec.step(state)
    dec.join(state, [PROMPTS[0], longer], [24, 16])
    store = dec.cache_mode.store
    c = state.run.cache
    assert c.slots is not None and c.slots.rows == 3 and c.slots.row0 == 0
    assert c.layers[0][0].data_ptr() == store.arena.data_ptr() and c.layers[0][0].shape[0] == 3
    assert store.stats["allocations"] == 2 and store.stats["grown"] == 1
    while state.batch.cursor < state.batch.end:
        dec.step(state)
    wide = Decoder(model, DecodeConfig(method="psd", depth=3, gen_length=24, block_length=8, cache=cache))
    alone = [dec.generate([PROMPTS[1]])[0], wide.generate([PROMPTS[0]])[0], dec.generate([longer])[0]]
    assert [r.token_ids for r in dec.results(state)] == [r.token_ids for r in alone]


def test_the_store_grows_keeping_the_rows_in_use():
    """Rows appended past the capacity: a larger arena, the running rows moved into it."""
    store = KVStore()
    k = torch.randn(1, 2, 10, 4)
    a = store.write([(k, k + 1)], [(0, 6)], torch.ones(1, 6, dtype=torch.bool), 10)
    with store.after(a):
        b = store.write([(k * 2, k * 3)], [(0, 6)], torch.zeros(1, 6, dtype=torch.bool), 10)
    assert store.stats["allocations"] == 2 and store.stats["grown"] == 1
    j = join_caches(a, b)
    assert j.slots is not None and j.layers[0][0].data_ptr() == store.arena.data_ptr()
    assert torch.equal(j.layers[0][0], torch.cat((k, k * 2))[:, :, :6])
    assert torch.equal(j.layers[0][1], torch.cat((k + 1, k * 3))[:, :, :6])
    assert j.key_mask.tolist() == [[True] * 6, [False] * 6]
    before = j.layers[0][0].clone()
    w = store.widen(j, 2, 1)                       # two invisible columns before, one after (j is stale now)
    assert store.live(j) is None and store.live(w) is not None
    assert torch.equal(w.layers[0][0][:, :, 2:8], before) and not w.layers[0][0][:, :, [0, 1, 8]].any()
    assert w.key_mask.tolist() == [[False] * 2 + [True] * 6 + [False], [False] * 9]


def test_caches_outside_a_store_are_concatenated():
    k = torch.randn(2, 2, 5, 4)
    a = KVCache([(k, k)], torch.ones(2, 5, dtype=torch.bool))
    b = KVCache([(k + 1, k)], torch.zeros(2, 5, dtype=torch.bool))
    j = join_caches(a, b)
    assert j.slots is None and torch.equal(j.layers[0][0], torch.cat((k, k + 1)))
    assert j.key_mask.shape == (4, 5)
