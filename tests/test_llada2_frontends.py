"""LLaDA2 checkpoints through the front ends (issue 29 item 7): engine.generate, engine.serve,
bench.eval and bench.speed (--shape llada2-mini / tiny-llada2) run them, and each answers what the
engine's own API decodes for the same options."""
import json
import re

import pytest
import torch

from bench.eval import main as eval_main
from bench import speed
from bench.speed import main as speed_main
from bench.workload import shape_config
from engine import InputError, generate
from engine.cli import main as generate_main
from models import Tokenizer, load_model
from models.random_checkpoint import make_checkpoint

from engine.calibrate import main as calibrate_main
from support import LLADA2_MINI_CONFIG, LLADA2_MINI_IDS, ServerProcess, run_main, start_servers

PROMPT = "t5 t9 t3 t17 t2"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llada2") / "m", "llada2", seed=3)[0]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A bidirectional (LLaDA) checkpoint: `--align auto` is `generation` there."""
    return make_checkpoint(tmp_path_factory.mktemp("llada") / "m", "llada", seed=3)[0]


def _engine_tokens(ckpt, gen_length, **options):
    model, tok = load_model(ckpt, dtype="float32", device="cpu"), Tokenizer(ckpt)
    return generate(model, [tok.encode(PROMPT)], gen_length=gen_length, **options)[0].token_ids


