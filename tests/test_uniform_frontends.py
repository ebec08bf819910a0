"""The benchmark front ends on DiffusionGemma (issue 32 item 5): bench.eval decodes a uniform-noise
checkpoint (what engine.generate returns for the same prompt ids and seed), bench.speed's
`--cost-curve` times its decoder call at the `tiny-diffusiongemma` shape and refuses the real
26B-A4B shape where it does not fit, and the projection (bench/simulate.py) counts its active
parameters (8 of 128 experts a token, with the dense MLP beside them) and records its calls."""
from __future__ import annotations

import json

import pytest
import torch

import engine
from bench import simulate as sim
from bench import speed, workload
from bench.eval import main as eval_main
from bench.tasks import get_task
from models import Tokenizer, Transformer, load_model
from models.checkpoint import SkipMetaInit
from models.random_checkpoint import make_checkpoint

from support import run_main

GENERATION = {"max_denoising_steps": 4, "stability_threshold": 1, "confidence_threshold": 0.5,
              "eos_token_id": [1], "pad_token_id": 0}


@pytest.fixture(scope="module")
def dg(tmp_path_factory):
    """A tiny random DiffusionGemma checkpoint (canvases of 8, 4 denoising steps) with a tokenizer."""
    path = tmp_path_factory.mktemp("dg") / "ckpt"
    make_checkpoint(path, "diffusion_gemma", std=0.05, generation_defaults={"block_length": 8})
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


