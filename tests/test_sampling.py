"""engine/sampling.py: the one home of what logits become (token, confidence)."""
from types import SimpleNamespace

import pytest
import torch

import psd_kernels
from engine import DecodeConfig
from engine.sampling import Sampler

V, MASK, STOPS = 47, 46, (2, 3)
MC = SimpleNamespace(mask_token_id=MASK, stop_token_ids=list(STOPS), max_length=64)


def sampler(**options) -> Sampler:
    return Sampler(DecodeConfig(**options), MC, torch.device("cpu"))


def logits(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_draws_nothing_and_is_the_argmax():
    s, x = sampler(), logits(3, 5)
    assert s.gen is None                          # no generator, so no noise can be drawn
    pred, conf, top = s.predict(x)
    ref_pred, ref_conf = psd_kernels.top1(x, MASK)
    assert torch.equal(pred, ref_pred) and torch.equal(conf, ref_conf) and top is None


def test_noise_is_the_float64_gumbel_draw_of_the_seeded_generator():
    """In place, the same values as LLaDA's -log(-log(u)) from the generator seeded by --seed: the
    stream the fingerprint pins (docs/loop.md, Sampling)."""
    s, x = sampler(temperature=0.7, seed=11), logits(4, 6)
    ref = torch.Generator().manual_seed(11)
    for _ in range(2):                             # the stream goes on from call to call
        u = torch.rand(x.shape, generator=ref, dtype=torch.float64)
        assert torch.equal(s.noise(x), -torch.log(-torch.log(u.clamp_min(1e-300))))


@pytest.mark.parametrize("options", [{"top_k": 3}, {"top_p": 0.5}, {"top_k": 5, "top_p": 0.8}])
def test_top_k_and_top_p_sample_only_among_the_kept_tokens(options):
    s, x = sampler(temperature=1.5, seed=2, **options), logits(8, 16, seed=3)
    x[..., MASK] = 50.0                            # the mask token is never kept, however likely
    kept = s.kept(x)
    assert not kept[..., MASK].any() and kept.any(-1).all()
    if "top_k" in options:
        assert (kept.sum(-1) <= options["top_k"]).all()
    for _ in range(5):
        pred, conf, _ = s.predict(x)
        assert kept.gather(-1, pred[..., None]).all()
        # the confidence stays the untempered probability of the sampled token
        p = torch.softmax(x.index_fill(-1, torch.tensor([MASK]), float("-inf")), -1)
        torch.testing.assert_close(conf, p.gather(-1, pred[..., None])[..., 0])


def test_sampled_tokens_follow_the_tempered_distribution():
    T, n = 0.8, 4000
    s, x = sampler(temperature=T, seed=5), logits(1, 1, seed=4) / 3
    pred, _, _ = s.predict(x.expand(n, 1, V).contiguous())
    freq = torch.bincount(pred[:, 0], minlength=V).double() / n
    want = torch.softmax(x[0, 0].double().index_fill(0, torch.tensor([MASK]), float("-inf")) / T, -1)
    assert freq[MASK] == 0
    assert (freq - want).abs().max() < 0.03


def test_min_tokens_and_ignore_eos_bar_the_stop_tokens():
    x = logits(2, 8)
    x[..., STOPS[0]] = 100.0                       # a stop token is everyone's argmax
    gen_start = torch.tensor([3, 6])
    pred, _, _ = sampler(min_tokens=4).predict(x, gen_start, lo=2)
    cols = torch.arange(2, 10)
    barred = cols[None] < gen_start[:, None] + 4
    assert (pred[barred] != STOPS[0]).all() and (pred[~barred] == STOPS[0]).all()
    pred, _, _ = sampler(ignore_eos=True, min_tokens=4).predict(x, gen_start, lo=2)
    assert not torch.isin(pred, torch.tensor(STOPS)).any()
    assert sampler(ignore_eos=True, min_tokens=4).no_stop(gen_start, 2, 8) is None
    assert sampler().no_stop(gen_start, 2, 8) is None


def test_top_logprobs_are_the_untempered_alternatives():
    s, x = sampler(top_logprobs=3, temperature=0.9), logits(2, 4)
    _, _, top = s.predict(x)
    p = torch.softmax(x.double().index_fill(-1, torch.tensor([MASK]), float("-inf")), -1)
    want_p, want_ids = p.topk(3, dim=-1)
    assert top.shape == (2, 4, 3, 2) and torch.equal(top[..., 0].long(), want_ids)
    torch.testing.assert_close(top[..., 1], want_p, rtol=1e-5, atol=1e-6)
