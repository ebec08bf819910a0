"""DiffusionGemma (models/): the hand-written encoder/decoder modes of one backbone against
transformers' DiffusionGemmaForBlockDiffusion, in both directions of checkpoint exchange; the
vision tower skipped with one line; the config.json checks (docs/models.md)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from models import CheckpointError, KVCache, ModelConfig, ParallelError, attention_mask, load_model, position_ids
from models.parallel import check_divisible
from models.random_checkpoint import main as random_checkpoint_main

transformers = pytest.importorskip("transformers", minversion="5.23",
                                   reason="the oracle is transformers' DiffusionGemmaForBlockDiffusion (5.23+)")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("this transformers has no DiffusionGemmaForBlockDiffusion", allow_module_level=True)

LENGTHS, PAD, C = [9, 6], 9, 8          # two prompts (one left-padded by 3) longer than the window 4; canvas 8


def _softcap(logits, cap):
    return torch.tanh(logits.float() / cap) * cap


def _inputs(cfg, seed=5):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, cfg.vocab_size, (len(LENGTHS), PAD), generator=g)
    valid = torch.zeros(len(LENGTHS), PAD, dtype=torch.bool)
    for r, n in enumerate(LENGTHS):
        valid[r, PAD - n:] = True
    prompt[~valid] = cfg.pad_token_id
    canvases = [torch.randint(2, cfg.vocab_size, (len(LENGTHS), C), generator=g) for _ in range(3)]
    sc = 4 * torch.randn(len(LENGTHS), C, cfg.vocab_size, generator=g)
    return prompt, valid, canvases, sc


def _engine_run(model, prompt, valid, canvases, sc):
    """The loop's model calls: encode the prompt; decode a canvas (no self-conditioning, then with
    the previous logits for row 0 only); encode the finished canvas onto the cache; decode the next."""
    cfg = model.config
    pos = position_ids(cfg, valid)
    idx = torch.arange(PAD)
    out = {}
    with torch.no_grad():
        out["encoder"], kvs = model(prompt, pos, attention_mask(cfg, valid, PAD, PAD, C, idx, idx), return_kv=True)
        cache = KVCache(kvs, valid, positions=pos)
        cpos = torch.arange(PAD, PAD + C).expand(len(LENGTHS), C)
        see_all = torch.ones(1, 1, C, C, dtype=torch.bool)
        out["decoder"] = model(canvases[0], cpos, see_all, cache, decoder=True)[0]
        out["decoder_sc"] = model(canvases[1], cpos, see_all, cache, decoder=True, self_cond=sc,
                                  self_cond_rows=torch.tensor([True, False]))[0]
        causal = torch.ones(C, C, dtype=torch.bool).tril()[None, None]
        out["encoder_chunk"], more = model(canvases[1], cpos, causal, cache, return_kv=True)
        cache = KVCache([(torch.cat((k, k2), 2), torch.cat((v, v2), 2)) for (k, v), (k2, v2) in zip(kvs, more)],
                        torch.cat((valid, torch.ones(len(LENGTHS), C, dtype=torch.bool)), 1),
                        positions=torch.cat((pos, cpos), 1))
        out["decoder_next"] = model(canvases[2], cpos + C, see_all, cache, decoder=True, self_cond=sc)[0]
    return out


def _hf_run(hf, prompt, valid, canvases, sc):
    """The same calls through transformers' model: its encoder writes a DynamicCache (sliding
    layers keep window - 1 positions), its decoder reads it."""
    from transformers import DynamicCache

    text = hf.config.text_config
    cap = text.final_logit_softcapping
    cache = DynamicCache(config=text)
    pos = torch.arange(PAD)[None]
    cpos = torch.arange(PAD, PAD + C)[None]
    ones = torch.ones(len(LENGTHS), C, dtype=torch.long)
    out = {}
    with torch.no_grad():
        enc = hf.model.encoder(input_ids=prompt, attention_mask=valid.long(), position_ids=pos, cache=cache)
        out["encoder"] = _softcap(hf.lm_head(enc.last_hidden_state), cap)
        dec_mask = torch.cat((valid.long(), ones), 1)
        out["decoder"] = hf(decoder_input_ids=canvases[0], cache=cache, decoder_attention_mask=dec_mask,
                            decoder_position_ids=cpos).logits
        out["decoder_sc"] = hf(decoder_input_ids=canvases[1], cache=cache, decoder_attention_mask=dec_mask,
                               decoder_position_ids=cpos, self_conditioning_logits=sc,
                               self_conditioning_mask=torch.tensor([True, False])).logits
        enc = hf.model.encoder(input_ids=canvases[1], attention_mask=dec_mask, position_ids=cpos, cache=cache)
        out["encoder_chunk"] = _softcap(hf.lm_head(enc.last_hidden_state), cap)
        out["decoder_next"] = hf(decoder_input_ids=canvases[2], cache=cache,
                                 decoder_attention_mask=torch.cat((dec_mask, ones), 1), decoder_position_ids=cpos + C,
                                 self_conditioning_logits=sc).logits
    return out


def _max_diffs(model, hf):
    prompt, valid, canvases, sc = _inputs(model.config)
    ours, theirs = _engine_run(model, prompt, valid, canvases, sc), _hf_run(hf, prompt, valid, canvases, sc)
    diffs = {}
    for key in ours:
        a, b = ours[key], theirs[key]
        assert a.shape == b.shape and a.dtype == torch.float32, (key, a.shape, b.shape, a.dtype)
        keep = valid if key == "encoder" else torch.ones(a.shape[:2], dtype=torch.bool)
        diffs[key] = (a - b)[keep].abs().max().item()
        assert b[keep].abs().max() > 1.0, key        # logits of real size, not a collapsed model
    return diffs, ours


def _hf_from(path):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=torch.float32).eval()


def test_random_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, capsys):
    """`python -m models.random_checkpoint DIR --family diffusion_gemma` writes the real layout:
    transformers' from_pretrained loads it, and every mode's fp32 logits agree within 1e-4."""
    assert random_checkpoint_main([str(tmp_path / "dg"), "--family", "diffusion_gemma"]) == 0
    assert "diffusion_gemma" in capsys.readouterr().out
    model = load_model(tmp_path / "dg")
    diffs, ours = _max_diffs(model, _hf_from(tmp_path / "dg"))
    assert max(diffs.values()) < 1e-4, diffs
    # the comparison covers behaviour that matters: self-conditioning, the canvas, the encoder's KV
    assert (ours["decoder_sc"][0] - ours["decoder_sc"][1]).abs().max() > 1e-2


def _randomise(hf, seed=3):
    """transformers' own init has unit norms and scales: give every text weight (and the two modes'
    layer scalars, different from each other) random values, through the tied parameters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if "vision" in name or "rotary" in name or "embed_scale" in name:
                continue
            if name.endswith(("norm.weight", "scale", "layer_scalar", "per_expert_scale")):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.3 * torch.randn(t.shape, generator=g))


