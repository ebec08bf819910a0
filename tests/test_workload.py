"""bench/workload.py: the real shapes the speed benchmarks build with random weights, and the prompt helpers."""
from __future__ import annotations

import torch

from bench import workload
from models import ModelConfig, Transformer


def test_real_shapes_are_the_published_sizes():
    def count(name):
        with torch.device("meta"):
            return sum(p.numel() for p in Transformer(workload.shape_config(name)).parameters())

    assert 7.9e9 < count("llada-8b") < 8.1e9          # LLaDA-8B
    assert 7.5e9 < count("dream-7b") < 7.7e9          # Qwen2.5-7B: 7.62B
    assert 8.0e9 < count("pangu-7b") < 8.6e9          # 7B without the 2 x 153376 x 4096 embeddings
    assert 1.2e8 < count("small") < 1.5e8
    c = workload.shape_config("dream-7b")
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.logit_shift) == (28, 4, 128, 1)
    assert workload.shape_config("pangu-7b").attention == "context_causal"


def test_build_random_allocates_once_in_the_target_dtype():
    cfg = workload.shape_config("tiny-dream")
    model = workload.build_random(cfg, torch.device("cpu"), torch.bfloat16, seed=3)
    params = list(model.parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" and torch.isfinite(p).all() for p in params)
    assert sum(p.numel() for p in params) == sum(p.numel() for p in Transformer(cfg).parameters())
    again = workload.build_random(cfg, torch.device("cpu"), torch.bfloat16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(params, again.parameters()))      # seeded
    assert not model.training and not any(p.requires_grad for p in params)


def test_prompt_helpers(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('first prompt\n\n{"prompt": "second\\nline"}\n')
    assert workload.read_prompt_file(str(f)) == ["first prompt", "second\nline"]
    # too short: filled from the front with the other prompts' tokens; too long: the last tokens
    assert workload.fit_length([[1, 2, 3], [4]], 5) == [[3, 4, 1, 2, 3], [1, 2, 3, 4, 4]]
    assert workload.fit_length([[1, 2, 3], [4]], 2) == [[2, 3], [4, 4]]
    assert workload.fit_length([[1, 2, 3]], None) == [[1, 2, 3]]
    mc = ModelConfig.tiny()
    ids = workload.random_prompts(mc, 4, 50, 0)
    assert all(len(p) == 50 and mc.mask_token_id not in p and mc.eos_token_id not in p for p in ids)
