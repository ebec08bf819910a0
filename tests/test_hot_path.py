"""The decoding hot path never waits for the device more than a constant number of times.

A host synchronisation is any call that needs a tensor's *value* on the host (`.item()`,
`.tolist()`, `bool(t)`, `int(t)`, `nonzero`, a boolean-mask index, ...): on a GPU each one
drains the queue. `SyncCounter` (a TorchFunctionMode, so it sees every torch call, in the engine
loop and in the model alike) counts them; forward hooks on the model split the count into
"inside a model call" (must be 0: no layer reads anything back, whatever the rows) and "between
two model calls" (one decode step: a small constant that must not grow with the batch, the
layers, the drafts or the positions). It replaces the source-text check of engine/loop.py,
which could not see the model.

The count runs on CPU, where these calls cost nothing; what it pins down is the code path,
which is the same on a GPU. The Triton backend's launchers are checked under the interpreter;
what runs inside a kernel launch (the interpreter's numpy copies) is not host code of a GPU run
and is not counted.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import psd_kernels
from engine import DecodeConfig, DraftGraph
from engine.loop import Decoder
from models import ModelConfig, init_random
import models.transformer as transformer
from engine.testing.hostsync import STEP_BOUND, Launches, Profile, SyncCounter, _pause_triton_kernels, check

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [30, 31]]
GRAPHS = {2: DraftGraph.chain(1), 8: DraftGraph([[], [0], [1], [0, 1], [0, 2], [0, 1, 2], [2], [0, 1, 2, 3]])}


def profile(family="llada", layers=2, batch=2, nodes=8, cache="dual", backend=None, monkeypatch=None, unpad=False,
            **opts):
    """`unpad`: whole-canvas calls on real positions only (`Transformer.unpads`, a CPU's default: one
    read each); off by default here, pinning the path a GPU runs."""
    model = init_random(ModelConfig.tiny(family, num_layers=layers), seed=7, std=0.3)
    model.unpad = unpad
    kw = dict(method="psd", policy_name="confidence", threshold=0.5, acceptance="policy", graph=GRAPHS[nodes],
              gen_length=16, block_length=8, cache=cache)
    kw.update(opts)
    dec = Decoder(model, DecodeConfig(**kw))
    counter = SyncCounter()
    if backend is not None:
        monkeypatch.setattr(psd_kernels, "BACKEND", backend)
        if backend == "triton":
            _pause_triton_kernels(monkeypatch, counter)
    prof = Profile(model, counter)
    try:
        with counter:
            results = dec.generate(PROMPTS[:batch])
    finally:
        prof.close()
    return prof, results


def exact_gaps(prof, blocks: int, drafts: bool, cache: str, backend: str = "reference", unpad: bool = False) -> Counter:
    """The host reads between two model calls, exactly. A decode step reads which rows go on (1),
    which drafts are valid (1; none with a root-only graph or --static-rows), and, on the reference
    backend, the row plan of a call over a cache (1). A block boundary reads which rows go on (the
    step that ends the block), whether a row failed (closing it) and which rows open the next (3).
    With `unpad`, a whole-canvas call reads its real positions (1): every call without a cache, the
    block's first call with one."""
    step = 1 + int(drafts) + int(cache != "none" and backend == "reference") + int(unpad and cache == "none")
    n = len(prof.between)
    return Counter({step: n - (blocks - 1)}) + Counter({3 + int(unpad): blocks - 1})


# (profile options, graph with drafts?): every configuration's reads, exactly
EXACT = [
    (dict(cache="none"), True), (dict(cache="prefix"), True), (dict(cache="dual"), True),
    (dict(cache="dual", batch=4), True), (dict(cache="none", layers=3, nodes=2), True),
    (dict(cache="dual", gen_length=32, block_length=16), True), (dict(family="pangu"), True),
    (dict(family="dream", cache="prefix"), True), (dict(cache="dual", static_rows=True), False),
    (dict(method="confidence", graph=None, policy_name=None, acceptance=None), False),
    (dict(method="confidence", graph=None, policy_name=None, acceptance=None, cache="none"), False),
    (dict(method="greedy", graph=None, policy_name=None, acceptance=None, threshold=None, cache="prefix"), False),
    (dict(method="confidence", graph=None, policy_name=None, acceptance=None, static_rows=True), False),
]


