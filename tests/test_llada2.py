"""LLaDA2.x (models/): the hand-written MoE transformer against stock transformers modules of the
same math, its block-causal mask with and without a KV cache, its checkpoint layout, and the
config.json checks (docs/models.md)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from models import (CheckpointError, KVCache, ModelConfig, ParallelError, attention_mask, checkpoint_names,
                    init_random, load_model, position_ids)
from models.config import LLADA2_BLOCK
from models.parallel import check_divisible
from models.random_checkpoint import main as random_checkpoint_main, make_checkpoint
from support import LLADA2_MINI_CONFIG, LLADA2_MINI_IDS, random_canvas

VARIANTS = {
    # the tiny default: a dense first layer, grouped routing, expert bias, a shared expert
    "grouped": {},
    # every layer MoE, one group, no expert bias, no shared expert, unnormalised weights, q/k/v biases
    "plain": dict(first_dense_layers=0, n_group=1, topk_group=1, expert_bias=False, shared_intermediate_size=0,
                  norm_topk_prob=False, routed_scaling_factor=1.5, qkv_bias=True, num_experts_per_tok=3),
}


def _model(variant: str, seed: int = 7):
    model = init_random(ModelConfig.tiny("llada2", **VARIANTS[variant]), seed=seed, std=0.2)
    with torch.no_grad():
        for layer in model.layers:
            if getattr(layer.mlp, "expert_bias", None) is not None:
                layer.mlp.expert_bias.copy_(0.1 * torch.randn(layer.mlp.expert_bias.shape,
                                                              generator=torch.Generator().manual_seed(seed)))
    return model


def _glm4_moe(model):
    """transformers' Glm4MoeModel (sigmoid router with e_score_correction_bias, n_group/topk_group,
    norm_topk_prob, routed_scaling_factor, shared experts, first_k_dense_replace, QK-norm, partial
    rotate-half RoPE) holding `model`'s weights, and the LM head."""
    pytest.importorskip("transformers", minversion="5.0",
                        reason="the oracle is transformers 5's Glm4MoeModel (experts stored as [E, 2I, H] gate_up_proj)")
    from transformers import Glm4MoeConfig, Glm4MoeModel

    c = model.config
    hf_cfg = Glm4MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, n_routed_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        n_shared_experts=c.shared_intermediate_size // c.moe_intermediate_size,
        n_group=c.n_group, topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
        norm_topk_prob=c.norm_topk_prob, first_k_dense_replace=c.first_dense_layers, use_qk_norm=c.qk_norm,
        attention_bias=c.qkv_bias, rms_norm_eps=c.rms_eps, max_position_embeddings=c.max_length,
        rope_theta=c.rope_theta, partial_rotary_factor=c.rotary_dim / c.head_dim)
    hf_cfg._experts_implementation = "eager"      # the plain per-expert loop
    hf = Glm4MoeModel(hf_cfg).eval()
    p = dict(model.named_parameters())
    sd = {"embed_tokens.weight": p["tok_embeddings.weight"], "norm.weight": p["norm.weight"]}
    attn = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}
    for i in range(c.num_layers):
        ours, theirs = f"layers.{i}.", f"layers.{i}."
        sd[theirs + "input_layernorm.weight"] = p[ours + "attn_norm.weight"]
        sd[theirs + "post_attention_layernorm.weight"] = p[ours + "ffn_norm.weight"]
        for a, b in attn.items():
            for kind in ("weight", "bias"):
                if ours + f"attn.{a}.{kind}" in p:
                    sd[theirs + f"self_attn.{b}.{kind}"] = p[ours + f"attn.{a}.{kind}"]
        mlp = model.layers[i].mlp
        if not c.is_moe_layer(i):
            for a, b in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                sd[theirs + f"mlp.{b}.weight"] = getattr(mlp, a).weight
            continue
        sd[theirs + "mlp.gate.weight"] = mlp.router.weight
        sd[theirs + "mlp.gate.e_score_correction_bias"] = (
            mlp.expert_bias if mlp.expert_bias is not None else torch.zeros(c.num_experts))
        sd[theirs + "mlp.experts.gate_up_proj"] = torch.cat((mlp.w_gate, mlp.w_up), dim=1)   # gate rows, then up
        sd[theirs + "mlp.experts.down_proj"] = mlp.w_down
        if mlp.shared is not None:
            for a, b in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                sd[theirs + f"mlp.shared_experts.{b}.weight"] = getattr(mlp.shared, a).weight
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m and "shared_experts" not in m], \
        (missing, unexpected)
    return hf, model.output.weight


