"""bench.arith_probe: the masked positions are exactly the result digits, and the accounting
gives 1.0 for an oracle and 0.0 for a model that never predicts a digit."""
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from bench import arith_probe as AP
from bench.tasks import math as M
from models import load_model
from models.tokenizer import Tokenizer

DEFAULT = "models/default"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEFAULT)


def test_only_result_digits_are_masked(tok):
    drills = M.generate_drill(8, 5)
    x, target, valid, P, where = AP.build_batch(tok, drills, M.format_prompt, 1, 0, 64)
    assert (x != target).sum() == len(where) and all(x[b, i] == 1 for b, i, _, _ in where)
    for b, d in enumerate(drills):
        results = [c for _, _, _, c in M._EQUATION.findall(d["answer"])]
        for k, res in enumerate(results):
            pos = [i for bb, i, _, kk in where if bb == b and kk == k]
            assert tok.decode(target[b, pos].tolist()) == res          # exactly this result's digits
        assert tok.decode(target[b, P:].tolist()).startswith(d["answer"])


class _Fake:
    def __init__(self, out, vocab):
        self.config = SimpleNamespace(mask_token_id=1, eos_token_id=0, position_mode="cumsum", family="llada",
                                      bidirectional=True)
        self.device = torch.device("cpu")
        self.out, self.vocab = out, vocab

    def __call__(self, x, pos, am):
        return F.one_hot(self.out(x), self.vocab).float(), None


def test_probe_accounting_oracle_and_blind(tok, monkeypatch):
    monkeypatch.setattr("bench.train.attention_mask", lambda *a, **k: None)
    monkeypatch.setattr("bench.train.position_ids", lambda *a, **k: None)
    _, target, _, _, _ = AP.build_batch(tok, M.generate_drill(16, 3), M.format_prompt, 1, 0, 64)
    oracle = AP.probe(_Fake(lambda x: target, 1024), tok, n=16, seed=3)
    assert oracle and set(oracle) <= {"+", "-", "*", "/"}
    assert all(r["digit_accuracy"] == 1.0 and r["equation_accuracy"] == 1.0 for r in oracle.values())
    blind = AP.probe(_Fake(lambda x: x, 1024), tok, n=16, seed=3)       # predicts the mask token
    assert all(r["digit_accuracy"] == 0.0 and r["equation_accuracy"] == 0.0 for r in blind.values())
    assert sum(r["equations"] for r in blind.values()) == sum(
        len(M._EQUATION.findall(d["answer"])) for d in M.generate_drill(16, 3))


def test_cli_on_shipped_model_and_bad_input(capsys, tmp_path):
    assert AP.main(["--model", DEFAULT, "--n", "8"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["n"] == 8 and all(0.0 <= r["digit_accuracy"] <= 1.0 for r in res["ops"].values())
    assert AP.main(["--model", str(tmp_path / "nope")]) == 2
    assert AP.main(["--n", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and all(l.startswith("error:") for l in err.splitlines())