@pytest.mark.parametrize("kw, drafts", EXACT, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items())
                         if isinstance(v, dict) else str(v))
def test_exact_host_reads_per_step(kw, drafts):
    """Not a bound: one more read per step (an .item() anywhere in the loop, the sampler or the
    model) fails here, for every configuration."""
    prof = profile(**kw)[0]
    assert prof.inside and max(prof.inside) == 0, prof.inside
    blocks = kw.get("gen_length", 16) // kw.get("block_length", 8)
    want = exact_gaps(prof, blocks, drafts, kw.get("cache", "dual"))
    assert Counter(prof.between) == want, (prof.between, want)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_exact_host_reads_per_step_with_unpadded_calls(cache):
    """A CPU's path (`Transformer.unpads`): one more read per whole-canvas call, none inside it."""
    prof = profile(cache=cache, unpad=True)[0]
    assert prof.inside and max(prof.inside) == 0, prof.inside
    assert Counter(prof.between) == exact_gaps(prof, 2, True, cache, unpad=True), prof.between


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_no_sync_inside_a_model_call_and_a_constant_per_step(cache):
    base = profile(cache=cache)[0]
    step = check(base)
    assert step <= STEP_BOUND
    assert max(base.rows) > 2 and (cache == "none" or any(base.cached))   # drafts verified over a cache
    for variant in (dict(batch=1), dict(batch=4), dict(layers=1), dict(layers=3), dict(nodes=2),
                    dict(gen_length=32, block_length=16)):
        other = profile(cache=cache, **variant)[0]
        assert check(other) == step, f"{variant}: {max(other.between)} syncs per step, {step} at the base"


def test_context_causal_model_and_plain_policies():
    """The own-mask path (openPangu) and a root-only graph (plain confidence decoding)."""
    steps = set()
    for kw in (dict(family="pangu"), dict(family="pangu", batch=4, layers=3), dict(family="dream", cache="prefix"),
               dict(method="confidence", graph=None, policy_name=None, acceptance=None)):
        steps.add(check(profile(**kw)[0]))
    assert max(steps) <= STEP_BOUND


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.slow
def test_cross_block_drafts_add_no_sync_per_step(backend, monkeypatch):
    """--cross-block drafts reach the next block (two rankings, the wider assembly, the reused
    output) and add no read per step. Between two calls there may now be a step, a block boundary
    whose first call a kept draft made unnecessary (the failure check, the rows that go on, the
    rows that carry) and the next step: a bound, whatever the batch, depth or graph size."""
    base = check(profile(cache="none", backend=backend, monkeypatch=monkeypatch, gen_length=32)[0])
    counts = set()
    # under Triton's interpreter a decode takes seconds: two variants there (the reference backend
    # runs all four, and shows that the drafts crossing blocks save calls)
    variants = (dict(), dict(batch=4), dict(nodes=2), dict(layers=3)) if backend == "reference" else \
        (dict(batch=4), dict(nodes=2))
    for variant in variants:
        prof, results = profile(cache="none", cross_block=True, backend=backend, monkeypatch=monkeypatch,
                                gen_length=32, **variant)
        counts.add(check(prof))
        if backend == "reference":
            assert sum(r.calls for r in results) < sum(r.calls for r in profile(
                cache="none", backend=backend, monkeypatch=monkeypatch, gen_length=32, **variant)[1])
    assert max(counts) <= base + 3, counts


@pytest.mark.slow
def test_triton_backend_launchers_do_not_sync(monkeypatch):
    """Under the interpreter: every psd_kernels launcher (top-1, draft assembly, attention and the
    call's RowPlan) reads nothing back, and one attention kernel launch serves a layer."""
    from psd_kernels.ops import sparse_attn

    prof, _ = profile(backend="triton", monkeypatch=monkeypatch, batch=3, layers=2)
    assert check(prof) <= STEP_BOUND
    cached_calls = sum(prof.cached)
    assert cached_calls > 0
    assert sparse_attn._kernel.n == 2 * cached_calls          # one launch per layer per cached call


