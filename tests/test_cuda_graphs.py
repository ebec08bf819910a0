"""`--cuda-graphs` (engine/graphs.py): the bucketing, padding and graph cache run on CPU with an
eager stand-in for capture/replay and must give the tokens of the plain decoder; the option on a
CPU device is one error. No GPU has run the capture path (the CUDA test below is skipped here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine
from engine import DecodeConfig, Decoder, InputError
from engine import graphs
from engine.graphs import GraphedCall, bucket, graphed, ladder, pad_rows
from models import ModelConfig, init_random
from support import EagerBackend

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]          # 3 rows x 3 nodes = 9 canvases: padded to 12
PSD = dict(method="psd", policy_name="confidence", threshold=0.5, depth=2, gen_length=32, block_length=8,
           static_rows=True)


@pytest.fixture(scope="module", params=["llada", "dream", "pangu"])
def model(request):
    return init_random(ModelConfig.tiny(request.param, vocab_size=64, mask_token_id=63, eos_token_id=62),
                       seed=5, std=0.5)


class Recorder(EagerBackend):
    """The eager stand-in, recording the row count of every captured call."""

    def __init__(self):
        self.shapes = []

    def capture(self, fn, inputs):
        self.shapes.append(inputs[0].shape[0])
        return super().capture(fn, inputs)


def decode(model, wrap=None, **opts):
    dec = Decoder(model, DecodeConfig(**{**PSD, **opts}))
    if wrap is not None:
        dec.cache_mode = wrap(dec.cache_mode)
    return [r.token_ids for r in dec.generate(PROMPTS)], dec


# ---------------------------------------------------------------------- pure functions
def test_ladder_and_bucket():
    assert ladder(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert ladder(20) == [1, 2, 3, 4, 6, 8, 12, 16]
    sizes = ladder(1024)
    assert [bucket(n, sizes) for n in (1, 2, 3, 5, 7, 9, 13, 17, 25, 33, 1000)] == \
        [1, 2, 3, 6, 8, 12, 16, 24, 32, 48, 1024]
    assert bucket(1025, sizes) is None                          # beyond the ladder: eager
    assert all(bucket(n, sizes) / n < 1.5 for n in range(2, 1025))   # padding wastes less than half
    with pytest.raises(ValueError):
        bucket(0, sizes)


def test_pad_rows_repeats_row_zero():
    t = torch.arange(6).view(3, 2)
    p = pad_rows(t, 5)
    assert p.tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [0, 1]]
    assert pad_rows(t, 3) is t


# ---------------------------------------------------------------------- the padding path, eager stand-in
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_padded_bucketed_calls_give_the_plain_tokens(model, cache):
    want, _ = decode(model, cache=cache)
    rec = Recorder()
    got, dec = decode(model, lambda m: GraphedCall(m, rec), cache=cache)
    assert got == want
    st = dec.cache_mode.stats
    assert st["captures"] >= 1 and st["replays"] > st["captures"]        # later calls of a block replay
    assert 12 in rec.shapes and 9 not in rec.shapes                      # 9 canvases ran padded to 12
    assert st["eager"] == 0
    if cache != "none":
        assert 1 <= st["cache_copies"] < st["replays"]                   # the cache once per block, not per call


def test_eviction_and_eager_fallback_keep_the_tokens(model):
    want, _ = decode(model, cache="dual")
    got, dec = decode(model, lambda m: GraphedCall(m, EagerBackend(), max_graphs=1), cache="dual")
    assert got == want and dec.cache_mode.stats["evictions"] >= 1 and len(dec.cache_mode.graphs) == 1
    got, dec = decode(model, lambda m: GraphedCall(m, EagerBackend(), max_rows=8), cache="dual")
    assert got == want and dec.cache_mode.stats["eager"] > 0           # 9 canvases: beyond a ladder topping at 8


def test_a_stale_cache_would_be_caught(model, monkeypatch):
    """The parity check can fail: a graph runner that never refreshes its cache buffer after the
    first block decodes other tokens."""
    want, _ = decode(model, cache="dual")
    copied = []

    def once(self, buf, cache):
        if not copied:
            copied.append(1)
            orig(self, buf, cache)

    orig = GraphedCall._load_cache
    monkeypatch.setattr(GraphedCall, "_load_cache", once)
    got, _ = decode(model, lambda m: GraphedCall(m, EagerBackend()), cache="dual")
    assert got != want


# ---------------------------------------------------------------------- the option
def test_cuda_graphs_on_cpu_is_one_error():
    model = init_random(ModelConfig.tiny("llada"), seed=1)
    with pytest.raises(InputError, match="^--cuda-graphs needs a CUDA device$"):
        Decoder(model, DecodeConfig(method="greedy", cuda_graphs=True, static_rows=True))
    with pytest.raises(InputError, match="^--cuda-graphs needs a CUDA device$"):
        engine.generate(model, [[1, 2]], method="greedy", cuda_graphs=True, gen_length=8, block_length=8)


def test_cuda_graphs_needs_static_rows_and_not_compile(monkeypatch):
    model = init_random(ModelConfig.tiny("llada"), seed=1)
    mode = engine.CACHE_MODES["none"](model)
    monkeypatch.setattr(graphs, "CUDAGraphBackend", EagerBackend)    # past the device check on a CPU
    cuda = torch.device("cuda")
    with pytest.raises(InputError, match="needs --static-rows"):
        graphed(mode, DecodeConfig(cuda_graphs=True), cuda)
    with pytest.raises(InputError, match="do not combine"):
        graphed(mode, DecodeConfig(cuda_graphs=True, static_rows=True, compile=True), cuda)
    wrapped = graphed(mode, DecodeConfig(cuda_graphs=True, static_rows=True), cuda)
    assert isinstance(wrapped, GraphedCall) and isinstance(wrapped.backend, EagerBackend)
    assert DecodeConfig(method="greedy", static_rows=True, cuda_graphs=True).describe() == \
        "greedy[static-rows,cuda-graphs]"


def test_cli_flag_on_cpu():
    res = subprocess.run([sys.executable, "-m", "engine.generate", "--cuda-graphs", "--static-rows", "--device", "cpu",
                          "--gen-length", "8", "--block-length", "8", "1+1="], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == ["error: --cuda-graphs needs a CUDA device"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (never run: no GPU where this was written)")
def test_captured_graphs_give_the_plain_tokens_on_cuda():
    model = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5,
                        std=0.5).cuda()
    for cache in ("none", "dual"):
        want, _ = decode(model, cache=cache)
        got, dec = decode(model, cache=cache, cuda_graphs=True)
        assert got == want and dec.cache_mode.stats["captures"] >= 1


def test_bench_speed_counts_a_graphed_call_once(model):
    """bench.speed's call counter: a graphed call is one call of its rows (its warm-ups, captures
    and replays are not counted as forwards)."""
    from bench.speed import CallCounter, _graphed

    counter = CallCounter(model)
    try:
        decode(model, cache="dual")
        want = counter.calls, counter.rows
        counter.reset()
        _, dec = decode(model, lambda m: GraphedCall(m, EagerBackend(), max_graphs=1), cache="dual")
        served = _graphed(dec)
        assert served[0] > 0 and (counter.calls + served[0], counter.rows + served[1]) == want
    finally:
        counter.remove()
