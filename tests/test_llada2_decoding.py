"""LLaDA2.x decoding as its authors run it (docs/algorithms.md §8, "LLaDA2"): the `threshold` policy
with its step schedule and token editing, blocks counted from the sequence's first token
(`--align sequence`), token for token against diffusers' `LLaDA2Pipeline` +
`BlockRefinementScheduler` driving the engine's own model through a thin adapter, so the sampler is
compared, not the model. Then PSD over it, the caches on block-causal llada2, and streaming.

The adapter (`EngineLM`) is what the pipeline calls: `model(ids, attention_mask=, position_ids=)`
-> `.logits`. It runs the engine's `Transformer` over the window the pipeline gives it (the prompt
and every block up to the current one) with the model's block-causal mask over every position of it,
as the authors' generate() does (the pipeline's 2-D mask only marks the block-aligned tail past
prompt + gen length, which the authors' mask attends to and so does the engine), and excludes the
mask token's logit, as the engine does before every argmax (§1).
"""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from engine import DecodeConfig, Decoder, InputError, generate
from models import ModelConfig, attention_mask
from models.config import FAMILIES
from models.checkpoint import init_random

diffusers = pytest.importorskip("diffusers", reason="diffusers (the LLaDA2Pipeline reference) is not installed")

if "llada2" not in FAMILIES:
    pytest.skip("the llada2 model family is not in models/ yet", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """A tiny model runs fastest on one thread (and the suite's other processes keep theirs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_llada2(block: int, seed: int = 0, eos_bias: float = 0.0):
    """A tiny random llada2 model with attention blocks of `block` (EOS made likely by `eos_bias`)."""
    cfg = ModelConfig.tiny("llada2", attention_block=block)
    model = init_random(cfg, seed=seed, std=0.3).eval()
    if eos_bias:
        w = model.tok_embeddings.weight if model.output is None else model.output.weight
        with torch.no_grad():
            w[cfg.eos_token_id] += eos_bias * w.mean(0) + eos_bias * 0.05 * w[1]
    return model


class EngineLM(torch.nn.Module):
    """The engine's model as the pipeline calls it (see the module docstring)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.mc = model, model.config

    @property
    def device(self):              # what DiffusionPipeline reads to place its tensors
        return self.model.device

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        R, T = input_ids.shape
        valid = torch.ones(R, T, dtype=torch.bool)
        idx = torch.arange(T)
        own = attention_mask_of(self.mc, valid, idx)
        logits, _ = self.model(input_ids, position_ids.expand(R, T), own, out_start=0, out_len=T)
        logits = logits.float().clone()
        logits[..., self.mc.mask_token_id] = float("-inf")
        return SimpleNamespace(logits=logits)


def attention_mask_of(mc, valid, idx):
    return attention_mask(mc, valid, 0, 0, mc.attention_block, idx, idx)


def reference(model, prompts, gen, steps, tau, edit, post=16, **sampling):
    """diffusers' LLaDA2Pipeline at temperature 0: the generated ids, cut after the first EOS."""
    from diffusers import BlockRefinementScheduler, LLaDA2Pipeline

    mc = model.config
    pipe = LLaDA2Pipeline(model=EngineLM(model), scheduler=BlockRefinementScheduler())
    pipe.set_progress_bar_config(disable=True)
    out = pipe(input_ids=torch.tensor(prompts), use_chat_template=False, gen_length=gen,
               block_length=mc.attention_block, num_inference_steps=steps, temperature=0.0, threshold=tau,
               editing_threshold=edit, max_post_steps=post, eos_early_stop=True, eos_token_id=mc.eos_token_id,
               mask_token_id=mc.mask_token_id, output_type="seq", **sampling).sequences
    res = []
    for row in out.tolist():
        res.append(row[:row.index(mc.eos_token_id) + 1] if mc.eos_token_id in row else row)
    return res


def engine_ids(model, prompts, gen, steps, tau, edit, post=16, **options):
    extra = {} if edit is None else {"editing_threshold": edit, "max_post_steps": post}
    res = generate(model, prompts, method="threshold", gen_length=gen, block_length=model.config.attention_block,
                   align="sequence", block_steps=steps, threshold=tau, **extra, **options)
    return [r.token_ids for r in res]


def prompt(rng, n, mc):
    """Random prompt ids, never the mask or EOS (a prompt EOS: diffusers then never finishes a row)."""
    return [rng.choice([t for t in range(mc.vocab_size) if t not in (mc.mask_token_id, mc.eos_token_id)])
            for _ in range(n)]


def cases():
    """(block, eos_bias, (prompt length, batch), gen, steps per block, τ, (editing τ, max post steps)):
    216 of the grid's 576 configurations, drawn with a fixed seed."""
    grid = list(itertools.product((4, 8), (0.0, 3.0), ((3, 1), (6, 2), (8, 1), (5, 3)), (6, 12), (3, 6),
                                  (0.1, 0.3), (None, (0.2, 2), (0.5, 16))))
    random.Random(0).shuffle(grid)
    return grid[:216]


@pytest.mark.slow
def test_threshold_and_editing_are_token_exact_against_diffusers():
    """216 configurations (block sizes, EOS-prone models, prompt lengths inside and at block boundaries,
    batches of 1-3 equal-length prompts, gen lengths that are and are not multiples of the block, steps
    per block below and above the block length, thresholds, editing off and at two thresholds), every
    sequence token-equal to diffusers' pipeline: to its batched run without editing, and with editing
    to its run of each prompt alone. (With editing the pipeline's block loop is the batch's: a row
    whose masks are filled gets editing passes while another row still fills, and the passes after
    that are counted for the batch, so a row's tokens depend on its batch. The engine decodes every
    row as it would alone — the property continuous batching needs — and equals the pipeline's
    single-prompt run; docs/algorithms.md §8.)"""
    models = {}
    rng = random.Random(1)
    n_seq = n_stop = n_diff_from_plain = n_edit = 0
    for block, eos_bias, (plen, batch), gen, steps, tau, (edit, post) in ((*c[:-1], c[-1] or (None, 16))
                                                                          for c in cases()):
        key = (block, eos_bias)
        if key not in models:
            models[key] = tiny_llada2(block, seed=len(models), eos_bias=eos_bias)
        model = models[key]
        prompts = [prompt(rng, plen, model.config) for _ in range(batch)]
        if edit is None or batch == 1:
            want = reference(model, prompts, gen, steps, tau, edit, post)
        else:   # the pipeline shares a batch's editing passes between its rows; the engine's rows are their own
            want = [reference(model, [p], gen, steps, tau, edit, post)[0] for p in prompts]
        got = engine_ids(model, prompts, gen, steps, tau, edit, post)
        assert got == want, (block, eos_bias, plen, batch, gen, steps, tau, edit, post, prompts)
        n_seq += len(got)
        n_stop += sum(model.config.eos_token_id in g for g in got)
        if edit is not None:
            n_diff_from_plain += got != engine_ids(model, prompts, gen, steps, tau, None)
            n_edit += 1
    assert n_stop >= 20 and n_seq - n_stop >= 20      # sequences that stop at EOS, and ones that run to the end
    assert n_edit >= 100 and n_diff_from_plain >= 10  # editing on, and changing the output


def test_top_k_top_p_at_temperature_zero_change_nothing_as_in_the_reference():
    model = tiny_llada2(4, seed=3)
    rng = random.Random(2)
    for top_k, top_p in ((2, 1.0), (0, 0.5), (3, 0.7)):
        prompts = [prompt(rng, 5, model.config)]
        want = reference(model, prompts, 12, 4, 0.2, 0.3, 2, top_k=top_k or None, top_p=top_p)
        assert engine_ids(model, prompts, 12, 4, 0.2, 0.3, 2, top_k=top_k, top_p=top_p) == want


def test_mixed_prompt_lengths_decode_as_alone():
    """Rows of different prompt lengths (different offsets in their first block) in one batch: each is
    diffusers' single-prompt run (the engine's batch never shifts a row's blocks or positions)."""
    model = tiny_llada2(4, seed=5, eos_bias=2.0)
    rng = random.Random(3)
    prompts = [prompt(rng, n, model.config) for n in (2, 7, 4, 9)]
    for edit in (None, 0.2):
        got = engine_ids(model, prompts, 10, 4, 0.2, edit, 3)
        assert got == [reference(model, [p], 10, 4, 0.2, edit, 3)[0] for p in prompts]


def test_records_and_stream_with_editing():
    """An edited token's records are the edit's; streamed pieces are final: a token is sent only when
    its block closes (it can no longer be edited), and the pieces concatenate to the result."""
    model = tiny_llada2(4, seed=0, eos_bias=3.0)
    rng = random.Random(4)
    prompts = [prompt(rng, n, model.config) for n in (3, 6)]
    dc = DecodeConfig(method="threshold", gen_length=12, block_length=4, threshold=0.3, editing_threshold=0.15,
                      max_post_steps=3)
    dec = Decoder(model, dc)
    results = dec.generate(prompts)
    updates = list(dec.stream(prompts))
    for b, r in enumerate(results):
        assert sum((u.pieces[b] for u in updates), []) == r.token_ids
        assert len(r.commit_call) == len(r.token_ids) and all(c >= 1 for c in r.commit_call)
    assert [r.token_ids for r in updates[-1].results] == [r.token_ids for r in results]
    # a token once sent never changes: every piece is a prefix of the final result when it is sent
    sent = [[] for _ in prompts]
    for u in updates[:-1]:
        for b, piece in enumerate(u.pieces):
            sent[b] += piece
            assert results[b].token_ids[:len(sent[b])] == sent[b]


def test_auto_alignment_is_sequence_on_block_causal_models():
    model = tiny_llada2(4, seed=2)
    rng = random.Random(5)
    prompts = [prompt(rng, 6, model.config)]
    auto = generate(model, prompts, method="threshold", gen_length=8, block_length=4, threshold=0.3)
    seq = generate(model, prompts, method="threshold", gen_length=8, block_length=4, threshold=0.3, align="sequence")
    gen = generate(model, prompts, method="threshold", gen_length=8, block_length=4, threshold=0.3,
                   align="generation")
    assert auto[0].token_ids == seq[0].token_ids
    assert auto[0].commit_block[0] == 0 and auto[0].commit_block[2] == 1   # prompt 6 = 4 + 2: block 0 holds 2
    assert gen[0].commit_block[:4] == [0, 0, 0, 0]


def test_auto_alignment_takes_any_gen_length_where_it_is_sequence():
    """gen length 10 with blocks of 4: `auto` is `sequence` on block-causal llada2, which takes any
    gen length (the config is checked against the model's, `engine.uniform.for_model`); `generation`,
    and `auto` on a bidirectional model, are one error naming the flag that takes it
    (docs/algorithms.md §8)."""
    model = tiny_llada2(4, seed=2)
    prompts = [prompt(random.Random(6), 5, model.config)]
    kw = dict(method="threshold", gen_length=10, block_length=4, threshold=0.3)
    auto = generate(model, prompts, **kw)
    assert auto[0].token_ids == generate(model, prompts, align="sequence", **kw)[0].token_ids
    assert 1 < len(auto[0].token_ids) <= 10
    with pytest.raises(InputError, match="not a multiple of the block length 4 .--align sequence takes any"):
        generate(model, prompts, align="generation", **kw)
    dense = init_random(ModelConfig.tiny("llada"), seed=0).eval()
    with pytest.raises(InputError, match="not a multiple of the block length 4 .--align sequence takes any"):
        generate(dense, [[5, 6, 7]], **kw)
    with pytest.raises(InputError, match="not a multiple of the block length 4"):
        DecodeConfig(align="generation", **kw).validate()         # no model needed to refuse that one
    assert DecodeConfig(**kw).validate().gen_length == 10          # auto: the model's config decides


@pytest.mark.slow
def test_compile_keeps_the_tokens_of_a_mixture_of_experts_batch():
    """--compile on llada2: rows of different prompt lengths route their tokens to different experts;
    the routed experts run outside the compiled graphs (their per-expert sizes come from a host read),
    where inductor's code had failed (NameError on a size symbol). Tokens equal eager's."""
    model = tiny_llada2(4, seed=4, eos_bias=2.0)
    rng = random.Random(11)
    prompts = [prompt(rng, n, model.config) for n in (3, 9)]
    kw = dict(method="threshold", threshold=0.3, gen_length=12, block_length=4)
    eager = [r.token_ids for r in generate(model, prompts, **kw)]
    assert [r.token_ids for r in generate(model, prompts, compile=True, **kw)] == eager


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_caches_are_exact_on_block_causal_llada2(cache):
    """A finished block never changes and never sees a later one, so its keys/values cached at the
    block's first call are the ones every later call would compute: tokens and calls equal --cache none."""
    model = tiny_llada2(4, seed=7, eos_bias=2.0)
    rng = random.Random(6)
    prompts = [prompt(rng, n, model.config) for n in (3, 5, 8)]
    for opts in ({"threshold": 0.2}, {"threshold": 0.2, "editing_threshold": 0.15, "max_post_steps": 3},
                 {"threshold": 0.5, "block_steps": 2}):
        base = generate(model, prompts, method="threshold", gen_length=14, block_length=4, align="sequence", **opts)
        got = generate(model, prompts, method="threshold", gen_length=14, block_length=4, align="sequence",
                       cache=cache, **opts)
        assert [(r.token_ids, r.calls, r.commit_call) for r in got] == \
            [(r.token_ids, r.calls, r.commit_call) for r in base]
    for method, kw in (("greedy", {}), ("psd", {"policy_name": "threshold", "threshold": 0.2, "acceptance": "exact"})):
        base = generate(model, prompts, method=method, gen_length=12, block_length=4, **kw)
        got = generate(model, prompts, method=method, gen_length=12, block_length=4, cache=cache, **kw)
        assert [r.token_ids for r in got] == [r.token_ids for r in base]


def test_psd_over_threshold_exact_is_the_plain_policy():
    model = tiny_llada2(8, seed=4, eos_bias=2.0)
    rng = random.Random(7)
    prompts = [prompt(rng, n, model.config) for n in (3, 9, 5)]
    for tau, steps in ((0.2, 8), (0.4, 3), (0.9, 8)):
        plain = generate(model, prompts, method="threshold", gen_length=16, block_length=8, threshold=tau,
                         block_steps=steps)
        for d in (1, 3):
            psd = generate(model, prompts, method="psd", policy_name="threshold", depth=d, acceptance="exact",
                           gen_length=16, block_length=8, threshold=tau, block_steps=steps)
            assert [r.token_ids for r in psd] == [r.token_ids for r in plain]
            assert sum(r.calls for r in psd) <= sum(r.calls for r in plain)
        loose = generate(model, prompts, method="psd", policy_name="threshold", depth=3, gen_length=16,
                         block_length=8, threshold=tau, block_steps=steps)
        assert all(len(r.token_ids) >= 1 for r in loose)


def test_editing_with_drafts_is_refused_with_one_line():
    model = tiny_llada2(4)
    with pytest.raises(InputError) as e:
        generate(model, [[1, 2]], method="psd", policy_name="threshold", editing_threshold=0.5, gen_length=8,
                 block_length=4)
    assert "\n" not in str(e.value) and "editing" in str(e.value)
    with pytest.raises(InputError):
        generate(model, [[1, 2]], method="threshold", max_post_steps=3, gen_length=8, block_length=4)


def test_continuous_batching_decodes_each_row_as_alone():
    """LiveBatch with staggered joins (rows of different prompt offsets join at block boundaries):
    every sequence's tokens, calls and streamed pieces equal its own generate()."""
    from support import run_live

    model = tiny_llada2(4, seed=6, eos_bias=1.0)
    rng = random.Random(8)
    prompts = [prompt(rng, n, model.config) for n in (3, 6, 4, 9)]
    for opts in ({"threshold": 0.3}, {"threshold": 0.3, "editing_threshold": 0.2, "max_post_steps": 3}):
        dec = Decoder(model, DecodeConfig(method="threshold", gen_length=12, block_length=4, **opts))
        out = run_live(dec, prompts, [(0, None, 0), (1, None, 0), (2, None, 2), (3, 8, 3)])
        for i, p in enumerate(prompts):
            alone = generate(model, [p], method="threshold", gen_length=8 if i == 3 else 12, block_length=4, **opts)[0]
            assert out.done[i].token_ids == alone.token_ids and out.done[i].calls == alone.calls
            assert out.pieces[i] == alone.token_ids