def test_transformers_checkpoint_loads_in_the_engine(tmp_path, capsys):
    """A checkpoint saved by transformers' own save_pretrained (vision tower included) loads in the
    engine: one line says the vision tower is not loaded; every mode's fp32 logits agree within 1e-4."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text = dict(vocab_size=80, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, global_head_dim=24, num_global_key_value_heads=1,
                sliding_window=4, layer_types=["sliding_attention", "full_attention", "full_attention"],
                num_experts=6, top_k_experts=3, moe_intermediate_size=20,
                final_logit_softcapping=20.0, max_position_embeddings=512,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                                 "full_attention": {"rope_type": "proportional", "rope_theta": 2e4,
                                                    "partial_rotary_factor": 0.5}})
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    hf = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, vision_config=vision,
                                                              canvas_length=C)).eval()
    assert hf.model.encoder.language_model.layers[1].router.proj.weight is hf.model.decoder.layers[1].router.proj.weight
    _randomise(hf)
    hf.save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()
    model = load_model(tmp_path / "hf")
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "vision tower" in err and "not loading" in err, err
    c = model.config
    assert (c.layer_types, c.full_head_dim, c.full_kv_heads, c.qkv_bias, c.logit_softcap, c.mask_token_id,
            c.generation_defaults["block_length"]) == (tuple(text["layer_types"]), 24, 1, False, 20.0, None, C)
    enc = [float(layer.enc_scalar) for layer in model.layers]
    assert enc != [float(layer.dec_scalar) for layer in model.layers]
    diffs, _ = _max_diffs(model, hf)
    assert max(diffs.values()) < 1e-4, diffs
    # and back: the engine writes what transformers reads to the same model
    from models import save_checkpoint

    save_checkpoint(model, tmp_path / "again")
    diffs, _ = _max_diffs(model, _hf_from(tmp_path / "again"))
    assert max(diffs.values()) < 1e-4, diffs


def test_windows_and_modes_change_the_logits(tmp_path):
    """The parts the parity covers are not no-ops: the sliding window (prompts longer than it), the
    self-conditioning input, and the decoder reading the encoder's KV."""
    assert random_checkpoint_main([str(tmp_path / "dg"), "--family", "diffusion_gemma", "--seed", "2"]) == 0
    model = load_model(tmp_path / "dg")
    prompt, valid, canvases, sc = _inputs(model.config)
    base = _engine_run(model, prompt, valid, canvases, sc)
    wide = load_model(tmp_path / "dg")
    for layer in wide.layers:
        if layer.attn.window is not None:
            layer.attn.window = 1000
    other = _engine_run(wide, prompt, valid, canvases, sc)
    for key in ("encoder", "decoder", "decoder_next"):
        assert (base[key] - other[key])[valid if key == "encoder" else slice(None)].abs().max() > 1e-3, key
    cpos = torch.arange(PAD, PAD + C).expand(2, C)
    with torch.no_grad():
        alone = model(canvases[0], cpos, torch.ones(1, 1, C, C, dtype=torch.bool), decoder=True)[0]
    assert (alone - base["decoder"]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="cached keys' positions"):
        model(canvases[0], cpos, torch.ones(1, 1, C, C, dtype=torch.bool),
              KVCache([(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16))] * 3, torch.ones(2, 1, dtype=torch.bool)),
              decoder=True)