def test_generate_command_decodes_what_the_api_decodes(ckpt, capsys):
    assert generate_main(["--model", str(ckpt), PROMPT, "--method", "confidence", "--threshold", "0.9",
                          "--gen-length", "32", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = _engine_tokens(ckpt, 32, method="confidence", threshold=0.9)
    assert out["token_ids"] == want and len(want) > 1 and out["method"].startswith("confidence")


@pytest.mark.slow
def test_server_answers_what_the_api_decodes(ckpt, tmp_path):
    import httpx

    running = start_servers(ServerProcess(tmp_path, "--model", str(ckpt), "--method", "confidence",
                                          "--threshold", "0.9"))
    (server,) = next(running)
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": ckpt.name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        want = _engine_tokens(ckpt, 32, method="confidence", threshold=0.9)[:12]
        assert body["choices"][0]["text"] == Tokenizer(ckpt).decode(want)
        assert body["usage"]["completion_tokens"] == len(want) and body["psd"]["method"].startswith("confidence")
    finally:
        running.close()                  # stops the server


def test_eval_runs_a_llada2_checkpoint(ckpt, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert eval_main(["--model", str(ckpt), "--task", "math", "--methods", "confidence:tau=0.9", "spiffy:d=3",
                      "--limit", "3", "--gen-length", "32", "--out", str(out), "--quiet", "--threads", "1"]) == 0
    capsys.readouterr()
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    by = {}
    for r in recs:
        by.setdefault(r["method"].split("(")[0], {})[r["id"]] = r["completion"]
    assert set(by) == {"greedy", "confidence", "spiffy"} and all(len(v) == 3 for v in by.values())
    assert by["spiffy"] == by["greedy"]                                  # lossless on llada2 too


def test_speed_cost_curve_and_end_to_end_on_the_tiny_llada2_shape(tmp_path, capsys):
    assert speed_main(["--shape", "tiny-llada2", "--cost-curve", "--prefix", "16", "--rows", "1", "2",
                       "--block-length", "8", "--cost-reps", "1", "--dtype", "float32", "--threads", "1",
                       "--out", str(tmp_path / "c"), "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["model"] == "tiny-llada2" and len(res["curves"][0]["ms"]) == 2
    assert speed_main(["--shape", "tiny-llada2", "--methods", "confidence", "psd:policy=confidence,d=3",
                       "--num-prompts", "1", "--gen-length", "16", "--block-length", "8", "--repeats", "1",
                       "--threads", "1", "--out", str(tmp_path / "e"), "--quiet"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert {r["method"].split("(")[0] for r in rows} >= {"greedy", "confidence", "psd"}


def test_llada2_mini_shape_is_the_real_config():
    """bench's llada2-mini shape equals what models.config reads from LLaDA2.0-mini's config.json
    (tests/test_llada2.py::test_real_llada2_mini_fields holds that mapping to the real file)."""
    from models import ModelConfig

    real = ModelConfig.from_hf(dict(LLADA2_MINI_CONFIG), dict(LLADA2_MINI_IDS))
    assert shape_config("llada2-mini") == real.replace(extra=shape_config("llada2-mini").extra)
    assert 16.2e9 < real.parameter_count() < 16.3e9


def test_simulate_costs_only_the_experts_a_call_uses():
    from bench import simulate as sim

    mc, h200 = shape_config("llada2-mini"), sim.card("h200")
    one = sim.Call(rows=1, tokens=1, out=1)
    big = sim.Call(rows=64, tokens=32, out=32)
    expert = sim.expert_params(mc)
    assert expert == 3 * 2048 * 512
    active = sim.body_params(mc) - mc.moe_layers() * (256 - 8) * expert  # a token multiplies 8 of 256 experts
    assert sim.call_flops(mc, one) == 2 * active + 2 * 2048 * 157184 + 4 * 20 * 16 * 128
    assert 1.3e9 < active + 2 * 2048 * 157184 < 1.5e9                     # LLaDA2.0-mini: 1.4B active
    read_one = sim.call_bytes(mc, one, 2) / 2
    assert read_one < sim.body_params(mc) / 4                           # 8 of 256 experts: 1.4B of 16B read
    assert sim.experts_used(mc, 1) == pytest.approx(8) and sim.experts_used(mc, 64 * 32) == pytest.approx(256)
    assert sim.call_bytes(mc, big, 2) / 2 > sim.body_params(mc)          # 2048 tokens: every expert read
    dense = shape_config("llada-8b")
    assert sim.experts_used(dense, 100) == 0 and sim.expert_params(dense) == 0


# ---------------------------------------------------------------------- --align auto off the block grid
OFF_GRID = ["--gen-length", "12", "--block-length", "8"]      # auto: sequence on llada2, generation on llada
REFUSAL = "not a multiple of the block length 8 (--align sequence takes any)"


def _front_end(name, model, tmp_path):
    """(main, argv) of a command-line front end decoding gen length 12 with blocks of 8 on `model`."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    common = ["--model", str(model), *OFF_GRID]
    return {"generate": (generate_main, [PROMPT, "--method", "confidence", "--threshold", "0.9", "--json",
                                         "--threads", "1", *common]),
            "speed": (speed_main, ["--prompts", str(prompts), "--methods", "confidence", "--num-prompts", "1",
                                   "--repeats", "1", "--no-warmup", "--dtype", "float32", "--quiet", "--threads", "1",
                                   "--out", str(tmp_path / "speed"), *common]),
            "calibrate": (calibrate_main, ["--prompts", str(prompts), "--depth", "2", "--nodes", "3",
                                           "--out", str(tmp_path / "graph.json"), *common]),
            "eval": (eval_main, ["--task", "math", "--methods", "confidence:tau=0.9", "--limit", "2", "--quiet",
                                 "--threads", "1", "--out", str(tmp_path / "r.jsonl"), *common])}[name]


def _server(model):
    from engine.serve.cli import build_parser
    from engine.serve.server import Server

    return Server(build_parser().parse_args(["--model", str(model), *OFF_GRID]))


def test_auto_alignment_takes_a_gen_length_off_the_block_grid_on_llada2(ckpt, tmp_path, capsys):
    """`--align auto` is `sequence` on a block-causal model, which takes any gen length: every front
    end checks its config against the checkpoint's config.json (engine.uniform.for_model) before the
    weights load, so engine.generate and bench.speed decode gen length 12 with blocks of 8, as the API
    does with --align sequence (they refused it, naming --align sequence)."""
    want = _engine_tokens(ckpt, 12, method="confidence", threshold=0.9, block_length=8, align="sequence")
    assert 1 < len(want) <= 12
    rc, out, err = run_main(*_front_end("generate", ckpt, tmp_path), capsys)
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == want
    rc, out, err = run_main(*_front_end("speed", ckpt, tmp_path), capsys)
    assert rc == 0, err
    rows = json.loads((tmp_path / "speed" / "speed.json").read_text())["rows"]
    assert {r["method"].split("(")[0] for r in rows} == {"greedy", "confidence"}
    assert all(0 < r["tokens"] <= 12 for r in rows)


def test_auto_alignment_takes_a_gen_length_off_the_block_grid_in_the_other_front_ends(ckpt, tmp_path, capsys):
    """As above for engine.calibrate, bench.eval, engine.serve (its defaults and a request's
    gen_length) and the lm-eval adapter (engine.calibrate and the adapter refused it)."""
    rc, out, err = run_main(*_front_end("calibrate", ckpt, tmp_path), capsys)
    assert rc == 0 and (tmp_path / "graph.json").is_file(), err
    rc, out, err = run_main(*_front_end("eval", ckpt, tmp_path), capsys)
    assert rc == 0 and len((tmp_path / "r.jsonl").read_text().splitlines()) == 4, err   # greedy, confidence
    server = _server(ckpt)
    assert (server.defaults["gen_length"], server.defaults["block_length"]) == (12, 8)
    spec = server.parse({"model": server.name, "prompt": PROMPT, "gen_length": 12}, chat=False)[0]
    assert (spec.config.gen_length, spec.config.block_length) == (12, 8)
    lm_eval = pytest.importorskip("bench.lm_eval")
    lm = lm_eval.PsdLM(model=str(ckpt), gen_length=12, block_length=8)
    assert (lm.decode_config(12).gen_length, lm.decode_config(12).block_length) == (12, 8)


@pytest.mark.parametrize("name", ["generate", "speed", "calibrate", "eval", "serve", "lm_eval"])
def test_auto_alignment_refuses_a_gen_length_off_the_block_grid_on_a_bidirectional_model(name, dense, tmp_path,
                                                                                         capsys, monkeypatch):
    """On a bidirectional checkpoint `auto` is `generation`: gen length 12 with blocks of 8 is one
    `error:` line naming --align sequence (exit status 2), said before any weight is read or any
    output written."""
    lm_eval = pytest.importorskip("bench.lm_eval")
    import bench.eval
    import models

    def no_weights(*a, **kw):
        raise AssertionError("the weights were read before the refusal")

    for module in (models, lm_eval, speed, bench.eval):
        monkeypatch.setattr(module, "load_model", no_weights)
    if name in ("serve", "lm_eval"):
        with pytest.raises(InputError, match=re.escape(REFUSAL)):
            _server(dense) if name == "serve" else lm_eval.PsdLM(model=str(dense), gen_length=12, block_length=8)
        return
    rc, out, err = run_main(*_front_end(name, dense, tmp_path), capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and REFUSAL in lines[0], err
    assert not [f.name for f in tmp_path.iterdir() if f.name != "prompts.txt"]       # nothing written