def test_the_counter_sees_a_sync_in_attend(monkeypatch):
    """The check can fail: the per-layer `bincount(row_map).tolist()` that attend used to make is
    counted in every layer of every cached call."""
    orig = transformer.attend

    def attend_with_readback(q, k_own, v_own, own_mask, cache_kv=None, cache=None, all_own=False, **kw):
        if cache is not None and cache.row_map is not None:
            torch.bincount(cache.row_map, minlength=cache.key_mask.shape[0]).tolist()
        return orig(q, k_own, v_own, own_mask, cache_kv, cache, all_own, **kw)

    monkeypatch.setattr(transformer, "attend", attend_with_readback)
    prof, _ = profile(layers=3)
    inside = [n for n, c in zip(prof.inside, prof.cached) if c]
    assert inside and all(n == 2 * 3 for n in inside)           # bincount + tolist, in each of 3 layers
    with pytest.raises(AssertionError, match="inside model calls"):
        check(prof)


def test_row_plan_reads_nothing_for_the_kernel_and_one_int_for_the_reference():
    row_map = torch.tensor([0, 0, 2, 2, 2, 3])
    with SyncCounter() as c:
        plan = psd_kernels.plan_rows(row_map, 5, backend="triton")
    assert c.count == 0, c.calls
    with SyncCounter() as c:
        padded = psd_kernels.plan_rows(row_map, 5, backend="reference")
    assert c.count == 1 and padded.max_rows == 3
    assert plan.offsets.tolist() == padded.offsets.tolist() == [0, 2, 2, 5, 6, 6]


def test_the_counter_sees_every_kind_of_sync():
    x = torch.tensor([1, 0, 2])
    m = x > 0
    cases = [lambda: x[0].item(), lambda: x.tolist(), lambda: bool(x[0]), lambda: int(x[0]), lambda: float(x[0]),
             lambda: [0, 1, 2][x[0]], lambda: x.nonzero(), lambda: torch.nonzero(x), lambda: x.cpu(),
             lambda: x.numpy(), lambda: x[m], lambda: x.clone().__setitem__(m, 5), lambda: torch.equal(x, x),
             lambda: torch.bincount(x), lambda: torch.unique(x), lambda: torch.repeat_interleave(x, x),
             lambda: torch.masked_select(x, m), lambda: 1 if x.any() else 0, lambda: f"{x[0]}"]
    for case in cases:
        with SyncCounter() as c:
            case()
        assert c.count == 1, c.calls
    with SyncCounter() as c:      # device-side work reads nothing back
        y = torch.where(m, x, -x).cumsum(0)[x.argmax()] + x.sum()
        torch.repeat_interleave(x, 2), x.index_select(0, x), torch.searchsorted(x.sort().values, x), y.exp()
    assert c.count == 0, c.calls


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.slow
def test_one_attention_launch_per_layer_whatever_the_batch(backend, monkeypatch):
    """Every cached verification call makes exactly one shared_prefix_attention call per layer
    (and, on the Triton backend, one kernel launch), for 1 or 4 sequences and 2 or 8 nodes."""
    from psd_kernels import reference
    from psd_kernels.ops import sparse_attn

    # the reference backend: three shapes; Triton's interpreter (seconds a decode): the two extremes
    for batch, nodes in ((1, 8), (4, 8), (4, 2)) if backend == "reference" else ((1, 8), (4, 2)):
        calls = {"public": 0, "impl": 0}

        def counting(fn, key):
            def wrapped(*a, **kw):
                calls[key] += 1
                return fn(*a, **kw)
            return wrapped

        with monkeypatch.context() as mp:
            mp.setattr(psd_kernels, "shared_prefix_attention", counting(psd_kernels.shared_prefix_attention, "public"))
            impl = reference if backend == "reference" else sparse_attn
            mp.setattr(impl, "shared_prefix_attention", counting(impl.shared_prefix_attention, "impl"))
            if backend == "triton":
                mp.setattr(psd_kernels, "BACKEND", "triton")
                mp.setattr(sparse_attn, "_kernel", Launches(sparse_attn._kernel, None))
            prof, _ = profile(layers=3, batch=batch, nodes=nodes, cache="dual")
            cached = sum(prof.cached)
            assert cached > 0 and max(r for r, c in zip(prof.rows, prof.cached) if c) > batch   # drafts per sequence
            assert calls == {"public": 3 * cached, "impl": 3 * cached}, (batch, nodes, calls, cached)
            if backend == "triton":
                assert sparse_attn._kernel.n == 3 * cached
