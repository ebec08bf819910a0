"""`--gemm onednn` (models.transformer.GEMMS): the dense projections through oneDNN's matmul, an opt-in
CPU speed option. It must run every projection it claims (and not the MoE routers), agree with the
default to rounding, come back exactly to the default, and refuse what it cannot run in one line."""
from __future__ import annotations

import json

import pytest
import torch

import models.transformer as tr
from engine import generate
from engine.cli import main as generate_main
from models import ModelConfig, check_gemm, init_random
from models.random_checkpoint import make_checkpoint
from tests.support import run_main

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def _call(model, rows=2, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, T), generator=g)
    pos = torch.arange(T).expand(rows, T)
    mask = torch.ones(1, 1, T, T, dtype=torch.bool)
    with torch.no_grad():
        return model(ids, pos, mask)[0]


@pytest.mark.parametrize("family", ["llada", "dream", "llada2"])
def test_onednn_runs_every_projection_and_agrees_to_rounding(family, monkeypatch):
    model = init_random(ModelConfig.tiny(family), seed=1)
    ref = _call(model)
    calls = []
    real = tr._onednn_linear
    monkeypatch.setattr(tr, "_onednn_linear", lambda x, w, b=None: calls.append(tuple(w.shape)) or real(x, w, b))
    out = _call(model.set_gemm("onednn"))
    c = model.config
    routers = sum(isinstance(m, (tr.MoE, tr.SoftmaxMoE)) for m in model.modules())
    dense = sum(isinstance(m, torch.nn.Linear) for m in model.modules()) - routers
    assert len(calls) == dense + (1 if model.output is None else 0)   # + the tied head's product
    assert (c.vocab_size, c.hidden_size) in calls                      # the LM head
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert model.gemm == "onednn"
    back = _call(model.set_gemm("torch"))
    assert torch.equal(back, ref)                     # the default comes back bit for bit
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_generate_decodes_with_onednn(tmp_path):
    ckpt, model = make_checkpoint(tmp_path / "m", "llada", seed=2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    a = generate(model, prompts, method="confidence", threshold=0.5, gen_length=16, block_length=8)
    b = generate(model.set_gemm("onednn"), prompts, method="confidence", threshold=0.5, gen_length=16, block_length=8)
    assert [len(r.token_ids) for r in b] == [len(r.token_ids) for r in a]
    # random weights: the argmax rarely ties within 1e-6, so the tokens agree here (not a promise in general)
    assert sum(x == y for r, s in zip(a, b) for x, y in zip(r.token_ids, s.token_ids)) >= 0.9 * sum(
        len(r.token_ids) for r in a)


def test_check_gemm_refuses_in_one_line():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        check_gemm("onednn", "cpu", torch.float64)
    with pytest.raises(ValueError, match="runs on a CPU"):
        check_gemm("onednn", "cuda", torch.float32)
    with pytest.raises(ValueError, match="unknown gemm"):
        check_gemm("mkl2", "cpu", torch.float32)
    check_gemm("torch", "cuda", torch.float64)        # the default runs anywhere


def test_cli_gemm_flag(capsys):
    code, out, err = run_main(generate_main, ["--gemm", "onednn", "--device", "cpu", "--threads", "1",
                                              "--gen-length", "8", "--block-length", "8", "2+2="], capsys)
    assert code == 0, err
    code, out, err = run_main(generate_main, ["--gemm", "onednn", "--dtype", "float64", "--device", "cpu", "2+2="],
                              capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "float32 or bfloat16" in err


def test_gemm_agreement_reports_both_backends(capsys):
    from bench import gemm_agreement

    code, out, err = run_main(gemm_agreement.main, ["--limit", "2", "--batch-size", "1", "--gen-length", "32",
                                                    "--methods", "confidence:threshold=0.9"], capsys)
    assert code == 0, err
    row = json.loads(out.strip().splitlines()[-1])["rows"][0]
    assert 0.9 <= row["token_agreement"] <= 1 and set(row["accuracy"]) == {"torch", "onednn"}
    assert all(v > 0 for v in row["cpu_s"].values())