def test_round_trip_bf16_and_parameter_count(tmp_path):
    """The engine's own layout round-trips (bit-identical logits); a bf16 load equals the fp32 model
    cast; parameter_count is the model's own count."""
    from models.random_checkpoint import make_checkpoint

    path, model = make_checkpoint(tmp_path / "dg", "diffusion_gemma", seed=4)
    assert sum(p.numel() for p in model.parameters()) == model.config.parameter_count()
    prompt, valid, canvases, sc = _inputs(model.config)
    pos = position_ids(model.config, valid)
    causal = attention_mask(model.config, valid, PAD, PAD, C, torch.arange(PAD), torch.arange(PAD))
    with torch.no_grad():
        want = model(prompt, pos, causal)[0]
        assert torch.equal(load_model(path)(prompt, pos, causal)[0], want)
        bf = load_model(path, dtype="bfloat16")
        assert torch.equal(bf(prompt, pos, causal)[0], model.to(torch.bfloat16)(prompt, pos, causal)[0])


def _write_config(tmp_path, name="m", **changes):
    from models.random_checkpoint import make_checkpoint

    path, _ = make_checkpoint(tmp_path / name, "diffusion_gemma")
    raw = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        where = raw if k.startswith("TOP_") else raw["text_config"]
        k = k.removeprefix("TOP_")
        if v is None:
            where.pop(k, None)
        else:
            where[k] = v
    (path / "config.json").write_text(json.dumps(raw))
    return path


BAD = [
    (dict(TOP_tie_word_embeddings=False), "tie_word_embeddings=false unties the encoder from the decoder"),
    (dict(TOP_text_config="x"), "config.json text_config must hold a JSON object"),
    (dict(hidden_activation="silu"), "hidden_activation 'silu' is not supported"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention 'all' (a string) is not supported"),
    (dict(layer_types=["full_attention"]), "field 'layer_types' must be a list of 3 of"),
    (dict(num_hidden_layers=10 ** 9, layer_types=None), "num_hidden_layers 1000000000 is more than this engine builds"),
    (dict(num_experts=None), "lacks the required field 'num_experts'"),
    (dict(top_k_experts=9), "top_k_experts 9 exceeds num_experts 4"),
    (dict(sliding_window=0), "field 'sliding_window' must be a positive integer"),
    (dict(global_head_dim=7), "the head dimension 7 (head_dim) is odd"),
    (dict(num_global_key_value_heads=3), "num_attention_heads 4 is not a multiple of the full layers' "
                                         "num_key_value_heads 3"),
    (dict(per_layer_config={"2": {"sliding_window": 3}}), "overriding 'sliding_window' is not supported"),
    (dict(per_layer_config={"0": {"head_dim": 8}}), "per_layer_config must give every full_attention layer the same"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}),
     "rope_type 'yarn' with partial_rotary_factor 1 is not supported by this engine for full_attention layers"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}}),
     "factor 2.0 is not supported"),
    (dict(attention_bias=True), "attention_bias=true is not supported by this engine (transformers keeps"),
    (dict(final_logit_softcapping=-1), "field 'final_logit_softcapping' must be a positive number"),
    (dict(eos_token_id=64), "eos_token_id 64 is outside the vocabulary of size 64"),
    (dict(mask_token_id=99), "mask_token_id 99 is outside the vocabulary of size 64"),
    # one flat RoPE (transformers fails on it): not the defaults of each layer type
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}), "rope_parameters names 'rope_theta'; it holds "
                                                                        "one object per layer type"),
]


