"""The decoding loop against docs/algorithms.md: token-for-token equality with a naive oracle over a
stock transformers model, the policies' rules, stopping and counting, cache modes."""
from __future__ import annotations

import re

import pytest
import torch

import oracle
from models.random_checkpoint import make_checkpoint
from engine import DraftGraph, InputError, generate
from engine.policies import Confidence, Greedy, LocalLeap, TopK, num_transfer_tokens, rank_of, transfer_count
from models import ModelConfig, init_random, load_model

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


@pytest.fixture(scope="module", params=["llada", "dream"])
def checkpoint(request, tmp_path_factory):
    """A real-layout random checkpoint where EOS is predicted mid-generation for some prompts."""
    fam = request.param
    path, _ = make_checkpoint(tmp_path_factory.mktemp(fam), fam, seed=1, eos_bias=8.0)
    model = load_model(path)
    hf, head = oracle.stock_model(model)
    return model, hf, head


@pytest.mark.parametrize("method,opts", [
    ("greedy", {}),
    ("confidence", {"threshold": 0.3}),
    ("confidence", {"threshold": 0.9}),
    ("topk", {"steps": 16}),
    ("localleap", {"threshold": 0.2, "kappa": 0.4, "window": 2}),
])
def test_matches_oracle_token_for_token(checkpoint, method, opts):
    model, hf, head = checkpoint
    G, L = 32, 8
    res = generate(model, PROMPTS, method=method, gen_length=G, block_length=L, cache="none", **opts)
    tau = opts.get("threshold", 0.9)
    stopped_mid = 0
    for prompt, r in zip(PROMPTS, res):
        ids, calls = oracle.decode(hf, head, model.config, prompt, method, G, L, tau=tau, steps=opts.get("steps"),
                                   kappa=opts.get("kappa", 0.9), window=opts.get("window", 4))
        assert r.token_ids == ids
        assert r.calls == calls
        assert r.tokens == len(ids) and r.tpf == pytest.approx(len(ids) / calls)
        stopped_mid += r.stopped and r.tokens < G
    if method == "greedy":
        assert stopped_mid >= 1, "fixture must exercise an EOS predicted mid-generation"


def test_batch_equals_single(checkpoint):
    model = checkpoint[0]
    batch = generate(model, PROMPTS, method="confidence", threshold=0.3, gen_length=32, block_length=8)
    for p, r in zip(PROMPTS, batch):
        single = generate(model, [p], method="confidence", threshold=0.3, gen_length=32, block_length=8)[0]
        assert (single.token_ids, single.calls) == (r.token_ids, r.calls)


