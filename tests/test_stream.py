"""Decoder.stream: after every model call, the tokens that became final (the left-most fully
committed prefix); its pieces concatenate to exactly generate's tokens, for every method."""
from __future__ import annotations

import pytest

from engine import Decoder, DecodeConfig, DraftGraph, StreamUpdate, generate
from models import load_model
from models.random_checkpoint import make_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]]
CASES = [("greedy", {}), ("topk", {"steps": 16}), ("confidence", {"threshold": 0.3}),
         ("localleap", {"threshold": 0.2, "kappa": 0.4}), ("spiffy", {"depth": 3}),
         ("psd", {"threshold": 0.3, "depth": 3}), ("psd", {"policy_name": "topk", "steps": 16, "acceptance": "exact"}),
         ("lopa", {"k": 3}), ("ete", {"k": 2, "threshold": 0.3}), ("fdm", {"k": 2})]


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=1, eos_bias=8.0)
    return load_model(path)


def _collect(dec, prompts):
    updates = list(dec.stream(prompts))
    assert all(isinstance(u, StreamUpdate) for u in updates)
    assert updates[-1].results is not None and all(u.results is None for u in updates[:-1])
    return updates


@pytest.mark.parametrize("method,opts", CASES)
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_pieces_concatenate_to_generate(model, method, opts, cache):
    cfg = DecodeConfig(method=method, gen_length=32, block_length=8, cache=cache, **opts)
    want = generate(model, PROMPTS, cfg)
    updates = _collect(Decoder(model, cfg), PROMPTS)
    for b, r in enumerate(want):
        streamed = [t for u in updates for t in u.pieces[b]]
        assert streamed == r.token_ids
    got = updates[-1].results
    assert [(r.token_ids, r.calls, r.commit_call) for r in got] == [(r.token_ids, r.calls, r.commit_call) for r in want]
    # one update per model call of the batch (rows share calls), plus the closing one
    assert max(r.calls for r in want) <= len(updates) - 1 <= sum(r.calls for r in want)


def test_pieces_arrive_before_the_end(model):
    cfg = DecodeConfig(method="confidence", threshold=0.3, gen_length=32, block_length=8)
    updates = _collect(Decoder(model, cfg), [[5, 6, 7]])
    res = updates[-1].results[0]
    if res.tokens <= 8:
        pytest.skip("stopped inside the first block")
    early = sum(len(u.pieces[0]) for u in updates[:-1])
    assert early >= 8          # at least the first block was streamed while later blocks decoded
    first = next(i for i, u in enumerate(updates) if u.pieces[0])
    assert first < len(updates) - 2


def test_a_streamed_token_is_final_when_streamed(model):
    """Every piece extends a prefix that never changes afterwards and holds no mask token."""
    cfg = DecodeConfig(method="psd", threshold=0.3, graph=DraftGraph([[], [0], [1], [0, 1]]), gen_length=32, block_length=8)
    mask = model.config.mask_token_id
    updates = _collect(Decoder(model, cfg), PROMPTS)
    for b, r in enumerate(updates[-1].results):
        pos = 0
        for u in updates:
            piece = u.pieces[b]
            assert mask not in piece
            assert piece == r.token_ids[pos:pos + len(piece)]
            pos += len(piece)


def test_cli_stream_prints_the_same_text(tmp_path, capsys):
    from engine.cli import main

    path, _ = make_checkpoint(tmp_path / "llada", "llada", seed=1, eos_bias=8.0)
    common = ["t5 t6 t7", "--model", str(path), "--method", "confidence", "--threshold", "0.3",
              "--gen-length", "32", "--block-length", "8"]
    assert main(common + ["--json"]) == 0
    import json

    want = json.loads(capsys.readouterr().out)["text"]
    assert main(common + ["--stream"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == want.splitlines()[0] if want else True
    assert out.rsplit("\n[", 1)[0].rstrip("\n") == want.rstrip("\n")
    assert main(common + ["--stream", "--json"]) == 2
    assert "does not combine with --json" in capsys.readouterr().err


def test_import_engine_generate_keeps_the_function():
    import subprocess
    import sys

    code = "import engine.generate, engine; import engine.loop; assert engine.generate is engine.loop.generate; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "ok", res.stderr
