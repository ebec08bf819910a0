"""bench.speed (wall-clock benchmark, cost curve) and bench/gpu_report.sh --dry (the GPU report's CPU run)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import speed, workload
from engine import InputError

REPO = Path(__file__).resolve().parent.parent


def run_main(argv, capsys):
    """(exit status, stdout, stderr) of `python -m bench.speed ARGV`, in process."""
    try:
        rc = speed.main(argv)
    except SystemExit as e:           # argparse errors exit from the parser
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------- bad input
BAD = [
    ["--shape", "nope"],
    ["--model", "models/default", "--shape", "tiny"],
    ["--methods", "bogus"],
    ["--methods", "psd:zz=1"],
    ["--methods", "greedy:tau=0.5"],
    ["--batch-sizes", "0"],
    ["--batch-sizes", "1", "2", "--num-prompts", "1", "2", "3"],
    ["--model", "/nonexistent/model"],
    ["--gen-length", "33"],
    ["--prompts", "/nonexistent/prompts.txt"],
    ["--prompt-length", "300"],                       # + gen length exceeds the shipped model's 256
    ["--repeats", "0"],
    ["--cost-curve", "--rows", "0"],
    ["--cache", "paged"],
]


@pytest.mark.parametrize("argv", BAD, ids=lambda a: " ".join(a))
def test_bad_input_is_one_error_line(argv, capsys, tmp_path):
    rc, out, err = run_main(argv + ["--out", str(tmp_path / "out")], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not (tmp_path / "out").exists()            # refused before anything was written


def test_bad_input_out_is_a_file(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = run_main(["--out", str(f)], capsys)
    assert rc == 2 and err.startswith("error: ")


# ---------------------------------------------------------------------- methods and baselines
def test_method_plan_adds_greedy_and_no_draft_baselines():
    plan = speed.method_plan(["psd:policy=confidence,d=3", "spiffy:d=3", "lopa:k=3", "ete:k=2",
                              "psd:policy=localleap,tau=0.8"])
    by = {e["label"]: e for e in plan}
    labels = [e["label"] for e in plan]
    assert labels[0] == "greedy" and by["greedy"]["added"]
    conf = "confidence(tau=0.9)"
    psd = next(lab for lab in labels if lab.startswith("psd(confidence"))
    assert by[psd]["base"] == conf and by[conf]["added"] and labels.index(conf) < labels.index(psd)
    assert by[next(lab for lab in labels if lab.startswith("spiffy"))]["base"] == "greedy"
    assert by[next(lab for lab in labels if lab.startswith("lopa"))]["base"] == conf
    assert by[next(lab for lab in labels if lab.startswith("ete"))]["base"] is None
    ll = next(lab for lab in labels if lab.startswith("psd(localleap"))
    assert by[ll]["base"].startswith("localleap(") and "0.8" in by[ll]["base"]
    assert all(e["greedy"] == "greedy" for e in plan)
    assert len(labels) == len(set(labels))


def test_method_plan_listed_baseline_is_not_marked_added():
    plan = speed.method_plan(["psd:policy=confidence", "confidence:tau=0.9"])
    assert [e["label"] for e in plan][:2] == ["greedy", "confidence(tau=0.9)"]
    assert not plan[1]["added"] and len(plan) == 3


def test_method_plan_baseline_runs_its_calls_the_same_way():
    """A method with --compile / --static-rows is compared with its policy run the same way."""
    plan = speed.method_plan(["psd:policy=confidence,d=3,compile=true,static_rows=true", "greedy:compile=true"])
    by = {e["label"]: e for e in plan}
    psd = next(lab for lab in by if lab.startswith("psd("))
    assert psd.endswith("[static-rows,compile]")
    assert by[psd]["base"] == "confidence(tau=0.9)[static-rows,compile]" and by[by[psd]["base"]]["added"]
    assert "greedy[compile]" in by and by["greedy[compile]"]["greedy"] == "greedy"


def test_method_plan_keeps_specs_that_differ_in_general_options():
    """`psd` and `psd:cache=dual` are two entries (one label made them one), and each is compared
    with its policy decoded the same way (the spec's own cache, sampling, min_tokens)."""
    plan = speed.method_plan(["psd:d=3", "psd:d=3,cache=dual", "psd:d=3,temperature=0.5,seed=2"])
    by = {e["label"]: e for e in plan}
    psd = "psd(confidence(tau=0.9),d=3,policy)"
    assert {psd, psd + "[cache=dual]", psd + "[seed=2,temperature=0.5]"} <= set(by)
    assert by[psd + "[cache=dual]"]["base"] == "confidence(tau=0.9)[cache=dual]"
    assert by["confidence(tau=0.9)[cache=dual]"]["opts"].get("cache") == "dual"
    assert by[psd + "[seed=2,temperature=0.5]"]["base"] == "confidence(tau=0.9)[seed=2,temperature=0.5]"


# ---------------------------------------------------------------------- end to end and cost curve
def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_end_to_end_on_the_shipped_model(capsys, tmp_path):
    rc, out, err = run_main(["--methods", "psd:policy=confidence,d=1", "--num-prompts", "1", "--repeats", "2",
                             "--gen-length", "32", "--cache", "dual", "--threads", "1", "--out", str(tmp_path)],
                            capsys)
    assert rc == 0, err
    summary = _last_json(out)
    assert summary["mode"] == "end_to_end" and not summary["random_weights"]
    rows = list(csv.DictReader(open(tmp_path / "speed.csv")))
    assert [r["method"] for r in rows] == ["greedy", "confidence(tau=0.9)", "psd(confidence(tau=0.9),d=1,policy)"]
    for r in rows:
        assert r["device"] and r["torch"] == torch.__version__ and r["triton"] and "bench.speed" in r["command"]
        assert float(r["tokens_per_s"]) > 0 and float(r["ms_per_call"]) > 0 and int(r["calls"]) > 0
        assert int(r["calls"]) == int(r["seq_calls"])       # batch 1: batched calls are the sequence's calls
        assert r["repeats"] == "2" and float(r["vs_greedy_median"]) > 0
    psd = rows[2]
    assert psd["baseline"] == "confidence(tau=0.9)" and float(psd["vs_baseline_min"]) > 0
    assert float(psd["rows_per_call"]) > 1                   # drafts are verified in the same call
    assert float(rows[0]["vs_greedy_min"]) == 1.0
    md = (tmp_path / "speed.md").read_text()
    assert "| batch | cache | method | tokens/s |" in md and md.strip() in out
    lines = err.splitlines()            # stderr is no terminal: progress lines, the first at once, the last at the end
    assert lines[0] == "speed: decodes: 0/6 (0%) 0 s" and lines[-1].startswith("speed: decodes: 6/6 (100%) ")
    assert json.loads((tmp_path / "speed.json").read_text())["rows"][2]["method"] == psd["method"]


def test_random_shape_reports_call_cost_not_tokens_per_s(capsys, tmp_path):
    rc, out, err = run_main(["--shape", "tiny", "--methods", "greedy", "--num-prompts", "1", "--repeats", "1",
                             "--gen-length", "8", "--block-length", "8", "--prompt-length", "16", "--dtype",
                             "float32", "--threads", "1", "--out", str(tmp_path)], capsys)
    assert rc == 0, err
    assert "random weights" in out and "random weights" in err
    summary = _last_json(out)
    assert summary["random_weights"] and "tokens_per_s" not in summary["rows"][0]
    row = next(csv.DictReader(open(tmp_path / "speed.csv")))
    assert row["tokens_per_s"] == "" and float(row["ms_per_call"]) > 0 and row["random_weights"] == "True"


def test_cost_curve_writes_the_profile(capsys, tmp_path):
    prof = tmp_path / "elsewhere" / "profile.json"
    rc, out, err = run_main(["--cost-curve", "--shape", "tiny-dream", "--prefix", "16", "24", "--rows", "1", "2",
                             "4", "--block-length", "8", "--cost-reps", "1", "--dtype", "float32", "--threads", "1",
                             "--batch-sizes", "1", "2", "--out", str(tmp_path / "o"), "--cost-profile-out",
                             str(prof)], capsys)
    assert rc == 0, err
    p = json.loads(prof.read_text())
    assert p["format"] == speed.PROFILE_FORMAT and len(p["curves"]) == 4
    for c in p["curves"]:
        assert {"device", "model", "dtype", "cache", "block_length", "prefix", "batch", "rows", "ms"} <= set(c)
        assert c["model"] == "tiny-dream" and c["cache"] == "dual" and c["block_length"] == 8
        assert c["rows"] == [1, 2, 4] and len(c["ms"]) == 3 and all(v > 0 for v in c["ms"])
    assert {(c["prefix"], c["batch"]) for c in p["curves"]} == {(16, 1), (16, 2), (24, 1), (24, 2)}
    assert _last_json(out)["cost_profile"] == str(prof)
    rows = list(csv.DictReader(open(tmp_path / "o" / "cost_curve.csv")))
    assert len(rows) == 12 and all(r["device"] and r["command"] for r in rows)
    assert err.splitlines()[-1].startswith("cost curve: points: 12/12 (100%) ")


def test_cost_curve_rows_map_to_their_sequence_cache(monkeypatch):
    """The timed call is the engine's cache-mode call with every draft row mapped to its sequence."""
    seen = []
    from engine.cache import DualCache

    orig = DualCache.call

    def spy(self, x, valid, pos, win, cache, rows):
        seen.append((x.shape[0], rows.tolist(), cache.length))
        return orig(self, x, valid, pos, win, cache, rows)

    monkeypatch.setattr(DualCache, "call", spy)
    model = workload.build_random(workload.shape_config("tiny"), torch.device("cpu"), torch.float32)
    speed.cost_curve(model, torch.device("cpu"), "dual", [12], [3], [2], 8, reps=1, warmup=0, seed=0, pbar=None)
    assert seen == [(6, [0, 0, 0, 1, 1, 1], 12)]


# ---------------------------------------------------------------------- the GPU report, dry
def test_gpu_report_only_reruns_the_named_sections(tmp_path):
    """ONLY=... (a rerun of the sections that failed on the card): those and the environment, nothing else."""
    out = tmp_path / "report"
    env = {**os.environ, "PYTHON": sys.executable, "ONLY": "bench_draft"}
    res = subprocess.run(["bash", str(REPO / "bench" / "gpu_report.sh"), "--dry", str(out)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    sections = list(csv.DictReader(open(out / "sections.tsv"), delimiter="\t"))
    assert [(s["section"], s["status"]) for s in sections] == [("environment", "ok"), ("bench_draft", "ok")]
    assert "All sections passed." in (out / "summary.md").read_text()


@pytest.mark.slow
def test_gpu_report_dry_run(tmp_path):
    out = tmp_path / "report"
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", str(REPO / "bench" / "gpu_report.sh"), "--dry", str(out)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    report = (out / "summary.md").read_text() if (out / "summary.md").is_file() else "(no summary)"
    assert res.returncode == 0, res.stderr[-3000:] + report[-3000:]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU report (dry") and "All sections passed." in summary
    assert "## One verification call" in summary and "| rows | event ms | host ms |" in summary
    sections = list(csv.DictReader(open(out / "sections.tsv"), delimiter="\t"))
    assert [s["section"] for s in sections] == ["environment", "kernel_tests", "bench_top1", "bench_draft",
                                                "sparse_attn_llada_8b", "sparse_attn_dream_7b", "bench_moe", "cost_curve_llada_8b",
                                                "cost_curve_dream_7b", "profile_call", "end_to_end"]
    assert all(s["status"] == "ok" and (out / s["log"]).is_file() for s in sections)
    env_info = json.loads((out / "environment.json").read_text())
    assert env_info["missing"] == [] and env_info["modules"]["torch"] == torch.__version__

    def rows(path, need):
        got = list(csv.DictReader(open(path)))
        assert got and need <= set(got[0]), (path, got[:1])
        return got

    tests = rows(out / "kernel_tests.csv", {"test", "outcome", "seconds"})
    assert all(t["outcome"] in ("passed", "skipped") for t in tests) and any(t["outcome"] == "passed" for t in tests)
    rows(out / "kernels" / "top1" / "bench_top1_cpu.csv", {"provider", "gbps", "device", "torch", "triton"})
    rows(out / "kernels" / "draft" / "bench_draft_cpu.csv", {"bench", "provider", "us"})
    rows(out / "kernels" / "moe" / "bench_moe_cpu.csv", {"provider"})
    for shape in ("llada_8b", "dream_7b"):
        rows(out / "kernels" / f"sparse_attn_{shape}" / "bench_sparse_attn_cpu.csv", {"provider", "drafts", "ms"})
        prof = json.loads((out / f"cost_{shape}" / "cost_profile.json").read_text())
        assert prof["curves"] and all(len(c["rows"]) == len(c["ms"]) for c in prof["curves"])
        rows(out / f"cost_{shape}" / "cost_curve.csv", {"prefix", "rows", "ms", "device"})
    e2e = rows(out / "end_to_end" / "speed.csv", {"method", "batch", "cache", "tokens_per_s", "ms_per_call",
                                                   "rows_per_call", "calls", "tpf", "peak_mib", "vs_greedy_median",
                                                   "vs_baseline_median", "device", "command"})
    assert {r["batch"] for r in e2e} == {"1", "4"} and {r["cache"] for r in e2e} == {"none", "dual"}
    assert len({r["method"] for r in e2e}) == 5


@pytest.mark.parametrize("specs, words", [
    (["greedy", "greedy"], "decode the same configuration"),                     # was run once, silently
    (["confidence", "confidence:threshold=0.9"], "decode the same configuration"),
    (["spiffy:graph=GA", "spiffy:graph=GB"], "decode differently but share the label"),   # was: the second never ran
])
def test_method_plan_refuses_a_spec_twice_or_two_under_one_label(specs, words, tmp_path):
    (tmp_path / "a.json").write_text("[[], [0], [1]]")          # two graphs of one shape: one label
    (tmp_path / "b.json").write_text("[[], [0], [2]]")
    specs = [s.replace("GA", str(tmp_path / "a.json")).replace("GB", str(tmp_path / "b.json")) for s in specs]
    with pytest.raises(InputError, match=words):
        speed.method_plan(specs)


def test_fdm_threshold_is_in_its_label():
    """fdm's τ belongs to its acceptance, not its greedy policy: two τ were refused as one label."""
    labels = [m["label"] for m in speed.method_plan(["fdm:k=2", "fdm:k=2,threshold=0.5", "fdm:k=2,threshold=0.9"][:2])]
    assert labels == ["greedy", "fdm(k=2,greedy)", "fdm(k=2,greedy,tau=0.5)"], labels
    with pytest.raises(InputError, match="decode the same configuration"):      # 0.9 is the default
        speed.method_plan(["fdm:k=2", "fdm:k=2,threshold=0.9"])
