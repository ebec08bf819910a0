"""bench.eval: the summary table is derived from the per-problem JSONL it writes; method specs;
plots; torchrun sharding over 2 CPU ranks with gloo."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench.eval
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
def test_eval_math_shipped_model_table_matches_jsonl(tmp_path, capsys):
    """20 problems: a full batch of 16 and a short one of 4."""
    out = tmp_path / "r.jsonl"
    assert eval_main(["--task", "math", "--methods", "greedy", "confidence", "--limit", "20", "--out", str(out),
                      "--quiet"]) == 0
    _check_table_against_jsonl(capsys.readouterr().out, out, 20)


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


def test_chat_puts_each_prompt_in_the_chat_template(tmp_path, capsys):
    """--chat: each prompt (few-shot examples included) is one user turn of the checkpoint's template,
    encoded as engine.generate --chat encodes it; without a template, one error line before decoding."""
    from bench.tasks import get_task
    from bench.tasks.common import truncate_at
    from engine import generate
    from engine.config import text_ids
    from models import Tokenizer, load_model

    tiny = make_checkpoint(tmp_path / "m", "llada", seed=2)[0]          # no EOS bias: answers of 8 tokens
    args = ["--model", str(tiny), "--task", "math", "--methods", "greedy", "--limit", "3", "--few-shot", "1",
            "--gen-length", "8", "--block-length", "8", "--quiet"]
    got = {}
    for chat in ([], ["--chat"]):
        out = tmp_path / f"{len(chat)}.jsonl"
        assert eval_main(args + chat + ["--out", str(out)]) == 0
        got[bool(chat)] = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    assert got[True] != got[False] and all(got[True])
    task, tok = get_task("math"), Tokenizer(tiny)
    problems, shots = task.load(None, limit=3), task.few_shot(1, None, heldout=None)
    ids = [text_ids(tok, tok.apply_chat_template(task.format_prompt(p, shots)), chat=True) for p in problems]
    assert ids[0][:1] == tok.encode("<|user|>", special=False)[:1]
    want = [tok.decode(r.token_ids) for r in generate(load_model(tiny), ids, method="greedy", gen_length=8,
                                                      block_length=8)]
    assert [truncate_at(w, task.STOP_SEQUENCES) for w in want] == got[True]
    (tiny / "tokenizer_config.json").rename(tmp_path / "saved.json")
    try:
        assert eval_main(args + ["--chat", "--out", str(tmp_path / "none.jsonl")]) == 2
    finally:
        (tmp_path / "saved.json").rename(tiny / "tokenizer_config.json")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: a chat prompt (--chat, chat=True) needs the checkpoint's chat template "
                   "(chat_template.jinja, or chat_template in tokenizer_config.json), and this checkpoint has none"]
    assert not (tmp_path / "none.jsonl").exists()


def test_fewshot_as_multiturn_gives_each_shot_its_own_turns(tmp_path, capsys, monkeypatch):
    """--chat --fewshot-as-multiturn: each shot a user turn (its question) and an assistant turn (its
    answer), the problem the last user turn, as lm-eval renders them; without --chat, one error line."""
    from bench.tasks import get_task
    from bench.tasks.common import truncate_at
    from engine import generate
    from engine.config import text_ids
    from models import Tokenizer, load_model

    tiny = make_checkpoint(tmp_path / "m", "llada", seed=2)[0]
    tc = json.loads((tiny / "tokenizer_config.json").read_text())
    tc["chat_template"] = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tiny / "tokenizer_config.json").write_text(json.dumps(tc))
    args = ["--model", str(tiny), "--task", "math", "--methods", "greedy", "--limit", "2", "--few-shot", "2",
            "--gen-length", "8", "--block-length", "8", "--quiet", "--chat"]
    out, decoded = tmp_path / "turns.jsonl", []
    run_method = bench.eval.run_method
    monkeypatch.setattr(bench.eval, "run_method", lambda *a, **kw: decoded.append(a[4]) or run_method(*a, **kw))
    assert eval_main(args + ["--fewshot-as-multiturn", "--out", str(out)]) == 0
    got = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    task, tok = get_task("math"), Tokenizer(tiny)
    problems, shots = task.load(None, limit=2), task.few_shot(2, None, heldout=None)
    turns = [m for s in shots for m in ({"role": "user", "content": f"Question: {s['prompt']}\nAnswer:"},
                                         {"role": "assistant", "content": s["answer"]})]
    texts = [tok.apply_chat_template(turns + [{"role": "user", "content": f"Question: {p['prompt']}\nAnswer:"}])
             for p in problems]
    assert texts[0].count("<|assistant|>") == 3 and f"<|assistant|> {shots[1]['answer']} <|user|>" in texts[0]
    ids = [text_ids(tok, t, chat=True) for t in texts]
    assert decoded == [ids]
    want = [tok.decode(r.token_ids) for r in generate(load_model(tiny), ids, method="greedy", gen_length=8,
                                                      block_length=8)]
    assert [truncate_at(w, task.STOP_SEQUENCES) for w in want] == got
    capsys.readouterr()
    assert eval_main(args[:-1] + ["--fewshot-as-multiturn", "--out", str(tmp_path / "no.jsonl")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --fewshot-as-multiturn needs --chat: the turns are the checkpoint's chat template's"]


@pytest.mark.parametrize("name", ["math", "code", "gsm8k", "mbpp"])
def test_shot_turns_split_every_tasks_shots(name):
    """Each task's shot text splits into its question and its answer (bench.tasks.common.shot_turns);
    a format that does not is one error, never turns that drop text."""
    from bench.tasks import get_task
    from bench.tasks.common import shot_turns

    task = get_task(name)
    problem, *shots = task.load(None, limit=3)
    turns = shot_turns(task, problem, shots)
    assert [t["role"] for t in turns] == ["user", "assistant"] * 2 + ["user"]
    assert all(s["answer"].strip().splitlines()[0] in t["content"] for s, t in zip(shots, turns[1::2]))
    assert turns[-1]["content"] == task.format_prompt(problem, ()).strip()
    fake = type("Task", (), {"NAME": name, "format_prompt": staticmethod(lambda p, sh=(): p["prompt"] + "".join(
        "\n" + s["answer"] for s in sh))})
    with pytest.raises(ValueError, match=f"--task {name}: a few-shot example's text does not split"):
        shot_turns(fake, problem, shots[:1])


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
    for spec in ("psd:d=3,d=4", "psd:d=3,depth=4", "confidence:tau=0.5,threshold=0.8"):   # the last one won
        with pytest.raises(InputError, match="is given twice in"):
            parse_method(spec)


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
    # each record keeps its whole spec (it held the bare method name: psd for all three)
    assert {r["spec"] for r in records} == {"greedy", "psd:depth=2", "psd:depth=2,cache=dual", "psd:depth=2,min_tokens=8"}
    ga, gb = tmp_path / "a.json", tmp_path / "b.json"
    ga.write_text("[[], [0], [1]]")
    gb.write_text("[[], [0], [2]]")
    for specs, words in ((["confidence", "confidence:cache=none"], "the method specs confidence and "
                                                                      "confidence:cache=none decode the same"),
                         # a default given explicitly, or a synonym: one configuration (they were two merged rows)
                         (["confidence", "confidence:threshold=0.9"], "decode the same configuration"),
                         (["localleap", "localleap:window=4"], "decode the same configuration"),
                         # a difference the label does not show (two graphs of one shape): refused, never merged
                         ([f"spiffy:graph={ga}", f"spiffy:graph={gb}"], "decode differently but share the label spiffy(")):
        assert eval_main(["--model", str(tiny), "--methods", *specs, "--limit", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, err


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
    # and the same file, line by line (it was ordered rank by rank: problems 0, 2, 4, 1, 3, 5)
    assert (tmp_path / "s.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    summary = json.loads(sharded.stdout.strip().splitlines()[-1])
    assert summary["problems"] == 6 and summary["rows"][0]["problems"] == 6
    assert "ranks=2" in sharded.stdout
    # the figures cover every rank's problems, not rank 0's shard only
    fs, f1 = (json.loads((tmp_path / d / "figures.json").read_text()) for d in ("fs", "f1"))
    assert fs["precision_at_k"] == f1["precision_at_k"] and fs["precision_at_k"]["1"]
    assert fs["contribution"] == f1["contribution"] and fs["contribution"]


def _two_ranks(argv: list[str], timeout: float = 300) -> list[tuple[int, str]]:
    """`python -m bench.eval ARGV` on 2 gloo ranks launched by hand (torchrun's environment, so each
    rank's exit status and stderr are its own, and no launcher stops the others): (status, stderr)
    per rank. A rank still running after `timeout` seconds fails the test: it waits in a collective."""
    import time

    from support import free_port

    port, procs = str(free_port()), []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.eval", *argv], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline, out = time.monotonic() + timeout, []
    try:
        for p in procs:
            out.append((p.communicate(timeout=max(1.0, deadline - time.monotonic()))[1], p.returncode))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the ranks of bench.eval {' '.join(argv)} did not end within {timeout} s (a rank waits in a "
                    f"collective)")
    return [(code, err) for err, code in out]


@pytest.mark.slow
def test_torchrun_outputs_rank0_cannot_write_end_every_rank_cleanly(tiny, tmp_path):
    """Under torchrun rank 0 writes the outputs. What can be checked before decoding (--out exists
    without --overwrite, --plot not a directory) is checked then, for every rank: all exit 2, one
    `error:` line (rank 0's), no traceback, none left waiting. Rank 0 failing to write results while
    decoding (a full disk: /dev/full) is its one `error:` line and status 2, and the other rank ends
    with status 0 (its part was done) instead of waiting in the next method's collective."""
    common = ["--model", str(tiny), "--task", "math", "--methods", "greedy", "confidence", "--limit", "4",
              "--gen-length", "16", "--block-length", "16", "--quiet"]
    there = tmp_path / "there.jsonl"
    there.write_text("kept\n")
    (tmp_path / "afile").write_text("x")
    for extra, says in ((["--out", str(there)], f"error: --out {there} exists; pass --overwrite to replace it"),
                        (["--out", str(tmp_path / "r.jsonl"), "--plot", str(tmp_path / "afile" / "fig")],
                         f"error: --plot {tmp_path / 'afile' / 'fig'}: cannot create the directory")):
        (code0, err0), (code1, err1) = _two_ranks(common + extra)
        assert (code0, code1) == (2, 2), err0[-2000:] + err1[-2000:]
        assert err0.splitlines() == [err0.strip()] and err0.startswith(says), err0[-2000:]
        assert err1 == "", err1[-2000:]
    assert there.read_text() == "kept\n" and not (tmp_path / "r.jsonl").exists()
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full to fail a write with")
    (code0, err0), (code1, err1) = _two_ranks(common + ["--out", "/dev/full"])
    assert (code0, code1) == (2, 0), err0[-2000:] + err1[-2000:]
    assert err0.strip() == "error: --out /dev/full: cannot write the results (No space left on device)", err0[-2000:]
    assert err1 == "", err1[-2000:]


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


class _Loaded(Exception):
    """The weights were about to load: every up-front check passed."""


def _no_weights(monkeypatch):
    import bench.eval as ev

    def loaded(*a, **k):
        raise _Loaded
    monkeypatch.setattr(ev, "load_model", loaded)


def _one_error_line(err: str, *parts: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(p in lines[0] for p in parts), lines[0]
    return lines[0]


def _jsonl(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


HE = [{"task_id": f"HumanEval/{i}", "entry_point": f"f{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
       "canonical_solution": f"    return x + {i}\n", "test": f"def check(c):\n    assert c(1) == {1 + i}\n"}
      for i in range(3)]


def test_few_shot_examples_are_never_evaluated_problems(tiny, tmp_path, capsys, monkeypatch):
    """HumanEval --few-shot 1 put HumanEval/0 with its canonical solution into every prompt and still
    evaluated HumanEval/0; a shot that is an evaluated problem is one error line before any weights
    load, and examples from a separate file are taken."""
    _no_weights(monkeypatch)
    data = _jsonl(tmp_path / "he.jsonl", HE)
    base = ["--model", str(tiny), "--task", "humaneval", "--data", str(data), "--few-shot", "1", "--gen-length",
            "32", "--methods", "greedy", "--unsafe-sandbox", "--out", str(tmp_path / "r.jsonl")]
    assert eval_main(base) == 2
    _one_error_line(capsys.readouterr().err, "the few-shot example HumanEval/0 is the evaluated problem HumanEval/0")
    shots = _jsonl(tmp_path / "shots.jsonl", [{**HE[1], "task_id": "Mine/0", "prompt": "def g(x):\n"}])
    with pytest.raises(_Loaded):
        eval_main(base + ["--few-shot-data", str(shots)])


def test_synthetic_suites_take_the_few_shot_data(tiny, tmp_path, capsys, monkeypatch):
    """math/code used --few-shot-data only as the file to stay disjoint from: the user's examples were
    silently replaced by generated ones (and the evaluated --data was not excluded)."""
    import bench.eval as ev
    from bench.tasks import math as mt

    _no_weights(monkeypatch)
    seen = []
    few_shots = ev._few_shots
    monkeypatch.setattr(ev, "_few_shots", lambda *a: seen.append(few_shots(*a)) or seen[-1])
    mine = [{"id": f"my-{i}", "prompt": f"My own example {i}: what is 2 + {i}?", "answer": f"#### {2 + i}",
             "target": str(2 + i)} for i in range(3)]
    shots = _jsonl(tmp_path / "my_shots.jsonl", mine)
    base = ["--model", str(tiny), "--task", "math", "--limit", "2", "--gen-length", "16", "--block-length", "16",
            "--out", str(tmp_path / "r.jsonl")]
    with pytest.raises(_Loaded):
        eval_main(base + ["--few-shot", "2", "--few-shot-data", str(shots)])
    assert seen[-1][1] == mine[:2]
    for given, words in (([], "(the default for math)"), (["--few-shot", "0"], "--few-shot is 0; give")):
        assert eval_main(base + given + ["--few-shot-data", str(shots)]) == 2     # was: ignored, 0 examples
        _one_error_line(capsys.readouterr().err, f"--few-shot-data {shots} is unused: --few-shot is 0", words)
    data = _jsonl(tmp_path / "data.jsonl", mt.load(limit=3))             # shots from the evaluated file
    assert eval_main(base + ["--few-shot", "1", "--data", str(data), "--few-shot-data", str(data)]) == 2
    _one_error_line(capsys.readouterr().err, "is the evaluated problem math-1001-00000")


def test_every_specs_gen_length_is_checked_against_the_window_up_front(tiny, tmp_path, capsys, monkeypatch):
    """A spec's own gen_length was checked only when that method ran, after greedy had decoded and
    been written; now it is one error line before any weights load or any output."""
    _no_weights(monkeypatch)
    out = tmp_path / "r.jsonl"
    assert eval_main(["--model", str(tiny), "--task", "math", "--limit", "2", "--gen-length", "16",
                      "--block-length", "16", "--methods", "greedy", "confidence:gen_length=4096",
                      "--out", str(out)]) == 2
    _one_error_line(capsys.readouterr().err, "method confidence:gen_length=4096: ", "4096-token window",
                    "plus gen_length=4096; use gen_length=")
    assert not out.exists()


def test_plot_files_are_replaced_only_with_overwrite(tiny, tmp_path, capsys, monkeypatch):
    """--plot silently replaced the figures of an earlier run (--overwrite guarded only --out)."""
    fig = tmp_path / "fig"
    fig.mkdir()
    (fig / "pareto.png").write_bytes(b"an earlier run")
    argv = ["--model", str(tiny), "--task", "math", "--limit", "2", "--gen-length", "16", "--block-length", "16",
            "--methods", "greedy", "--plot", str(fig), "--quiet"]
    _no_weights(monkeypatch)
    assert eval_main(argv + ["--out", str(tmp_path / "r.jsonl")]) == 2
    _one_error_line(capsys.readouterr().err, f"--plot {fig} holds pareto.png", "--overwrite")
    assert (fig / "pareto.png").read_bytes() == b"an earlier run" and not (tmp_path / "r.jsonl").exists()
    with pytest.raises(_Loaded):
        eval_main(argv + ["--out", str(tmp_path / "r.jsonl"), "--overwrite"])


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_write_failure_after_decoding_is_one_error_line(tiny, tmp_path, capsys):
    assert eval_main(["--model", str(tiny), "--task", "math", "--limit", "2", "--gen-length", "16",
                      "--block-length", "16", "--methods", "greedy", "--quiet", "--out", "/dev/full"]) == 2
    _one_error_line(capsys.readouterr().err, "--out /dev/full: cannot write the results")


def test_unsafe_sandbox_allows_the_reduced_level_and_never_lowers_namespaces(monkeypatch):
    """--unsafe-sandbox: where Linux namespaces can be set up, generated code still runs under them
    (the flag used to force the reduced level everywhere); only where they cannot is it "fallback"."""
    import argparse

    from bench import sandbox
    from bench.eval import sandbox_mode

    asked = argparse.Namespace(unsafe_sandbox=True)
    assert sandbox_mode(argparse.Namespace(unsafe_sandbox=False)) is None
    monkeypatch.setattr(sandbox, "isolation", lambda mode=None: "namespaces")
    assert sandbox_mode(asked) is None

    def unavailable(mode=None):
        raise sandbox.SandboxUnavailable("no user namespaces here")

    monkeypatch.setattr(sandbox, "isolation", unavailable)
    assert sandbox_mode(asked) == "fallback"
