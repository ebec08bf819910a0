"""`--sampler row` (engine/sampling.py): at temperature > 0 every sequence draws from its own
generator, so a sampled result is the same whatever shares its batch, joins it or leaves it; a
sequence alone draws what the default `--sampler batch` draws. The server decodes sampled
requests this way, so requests with different seeds share one batch."""
from __future__ import annotations

import pytest

from engine import DecodeConfig, Decoder, InputError, generate
from engine.live import LiveBatch
from engine.serve.continuous import live_key
from engine.serve.jobs import config_key
from models.random_checkpoint import make_checkpoint

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15], [20, 21, 22]]
SEEDS = [40, 7, 2 ** 63 + 5, 40]          # two rows with one seed: equal prompts would decode alike


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param) / "m", request.param, seed=1)[1]


def alone(model, base, prompts=PROMPTS, seeds=SEEDS):
    return [generate(model, [p], seed=s, **base)[0].token_ids for p, s in zip(prompts, seeds)]


@pytest.mark.parametrize("method, extra", [("confidence", {"threshold": 0.5}), ("psd", {"depth": 3}),
                                           ("greedy", {"top_k": 5}), ("confidence", {"top_p": 0.9})])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_a_sampled_row_decodes_as_alone_whatever_its_batch(model, method, extra, cache):
    base = dict(method=method, temperature=0.8, gen_length=16, block_length=8, cache=cache, **extra)
    want = alone(model, base)
    dec = Decoder(model, DecodeConfig(sampler="row", **base))
    st = dec.start(PROMPTS, seeds=SEEDS)
    while not st.done:
        dec.step(st)
    assert [r.token_ids for r in dec.results(st)] == want
    # without seeds, row i is seeded seed + i
    rows = generate(model, PROMPTS, seed=40, sampler="row", **base)
    assert [r.token_ids for r in rows] == alone(model, base, seeds=[40, 41, 42, 43])
    # the default draws one noise tensor for the batch: a row's sample depends on its batch-mates
    batch = generate(model, PROMPTS, seed=40, **base)
    assert [r.token_ids for r in batch] != alone(model, base, seeds=[40, 41, 42, 43])


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_sampled_rows_that_join_a_running_batch_decode_as_alone(model, cache):
    base = dict(method="confidence", threshold=0.5, temperature=0.9, gen_length=16, block_length=8, cache=cache)
    want = alone(model, base)
    live = LiveBatch(Decoder(model, DecodeConfig(sampler="row", **base)))
    handles = {live.add(PROMPTS[0], seed=SEEDS[0]): 0}
    done, step = {}, 0
    while True:
        if step in (1, 3, 4):          # joins inside the first block and at later steps
            i = {1: 1, 3: 2, 4: 3}[step]
            handles[live.add(PROMPTS[i], seed=SEEDS[i])] = i
        update = live.step()
        step += 1
        if update is None:
            if step > 4:
                break
            continue
        for h, r in update.done.items():
            done[handles[h]] = r.token_ids
    assert [done[i] for i in range(len(PROMPTS))] == want


@pytest.mark.parametrize("opts", [dict(method="ete", cache="dual"), dict(method="ete", k=2),
                                  dict(method="psd", depth=2, cross_block=True),
                                  dict(method="psd", depth=3, static_rows=True, cache="dual")], ids=str)
def test_a_sampled_row_of_a_mixed_batch_draws_what_it_draws_alone(model, opts):
    """Mixed generation lengths: ETE's and --cross-block's windows reach past a shorter row's end (its
    draws cover only its own columns, as alone), and --static-rows' filler canvases of rows done
    with the block draw from no sequence's generator. Before, each changed the row's draws."""
    if opts.get("cross_block") and model.config.attention != "bidirectional":
        pytest.skip("--cross-block needs a bidirectional model")
    base = dict(temperature=0.8, block_length=8, **opts)
    lengths = [8, 32, 16, 24]
    want = [generate(model, [p], seed=s, gen_length=g, **base)[0].token_ids for p, s, g in zip(PROMPTS, SEEDS, lengths)]
    dec = Decoder(model, DecodeConfig(sampler="row", gen_length=32, **base))
    st = dec.start(PROMPTS, lengths, seeds=SEEDS)
    while not st.done:
        dec.step(st)
    assert [r.token_ids for r in dec.results(st)] == want


def test_row_sampler_is_refused_on_a_uniform_noise_model(tmp_path):
    _, model = make_checkpoint(tmp_path / "g", "diffusion_gemma", seed=0)
    with pytest.raises(InputError, match="--sampler row is for masked models"):
        Decoder(model, DecodeConfig("eb", sampler="row"))


def test_seeds_must_match_the_prompts(model):
    dec = Decoder(model, DecodeConfig(sampler="row", temperature=0.5, gen_length=8, block_length=8))
    with pytest.raises(InputError, match="2 seeds for 1 prompts"):
        dec.start([[5, 6]], seeds=[1, 2])


def test_server_batches_sampled_requests_of_different_seeds_together():
    a = DecodeConfig("confidence", temperature=0.7, seed=1, sampler="row")
    b = a.replace(seed=2)
    assert config_key(a) == config_key(b) and live_key(a) == live_key(b)
    batch_a, batch_b = a.replace(sampler="batch"), b.replace(sampler="batch")
    assert config_key(batch_a) != config_key(batch_b)        # one generator per batch: a seed is the batch's


def test_a_sampled_request_decodes_with_row_generators_unless_the_operator_says_batch():
    from models import ModelConfig, Tokenizer

    from engine.serve.request import Limits, parse_request

    mc, tok = ModelConfig.from_dir("models/default"), Tokenizer("models/default")

    def specs(defaults, temperature):
        lim = Limits("default", mc, tok, defaults={"method": "greedy", "gen_length": 32, "block_length": 32,
                                                   **defaults}, max_choices=8, max_queue=16, draw_seed=lambda: 9)
        return parse_request({"model": "default", "prompt": [5, 6, 7], "n": 2, "max_tokens": 8,
                              "temperature": temperature}, False, lim)

    sampled = specs({}, 0.5)
    assert [s.config.sampler for s in sampled] == ["row", "row"] and [s.config.seed for s in sampled] == [9, 10]
    assert config_key(sampled[0].config) == config_key(sampled[1].config)      # one batch for both samples
    assert {s.config.sampler for s in specs({}, 0.0)} == {"batch"}            # greedy: nothing drawn
    assert {s.config.sampler for s in specs({"sampler": "batch"}, 0.5)} == {"batch"}