def _capture_routes(model, hf):
    """Hooks recording each MoE layer's chosen experts [T, k] on both sides, in layer order."""
    ours, theirs, handles = [], [], []
    for layer in model.layers:
        if hasattr(layer.mlp, "route"):
            handles.append(layer.mlp.register_forward_pre_hook(
                lambda mod, args: ours.append(mod.route(args[0].reshape(-1, args[0].shape[-1]))[0])))
    for layer in hf.layers:
        if hasattr(layer.mlp, "gate"):
            handles.append(layer.mlp.gate.register_forward_hook(lambda mod, args, out: theirs.append(out[2])))
    return ours, theirs, handles


def _experts(mlp, x, **change):
    """The sorted experts `mlp` chooses for x with some of its attributes changed for the call."""
    saved = {k: getattr(mlp, k) for k in change}
    try:
        for k, v in change.items():
            setattr(mlp, k, v)
        return mlp.route(x)[0].sort(-1).values
    finally:
        for k, v in saved.items():
            setattr(mlp, k, v)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_experts_match_stock_transformers(variant):
    """fp32 logits equal transformers' Glm4MoeModel (the same routing and attention math) run with
    the same block-causal mask and positions: max abs diff < 1e-4; every token's experts in every
    MoE layer are the same set."""
    model = _model(variant)
    hf, head = _glm4_moe(model)
    cfg = model.config
    ids, valid, P = random_canvas(cfg, [11, 6, 9], n_gen=8, seed=3)
    idx = torch.arange(ids.shape[1])
    mask = attention_mask(cfg, valid, P, P, 4, idx, idx)
    pos = position_ids(cfg, valid)
    ours, theirs, handles = _capture_routes(model, hf)
    with torch.no_grad():
        logits, _ = model(ids, pos, mask)
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state @ head.T
    for h in handles:
        h.remove()
    diff = (logits - ref)[valid].abs().max().item()
    assert diff < 1e-4, diff
    assert len(ours) == len(theirs) == cfg.moe_layers() > 0
    for a, b in zip(ours, theirs):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    # the routing the comparison covers is not trivial: the bias and the group limit each change choices
    mlp = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "route"))
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    chosen = _experts(mlp, x)
    if variant == "grouped":
        assert (chosen != _experts(mlp, x, expert_bias=None)).any()
        assert (chosen != _experts(mlp, x, topk_group=mlp.groups)).any()
    # and the mask matters: all-visible attention gives other logits
    with torch.no_grad():
        full = model(ids, pos, attention_mask(cfg.replace(attention="bidirectional", attention_block=None),
                                              valid, P, P, 4, idx, idx))[0]
    assert (full - logits)[valid].abs().max() > 1e-2


def test_block_causal_mask():
    """i sees j iff block(j) <= block(i), blocks of attention_block counted from each row's first
    real token; pads are never keys; every query sees itself."""
    cfg = ModelConfig.tiny("llada2", attention_block=3)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :2] = False                                   # row 1: 7 tokens after 2 pads
    idx = torch.arange(9)
    m = attention_mask(cfg, valid, 2, 5, 2, idx, idx)[:, 0].int()
    blk = idx // 3
    assert torch.equal(m[0], (blk[None, :] <= blk[:, None]).int())
    blk1 = (idx - 2).clamp_min(0) // 3
    want = (blk1[None, :] <= blk1[:, None]) & valid[1][None, :] | torch.eye(9, dtype=torch.bool)
    assert torch.equal(m[1], want.int())
    # the padded row sees what the unpadded sequence sees
    alone = attention_mask(cfg, torch.ones(1, 7, dtype=torch.bool), 0, 0, 2, torch.arange(7), torch.arange(7))
    assert torch.equal(m[1, 2:, 2:], alone[0, 0].int())
    # any query/key subset is the same slice of the whole
    q, k = torch.tensor([4, 7]), torch.tensor([0, 3, 6, 8])
    assert torch.equal(attention_mask(cfg, valid, 2, 5, 2, q, k)[:, 0].int(), m[:, q][:, :, k])


