"""The hand-written transformer against stock transformers models, and checkpoint round trips in
each family's real layout (docs/algorithms.md §7)."""
from __future__ import annotations

import json
import re

import pytest
import torch

import oracle
from models.random_checkpoint import make_checkpoint
from models import CheckpointError, ModelConfig, attention_mask, init_random, load_model, position_ids, save_checkpoint
from support import random_canvas


@pytest.mark.parametrize("family", ["llada", "dream", "pangu"])
@pytest.mark.parametrize("lengths", [[9], [9, 4]])
def test_logits_match_stock_transformers(family, lengths):
    """fp32 logits equal LlamaModel (LLaDA, openPangu with biases) / Qwen2Model (Dream) run with the
    same non-causal (or context-causal) mask and positions: max abs diff < 1e-4."""
    cfg = ModelConfig.tiny(family)
    model = init_random(cfg, seed=7, std=0.2)
    hf, head = oracle.stock_model(model)
    ids, valid, P = random_canvas(cfg, lengths, n_gen=8)
    N = ids.shape[1]
    idx = torch.arange(N)
    mask = attention_mask(cfg, valid, P, P, 4, idx, idx)
    pos = position_ids(cfg, valid)
    with torch.no_grad():
        ours, _ = model(ids, pos, mask)
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state @ head.T
    diff = (ours - ref)[valid].abs().max().item()
    assert diff < 1e-4
    if family != "pangu":      # the stock model with its own causal mask is clearly different
        with torch.no_grad():
            causal = hf(input_ids=ids, position_ids=pos).last_hidden_state @ head.T
        assert (causal - ref)[valid].abs().max().item() > 1e-2


def test_left_padding_positions():
    llada, dream = ModelConfig.tiny("llada"), ModelConfig.tiny("dream")
    valid = torch.tensor([[False, False, True, True, True]])
    assert position_ids(llada, valid).tolist() == [[0, 1, 2, 3, 4]]     # absolute index
    assert position_ids(dream, valid).tolist() == [[0, 0, 0, 1, 2]]     # cumsum of the mask


def test_context_causal_mask_shape():
    cfg = ModelConfig.tiny("pangu")
    valid = torch.ones(1, 8, dtype=torch.bool)
    # prompt 0..3, block 4..5 (current), block 6..7 (later)
    m = attention_mask(cfg, valid, 4, 4, 2, torch.arange(8), torch.arange(8))[0, 0].int().tolist()
    assert m[1] == [1, 1, 0, 0, 0, 0, 0, 0]          # context: causal
    assert m[4] == [1, 1, 1, 1, 1, 1, 0, 0]          # block: all context + own block
    assert m[6] == [1, 1, 1, 1, 0, 0, 1, 1]          # later block: context + itself, never earlier masked blocks


@pytest.mark.parametrize("family", ["llada", "dream", "pangu"])
@pytest.mark.parametrize("shard", [None, 20_000])
def test_checkpoint_round_trip(tmp_path, family, shard):
    path, model = make_checkpoint(tmp_path / family, family, seed=3, shard_bytes=shard)
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("model-*.safetensors"))) > 1
    loaded = load_model(path)
    assert loaded.config.family == family
    ids, valid, P = random_canvas(model.config, [6, 3], 4)
    idx = torch.arange(ids.shape[1])
    mask = attention_mask(model.config, valid, P, P, 4, idx, idx)
    pos = position_ids(model.config, valid)
    with torch.no_grad():
        assert torch.equal(model(ids, pos, mask)[0], loaded(ids, pos, mask)[0])
    bf = load_model(path, dtype="bfloat16")
    assert bf.dtype == torch.bfloat16
    with torch.no_grad():
        # loading as bf16 is exactly the fp32 model cast to bf16
        assert torch.equal(bf(ids, pos, mask)[0], model.to(torch.bfloat16)(ids, pos, mask)[0])


def test_real_tensor_names(tmp_path):
    """The files hold the families' real names (so real checkpoints load)."""
    from safetensors import safe_open

    want = {
        "llada": ["model.transformer.wte.weight", "model.transformer.blocks.0.attn_out.weight",
                  "model.transformer.blocks.1.ff_proj.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"],
        "dream": ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.down_proj.weight",
                  "model.norm.weight", "lm_head.weight"],
        "pangu": ["model.layers.0.self_attn.o_proj.bias", "model.layers.0.self_attn.k_proj.bias"],
    }
    for fam, names in want.items():
        path, _ = make_checkpoint(tmp_path / fam, fam)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert set(names) <= keys
        assert not any(k.endswith("o_proj.bias") for k in keys) or fam == "pangu"


