"""`bench.speed --simulate CARD` (bench/simulate.py): the roofline on hand-checked numbers, the
projection's arithmetic against the recorded calls, its labels, and bad input as one line."""
from __future__ import annotations

import csv
import json

import pytest

from bench import simulate as sim
from bench import speed, workload
from bench.simulate import CARDS, TITLE, Call, Card
from engine.frontend import DEFAULT_MODEL_DIR
from models import Tokenizer, load_model
from support import run_main

LLADA = workload.shape_config("llada-8b")
H100 = CARDS["h100-sxm"]


def _speed(argv, capsys):
    return run_main(speed.main, argv, capsys)


@pytest.fixture(scope="module")
def shipped():
    return load_model(DEFAULT_MODEL_DIR, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompt():
    return Tokenizer(DEFAULT_MODEL_DIR).encode((DEFAULT_MODEL_DIR / "sample_prompt.txt").read_text())


# ---------------------------------------------------------------------- the roofline
def test_default_constants_reproduce_the_h200_measurement():
    """The CLI's defaults (bench/simulate.py's docstring) against docs/gpu/h200-2026-11-26/profile_call_*.txt:
    one verification call of 1 and 16 draft rows, dual cache, prefix 512, block 32, bf16 on an H200."""
    from bench.workload import shape_config

    h200 = sim.card("h200")
    for shape, measured in (("llada-8b", {1: (27.88, 8.97), 16: (30.96, 18.49)}),
                            ("dream-7b", {1: (24.65, 8.44), 16: (32.18, 17.57)})):
        mc = shape_config(shape)
        for rows, (eager, replay) in measured.items():
            call = Call(rows=rows, tokens=32, cached=512, cache_rows=1, out=32)
            kw = dict(overhead_ms=sim.OVERHEAD_MS, efficiency=sim.EFFICIENCY)
            got = sim.call_ms(mc, call, h200, 2, host_ms_per_layer=sim.HOST_MS_PER_LAYER, **kw)
            assert got == pytest.approx(eager, rel=0.25), (shape, rows, "eager")
            assert sim.call_ms(mc, call, h200, 2, host_ms_per_layer=0, **kw) == pytest.approx(replay, rel=0.1)
            assert sim.call_ms(mc, call, h200, 2, overhead_ms=0) < replay / 2      # the plain roofline: far under


def test_roofline_is_the_larger_bound_plus_overhead():
    c = Card("test", hbm_gbps=1000, bf16_tflops=100, source="-")
    assert sim.roofline_ms(2e9, 1e11, c, 0.5) == pytest.approx(2.0 + 0.5)      # 2 GB at 1 TB/s: 2 ms
    assert sim.roofline_ms(1e9, 3e11, c, 0.0) == pytest.approx(3.0)            # 0.3 TFLOP at 100 TFLOP/s
    assert sim.roofline_ms(0, 0, c, 0.25) == pytest.approx(0.25)


def test_llada_8b_one_token_is_bandwidth_bound_by_hand():
    """LLaDA-8B: d 4096, 32 layers, 32/32 heads of 128, MLP 12288, vocab 126464, untied, no biases.
    Blocks: 32 x (4 d^2 + 3 d I + 2 d) = 6,979,584,000, + the final norm 4096."""
    assert sim.body_params(LLADA) == 6_979_588_096
    weights = 6_979_588_096 + 126464 * 4096                 # + the LM head (517,996,544): 7,497,584,640
    act = 32 * (17 * 4096 + 6 * 4096 + 6 * 4096 + 6 * 12288)   # one token through 32 layers: 6,160,384
    elems = weights + 4096 + act                            # + one embedding row
    assert elems == 7_503_749_120
    one = Call(rows=1, tokens=1)
    assert sim.call_bytes(LLADA, one, 2) == 2 * elems
    assert sim.call_flops(LLADA, one) == 2 * 6_979_588_096 + 4 * 32 * 32 * 128
    assert sim.bandwidth_bound(LLADA, one, H100)
    assert sim.call_ms(LLADA, one, H100, 2, 0.5) == pytest.approx(2 * elems / 3.35e12 * 1e3 + 0.5)   # 4.98 ms


def test_cache_rows_are_read_once_and_big_calls_turn_compute_bound():
    kv_row = 32 * 2 * 32 * 128 * 1000 * 2            # one cache row of 1000 positions, bf16
    a = sim.call_bytes(LLADA, Call(rows=8, tokens=32, cached=1000, cache_rows=1, out=32), 2)
    b = sim.call_bytes(LLADA, Call(rows=8, tokens=32, cached=1000, cache_rows=2, out=32), 2)
    assert b - a == kv_row                              # drafts share their sequence's cache row
    big = Call(rows=64, tokens=2048)
    assert not sim.bandwidth_bound(LLADA, big, H100)
    assert sim.call_ms(LLADA, big, H100, 2, 0) == pytest.approx(sim.call_flops(LLADA, big) / 989e12 * 1e3)


# ---------------------------------------------------------------------- the projection
def test_policy_projection_is_tokens_over_calls_times_one_row(shipped, prompt):
    """Batch 1, no cache: every call of the plain policy runs one row over the whole canvas, so
    its projection is tokens / (calls x cost(one row)); PSD's calls hold more rows."""
    specs = [("confidence", {}), ("psd", {"policy_name": "confidence", "depth": 3})]
    rows = sim.simulate(shipped, specs, [prompt], ["h100-sxm"], LLADA, "none", 1, 64, 32, 2, 0.5)
    pol, psd = rows
    one = sim.call_ms(LLADA, Call(rows=1, tokens=len(prompt) + 64, out=32), H100, 2, 0.5)
    assert pol["projected_tokens_per_s"] == pytest.approx(pol["tokens"] / (pol["calls"] * one / 1e3), rel=1e-12)
    assert pol["rows_per_call"] == 1 and pol["vs_policy"] == 1
    assert psd["rows_per_call"] > 1
    assert psd["projected_tokens_per_s"] != pytest.approx(psd["tokens"] / (psd["calls"] * one / 1e3))


def test_a_measured_cost_profile_replaces_the_roofline(shipped, prompt, tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"format": "psd-cost-profile/1", "curves": [
        {"cache": "dual", "block_length": 32, "prefix": 64, "batch": 1, "rows": [1, 2, 4], "ms": [10.0, 11.0, 14.0]}]}))
    specs = [("confidence", {}), ("psd", {"policy_name": "confidence", "depth": 3, "draft_budget": "auto"})]
    pol, auto = sim.simulate(shipped, specs, [prompt], ["h100-sxm"], LLADA, "dual", 1, 64, 32, 2, 0.5,
                             profile=str(prof))
    assert pol["projected_ms_per_call"] == pytest.approx(10.0) and pol["cost"] == "profile"
    assert auto["budget_nodes_median"] is not None and auto["bandwidth_bound_share"] is None


