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
    assert all(type(b).__name__ == "Block" for b in model.layers)       # the model itself stays eager
    assert all(type(b).__name__ == "OptimizedModule" for b in twin.layers)
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
