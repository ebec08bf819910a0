"""DiffusionGemma's uniform-noise paradigm (engine/uniform.py) token-exact against transformers' own
`generate`: the same seed gives the same tokens, up to and including EOS, over entropy bounds,
temperature schedules, stopping thresholds, canvas lengths, gen lengths, batch sizes and EOS cases,
on checkpoints the engine writes and on one transformers' `save_pretrained` wrote; and the options
the paradigm refuses, each with one line (docs/algorithms.md §9)."""
from __future__ import annotations

import json
import random

import pytest
import torch

import engine
from engine import DecodeConfig, Decoder, InputError
from engine.uniform import DEFAULTS
from models import load_model
from models.random_checkpoint import make_checkpoint

transformers = pytest.importorskip("transformers", minversion="5.23",
                                   reason="the oracle is transformers' DiffusionGemmaForBlockDiffusion (5.23+)")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("this transformers has no DiffusionGemmaForBlockDiffusion", allow_module_level=True)

# Random weights of std 0.05: the decoder's self-conditioning (each step reads the last step's
# logits) does not amplify the two implementations' float rounding (about 1e-6 per call); at the
# default std 0.3 it grows about 10x per step and some long runs part ways (docs/algorithms.md §9).
STD = 0.05
GEN = dict(max_denoising_steps=4, sampler_config={"entropy_bound": 0.5, "_cls_name": "EntropyBoundSamplerConfig"},
           t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=4.3, eos_token_id=[1], pad_token_id=0)


