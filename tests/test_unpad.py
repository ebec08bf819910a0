"""Whole-canvas calls on real positions only (`models.Tokens`, `Transformer.unpads`): on a CPU the
padding columns of a call (shorter prompts, shorter generations, rows of other progress) run through
no projection, norm or MLP, only attention sees the [rows, width] layout. The real positions' logits
and keys/values are those of the padded call, and every decode is unchanged."""
from __future__ import annotations

import pytest
import torch

from engine import DecodeConfig, Decoder
from engine.live import LiveBatch
from models import ModelConfig, Tokens, attention_mask, init_random, position_ids

FAMILIES = ["llada", "dream", "pangu", "llada2", "diffusion_gemma"]


def _model(family, unpad=None):
    cfg = ModelConfig.tiny(family, vocab_size=64, **({} if family == "diffusion_gemma" else
                                                     dict(mask_token_id=63, eos_token_id=62)))
    m = init_random(cfg, seed=3, std=0.5).double()
    m.unpad = unpad
    return m


@pytest.mark.parametrize("family", FAMILIES)
def test_real_positions_get_the_padded_calls_logits_and_keys(family):
    m = _model(family)
    mc, R, T = m.config, 3, 14
    valid = torch.zeros(R, T, dtype=torch.bool)
    for r, (a, b) in enumerate([(0, 14), (3, 14), (5, 11)]):       # left padding, and right padding too
        valid[r, a:b] = True
    ids = torch.randint(2, 60, (R, T), generator=torch.Generator().manual_seed(0))
    pos, idx = position_ids(mc, valid), torch.arange(T)
    mask = attention_mask(mc, valid, 6, 6, 4, idx, idx)
    seen = []
    hook = m.layers[0].attn.wq.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    try:
        full, kv_full = m(ids, pos, mask, out_start=6, out_len=5, return_kv=True)
        part, kv_part = m(ids, pos, mask, out_start=6, out_len=5, return_kv=True, tokens=Tokens.of(valid))
    finally:
        hook.remove()
    assert seen[0] == (R, T, mc.hidden_size) and seen[1] == (int(valid.sum()), mc.hidden_size)   # real rows only
    out = valid[:, 6:11]
    torch.testing.assert_close(part[out], full[out], rtol=0, atol=1e-12)
    for (k0, v0), (k1, v1) in zip(kv_full, kv_part):
        for a, b in ((k0, k1), (v0, v1)):                 # [R, H, T, D]: real columns equal, padding zero
            torch.testing.assert_close(b.transpose(1, 2)[valid], a.transpose(1, 2)[valid], rtol=0, atol=1e-12)
            assert not b.transpose(1, 2)[~valid].any()


def test_the_decoder_mode_refuses_tokens():
    m = _model("diffusion_gemma")
    valid = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="encoder calls"):
        m(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], valid[:, None, None, :].expand(1, 1, 4, 4),
          decoder=True, tokens=Tokens.of(valid))


def test_unpads_by_device_and_setting():
    m = _model("llada")
    assert m.unpads                                          # a CPU model, eager
    m.unpad = False
    assert not m.unpads
    m.unpad = None
    assert not m.compiled().unpads                           # a compiled twin: one shape per token count


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(1, 14)), [30, 31]]


@pytest.mark.parametrize("family", ["llada", "dream", "pangu", "llada2"])
@pytest.mark.parametrize("case", [dict(method="confidence", threshold=0.5, cache="none"),
                                  dict(method="psd", policy_name="confidence", depth=3, cache="prefix"),
                                  dict(method="psd", policy_name="confidence", depth=2, cache="dual"),
                                  dict(method="ete", cache="dual")], ids=lambda c: f"{c['method']}-{c['cache']}")
def test_decodes_are_the_padded_calls(family, case):
    """A static batch of mixed prompt and generation lengths, and a live batch with joins: the same
    tokens, calls and commit records with and without padding in the calls."""
    got = {}
    for unpad in (True, False):
        m = _model(family, unpad)
        dec = Decoder(m, DecodeConfig(gen_length=16, block_length=8, **case))
        state = dec.start(PROMPTS, [16, 8, 16, 8])
        while not state.done:
            dec.step(state)
        live = LiveBatch(dec)
        handles = [live.add(p, gen_length=g) for p, g in zip(PROMPTS[:2], (16, 8))]
        done, n = {}, 0
        while (u := live.step()) is not None:
            n += 1
            done.update(u.done)
            if n == 2:
                handles += [live.add(p, gen_length=g) for p, g in zip(PROMPTS[2:], (8, 16))]
        got[unpad] = [(r.token_ids, r.calls, r.commit_call, r.commit_step, r.commit_prob)
                      for r in dec.results(state) + [done[h] for h in handles]]
    assert got[True] == got[False]


def test_the_shipped_model_in_float32_gives_the_same_logits_and_runs_fewer_columns(capsys):
    """bench.unpad's call (8 rows of math questions, generations of 64 and 32, packed): bitwise-equal
    logits at the real positions of the window."""
    from bench import unpad

    assert unpad.main(["--rows", "8", "--reps", "1", "--threads", "1"]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("| 8 |"))
    share, equal = row.split("|")[2].strip(), row.split("|")[6].strip()
    assert equal == "yes" and int(share.rstrip("%")) < 100


def test_bench_unpad_at_a_random_shape(capsys):
    """--shape: random weights at a bench.workload shape (the prompts from the checkpoint's tokenizer)."""
    import json

    from bench import unpad

    assert unpad.main(["--shape", "tiny", "--rows", "4", "--reps", "1", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["model"] == "tiny" and report["parameters"] > 0
    assert report["rows"][0]["equal"] and report["rows"][0]["real_share"] < 1