def test_simulate_command_is_labelled_a_projection(capsys, tmp_path):
    # --host-ms-per-layer 0 (calls replayed from CUDA graphs): eager calls are host-bound and cost the same on both
    rc, out, err = _speed(["--simulate", "h100-sxm", "a100-80g", "--shape", "llada-8b", "--num-prompts", "1",
                             "--gen-length", "32", "--threads", "1", "--host-ms-per-layer", "0",
                             "--out", str(tmp_path / "o")], capsys)
    assert rc == 0, err
    assert out.startswith(f"## {TITLE}")
    md = (tmp_path / "o" / "projection.md").read_text()
    assert md.startswith(f"## {TITLE}") and md.rstrip().endswith("not timed on the card.*")
    rows = list(csv.DictReader(open(tmp_path / "o" / "projection.csv")))
    assert len(rows) == 6 and all(r["projection"] == TITLE for r in rows)        # 2 cards x 3 methods
    assert {r["card"] for r in rows} == {"h100-sxm", "a100-80g"}
    js = json.loads((tmp_path / "o" / "projection.json").read_text())
    assert js["projection"] == TITLE and json.loads(out.strip().splitlines()[-1])["projection"] == TITLE
    by = {(r["card"], r["method"]): float(r["projected_tokens_per_s"]) for r in rows}
    pol = next(m for c, m in by if "psd" not in m)
    assert by["h100-sxm", pol] > by["a100-80g", pol]                # more bandwidth, more tokens/s
    # stderr is no terminal: progress lines; the policy and fixed-depth PSD decode once, the auto budget per card
    lines = err.splitlines()
    assert lines[0] == "simulate: decoded batches: 0/4 (0%) 0 s"
    assert lines[-1].startswith("simulate: decoded batches: 4/4 (100%) ")


def test_card_names_as_people_write_them(capsys):
    assert [sim.card_key(n) for n in ("H100", "NVIDIA H100 SXM5", "h100_pcie", "A100", "a100-40GB", "H200")] == \
        ["h100-sxm", "h100-sxm", "h100-pcie", "a100-80g", "a100-40g", "h200"]
    assert sim.card("H100") is H100
    rc, out, err = _speed(["--simulate", "H100", "--cost-curve"], capsys)     # accepted: the next check speaks
    assert rc == 2 and "does not combine with --cost-curve" in err


@pytest.mark.parametrize("argv,says", [
    (["--simulate", "h101"], "unknown card 'h101'"),
    (["--simulate", "h100-sxm", "--cost-curve"], "does not combine with --cost-curve"),
    (["--simulate", "h100-sxm", "--call-overhead-ms", "-1"], "--call-overhead-ms must be"),
    (["--simulate", "h100-sxm", "--kernel-efficiency", "0"], "--kernel-efficiency must be in"),
    (["--simulate", "h100-sxm", "--kernel-efficiency", "1.5"], "--kernel-efficiency must be in"),
    (["--simulate", "h100-sxm", "--host-ms-per-layer", "nan"], "--host-ms-per-layer must be"),
    (["--host-ms-per-layer", "1"], "--host-ms-per-layer applies to --simulate only"),
    (["--cost-profile", "x.json"], "applies to --simulate only"),
    (["--simulate", "h100-sxm", "--cost-profile", "/nonexistent.json"], "cost profile"),
    (["--simulate", "h100-sxm", "--methods", "psd:zz=1"], "zz"),
])
def test_bad_input_is_one_error_line(argv, says, capsys, tmp_path):
    rc, out, err = _speed(argv + ["--out", str(tmp_path / "o")], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert not (tmp_path / "o").exists()