REAL_CONFIGS = {
    # the fields of the real config.json files (weights not needed to check the mapping)
    "llada": dict(model_type="llada", d_model=4096, n_heads=32, n_kv_heads=32, n_layers=32, mlp_hidden_size=12288,
                  rope_theta=500000.0, rms_norm_eps=1e-05, vocab_size=126464, embedding_size=126464,
                  mask_token_id=126336, eos_token_id=126081, pad_token_id=126081, max_sequence_length=4096,
                  include_bias=False, weight_tying=False),
    "dream": dict(model_type="Dream", hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                  num_key_value_heads=4, num_hidden_layers=28, rope_theta=1000000.0, rms_norm_eps=1e-06,
                  vocab_size=152064, mask_token_id=151666, eos_token_id=151643, pad_token_id=151643,
                  max_position_embeddings=131072, tie_word_embeddings=False),
    "pangu": dict(model_type="PanguEmbedded", hidden_size=4096, intermediate_size=12800, num_attention_heads=32,
                  num_key_value_heads=8, num_hidden_layers=34, rope_theta=16000000.0, rms_norm_eps=1e-06,
                  vocab_size=153376, mask_token_id=45830, eos_token_id=2, eot_token_id=45892, bias=True,
                  max_position_embeddings=32768, tie_word_embeddings=False),
}


@pytest.mark.parametrize("family", list(REAL_CONFIGS))
def test_real_config_fields(family):
    c = ModelConfig.from_hf(REAL_CONFIGS[family], {"eos_token_id": [126081, 126348]} if family == "llada" else None)
    table = {  # docs/algorithms.md §7
        "llada": dict(attention="bidirectional", logit_shift=0, qkv_bias=False, o_bias=False, num_heads=32,
                      num_kv_heads=32, rope_theta=5e5, rms_eps=1e-5, mask_token_id=126336, eos_token_id=126081),
        "dream": dict(attention="bidirectional", logit_shift=1, qkv_bias=True, o_bias=False, num_heads=28,
                      num_kv_heads=4, rope_theta=1e6, rms_eps=1e-6, mask_token_id=151666, eos_token_id=151643),
        "pangu": dict(attention="context_causal", logit_shift=1, qkv_bias=True, o_bias=True, num_heads=32,
                      num_kv_heads=8, rope_theta=1.6e7, rms_eps=1e-6, mask_token_id=45830, eos_token_id=2),
    }[family]
    for k, v in table.items():
        assert getattr(c, k) == v, k
    if family == "llada":
        assert c.stop_token_ids == (126081, 126348) and c.head_dim == 128 and c.intermediate_size == 12288
    if family == "pangu":
        assert c.stop_token_ids == (2, 45892)
    with torch.device("meta"):          # real 7-8B shapes build without allocating
        from models import Transformer

        m = Transformer(c)
    assert 6e9 < sum(p.numel() for p in m.parameters()) < 9e9


# ---------------------------------------------------------------------- bad checkpoints
def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_unknown_model_type(tmp_path):
    path, _ = make_checkpoint(tmp_path / "m", "llada")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown model_type 'gpt2'"):
        load_model(path)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_checkpoint(tmp_path / "m", "dream")
    sd = load_file(str(path / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("missing tensor model.layers.1.mlp.up_proj.weight")):
        load_model(path)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_checkpoint(tmp_path / "m", "llada")
    sd = load_file(str(path / "model.safetensors"))
    sd["model.transformer.blocks.0.q_proj.weight"] = torch.zeros(8, 64)
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("tensor model.transformer.blocks.0.q_proj.weight has shape [8, 64], the config implies [64, 64]")):
        load_model(path)


def test_missing_shard_and_missing_weights(tmp_path):
    path, _ = make_checkpoint(tmp_path / "m", "llada", shard_bytes=20_000)
    next(path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="which is missing"):
        load_model(path)
    path2, _ = make_checkpoint(tmp_path / "m2", "llada")
    (path2 / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_model(path2)


def test_ignored_and_unexpected_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    path, model = make_checkpoint(tmp_path / "m", "pangu")
    sd = load_file(str(path / "model.safetensors"))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(sd, str(path / "model.safetensors"))
    load_model(path)                                   # exporters' rotary buffers are ignored
    sd["model.layers.0.self_attn.extra.weight"] = torch.ones(8)
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor model.layers.0.self_attn.extra.weight"):
        load_model(path)


def test_tied_embeddings_round_trip(tmp_path):
    model = init_random(ModelConfig.tiny("dream", tie_embeddings=True), seed=1)
    save_checkpoint(model, tmp_path / "t")
    loaded = load_model(tmp_path / "t")
    assert loaded.output is None
    assert torch.equal(loaded.tok_embeddings.weight, model.tok_embeddings.weight)


def test_loading_builds_on_meta_and_assigns(tmp_path, monkeypatch):
    """No full-size second copy: parameters are created on the meta device and the loaded tensors
    are assigned, not copied into pre-allocated ones."""
    import models.checkpoint as ck

    path, _ = make_checkpoint(tmp_path / "m", "llada")
    created = []
    orig = ck.Transformer.__init__

    def spy(self, config):
        orig(self, config)
        created.append(self.tok_embeddings.weight.device.type)

    monkeypatch.setattr(ck.Transformer, "__init__", spy)
    model = load_model(path)
    assert created == ["meta"]
    assert all(p.device.type == "cpu" for p in model.parameters())