@pytest.mark.parametrize("shared_rows", [False, True])
def test_kv_cache_path_matches_the_full_forward(shared_rows):
    """Finished blocks cached, the next block run over the cache (one cache row per row, or drafts
    sharing a sequence's cache row through psd_kernels.shared_prefix_attention): the same logits."""
    model = _model("grouped")
    cfg = model.config
    # 16 positions in blocks of 4; row 1's 4 pads keep its blocks on the same canvas spans (a block
    # run over a cache must be whole: its last query sees its whole block)
    ids, valid, P = random_canvas(cfg, [8, 4], n_gen=8, seed=4)
    N = ids.shape[1]
    idx = torch.arange(N)
    pos = position_ids(cfg, valid)
    with torch.no_grad():
        full, kvs = model(ids, pos, attention_mask(cfg, valid, P, P, 4, idx, idx), return_kv=True)
        lo, hi = 8, 12                                     # the third block (row 1's second)
        pre, blk = torch.arange(lo), torch.arange(lo, hi)
        km = attention_mask(cfg, valid, P, lo, 4, blk[-1:], pre)[:, 0, 0]
        cache = KVCache([(k[:, :, pre], v[:, :, pre]) for k, v in kvs], km)
        own = attention_mask(cfg, valid, P, lo, 4, blk, blk)
        if not shared_rows:
            cached, _ = model(ids[:, blk], pos[:, blk], own, cache=cache)
            assert (cached - full[:, blk])[valid[:, blk]].abs().max() < 1e-5
            return
        rows = torch.tensor([0, 0, 1])                     # two drafts of sequence 0, one of sequence 1
        cached, _ = model(ids[rows][:, blk], pos[rows][:, blk], own[rows], cache=cache.for_rows(rows))
    assert (cached - full[rows][:, blk])[valid[rows][:, blk]].abs().max() < 1e-5


def test_random_checkpoint_round_trip(tmp_path, capsys):
    """`python -m models.random_checkpoint DIR --family llada2` writes the real layout; loading it
    gives the logits of the model written (also sharded; bf16 = the fp32 model cast, router kept fp32)."""
    from safetensors import safe_open

    assert random_checkpoint_main([str(tmp_path / "cli"), "--family", "llada2"]) == 0
    assert "llada2" in capsys.readouterr().out
    path, model = make_checkpoint(tmp_path / "ref", "llada2", seed=0, eos_bias=8.0)
    with safe_open(str(tmp_path / "cli" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.word_embeddings.weight", "model.layers.0.attention.query_key_value.weight",
            "model.layers.0.attention.dense.weight", "model.layers.0.attention.query_layernorm.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.gate.expert_bias", "model.layers.1.mlp.experts.7.down_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight", "model.norm.weight", "lm_head.weight"} <= keys
    assert keys == set(checkpoint_names(model.config).values())
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "llada2_moe" and raw["architectures"] == ["LLaDA2MoeModelLM"]
    ids, valid, P = random_canvas(model.config, [7, 3], 8)
    idx = torch.arange(ids.shape[1])
    mask = attention_mask(model.config, valid, P, P, 4, idx, idx)
    pos = position_ids(model.config, valid)
    with torch.no_grad():
        want = model(ids, pos, mask)[0]
        for loaded in (load_model(tmp_path / "cli"), load_model(path)):
            assert loaded.config.attention_block == 4 and loaded.config.family == "llada2"
            assert torch.equal(loaded(ids, pos, mask)[0], want)
        sharded, _ = make_checkpoint(tmp_path / "sharded", "llada2", seed=0, eos_bias=8.0, shard_bytes=20_000)
        assert len(list(sharded.glob("model-*.safetensors"))) > 1
        assert torch.equal(load_model(sharded)(ids, pos, mask)[0], want)
        bf = load_model(path, dtype="bfloat16")
        assert bf.dtype == torch.bfloat16 and bf.layers[1].mlp.router.weight.dtype == torch.float32
        cast = model.to(torch.bfloat16)
        for a, b in zip(cast.layers, bf.layers):
            if hasattr(a.mlp, "router"):
                a.mlp.router.weight.data = b.mlp.router.weight.data
                a.mlp.expert_bias.data = b.mlp.expert_bias.data
        assert torch.equal(bf(ids, pos, mask)[0], cast(ids, pos, mask)[0])


def _write_config(tmp_path, name="m", gen=None, **changes):
    path, _ = make_checkpoint(tmp_path / name, "llada2")
    raw = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (path / "config.json").write_text(json.dumps(raw))
    if gen is not None:
        (path / "generation_config.json").write_text(json.dumps(gen))
    return path


BAD = [
    (dict(n_group=3), "n_group 3 does not divide num_experts 8"),
    (dict(topk_group=5), "topk_group 5 exceeds n_group 4"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 exceeds num_experts 8"),
    (dict(topk_group=1, num_experts_per_tok=3), "num_experts_per_tok 3 exceeds the 2 experts of the topk_group 1"),
    (dict(n_group=8, topk_group=2, num_experts_per_tok=2), "leaves one expert a group"),
    (dict(n_group=0), "n_group 0 and topk_group 2 must both be 0"),
    (dict(n_group=2.5), "field 'n_group' must be a non-negative integer, got 2.5"),
    (dict(num_experts=0), "field 'num_experts' must be a positive integer, got 0"),
    (dict(first_k_dense_replace=3), "first_k_dense_replace 3 exceeds num_hidden_layers 2"),
    (dict(score_function="softmax"), "score_function 'softmax' is not supported"),
    (dict(use_bias=True), "use_bias=true is not supported"),
    (dict(norm_head=True), "norm_head=true is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(partial_rotary_factor=0.1), "partial_rotary_factor 0.1 of the head dimension 16 gives 1 rotary"),
    (dict(use_qk_norm="yes"), "field 'use_qk_norm' must be true or false"),
    (dict(routed_scaling_factor=-1), "field 'routed_scaling_factor' must be a positive number"),
    (dict(block_length=0), "field 'block_length' must be a positive integer"),
    (dict(mask_token_id=None), "lacks the required field 'mask_token_id' (of a llada2 model; "),
    (dict(rope_scaling={"type": "yarn", "factor": 4}), "rope_scaling of type 'yarn' is not supported"),
    # transformers 5 reads rope_parameters in place of rope_scaling / rope_theta: it must agree with them
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 6e5}),
     'rope_parameters {"rope_type": "yarn", "factor": 4.0, "rope_theta": 600000.0} (an object) is not supported'),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     "plain RoPE with theta 600000 over 8 of the 16"),
    (dict(rope_parameters={"rope_theta": 6e5, "partial_rotary_factor": 1.0}), "rope_parameters {"),
]