def _checkpoint(path, canvas=8, generation=None, seed=0, eos_bias=0.0):
    make_checkpoint(path, "diffusion_gemma", seed=seed, std=STD, eos_bias=eos_bias,
                    generation_defaults={"block_length": canvas})
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    hf = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_model(path), hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (engine model, transformers model): canvases of 8, 4 and 16; generation configs with
    one EOS and a pad, two EOS ids and no pad, none at all (transformers' defaults, no EOS stop); and
    a checkpoint written by transformers' save_pretrained."""
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("uniform")
    out = {"c8": _checkpoint(root / "c8", 8, GEN, eos_bias=2.0),
           "c4": _checkpoint(root / "c4", 4, {**GEN, "eos_token_id": [1, 9], "pad_token_id": None,
                                              "sampler_config": {"entropy_bound": 3.0, "_cls_name": "EntropyBoundSamplerConfig"}}, seed=1),
           "c16": _checkpoint(root / "c16", 16, None, seed=2)}
    hf = out["c8"][1]
    hf.generation_config.stability_threshold = 2
    hf.save_pretrained(root / "saved")
    out["saved"] = (load_model(root / "saved"), transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(
        str(root / "saved"), dtype=torch.float32).eval())
    return out


def _reference(hf, prompts, seed, n, options):
    """transformers' tokens per prompt (left-padded batch, its attention mask), cut after the first
    EOS of its generation config (what follows is its padding)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
    kw = {k: v for k, v in options.items() if k != "entropy_bound"}
    if "entropy_bound" in options:
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig
        kw["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=options["entropy_bound"])
    torch.manual_seed(seed)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, **kw).sequences[:, width:].tolist()
    eos = hf.generation_config.eos_token_id
    eos = set([] if eos is None else [eos] if isinstance(eos, int) else eos)
    return [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out]


BOUNDS = (0.05, 0.5, 2.0, 8.0, 40.0)
SCHEDULES = ((0.4, 0.8), (0.1, 1.0), (0.9, 1.1), (0.0, 0.5))
STOPPING = ((1, 4.3), (0, 4.2), (2, 5.0), (1, 0.005), (3, 4.3))
LENGTHS = (1, 5, 8, 13, 16, 24)


def _runs():
    """(model, seed, prompts, gen length, options): 210 runs, drawn from a fixed seed; a third of
    them with no options (the checkpoint's generation_config.json decides)."""
    rng = random.Random(2026)
    runs = []
    for name, count in (("c8", 80), ("c4", 60), ("saved", 54), ("c16", 16)):
        for i in range(count):
            options = {}
            if i % 3:
                options["entropy_bound"] = rng.choice(BOUNDS)
                options["t_min"], options["t_max"] = rng.choice(SCHEDULES)
                options["stability_threshold"], options["confidence_threshold"] = rng.choice(STOPPING)
                options["max_denoising_steps"] = rng.randint(1, 5)
            elif name == "c16" and i > 3:          # its defaults are transformers' 48 steps: a few runs only
                options["max_denoising_steps"] = rng.randint(1, 5)
            batch = rng.choice((1, 1, 2, 3))
            prompts = [[rng.randrange(2, 64) for _ in range(rng.randint(1, 9))] for _ in range(batch)]
            runs.append((name, rng.randrange(10_000), prompts, rng.choice(LENGTHS), options))
    return runs


def test_tokens_equal_transformers_generate(models):
    """Every run's tokens equal transformers' (210 runs); the runs cover EOS endings, canvases that
    stop early and runs with no options."""
    runs, wrong, ended = _runs(), [], 0
    for name, seed, prompts, n, options in runs:
        model, hf = models[name]
        want = _reference(hf, prompts, seed, n, options)
        got = [r.token_ids for r in engine.generate(model, prompts, seed=seed, gen_length=n, **options)]
        ended += sum(len(w) < -(-n // model.config.generation_defaults["block_length"]) *
                     model.config.generation_defaults["block_length"] for w in want)
        if got != want:
            wrong.append((name, seed, prompts, n, options, want, got))
    assert len(runs) >= 200
    assert ended >= 20, f"only {ended} sequences ended at an EOS: the EOS path is barely tested"
    assert not wrong, f"{len(wrong)} of {len(runs)} runs differ, first: {wrong[0]}"


def test_stream_and_counts(models):
    """Decoder.stream returns the same tokens as generate, canvas by canvas (a canvas is final when
    it closes); calls count the decoder calls a sequence took part in, as transformers' TPF."""
    model, hf = models["c8"]
    dec = Decoder(model, DecodeConfig(gen_length=24, seed=7))
    final = dec.generate([[5, 6, 7], [9, 10]])
    pieces = [[], []]
    for update in Decoder(model, DecodeConfig(gen_length=24, seed=7)).stream([[5, 6, 7], [9, 10]]):
        for b, p in enumerate(update.pieces):
            pieces[b] += p
    assert pieces == [r.token_ids for r in final]
    torch.manual_seed(7)
    ids = torch.tensor([[0, 5, 6, 7], [0, 0, 9, 10]])
    out = hf.generate(ids, attention_mask=(torch.arange(4) >= torch.tensor([[1], [2]])).long(), max_new_tokens=24)
    tpf = [len(r.token_ids) / r.calls for r in final]
    pad = hf.generation_config.pad_token_id
    want = [(row[4:] != pad).sum().item() / n for row, n in zip(out.sequences, [r.calls for r in final])]
    assert tpf == pytest.approx(want)
    assert [r.tpf for r in final] == pytest.approx(tpf)
    assert all(r.calls >= 1 for r in final)


def test_settings_come_from_generation_config(models):
    """No options: the checkpoint's generation_config.json; none there: transformers' defaults."""
    assert Decoder(models["c4"][0]).uniform.settings()["entropy_bound"] == 3.0
    assert Decoder(models["c4"][0]).uniform.settings()["eos"] == (1, 9)
    s = Decoder(models["c16"][0]).uniform.settings()
    assert {k: s[k] for k in DEFAULTS} == DEFAULTS and s["eos"] == () and s["pad"] is None
    assert Decoder(models["c4"][0], DecodeConfig(entropy_bound=0.25)).uniform.settings()["entropy_bound"] == 0.25


@pytest.mark.parametrize("options, message", [
    (dict(method="psd"), "decodes with eb"),
    (dict(method="confidence"), "decodes with eb"),
    (dict(temperature=0.7), "temperature does not apply"),
    (dict(cache="dual"), "cache does not apply"),
    (dict(block_length=4), "canvas_length 8"),
    (dict(t_min=0.9, t_max=0.5), "t-max 0.5 must be above t-min 0.9"),
    (dict(max_denoising_steps=0), "max denoising steps must be >= 1"),
])
def test_refused_options_are_one_line(models, options, message):
    with pytest.raises(InputError, match=message) as e:
        Decoder(models["c8"][0], DecodeConfig(**options))
    assert "\n" not in str(e.value)


def test_masked_models_refuse_the_uniform_settings(tmp_path):
    _, model = make_checkpoint(tmp_path / "llada", "llada")
    with pytest.raises(InputError, match="t-min applies to uniform-noise models"):
        Decoder(model, DecodeConfig(method="eb", t_min=0.2))
    with pytest.raises(InputError, match="applies to eb"):
        DecodeConfig(method="confidence", max_denoising_steps=3).validate()


def test_continuous_batching_refuses_a_uniform_model(models):
    from engine.live import LiveBatch

    with pytest.raises(InputError, match="continuous batching does not decode a diffusion_gemma model"):
        LiveBatch(Decoder(models["c8"][0]))


def test_a_stability_threshold_beyond_the_steps_keeps_no_longer_history(models):
    """A canvas takes max_denoising_steps steps at most, so a threshold beyond them stops as that many:
    the same tokens as transformers' at that many, with no history of the given length (10**9 steps of
    history was a 64 GB allocation and a traceback)."""
    model, hf = models["c8"]
    for seed in range(4):
        options = dict(max_denoising_steps=4, confidence_threshold=50.0)
        want = _reference(hf, [[5, 6, 7]], seed, 16, {**options, "stability_threshold": 4})
        got = engine.generate(model, [[5, 6, 7]], seed=seed, gen_length=16, stability_threshold=10 ** 9, **options)
        assert [r.token_ids for r in got] == want, seed