# ---------------------------------------------------------------------- bench.eval
def test_eval_decodes_a_diffusion_gemma_checkpoint_as_engine_generate_does(dg, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    rc, stdout, err = run_main(eval_main, ["--model", str(dg), "--task", "math", "--methods", "eb", "--limit", "3",
                                       "--gen-length", "12", "--out", str(out), "--quiet"], capsys)
    assert rc == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and {r["spec"] for r in records} == {"eb"}
    assert "gen=16 block=8 cache=encoder" in stdout          # 12 tokens: two whole canvases of 8
    summary = json.loads(stdout.strip().splitlines()[-1])
    # the same prompt ids, one batch, the same seed (0): engine.generate's tokens, calls and TPF
    task, tok = get_task("math"), Tokenizer(dg)
    prompts = [tok.encode(task.format_prompt(p, [])) for p in task.load(None, limit=3)]
    want = engine.generate(load_model(dg), prompts, gen_length=12, seed=0)
    assert [r["tokens"] for r in records] == [w.tokens for w in want]
    assert [r["calls"] for r in records] == [w.calls for w in want]
    assert [r["completion"] for r in records] == [tok.decode(w.token_ids) for w in want]
    row = summary["rows"][0]
    assert row["calls"] == sum(w.calls for w in want) and row["tokens"] == sum(w.tokens for w in want)
    assert row["tpf"] == pytest.approx(row["tokens"] / row["calls"])


def test_the_text_api_decodes_a_diffusion_gemma_checkpoint_as_engine_generate_does(dg, capsys):
    """`engine.load(dir).generate(text)` with no method: a uniform-noise model decodes with its eb,
    as `python -m engine.generate` picks (it used to default to greedy, which such a model refuses);
    a masked model's method is refused with the one line the CLI gives."""
    from engine.cli import main

    lm = engine.load(dg, device="cpu")
    (res,) = lm.results(["t5 t6"], gen_length=8)
    assert main(["t5 t6", "--model", str(dg), "--gen-length", "8", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert res.token_ids == cli["token_ids"] and res.calls == cli["calls"] and res.text == lm.generate("t5 t6",
                                                                                                   gen_length=8)
    with pytest.raises(engine.InputError, match="decodes with eb"):
        lm.generate("t5 t6", method="greedy", gen_length=8)


@pytest.mark.parametrize("extra", [["--methods", "eb", "confidence"], ["--methods", "greedy"],
                                   ["--methods", "eb", "--cache", "dual"], ["--methods", "eb", "--block-length", "32"]],
                         ids=["confidence", "greedy", "cache", "block"])
def test_eval_refuses_what_a_uniform_noise_model_does_not_take(dg, tmp_path, capsys, extra):
    rc, _, err = run_main(eval_main, ["--model", str(dg), "--task", "math", "--limit", "1",
                                  "--out", str(tmp_path / "r.jsonl"), "--quiet", *extra], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert not (tmp_path / "r.jsonl").exists()


# ---------------------------------------------------------------------- the shapes
def test_the_26b_shape_is_the_real_config():
    mc = workload.shape_config("diffusiongemma-26b-a4b")
    assert mc.family == "diffusion_gemma" and mc.mask_token_id is None and mc.encoder_decoder
    assert 25.2e9 < mc.parameter_count() < 25.3e9           # 25,250,986,812: "26B" total
    assert mc.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 5
    sliding, full = mc.layer(0), mc.layer(5)
    assert (sliding.window, sliding.head_dim, sliding.kv_heads, sliding.k_is_v) == (1024, 256, 8, False)
    assert (full.window, full.head_dim, full.kv_heads, full.k_is_v) == (None, 512, 2, True)
    assert full.rope == (512, 1e6, 64) and sliding.rope == (256, 1e4, None)   # a quarter of the pairs turn
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size, mc.intermediate_size) == \
        (128, 8, 704, 2112)
    assert (mc.vocab_size, mc.logit_softcap, mc.rms_eps, mc.tie_embeddings) == (262144, 30.0, 1e-6, True)
    assert mc.generation_defaults["block_length"] == 256 and mc.stop_token_ids == (1, 106, 50)
    assert {k: mc.diffusion[k] for k in ("max_denoising_steps", "t_min", "t_max", "entropy_bound",
                                         "stability_threshold", "confidence_threshold")} == \
        dict(max_denoising_steps=48, t_min=0.4, t_max=0.8, entropy_bound=0.1, stability_threshold=1,
             confidence_threshold=0.005)


def _active_by_tensor(mc) -> int:
    """Active parameters per token counted over the model's own tensors (built on the meta device):
    every tensor of the blocks whole, the routed experts' k of E."""
    with torch.device("meta"), SkipMetaInit():
        model = Transformer(mc)
    E, k = mc.num_experts, mc.num_experts_per_tok
    routed = ("moe.w_gate", "moe.w_up", "moe.w_down")
    return sum(p.numel() // E * k if name.endswith(routed) else p.numel()
               for name, p in model.named_parameters() if name != "tok_embeddings.weight")


@pytest.mark.parametrize("shape", ["tiny-diffusiongemma", "diffusiongemma-26b-a4b"])
def test_the_roofline_counts_eight_of_128_experts_and_the_dense_mlp(shape):
    mc = workload.shape_config(shape)
    assert sim.active_params(mc) == _active_by_tensor(mc)
    if shape == "diffusiongemma-26b-a4b":       # "A4B": 3.84B with the embedding, 3.10B in the blocks
        assert sim.active_params(mc) == 3_102_178_108
        assert round((sim.active_params(mc) + mc.vocab_size * mc.hidden_size) / 1e9, 2) == 3.84
        one = sim.Call(1, 256, 1024, 1, 256, self_cond=True)
        dense = mc.num_layers * 3 * mc.hidden_size * (mc.intermediate_size + 8 * mc.moe_intermediate_size)
        assert sim.call_flops(mc, one) > 2 * 256 * dense


# ---------------------------------------------------------------------- the decoder call
def test_the_cost_curve_times_the_engines_decoder_call():
    mc = workload.shape_config("tiny-diffusiongemma")
    model = workload.build_random(mc, torch.device("cpu"), torch.float32)
    mode = workload.call_mode(model, "dual")
    assert isinstance(mode, workload.UniformCalls)
    block = workload.cached_block(mode, mc, 2, 12, 8, 0, torch.device("cpu"))
    x, valid, pos, win, kv = block
    assert kv.length == 12 and kv.positions is not None            # the encoder's KV of the prefix
    rows = torch.tensor([0, 0, 1])
    gen = torch.Generator().manual_seed(1)
    logits = workload.verification_call(mode, mc, block, rows, gen)()
    assert logits.shape == (3, 8, mc.vocab_size)
    # the same call made by hand: the decoder over those canvases, each over its sequence's cache row
    gen = torch.Generator().manual_seed(1)
    canvas = torch.randint(0, mc.vocab_size, (3, 8), generator=gen)
    sc = torch.randn(3, 8, mc.vocab_size, generator=gen)
    with torch.no_grad():
        want, _ = model(canvas, pos[rows, 12:], torch.ones(1, 1, 8, 8, dtype=torch.bool), mode.rows(kv, rows),
                        decoder=True, self_cond=sc)
    torch.testing.assert_close(logits, want)


def test_cost_curve_runs_the_tiny_shape_end_to_end(tmp_path, capsys):
    rc, out, err = run_main(speed.main, ["--shape", "tiny-diffusiongemma", "--cost-curve", "--dtype", "float32",
                                     "--prefix", "16", "--rows", "1", "2", "--batch-sizes", "1", "2",
                                     "--cost-reps", "1", "--no-warmup", "--quiet", "--out", str(tmp_path)], capsys)
    assert rc == 0, err
    profile = json.loads((tmp_path / "cost_profile.json").read_text())
    assert [(c["cache"], c["block_length"], c["batch"], c["rows"]) for c in profile["curves"]] == \
        [("encoder", 8, 1, [1, 2]), ("encoder", 8, 2, [1, 2])]
    assert all(ms > 0 for c in profile["curves"] for ms in c["ms"])
    assert "(encoder cache, block 8" in out


def test_the_26b_shape_is_refused_where_it_does_not_fit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(speed, "available_memory", lambda device: 32 << 30)
    rc, _, err = run_main(speed.main, ["--shape", "diffusiongemma-26b-a4b", "--cost-curve", "--out", str(tmp_path / "o")],
                      capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: --shape diffusiongemma-26b-a4b needs")
    assert "25.25B parameters" in lines[0] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv", [["--shape", "tiny-diffusiongemma"],                       # end to end: refused
                                  ["--shape", "tiny-diffusiongemma", "--cost-curve", "--block-length", "32"],
                                  ["--shape", "tiny-diffusiongemma", "--cost-curve", "--cache", "dual"],
                                  ["--shape", "tiny-diffusiongemma", "--model", "models/default", "--cost-curve"]],
                         ids=["e2e", "block", "cache", "model"])
def test_speed_refusals_are_one_line(argv, tmp_path, capsys):
    rc, _, err = run_main(speed.main, argv + ["--out", str(tmp_path / "o")], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err


# ---------------------------------------------------------------------- the projection
def test_call_trace_records_the_encoder_and_decoder_calls(dg):
    model = load_model(dg)
    trace = sim.CallTrace(model)
    try:
        (res,) = engine.generate(model, [[5, 6, 7]], gen_length=16, seed=0)
    finally:
        trace.remove()
    calls = trace.calls
    assert calls[0] == sim.Call(1, 3, 0, 0, 3)                  # the encoder over the prompt
    canvases = sorted({c.cached for c in calls[1:]})             # each canvas's calls read the KV before it
    assert canvases in ([3], [3, 11]) and {(c.rows, c.tokens, c.out, c.cache_rows) for c in calls[1:]} == {(1, 8, 8, 1)}
    # per canvas: the encoder of the canvas before it (none for the first), the decoder's first step
    # without self-conditioning, every later step with it; the engine counts the decoder's calls
    assert len(calls) == 1 + res.calls + len(canvases) - 1
    assert sum(c.self_cond for c in calls) == res.calls - len(canvases)


def test_simulate_projects_a_diffusion_gemma_decode(dg, tmp_path, capsys):
    rc, out, err = run_main(speed.main, ["--simulate", "h100", "--shape", "tiny-diffusiongemma", "--model", str(dg),
                                     "--num-prompts", "1", "--gen-length", "8", "--quiet", "--out", str(tmp_path)],
                        capsys)
    assert rc == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    (row,) = summary["rows"]
    assert row["method"].startswith("eb") and row["cache"] == "encoder" and row["tokens"] == 8
    assert row["projected_tokens_per_s"] > 0


@pytest.mark.parametrize("shape,model", [("diffusiongemma-26b-a4b", None), ("diffusiongemma-26b-a4b", "dg"),
                                         ("tiny", "dg")], ids=["masked-acceptance", "canvas", "masked-target"])
def test_simulate_refuses_a_mismatched_acceptance_model(shape, model, dg, tmp_path, capsys):
    argv = ["--simulate", "h100", "--shape", shape, "--quiet", "--out", str(tmp_path / "o")]
    argv += ["--model", str(dg)] if model else []
    rc, _, err = run_main(speed.main, argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err


@pytest.mark.slow
def test_server_answers_what_the_api_decodes(dg, tmp_path):
    """engine.serve on a DiffusionGemma checkpoint: static batching by default, the request's seed
    decodes what `engine.generate` decodes with it (cut at max_tokens); masked-only request fields
    are a 400 naming them; `--batching continuous` is refused at start-up in one line."""
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    from support import ServerProcess, start_servers

    running = start_servers(ServerProcess(tmp_path, "--model", str(dg)))
    (server,) = next(running)
    try:
        tok = Tokenizer(dg)
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": dg.name, "prompt": "t5 t9 t3", "max_tokens": 12, "seed": 3})
        assert r.status_code == 200, r.text
        want = engine.generate(load_model(dg), [tok.encode("t5 t9 t3")], seed=3, gen_length=12)[0].token_ids[:12]
        assert r.json()["choices"][0]["text"] == tok.decode(want) and r.json()["psd"]["method"].startswith("eb")
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": dg.name, "prompt": "t5", "max_tokens": 4, "temperature": 0.7})
        assert r.status_code == 400 and "temperature does not apply" in r.text
    finally:
        running.close()
    r = subprocess.run([sys.executable, "-m", "engine.serve", "--model", str(dg), "--batching", "continuous"],
                       cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "continuous batching does not decode" in r.stderr
