"""`--method topk --schedule dream` is Dream's `diffusion_generate` sampler token for token.

The reference below transcribes Dream's step rule directly (one block over the whole generation,
`timesteps = linspace(1, eps, steps + 1)`, at step i `int(n * (1 - t[i+1] / t[i]))` of the n masked
positions, all of them at the last step, a step that commits nothing still costing a call), with
the confidences of its three algorithms (maskgit_plus = prob, topk_margin = margin, entropy) at
temperature 0, over the stock transformers Qwen2 model holding the engine's weights (oracle.py).
The mask token is never predicted (the engine's convention, docs/algorithms.md §1)."""
from __future__ import annotations

import pytest
import torch

import engine
import oracle
from models import ModelConfig, init_random

SCORES = {"prob": "maskgit_plus", "margin": "topk_margin", "entropy": "entropy"}


def _confidence(logits: torch.Tensor, score: str):
    p = torch.softmax(logits.float(), -1)
    top2 = p.topk(2, -1)
    x0 = top2.indices[:, 0]
    if score == "prob":
        return top2.values[:, 0], x0
    if score == "margin":
        return top2.values[:, 0] - top2.values[:, 1], x0
    return (p * torch.log(p.clamp_min(1e-30))).sum(-1), x0      # Dream: -entropy


def dream_sample(hf, head, cfg, prompt, gen_length, steps, eps, score):
    """Dream's diffusion_generate loop (alg_temp 0, temperature 0), one sequence: the generated
    ids and, per id, the (1-based) call whose output committed it."""
    M = cfg.mask_token_id
    x = torch.tensor([list(prompt) + [M] * gen_length])
    when = torch.zeros_like(x)
    timesteps = torch.linspace(1, eps, steps + 1)
    calls = 0
    for i in range(steps):
        mask_index = x == M
        with torch.no_grad():
            h = hf(input_ids=x, attention_mask=torch.ones(1, 1, x.shape[1], x.shape[1], dtype=torch.bool))
        logits = (h.last_hidden_state @ head.T).float()
        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)          # Dream reads position i at i - 1
        logits[..., M] = float("-inf")
        calls += 1
        confidence, x0 = _confidence(logits[mask_index], score)
        t, s = timesteps[i], timesteps[i + 1]
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        number_transfer_tokens = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, float("-inf"), dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if number_transfer_tokens > 0:
            _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)
            x_ = torch.full_like(x, M)
            x_[mask_index] = x0.clone()
            row = torch.zeros_like(x, dtype=torch.bool).scatter_(1, transfer_index, True)
            x[row] = x_[row]
            when[row] = calls
    return x[0, len(prompt):].tolist(), when[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def dream_model():
    model = init_random(ModelConfig.tiny("dream", vocab_size=96, mask_token_id=95, eos_token_id=94), seed=7, std=0.3)
    return model, *oracle.stock_model(model)


CASES = [  # (gen_length, steps, eps, score)
    (32, 32, 1e-3, "prob"), (32, 8, 1e-3, "prob"), (24, 12, 1e-3, "margin"), (32, 16, 0.05, "entropy"),
    (16, 5, 1e-3, "prob"),
]


def _tokens_until_stop(ids, stops):
    cut = next((i for i, t in enumerate(ids) if t in stops), None)
    return ids if cut is None else ids[:cut + 1]


@pytest.mark.parametrize("gen_length,steps,eps,score", CASES)
def test_topk_dream_schedule_is_dreams_sampler(dream_model, gen_length, steps, eps, score):
    model, hf, head = dream_model
    prompt = [5, 17, 33, 2, 60, 11]
    want, when = dream_sample(hf, head, model.config, prompt, gen_length, steps, eps, score)
    res = engine.generate(model, [prompt], method="topk", schedule="dream", eps=eps, steps=steps, score=score,
                          gen_length=gen_length, block_length=gen_length)[0]
    ids = _tokens_until_stop(want, set(model.config.stop_token_ids))
    assert res.token_ids == ids
    assert res.commit_call == when[:len(ids)]      # the same tokens at the same calls (empty steps included)


@pytest.mark.parametrize("gen_length,steps,eps,score", CASES[:3])
def test_the_llada_split_is_not_dreams_sampler(dream_model, gen_length, steps, eps, score):
    """The reference tells the schedules apart: LLaDA's even split commits other tokens, or the
    same tokens at other calls."""
    model, hf, head = dream_model
    prompt = [5, 17, 33, 2, 60, 11]
    want, when = dream_sample(hf, head, model.config, prompt, gen_length, steps, eps, score)
    res = engine.generate(model, [prompt], method="topk", schedule="llada", steps=steps, score=score,
                          gen_length=gen_length, block_length=gen_length)[0]
    ids = _tokens_until_stop(want, set(model.config.stop_token_ids))
    assert (res.token_ids, res.commit_call) != (ids, when[:len(ids)])


def test_dream_schedule_counts():
    """The per-step counts: Dream's first step at steps == n commits nothing, the last commits the rest."""
    from engine.policies import dream_transfer_count

    n, steps = 32, 32
    left, counts = n, []
    for i in range(steps):
        k = int(dream_transfer_count(torch.tensor([left]), torch.tensor([i]), steps, 1e-3))
        counts.append(k)
        left -= k
    assert counts[0] == 0 and left == 0 and sum(counts) == n
    assert counts == [int(c) for c in counts]


def test_zero_commit_steps_are_not_a_stall_and_psd_exact_stays_lossless(dream_model):
    """A Dream step may commit nothing (no progress-guard failure); PSD exact over the Dream
    schedule equals the schedule alone, with fewer calls or as many."""
    model, _, _ = dream_model
    prompt = [[5, 17, 33, 2, 60, 11], [8, 9, 10]]
    opts = dict(schedule="dream", steps=32, gen_length=32, block_length=16)
    plain = engine.generate(model, prompt, method="topk", **opts)
    psd = engine.generate(model, prompt, method="psd", policy_name="topk", depth=3, acceptance="exact", **opts)
    assert [r.token_ids for r in psd] == [r.token_ids for r in plain]
    assert all(p.calls <= q.calls for p, q in zip(psd, plain))


def test_bad_schedule_options_are_one_line_errors(dream_model):
    model, _, _ = dream_model
    for opts, words in ((dict(method="topk", eps=0.01), "eps applies to --schedule dream"),
                        (dict(method="confidence", schedule="dream"), "schedule applies to topk, random and psd"),
                        (dict(method="topk", schedule="cosine"), "unknown schedule"),
                        (dict(method="topk", schedule="dream", eps=1.0), "outside (0, 1)")):
        with pytest.raises(engine.InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
            engine.generate(model, [[1, 2]], gen_length=8, block_length=8, **opts)