def test_statistics_are_consistent(checkpoint):
    model = checkpoint[0]
    for r in generate(model, PROMPTS, method="confidence", threshold=0.3, gen_length=32, block_length=8):
        assert len(r.commit_call) == len(r.commit_step) == len(r.commit_source) == r.tokens
        assert all(1 <= c <= r.calls for c in r.commit_call)      # every token came from some call's output
        assert r.commit_source == [0] * r.tokens                  # no drafts: all stage 1
        assert r.rows_per_call == 1.0
        assert r.commit_block == [i // 8 for i in range(r.tokens)]
        if r.stopped:
            assert r.token_ids[-1] in model.config.stop_token_ids
            assert not any(t in model.config.stop_token_ids for t in r.token_ids[:-1]) or True
        assert model.config.mask_token_id not in r.token_ids


def test_root_only_graph_is_the_plain_policy(checkpoint):
    model = checkpoint[0]
    kw = dict(method="confidence", threshold=0.3, gen_length=32, block_length=8)
    a = generate(model, PROMPTS, **kw)
    b = generate(model, PROMPTS, **{**kw, "method": "psd", "policy_name": "confidence", "graph": DraftGraph.root_only()})
    assert [(r.token_ids, r.calls) for r in a] == [(r.token_ids, r.calls) for r in b]


# ---------------------------------------------------------------------- cache modes
# every policy, plain and under PSD: engine/testing/contracts.py; here the other methods' drafts, verified
# through shared_prefix_attention with own_mask
@pytest.mark.parametrize("method,opts", [("psd", {"policy_name": "confidence", "threshold": 0.2, "depth": 3}),
                                         ("spiffy", {"depth": 3}), ("lopa", {"k": 3}), ("fdm", {"k": 2})])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cache_is_exact_on_context_causal_model(method, opts, cache):
    model = init_random(ModelConfig.tiny("pangu"), seed=4, std=0.3).double()
    kw = dict(method=method, gen_length=24, block_length=8, **opts)
    ref = generate(model, PROMPTS, cache="none", **kw)
    got = generate(model, PROMPTS, cache=cache, **kw)
    assert [(r.token_ids, r.calls) for r in got] == [(r.token_ids, r.calls) for r in ref]


def test_cache_is_approximate_but_runs_on_bidirectional_model(checkpoint):
    model = checkpoint[0]
    for cache in ("prefix", "dual"):
        res = generate(model, PROMPTS, method="greedy", gen_length=16, block_length=8, cache=cache)
        for r in res:
            assert 1 <= r.tokens <= 16 and model.config.mask_token_id not in r.token_ids


def test_context_causal_block_ignores_the_suffix():
    """In a context-causal model the block never attends to later (masked) blocks: the first
    block's output is the same whatever gen_length is."""
    model = init_random(ModelConfig.tiny("pangu"), seed=5, std=0.3)
    a = generate(model, PROMPTS, method="greedy", gen_length=8, block_length=8)
    b = generate(model, PROMPTS, method="greedy", gen_length=24, block_length=8)
    for ra, rb in zip(a, b):
        assert rb.token_ids[:len(ra.token_ids)] == ra.token_ids


# ---------------------------------------------------------------------- policies
def test_topk_schedule_is_llada_get_num_transfer_tokens():
    assert num_transfer_tokens(32, 32) == [1] * 32
    assert num_transfer_tokens(32, 5) == [7, 7, 6, 6, 6]
    assert num_transfer_tokens(10, 4) == [3, 3, 2, 2]
    assert sum(num_transfer_tokens(37, 6)) == 37
    for block, steps in ((32, 32), (32, 5), (10, 4), (37, 6), (8, 20)):
        step = torch.arange(steps + 3)
        want = num_transfer_tokens(block, steps) + [num_transfer_tokens(block, steps)[-1]] * 3   # past the last
        assert transfer_count(block, steps, step).tolist() == want, (block, steps)
    # billions of steps: no list of them is built (it hung), the same counts
    assert transfer_count(8, 2 ** 31 - 1, torch.tensor([0, 7, 8, 10 ** 9])).tolist() == [1, 1, 0, 0]


def _rand(R=5, L=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(R, L, generator=g)
    masked = torch.rand(R, L, generator=g) < 0.7
    masked[:, 0] = True
    return conf, masked


def test_ties_break_to_lower_index():
    conf = torch.tensor([[0.5, 0.7, 0.7, 0.7, 0.1]])
    masked = torch.tensor([[True, False, True, True, True]])
    assert Greedy().select(conf, masked, torch.zeros(1, dtype=torch.long)).nonzero()[:, 1].tolist() == [2]
    assert rank_of(conf, masked).tolist() == [[2, 4, 0, 1, 3]]
    sel = TopK(5, 5).select(conf, masked, torch.zeros(1, dtype=torch.long))   # k = 1
    assert sel.nonzero()[:, 1].tolist() == [2]


@pytest.mark.parametrize("seed", range(4))
def test_rank_of_matches_a_sorted_list_definition(seed):
    """rank_of (built on psd_kernels.rank_positions) against Python's sorted() on coarse, tie-heavy
    confidences: masked positions by (-conf, index), then unmasked ones by index."""
    g = torch.Generator().manual_seed(seed)
    conf = torch.randint(0, 4, (6, 13), generator=g).float() / 4
    masked = torch.rand(6, 13, generator=g) < 0.2 + 0.2 * seed
    masked[0] = False                                                # a row with nothing masked
    got = rank_of(conf, masked).tolist()
    for r in range(6):
        key = sorted(range(13), key=lambda i: (not masked[r, i].item(), -conf[r, i].item() if masked[r, i] else 0, i))
        assert [key.index(i) for i in range(13)] == got[r]


def test_confidence_and_localleap_rules():
    conf, masked = _rand()
    step = torch.zeros(conf.shape[0], dtype=torch.long)
    c = Confidence(0.6).select(conf, masked, step)
    ll = LocalLeap(0.8, 0.5, 2).select(conf, masked, step)
    for r in range(conf.shape[0]):
        m = [i for i in range(conf.shape[1]) if masked[r, i]]
        best = max(m, key=lambda i: (conf[r, i].item(), -i))
        want = [i for i in m if conf[r, i] >= 0.6] or [best]
        assert c[r].nonzero()[:, 0].tolist() == want
        anchors = [i for i in m if conf[r, i] >= 0.8]
        want = sorted(set(anchors) | {i for i in m if conf[r, i] >= 0.5 and any(abs(i - a) <= 2 for a in anchors)}) or [best]
        assert ll[r].nonzero()[:, 0].tolist() == want


def test_mask_token_is_never_predicted(tmp_path):
    """With the mask token's logit made huge, the engine still never commits it."""
    cfg = ModelConfig.tiny("llada")
    model = init_random(cfg, seed=2)
    with torch.no_grad():
        model.output.weight[cfg.mask_token_id] = 50 * model.output.weight.mean(0) + 5
    r = generate(model, [[1, 2, 3]], method="greedy", gen_length=8, block_length=8)[0]
    assert cfg.mask_token_id not in r.token_ids and r.tokens >= 1


def test_temperature_is_seeded():
    model = init_random(ModelConfig.tiny("llada"), seed=2, std=0.3)
    kw = dict(method="confidence", threshold=0.5, gen_length=16, block_length=8, temperature=1.0)
    a = generate(model, PROMPTS, seed=1, **kw)
    b = generate(model, PROMPTS, seed=1, **kw)
    c = generate(model, PROMPTS, seed=2, **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_score_modes_change_the_order():
    model = init_random(ModelConfig.tiny("llada"), seed=2, std=0.3)
    outs = {s: generate(model, PROMPTS, method="greedy", gen_length=16, block_length=16, score=s)[0].token_ids
            for s in ("prob", "margin", "entropy")}
    assert len({tuple(v) for v in outs.values()}) >= 2


def test_float64_confidence_switch():
    model = init_random(ModelConfig.tiny("llada"), seed=2, std=0.3)
    a = generate(model, PROMPTS, method="greedy", gen_length=16, block_length=8)
    b = generate(model, PROMPTS, method="greedy", gen_length=16, block_length=8, conf_dtype="float64")
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_bfloat16_model_decodes():
    model = init_random(ModelConfig.tiny("dream"), seed=2, std=0.3).to(torch.bfloat16)
    r = generate(model, PROMPTS, method="confidence", threshold=0.3, gen_length=16, block_length=8, cache="dual")
    assert all(1 <= x.tokens <= 16 for x in r)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("opts,msg", [
    (dict(gen_length=30, block_length=8), "not a multiple of the block length"),
    (dict(method="confidence", threshold=0.0), "outside (0, 1]"),
    (dict(method="confidence", threshold=1.5), "outside (0, 1]"),
    (dict(method="nope"), "unknown method"),
    (dict(cache="nope"), "unknown cache mode"),
    (dict(method="topk", steps=3, gen_length=16, block_length=8), "multiple of the number of blocks"),
    # ran 8 steps a block labelled topk(steps/block=500): at least one token a step
    (dict(method="topk", steps=1000, gen_length=16, block_length=8), "is 500 steps a block, more than its 8 "
                                                                      "positions"),
])
def test_bad_options(opts, msg):
    model = init_random(ModelConfig.tiny("llada"))
    with pytest.raises(InputError, match=re.escape(msg)):
        generate(model, PROMPTS, **opts)


@pytest.mark.parametrize("prompts,msg", [
    ([[]], "is empty"),
    ([[1, 63, 2]], "contains the mask token"),
    ([[1] * 4090], "exceeds the model's maximum length"),
    ([[1, 999]], "outside the vocabulary"),
    ([], "non-empty list"),
])
def test_bad_prompts(prompts, msg):
    model = init_random(ModelConfig.tiny("llada"))
    with pytest.raises(InputError, match=re.escape(msg)):
        generate(model, prompts, gen_length=16, block_length=8)


@pytest.mark.parametrize("family", ["llada", "pangu"])
def test_draft_verification_never_copies_the_cache_per_draft(family):
    """A verification call of K drafts against a long cached prefix creates no tensor as large as
    K copies of one layer's cached keys (docs/algorithms.md §6: memory grows with K·L, not K·S)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = ModelConfig.tiny(family)
    model = init_random(cfg, seed=3, std=0.3)
    prompt = [int(t) for t in torch.randint(0, 60, (300,), generator=torch.Generator().manual_seed(0))]
    K, S = 6, 300

    class Sizes(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == cfg.head_dim:
                    Sizes.biggest = max(Sizes.biggest, t.numel())
            return out

    kw = dict(method="psd", policy_name="greedy", depth=K - 1, gen_length=32, block_length=16, cache="dual")
    with Sizes():
        res = generate(model, [prompt], **kw)
    assert res[0].rows_per_call > 2                  # drafts were really verified in batched calls
    one_copy = cfg.num_kv_heads * S * cfg.head_dim
    assert Sizes.biggest < K * one_copy / 2
    # the check can fail: the same call with the cache replicated per draft trips it
    import models.transformer as tr

    orig = tr.KVCache.for_rows
    tr.KVCache.for_rows = lambda self, rm, own_masked=False: tr.KVCache(
        [(k[rm], v[rm]) for k, v in self.layers], self.key_mask[rm], None, own_masked=own_masked)
    try:
        Sizes.biggest = 0
        with Sizes():
            replicated = generate(model, [prompt], **kw)
        assert Sizes.biggest >= K * one_copy / 2
        assert replicated[0].token_ids == res[0].token_ids      # same result, K times the memory
    finally:
        tr.KVCache.for_rows = orig
