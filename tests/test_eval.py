"""bench.eval: the summary table is derived from the per-problem JSONL it writes; method specs;
plots; torchrun sharding over 2 CPU ranks with gloo."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.eval import main as eval_main
from bench.eval import parse_method
from engine import InputError
from models.random_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "models" / "default"


def _check_table_against_jsonl(stdout: str, jsonl: Path, n: int):
    summary = json.loads(stdout.strip().splitlines()[-1])
    records = [json.loads(l) for l in jsonl.read_text().splitlines()]
    assert summary["problems"] == n
    for row in summary["rows"]:
        recs = [r for r in records if r["method"] == row["method"]]
        assert len(recs) == row["problems"] == n
        assert row["accuracy"] == pytest.approx(sum(r["correct"] for r in recs) / n)
        tokens, calls = sum(r["tokens"] for r in recs), sum(r["calls"] for r in recs)
        assert row["tpf"] == pytest.approx(tokens / calls)
        assert row["calls_per_problem"] == pytest.approx(calls / n)
        assert f"| {row['method']} | {100 * row['accuracy']:.1f}% | {row['tpf']:.2f} |" in stdout
    assert summary["rows"][0]["method"] == "greedy" and summary["rows"][0]["speedup"] == 1.0
    return summary, records


@pytest.mark.skipif(not (DEFAULT / "config.json").is_file(), reason="no shipped model")
@pytest.mark.slow
def test_eval_math_limit_50_table_matches_jsonl(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert eval_main(["--task", "math", "--methods", "greedy", "confidence", "--limit", "50", "--out", str(out),
                      "--quiet"]) == 0
    _check_table_against_jsonl(capsys.readouterr().out, out, 50)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("eval") / "m", "llada", seed=1, eos_bias=8.0)[0]


def test_plots_and_speculative_rows(tiny, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    code = eval_main(["--model", str(tiny), "--task", "math", "--methods", "confidence:tau=0.3", "spiffy:d=3",
                      "--limit", "6", "--gen-length", "32", "--block-length", "16", "--out", str(out),
                      "--plot", str(tmp_path / "fig"), "--quiet"])
    assert code == 0
    stdout = capsys.readouterr().out
    summary, records = _check_table_against_jsonl(stdout, out, 6)
    assert [r["method"] for r in summary["rows"]][0] == "greedy"            # baseline added
    greedy = {r["id"]: r["completion"] for r in records if r["method"] == "greedy"}
    spiffy = {r["id"]: r["completion"] for r in records if r["method"].startswith("spiffy")}
    assert greedy == spiffy                                                  # lossless
    for f in ("pareto.png", "lookahead.png", "contribution.png"):
        assert (tmp_path / "fig" / f).stat().st_size > 1000


def test_progress_lines_in_a_log_and_threads(tiny, tmp_path, capsys, monkeypatch):
    """stderr is no terminal here (a log): each method's progress is lines, one per batch with
    PSD_PROGRESS_SECONDS=0; --threads sets torch's threads before the weights are read."""
    import torch

    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    monkeypatch.setenv("PSD_PROGRESS_SECONDS", "0")
    assert eval_main(["--model", str(tiny), "--task", "math", "--methods", "greedy", "--limit", "4", "--batch-size",
                      "2", "--gen-length", "16", "--block-length", "16", "--threads", "1",
                      "--out", str(tmp_path / "r.jsonl")]) == 0
    assert seen == [1]
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in err] == ["greedy: problems: 0/4", "greedy: problems: 2/4",
                                                     "greedy: problems: 4/4"]
    assert eval_main(["--model", str(tiny), "--task", "math", "--methods", "greedy", "--limit", "2", "--gen-length",
                      "16", "--block-length", "16", "--quiet", "--out", str(tmp_path / "q.jsonl")]) == 0
    assert capsys.readouterr().err == ""


def test_parse_method_specs():
    assert parse_method("greedy") == ("greedy", {})
    assert parse_method("confidence:tau=0.8") == ("confidence", {"threshold": 0.8})
    assert parse_method("psd:policy=localleap,d=5,acceptance=exact") == (
        "psd", {"policy_name": "localleap", "depth": 5, "acceptance": "exact"})
    assert parse_method("lopa:k=3,tau=0.9") == ("lopa", {"k": 3, "threshold": 0.9})
    with pytest.raises(InputError, match="bad method option"):
        parse_method("psd:depth")
    with pytest.raises(InputError, match="bad value"):
        parse_method("psd:d=three")