@pytest.mark.parametrize("changes,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_llada2_config_is_one_line(tmp_path, changes, message):
    path = _write_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=re.escape(message)) as e:
        load_model(path)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_rope_parameters_that_agree_load(tmp_path):
    """rope_parameters as transformers 5 saves a LLaDA2 config (the same theta and rotary fraction) loads."""
    path = _write_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 6e5,
                                                    "partial_rotary_factor": 0.5})
    assert load_model(path).config.rotary_dim == 8
    # transformers 5 may save no top-level rope_theta: the theta is rope_parameters' (was: 10000, silently)
    path = _write_config(tmp_path, "m2", rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 6e5})
    assert ModelConfig.from_dir(path).rope_theta == 6e5


def test_ids_and_block_from_generation_config(tmp_path):
    """LLaDA2's config.json may leave mask, EOS and block size to generation_config.json; without
    any block size the attention block is the authors' default."""
    path = _write_config(tmp_path, mask_token_id=None, eos_token_id=None, block_length=None,
                         gen={"mask_token_id": 60, "eos_token_id": [61, 62], "block_length": 8})
    c = ModelConfig.from_dir(path)
    assert (c.mask_token_id, c.eos_token_id, c.stop_token_ids, c.attention_block) == (60, 61, (61, 62), 8)
    assert load_model(path).config.attention_block == 8
    path = _write_config(tmp_path, "m2", block_length=None)
    assert ModelConfig.from_dir(path).attention_block == LLADA2_BLOCK
    path = _write_config(tmp_path, "m3", mask_token_id=None, gen={"mask_token_id": 64})
    with pytest.raises(CheckpointError, match=re.escape("generation_config.json: mask_token_id 64 is outside the "
                                                        "vocabulary of size 64 (vocab_size of ")):
        load_model(path)


def test_real_llada2_mini_fields():
    """The fields of LLaDA2.0-mini's config.json (as SGLang and the authors' configuration class
    read them) map to the right config; the real-size model (16B) builds on the meta device."""
    c = ModelConfig.from_hf(dict(LLADA2_MINI_CONFIG), dict(LLADA2_MINI_IDS))
    want = dict(family="llada2", attention="block_causal", attention_block=32, logit_shift=0, qk_norm=True,
                rotary_dim=64, head_dim=128, num_kv_heads=4, num_experts=256, num_experts_per_tok=8,
                moe_intermediate_size=512, shared_intermediate_size=512, first_dense_layers=1, n_group=8,
                topk_group=4, routed_scaling_factor=2.5, expert_bias=True, qkv_bias=False, o_bias=False,
                mask_token_id=156895, eos_token_id=156892, pad_token_id=156892)
    assert {k: getattr(c, k) for k in want} == want
    with torch.device("meta"):
        from models import Transformer

        m = Transformer(c)
    n = sum(p.numel() for p in m.parameters())
    assert n == c.parameter_count() and 15.5e9 < n < 17e9


def test_tensor_parallel_is_refused_in_one_line():
    with pytest.raises(ParallelError, match="tensor parallel is not implemented for mixture-of-experts models"):
        check_divisible(ModelConfig.tiny("llada2"), 2)