@pytest.mark.parametrize("changes,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_diffusion_gemma_config_is_one_line(tmp_path, changes, message):
    path = _write_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=re.escape(message)) as e:
        load_model(path)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("where", ["TOP_mask_token_id", "mask_token_id", "gen"])
def test_a_mask_id_does_not_make_it_a_masked_model(tmp_path, where):
    """A mask id in config.json (either level) or generation_config.json is checked but never used:
    transformers ignores it, and a model with a mask id would be decoded as a masked one (greedy, PSD)."""
    path = _write_config(tmp_path, **({} if where == "gen" else {where: 5}))
    if where == "gen":
        (path / "generation_config.json").write_text(json.dumps({"mask_token_id": 5}))
    assert ModelConfig.from_dir(path).mask_token_id is None
    with pytest.raises(CheckpointError, match="decodes from uniform noise: no mask token"):
        ModelConfig.tiny("diffusion_gemma", mask_token_id=5)


def test_config_defaults_follow_transformers(tmp_path):
    """Absent fields take DiffusionGemmaTextConfig's defaults: five sliding layers then a full one,
    the last layer full, Gemma 4's full-layer head dim 512 and proportional RoPE on a quarter."""
    raw = dict(model_type="diffusion_gemma", text_config=dict(
        num_hidden_layers=7, hidden_size=64, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=128, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
        eos_token_id=1, pad_token_id=0))
    c = ModelConfig.from_hf(raw)
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention",) * 2
    assert (c.full_head_dim, c.full_kv_heads, c.full_rope_theta, c.full_rotary_fraction, c.rope_theta,
            c.sliding_window, c.logit_softcap, c.embedding_scale, c.mask_token_id) == \
        (512, 1, 1e6, 0.25, 1e4, 512, 30.0, 8.0, None)
    assert c.layer(6).rope == (512, 1e6, 64) and c.layer(0).rope == (32, 1e4, None)


def test_tensor_parallel_is_refused_in_one_line():
    with pytest.raises(ParallelError, match="tensor parallel is not implemented for mixture-of-experts models "
                                            r"\(diffusion_gemma"):
        check_divisible(ModelConfig.tiny("diffusion_gemma"), 2)


def test_decoder_mode_is_refused_for_other_families():
    from models import init_random

    model = init_random(ModelConfig.tiny("llada"))
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="has no decoder mode"):
        model(ids, torch.arange(3)[None], torch.ones(1, 1, 3, 3, dtype=torch.bool), decoder=True)


def test_cli_decodes_a_diffusion_gemma_checkpoint(tmp_path):
    """`python -m engine.generate` on a DiffusionGemma checkpoint decodes with eb (the uniform-noise
    paradigm, engine/uniform.py) and prints the tokens the Python API returns for the same seed;
    PSD on it is one `error:` line and status 2 (tests/test_uniform.py checks the tokens against
    transformers' generate)."""
    import subprocess
    import sys
    from pathlib import Path

    import engine
    from models import Tokenizer, load_model
    from models.random_checkpoint import make_checkpoint

    path, _ = make_checkpoint(tmp_path / "dg", "diffusion_gemma", seed=1)
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "engine.generate", "t1 t2 t3", "--model", str(path), "--seed", "4",
                        "--gen-length", "16", "--max-denoising-steps", "3", "--json"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    ids = Tokenizer(path).encode("t1 t2 t3")
    want = engine.generate(load_model(path), [ids], seed=4, gen_length=16, max_denoising_steps=3)[0]
    assert out["token_ids"] == want.token_ids and out["method"] == "eb" and len(want.token_ids) >= 1
    r = subprocess.run([sys.executable, "-m", "engine.generate", "t1 t2 t3", "--model", str(path), "--method", "psd"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "decodes with eb" in r.stderr
