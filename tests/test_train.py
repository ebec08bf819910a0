"""bench/train.py: tokenizer, masked-diffusion SFT loss, optimisation, export; the shipped default model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench.tasks import get_task
from models import ModelConfig, Tokenizer, load_model
from bench import train as T
from models.transformer import attention_mask, position_ids

DEFAULT = Path(__file__).resolve().parent.parent / "models" / "default"


@pytest.fixture(scope="module")
def tok():
    return T.build_tokenizer(T.corpus(300, seed=5), 512)


def _suite_texts(limit=100):
    out = []
    for s in T.SUITES:
        task = get_task(s)
        for p in task.load(limit=limit):
            prompt = task.format_prompt(p)
            out += [prompt, p["answer"], prompt + p["answer"]]
    out.append("def f(x):\n    if x > 0:\n        return x\n\n\treturn  -x  \n")
    return out


def _tiny(tok, **kw):
    eos, mask = tok.token_to_id(T.EOS), tok.token_to_id(T.MASK)
    return ModelConfig.tiny("llada", vocab_size=tok.get_vocab_size(), mask_token_id=mask, eos_token_id=eos,
                            pad_token_id=eos, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=4, head_dim=16, max_length=256, **kw)


def _batch(tok, n=8, seed=3, answer_len=64):
    eos = tok.token_to_id(T.EOS)
    pairs = [T.pair("math", p) for p in T.problems("math", n // 2, seed)]
    pairs += [T.pair("code", p) for p in T.problems("code", n - n // 2, seed)]
    return T.collate(T.encode_pairs(tok, pairs, answer_len, eos), eos)


def test_tokenizer_round_trips_suite_text(tok):
    assert tok.token_to_id(T.EOS) == 0 and tok.token_to_id(T.MASK) == 1
    for text in _suite_texts():
        assert tok.decode(tok.encode(text).ids) == text
    # digits are one token each (arithmetic is learnt digit by digit)
    assert all(len(tok.id_to_token(i).strip("Ġ")) <= 1 for i in tok.encode("123 + 4567 = 4690").ids
               if tok.id_to_token(i).strip("Ġ").isdigit())


def test_collate_matches_engine_layout(tok):
    ids, valid, P = _batch(tok)
    eos = tok.token_to_id(T.EOS)
    assert ids.shape[1] == P + 64 and P % 8 == 0
    for b in range(ids.shape[0]):
        n_pad = int((~valid[b]).sum())
        assert not valid[b, :n_pad].any() and valid[b, n_pad:].all()     # left padding only
        assert (ids[b, :n_pad] == eos).all()
    assert (ids[:, -1] == eos).all()                                       # answers end in EOS padding


def test_loss_finite_and_only_masked_answer_tokens(tok):
    config = _tiny(tok)
    model = T.init_model(config, 0)
    ids, valid, P = _batch(tok)
    loss, info = T.diffusion_loss(model, ids, valid, P, torch.Generator().manual_seed(1))
    assert torch.isfinite(loss)
    masked, t = info["masked"], info["t"]
    assert not masked[:, :P].any()                       # the prompt (and its padding) is never masked
    assert masked[:, P:].any()
    assert ((t > 0) & (t <= 1)).all()
    # recompute by hand: CE on masked positions only, weighted 1/t, normalised by the answer length
    x = torch.where(masked, torch.full_like(ids, config.mask_token_id), ids)
    idx = torch.arange(ids.shape[1])
    logits, _ = model(x, position_ids(config, valid), attention_mask(config, valid, P, P, ids.shape[1] - P, idx, idx))
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1), reduction="none").view(ids.shape)
    ref = (ce * masked / t[:, None]).sum() / (ids.shape[0] * (ids.shape[1] - P))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    # only masked positions receive gradient through the logits (prompt and unmasked answer tokens: none)
    seen = {}

    def hook(_mod, _inp, out):
        out.retain_grad()
        seen["logits"] = out

    h = model.output.register_forward_hook(hook)
    model.requires_grad_(True)
    loss3, info3 = T.diffusion_loss(model, ids, valid, P, torch.Generator().manual_seed(1))
    h.remove()
    loss3.backward()
    g = seen["logits"].grad.abs().sum(-1)
    assert (g[~info3["masked"]] == 0).all()
    assert (g[info3["masked"]] > 0).all()


def test_stratified_t_covers_the_interval():
    t = T.sample_t(16, 1e-3, torch.Generator().manual_seed(0))
    strata = torch.sort(((t - 1e-3) / (1 - 1e-3) * 16).floor().long()).values
    assert strata.tolist() == list(range(16))


def test_a_few_steps_reduce_the_loss(tok):
    torch.manual_seed(0)
    model = T.init_model(_tiny(tok), 0)
    ids, valid, P = _batch(tok, n=8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def fixed_loss():
        return T.diffusion_loss(model, ids, valid, P, torch.Generator().manual_seed(123))[0]

    with torch.no_grad():
        before = fixed_loss().item()
    for s in range(25):
        loss, _ = T.diffusion_loss(model, ids, valid, P, torch.Generator().manual_seed(s))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = fixed_loss().item()
    assert after < 0.7 * before, (before, after)


def test_lr_schedule():
    assert T.lr_at(0, 100, 1e-3, 10) == pytest.approx(1e-4)
    assert T.lr_at(9, 100, 1e-3, 10) == pytest.approx(1e-3)
    assert T.lr_at(100, 100, 1e-3, 10) == pytest.approx(1e-4)
    assert T.lr_at(55, 100, 1e-3, 10) < 1e-3


def test_export_load_round_trip(tok, tmp_path):
    model = T.init_model(_tiny(tok), 0).eval()
    T.export(model, tok, tmp_path, 256)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / f).is_file(), f
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "llada" and raw["include_bias"] is False and "d_model" in raw
    loaded = load_model(tmp_path)
    assert loaded.config.mask_token_id == model.config.mask_token_id
    assert loaded.config.eos_token_id == model.config.eos_token_id
    ids, valid, P = _batch(tok, n=4)
    idx = torch.arange(ids.shape[1])
    args = (ids, position_ids(model.config, valid), attention_mask(model.config, valid, P, P, 64, idx, idx))
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args)[0], model(*args)[0])
    t2 = Tokenizer(tmp_path)
    text = "Question: Tom has 12 apples.\nAnswer: 12 + 5 = 17. #### 17"
    assert t2.decode(t2.encode(text)) == text


@pytest.mark.skipif(not (DEFAULT / "config.json").is_file(), reason="no default model shipped")
def test_shipped_default_model_decodes():
    import engine

    model = load_model(DEFAULT)
    tok = Tokenizer(DEFAULT)
    c = model.config
    assert c.family == "llada" and c.attention == "bidirectional" and not c.qkv_bias
    assert c.mask_token_id == tok.token_id(T.MASK)
    assert c.eos_token_id == tok.token_id(T.EOS)
    assert tok.size <= c.vocab_size
    size = sum((DEFAULT / f).stat().st_size for f in ("model.safetensors",))
    assert size <= 25 * 2**20
    task = get_task("math")
    p = task.load(limit=1)[0]
    text = task.format_prompt(p)
    assert tok.decode(tok.encode(text)) == text
    (res,) = engine.generate(model, [tok.encode(text)], method="greedy", gen_length=64, block_length=32)
    assert 1 <= res.tokens <= 64 and res.calls >= 1
    assert isinstance(tok.decode(res.token_ids), str)


@pytest.mark.slow
def test_resume_with_restart_schedule_and_math_frac(tmp_path, capsys):
    """A tiny end-to-end run, resumed with a fresh warm-up + cosine segment and a new data mix:
    the learning rates in the log follow the new segment from the resumed step."""
    import csv

    out, sd = tmp_path / "m", tmp_path / "state"
    common = ["--out", str(out), "--state-dir", str(sd), "--vocab", "400", "--hidden", "32", "--layers", "1",
              "--heads", "2", "--intermediate", "64", "--batch", "4", "--log-every", "1", "--ckpt-every", "100",
              "--warmup", "2", "--answer-len", "64", "--threads", "1"]
    T.main(common + ["--steps", "4", "--lr", "1e-3"])
    T.main(common + ["--resume", "--restart-schedule", "--steps", "8", "--lr", "5e-4", "--math-frac", "1.0"])
    rows = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(open(sd / "log.csv"))}
    assert sorted(rows) == list(range(1, 9))
    assert rows[4] == pytest.approx(T.lr_at(3, 4, 1e-3, 2), rel=1e-3)          # end of the first schedule
    for step in range(5, 9):                                                    # the new segment: steps 4..7
        assert rows[step] == pytest.approx(T.lr_at(step - 1 - 4, 8 - 4, 5e-4, 2), rel=1e-3)
    assert json.loads((sd / "summary.json").read_text())["step"] == 8
    assert load_model(out).config.num_layers == 1
    for bad in (["--resume", "--restart-schedule", "--math-frac", "1.5"], ["--restart-schedule"]):
        with pytest.raises(SystemExit) as ei:
            T.main(common + bad)
        assert str(ei.value).startswith("error:")


@pytest.mark.slow
def test_plain_resume_keeps_the_saved_peak_lr(tmp_path):
    """--resume without --lr continues the saved schedule at its own peak (not the fresh-run default)."""
    import csv

    out, sd = tmp_path / "m", tmp_path / "state"
    common = ["--out", str(out), "--state-dir", str(sd), "--vocab", "400", "--hidden", "32", "--layers", "1",
              "--heads", "2", "--intermediate", "64", "--batch", "4", "--log-every", "1", "--ckpt-every", "100",
              "--answer-len", "64", "--threads", "1"]
    T.main(common + ["--steps", "3", "--lr", "3e-3", "--warmup", "2"])
    T.main(common + ["--resume", "--steps", "6"])
    rows = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(open(sd / "log.csv"))}
    for step in range(4, 7):
        assert rows[step] == pytest.approx(T.lr_at(step - 1, 6, 3e-3, 2), rel=1e-3)
    assert json.loads((sd / "summary.json").read_text())["args"]["lr"] == 3e-3


@pytest.mark.parametrize("frac,drill,expected", [(0.5, 0.0, (32, 0, 32)), (0.65, 0.0, (42, 0, 22)),
                                                 (1.0, 0.0, (64, 0, 0)), (0.0, 0.0, (0, 0, 64)),
                                                 (0.5, 0.35, (32, 22, 10)), (0.0, 1.0, (0, 64, 0))])
def test_math_and_drill_frac_set_the_batch_mix(monkeypatch, frac, drill, expected):
    import argparse

    calls = []
    monkeypatch.setattr(T, "problems", lambda name, n, seed: calls.append((name, n)) or [])
    monkeypatch.setattr(T, "drills", lambda n, seed: calls.append(("drill", n)) or [])
    monkeypatch.setattr(T, "encode_pairs", lambda *a: [])
    monkeypatch.setattr(T, "collate", lambda *a: None)
    T.step_batch(None, 0, argparse.Namespace(batch=64, math_frac=frac, drill_frac=drill, seed=0, answer_len=64), 0)
    assert calls == [("math", expected[0]), ("drill", expected[1]), ("code", expected[2])]


def test_drill_frac_beyond_the_non_math_share_is_a_one_line_error(tmp_path):
    """...and changes nothing first: no state directory, not the process's torch threads (the default
    --threads 2 was set before the check, and every later test of the process ran on two threads)."""
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as ei:
        T.main(["--out", str(tmp_path / "m"), "--state-dir", str(tmp_path / "s"), "--math-frac", "0.7",
                "--drill-frac", "0.4", "--threads", str(threads + 1)])
    assert str(ei.value).startswith("error: --drill-frac") and "\n" not in str(ei.value)
    assert not (tmp_path / "s").exists() and torch.get_num_threads() == threads


def test_drills_are_seeded():
    a, b = T.drills(16, 3), T.drills(16, 3)
    assert a == b and a != T.drills(16, 4) and len(a) == 16 and T.drills(0, 3) == []
