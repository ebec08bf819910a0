"""LLaDA2 checkpoints through the front ends (issue 29 item 7): engine.generate, engine.serve,
bench.eval and bench.speed (--shape llada2-mini / tiny-llada2) run them, and each answers what the
engine's own API decodes for the same options."""
import json

import pytest
import torch

from bench.eval import main as eval_main
from bench.speed import main as speed_main
from bench.workload import shape_config
from engine import generate
from engine.cli import main as generate_main
from models import Tokenizer, load_model
from models.random_checkpoint import make_checkpoint

from support import LLADA2_MINI_CONFIG, LLADA2_MINI_IDS, ServerProcess, start_servers

PROMPT = "t5 t9 t3 t17 t2"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llada2") / "m", "llada2", seed=3)[0]


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
