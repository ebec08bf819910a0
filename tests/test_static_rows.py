"""`--static-rows` (every verification call of a block has the same number of canvases, the
precondition for CUDA graphs) and `--compile` (torch.compile of the transformer blocks, on a twin
that shares the weights): neither changes a token."""
from __future__ import annotations

import pytest

import engine
from engine import DecodeConfig, Decoder
from models import ModelConfig, init_random

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13]]


@pytest.fixture(scope="module", params=["llada", "dream", "pangu"])
def model(request):
    return init_random(ModelConfig.tiny(request.param, vocab_size=64, mask_token_id=63, eos_token_id=62),
                       seed=5, std=0.5)


def rows_per_call(model, **opts):
    """Canvases of every model call, in order, and the results."""
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    try:
        results = engine.generate(model, PROMPTS, gen_length=32, block_length=8, **opts)
    finally:
        hook.remove()
    return seen, results


def test_every_verification_call_of_a_block_has_one_shape(model):
    """4 rows, a graph of 4 nodes: a call has S (a block's first) or S·4 canvases, S the rows still
    on the block; without the option the counts follow the valid drafts."""
    static, res = rows_per_call(model, method="psd", policy_name="confidence", threshold=0.5, depth=3, cache="dual",
                                static_rows=True)
    allowed = {s for s in range(1, 5)} | {4 * s for s in range(1, 5)}
    assert set(static) <= allowed, static
    assert 16 in static
    free, _ = rows_per_call(model, method="psd", policy_name="confidence", threshold=0.5, depth=3, cache="dual")
    assert not set(free) <= allowed, free           # the check can fail: drafts are skipped at block ends


def test_static_rows_read_back_less_per_step(model):
    """The valid drafts are no longer gathered with a nonzero: one host read fewer per step."""
    from tests.test_hot_path import SyncCounter

    def syncs(**opts):
        dec = Decoder(model, DecodeConfig(method="psd", policy_name="confidence", threshold=0.5, depth=3,
                                          gen_length=32, block_length=8, cache="none", **opts))
        with SyncCounter() as c:
            dec.generate(PROMPTS)
        return c.count

    assert syncs(static_rows=True) < syncs()


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.slow
def test_compile_keeps_every_token_and_leaves_the_model_eager(cache):
    model = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5, std=0.5)
    for opts in (dict(method="greedy"), dict(method="psd", policy_name="confidence", threshold=0.5, depth=3,
                                              static_rows=True)):
        kw = dict(gen_length=16, block_length=8, cache=cache, **opts)
        want = engine.generate(model, PROMPTS, **kw)
        got = engine.generate(model, PROMPTS, compile=True, **kw)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
    twin = model.compiled()
    assert twin is model.compiled()                                     # made once per model
    assert all("before_attention" not in vars(b) for b in model.layers)  # the model itself stays eager
    assert all("before_attention" in vars(b) and "after_attention" in vars(b) for b in twin.layers)
    assert twin.layers[0].attn.wq.weight is model.layers[0].attn.wq.weight      # one copy of the weights
    assert twin.tok_embeddings is model.tok_embeddings


def test_labels_and_flags():
    assert DecodeConfig(method="greedy", compile=True, static_rows=True).describe() == "greedy[static-rows,compile]"
    assert DecodeConfig(method="greedy").describe() == "greedy"
    from engine.cli import build_parser

    args = build_parser().parse_args(["--static-rows", "--compile", "x"])
    assert args.static_rows is True and args.compile is True


def test_compile_without_a_compiler_is_one_error(monkeypatch):
    import shutil

    from engine import InputError

    model = init_random(ModelConfig.tiny("llada"), seed=1)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(InputError, match="needs a C\\+\\+ compiler"):
        Decoder(model, DecodeConfig(method="greedy", compile=True))
    Decoder(model, DecodeConfig(method="greedy"))                     # without --compile nothing is needed


def _cached_calls(model, R: int, T: int, C: int, S: int, row_map: list | None, seed: int, **own):
    """(ids, pos, own mask, cache) of a call of R rows of T positions over C cache rows of S keys (each
    row's cache row: `row_map`, None one per row)."""
    import torch

    from models import KVCache

    c = model.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size - 2, (R, T), generator=g)
    pos = torch.arange(S, S + T).expand(R, T)
    own_mask = torch.ones(1, 1, T, T, dtype=torch.bool)
    if not C:
        return ids, pos, own_mask, None
    layers = [tuple(torch.randn(C, c.num_kv_heads, S, c.head_dim, generator=g) for _ in "kv") for _ in model.layers]
    key_mask = torch.rand(C, S, generator=g) < 0.8
    key_mask[:, 0] = True
    rows = None if row_map is None else torch.tensor(row_map)
    return ids, pos, own_mask, KVCache(layers, key_mask).for_rows(rows, **own)