def test_specs_differing_only_in_general_options_are_separate_rows(tiny, tmp_path, capsys):
    """`psd` and `psd:cache=dual` (or `psd:min_tokens=8`) describe the same method: their labels
    carry the options the spec gave, so the table has a row each (they were one merged row); two
    specs that decode the same configuration are one error line."""
    out = tmp_path / "r.jsonl"
    assert eval_main(["--model", str(tiny), "--task", "math", "--methods", "psd:d=2", "psd:d=2,cache=dual",
                      "psd:d=2,min_tokens=8", "--limit", "3", "--gen-length", "16", "--block-length", "8",
                      "--out", str(out), "--quiet"]) == 0
    summary, records = _check_table_against_jsonl(capsys.readouterr().out, out, 3)
    labels = [r["method"] for r in summary["rows"]]
    assert labels[0] == "greedy" and len(set(labels)) == 4
    assert labels[2] == labels[1] + "[cache=dual]" and labels[3] == labels[1] + "[min_tokens=8]"
    assert all(r["tokens"] >= 9 for r in records if r["method"] == labels[3])      # no stop token before 8
    assert eval_main(["--model", str(tiny), "--methods", "confidence", "confidence:cache=none", "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the method specs confidence(") and "decode the same configuration" in err
    assert len(err.strip().splitlines()) == 1


def test_bad_eval_input(tiny, capsys):
    assert eval_main(["--model", str(tiny), "--methods", "beam", "--limit", "2"]) == 2
    assert "unknown method 'beam'" in capsys.readouterr().err
    assert eval_main(["--model", str(tiny), "--task", "gsm8k", "--data", "/nonexistent/gsm8k.jsonl"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.slow
def test_torchrun_two_ranks_gather_one_result(tiny, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    common = ["--model", str(tiny), "--task", "math", "--methods", "greedy", "spiffy:d=3",
              "--limit", "6", "--gen-length", "16", "--block-length", "16", "--quiet"]
    sharded = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-port", "29517", "-m", "bench.eval", *common, "--out", str(tmp_path / "s.jsonl"),
                              "--plot", str(tmp_path / "fs")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert sharded.returncode == 0, sharded.stderr[-2000:]
    single = subprocess.run([sys.executable, "-m", "bench.eval", *common, "--out", str(tmp_path / "one.jsonl"),
                             "--plot", str(tmp_path / "f1")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    s = {r["id"]: r["completion"] for r in map(json.loads, (tmp_path / "s.jsonl").read_text().splitlines())}
    o = {r["id"]: r["completion"] for r in map(json.loads, (tmp_path / "one.jsonl").read_text().splitlines())}
    assert len(s) == 6 and s == o
    summary = json.loads(sharded.stdout.strip().splitlines()[-1])
    assert summary["problems"] == 6 and summary["rows"][0]["problems"] == 6
    assert "ranks=2" in sharded.stdout
    # the figures cover every rank's problems, not rank 0's shard only
    fs, f1 = (json.loads((tmp_path / d / "figures.json").read_text()) for d in ("fs", "f1"))
    assert fs["precision_at_k"] == f1["precision_at_k"] and fs["precision_at_k"]["1"]
    assert fs["contribution"] == f1["contribution"] and fs["contribution"]


def test_precision_at_k_uses_problem_indices_across_batches(tiny, tmp_path, capsys, monkeypatch):
    """Lookahead statistics must not mix up rows of different batches: with batch size 1 and with
    one batch the curves are identical."""
    import bench.plots as plots

    seen = []
    monkeypatch.setattr(plots, "write_plots", lambda out, rows, results, traces, L: seen.append(
        plots.precision_at_k(results["greedy"], traces["greedy"], L)) or [])
    for bs in ("1", "6"):
        assert eval_main(["--model", str(tiny), "--task", "math", "--methods", "greedy", "--limit", "6",
                          "--gen-length", "16", "--block-length", "16", "--batch-size", bs, "--quiet",
                          "--out", str(tmp_path / f"r{bs}.jsonl"), "--plot", str(tmp_path / "f")]) == 0
    assert seen[0] == seen[1] and seen[0][1]