# calls whose shapes and caches differ as a running batch's do: (R, T, C, S, row map, own keys masked).
# Warm-up: rows 1 and more, with and without a cache, drafts sharing cache rows (rows already grouped
# by cache row and not, every cache row read and not).
WARM_UP = [(1, 8, 0, 0, None, False), (3, 8, 0, 0, None, False), (2, 8, 2, 12, None, False),
           (4, 8, 2, 12, [0, 0, 1, 1], False), (3, 8, 2, 12, [0, 0, 1], True), (2, 8, 3, 12, [2, 2], False)]
# then other rows, lengths, cache rows, draft depths (K 1..5) and layouts: no new graph
LATER = [(1, 8, 1, 20, [0], False), (6, 16, 3, 7, [0, 0, 1, 1, 2, 2], False), (5, 8, 4, 9, [3, 3, 3, 1, 1], True),
         (7, 8, 2, 30, [1, 0, 1, 0, 1, 0, 1], False), (10, 4, 2, 5, [0] * 5 + [1] * 5, False),
         (1, 8, 3, 12, [1], True), (3, 16, 3, 3, None, False), (9, 8, 5, 6, [0, 0, 0, 2, 2, 2, 4, 4, 4], True),
         (2, 8, 2, 12, [1, 1], True), (4, 6, 0, 0, None, False)]


@pytest.mark.slow
def test_compile_makes_a_bounded_number_of_graphs_whatever_the_batch(capfd):
    """--compile over the calls of a running batch (rows joining and leaving, psd drafts of any depth,
    drafts sharing cache rows in any layout, own keys masked or not): the graphs made while warming up
    serve every later mix, the logits' tokens are eager's, and nothing reaches dynamo's recompile
    limit. (It did: the whole block was one graph, guarded on the cache's presence and the row plan's
    Python values, a new graph per mix, and past 8 the blocks ran eagerly.)"""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()            # no graph of an earlier test's model: this one's are counted from 0
    model = init_random(ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=5, std=0.5)
    twin = model.compiled()

    def run(calls):
        """Graphs compiled for `calls`, frames dynamo refused to compile."""
        ok, total = counters["frames"]["ok"], counters["frames"]["total"]
        for i, (R, T, C, S, row_map, masked) in enumerate(calls):
            ids, pos, own, cache = _cached_calls(model, R, T, C, S, row_map, seed=i, own_masked=masked)
            with torch.no_grad():
                got, want = twin(ids, pos, own, cache)[0], model(ids, pos, own, cache)[0]
            assert torch.equal(got.argmax(-1), want.argmax(-1)), (R, T, C, S, row_map)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        made = counters["frames"]["ok"] - ok
        return made, counters["frames"]["total"] - total - made

    # two parts, each compiled for one row and for more; later mixes: no new graph, none refused
    assert (run(WARM_UP), run(LATER)) == ((4, 0), (0, 0))
    err = capfd.readouterr().err
    assert "recompile" not in err, err


@pytest.mark.slow
def test_reaching_the_recompile_limit_is_one_warning_line(monkeypatch, capfd):
    """Should dynamo reach its recompile limit on the model's compiled parts (here a limit of 1), one
    line on stderr says so, once, instead of dynamo's five; the calls go on, eagerly, as they were."""
    import torch
    import torch._dynamo

    from models import transformer

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    monkeypatch.setattr(transformer, "_warned_recompile_limit", False, raising=False)
    model = init_random(ModelConfig.tiny("dream", vocab_size=64, mask_token_id=63, eos_token_id=62), seed=2, std=0.5)
    twin = model.compiled()
    for R, T, C, S, row_map, masked in WARM_UP[:3] + LATER[:2]:
        ids, pos, own, cache = _cached_calls(model, R, T, C, S, row_map, seed=R, own_masked=masked)
        with torch.no_grad():
            torch.testing.assert_close(twin(ids, pos, own, cache)[0], model(ids, pos, own, cache)[0],
                                       rtol=1e-4, atol=1e-4)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "recompile" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("warning: --compile: torch.compile reached its recompile limit (1) "
                               "in the model's blocks ("), err
