"""Nothing hangs, nothing lies: hostile and careless input to the CLI and the API ends quickly
with one `error:` line and exit status 2 (or a typed exception), never a traceback or a hang."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import DecodeConfig, Decoder, DecodingError, DraftGraph, InputError, generate
from models import load_model
from models.random_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("hostile") / "llada", "llada", seed=1, eos_bias=8.0)
    return path


def cli(args, ckpt=None, stdin=None, timeout=120):
    argv = [sys.executable, "-m", "engine.generate"] + [a if isinstance(a, bytes) else str(a) for a in args]
    if ckpt is not None:
        argv += ["--model", str(ckpt)]
    return subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, input=stdin, timeout=timeout)


def one_error_line(res, msg):
    err = res.stderr.decode("utf-8", "replace")
    assert res.returncode == 2, err
    assert "Traceback" not in err and res.stdout == b""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], err


@pytest.mark.parametrize("args,msg", [
    (["t5", "--method", "confidence", "--temperature", "inf"], "temperature must be finite"),
    (["t5", "--temperature", "nan"], "temperature must be finite"),
    (["t5", "--gen-length", "0"], "gen length must be >= 1"),
    (["t5", "--block-length", "0"], "block length must be >= 1"),
    (["t5", "--method", "confidence", "--steps", "8"], "steps applies to topk, random and psd, not to confidence"),
    (["t5", "--method", "greedy", "--threshold", "0.5"], "threshold applies to"),
    (["t5", "--method", "greedy", "--depth", "2"], "draft depth applies to spiffy and psd, not to greedy"),
    (["t5", "--method", "greedy", "--acceptance", "exact"], "acceptance mode applies to psd"),
    (["t5", "--seed", str(2 ** 64)], "seed must be in"),
    (["t5", "--seed", "-1"], "seed must be in"),
    (["t5", "--device", "tpu"], "device"),
    (["t5", "--device", "meta"], "is not supported"),
    (["t5", "--device", "cuda:7"], "CUDA"),
    (["t5", "--gen-length", "abc"], "invalid int value"),
    ([b"t5 \xff\xfe"], "not valid UTF-8"),
])
@pytest.mark.slow
def test_bad_flags(ckpt, args, msg):
    one_error_line(cli(args, ckpt), msg)


@pytest.mark.slow
def test_graph_files(ckpt, tmp_path):
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps([[]] + [[i % 32, 32 + i] for i in range(5000)]))
    res = cli(["t5", "--method", "psd", "--graph", huge], ckpt, timeout=60)
    one_error_line(res, "at most 256 are supported")
    far = tmp_path / "far.json"
    far.write_text(json.dumps([[], [0], [0, 40]]))
    one_error_line(cli(["t5", "--method", "spiffy", "--graph", far, "--block-length", "32", "--gen-length", "32"], ckpt),
                   "names rank 40")
    chain = tmp_path / "chain.json"
    chain.write_text(json.dumps([[], [0]]))
    one_error_line(cli(["t5", "--method", "psd", "--graph", chain, "--depth", "2"], ckpt), "not both")
    one_error_line(cli(["t5", "--method", "greedy", "--graph", chain], ckpt), "a draft graph applies to spiffy and psd")


def test_stdin_not_utf8(ckpt):
    one_error_line(cli(["-"], ckpt, stdin=b"Question: \xff\xfe"), "not valid UTF-8")


def test_endless_stdin_is_bounded_like_a_named_file(ckpt):
    """/dev/zero on stdin is read up to the named files' bound (256 MiB), then one error line; the
    child's address space is capped so that reading without a bound fails fast here, never the machine."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    argv = [sys.executable, "-m", "engine.generate", "--prompt-file", "-", "--model", str(ckpt)]
    with open("/dev/zero", "rb") as zero:
        res = subprocess.run(argv, cwd=ROOT, env=ENV, stdin=zero, capture_output=True, timeout=120, preexec_fn=cap)
    one_error_line(res, "the prompt on stdin is too large: over 268435456 bytes")


@pytest.mark.slow
def test_broken_pipe_is_quiet(ckpt):
    cmd = f"{sys.executable} -m engine.generate 't5 t6' --model {ckpt} --gen-length 32 --block-length 8 | head -c 1"
    res = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=ENV, capture_output=True, timeout=120)
    assert "Traceback" not in res.stderr.decode() and "BrokenPipe" not in res.stderr.decode()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_is_one_error_line(ckpt):
    with open("/dev/full", "wb") as full:
        res = subprocess.run([sys.executable, "-m", "engine.generate", "t5 t6", "--model", str(ckpt), "--json",
                              "--gen-length", "16", "--block-length", "8"], cwd=ROOT, env=ENV, stdout=full,
                             stderr=subprocess.PIPE, timeout=120)
    err = res.stderr.decode()
    assert res.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "error: cannot write the output: No space left on device"


def test_api_prompt_ids_must_be_integers(ckpt):
    model = load_model(ckpt)
    for bad, msg in (([[5.0, 6.7]], "not an integer"), ([[True, 5]], "bool"), (["abc"], "not a list of token ids"),
                     ([[5, None]], "not an integer"), ([torch.tensor(5)], "not an integer")):
        with pytest.raises(InputError, match=msg):
            generate(model, bad, gen_length=8, block_length=8)
    ok = generate(model, [[torch.tensor(5), 6]], gen_length=8, block_length=8)
    assert ok[0].tokens >= 1
    once = generate(model, [iter([5, 6])], gen_length=8, block_length=8)       # an iterator, read once
    assert once[0].token_ids == generate(model, [[5, 6]], gen_length=8, block_length=8)[0].token_ids


@pytest.mark.parametrize("method", ["greedy", "confidence", "psd"])
def test_nonfinite_outputs_stop_with_an_error_naming_the_call(ckpt, method):
    model = load_model(ckpt)
    with torch.no_grad():      # poisoned after load, so the load-time weight check cannot catch it
        next(p for n, p in model.named_parameters() if n.endswith("attn.wq.weight")).view(-1)[0] = float("nan")
    with pytest.raises(DecodingError, match=r"at call 1 of sequence 0 .*NaN/Inf"):
        generate(model, [[5, 6, 7]], method=method, gen_length=16, block_length=8)


def test_a_step_that_commits_nothing_cannot_hang(ckpt, monkeypatch):
    """If the predictions were ever the mask token, the loop would spin; it stops with an error."""
    import psd_kernels

    model = load_model(ckpt)
    real = psd_kernels.top1
    mask = model.config.mask_token_id

    def mask_only(logits, exclude_id=None, *a, **k):
        ids, conf = real(logits, exclude_id, *a, **k)
        return torch.full_like(ids, mask), conf

    monkeypatch.setattr(psd_kernels, "top1", mask_only)
    with pytest.raises(DecodingError, match="made no progress at call 1"):
        generate(model, [[5, 6, 7], [8, 9]], method="confidence", gen_length=16, block_length=8)


# ---------------------------------------------------------------------- results are never lost or overwritten
def _results_state():
    return {p.name: p.stat().st_mtime_ns for p in (ROOT / "bench" / "results").iterdir()}


def test_eval_without_out_writes_a_fresh_run_dir(ckpt, capsys):
    from bench.eval import main as eval_main

    before = _results_state()
    code = eval_main(["--model", str(ckpt), "--task", "math", "--methods", "greedy", "--limit", "2",
                      "--gen-length", "8", "--block-length", "8", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    path = Path(json.loads(out.strip().splitlines()[-1])["results_file"])
    assert path.is_file() and (ROOT / "runs") in path.parents and f"results: {path}" in err
    assert len(path.read_text().splitlines()) == 2
    assert _results_state() == before


def test_eval_checks_outputs_and_specs_before_decoding(ckpt, tmp_path, capsys):
    from bench.eval import main as eval_main

    common = ["--model", str(ckpt), "--task", "math", "--limit", "2", "--gen-length", "8", "--block-length", "8",
              "--quiet"]
    mine = tmp_path / "mine.jsonl"
    mine.write_text("precious\n")
    cases = [
        (["--methods", "greedy", "--out", str(mine)], "exists; pass --overwrite"),
        (["--methods", "greedy", "--out", str(tmp_path)], "is a directory"),
        (["--methods", "greedy", "--out", "/proc/nope/x.jsonl"], "--out"),
        (["--methods", "greedy", "--plot", "/proc/nope"], "--plot"),
        (["--methods", "greedy", "confidence:tau=7", "--out", str(tmp_path / "a.jsonl")], "outside (0, 1]"),
        (["--methods", "greedy", "greedy:tau=0.5", "--out", str(tmp_path / "b.jsonl")], "threshold applies to"),
    ]
    for extra, msg in cases:
        assert eval_main(common + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and msg in err, (extra, err)
    assert mine.read_text() == "precious\n"
    assert not (tmp_path / "a.jsonl").exists() or (tmp_path / "a.jsonl").read_text() == ""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert eval_main(common + ["--methods", "greedy", "--data", str(empty), "--out", str(tmp_path / "c.jsonl")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert eval_main(common + ["--methods", "greedy", "--out", str(mine), "--overwrite"]) == 0
    assert len(mine.read_text().splitlines()) == 2


def test_eval_writes_each_method_as_it_finishes(ckpt, tmp_path, monkeypatch, capsys):
    """An interruption after the first method loses nothing of it."""
    import bench.eval as E

    real, calls = E.run_method, []

    def interrupt_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(E, "run_method", interrupt_second)
    out = tmp_path / "r.jsonl"
    code = E.main(["--model", str(ckpt), "--task", "math", "--methods", "greedy", "confidence", "--limit", "2",
                   "--gen-length", "8", "--block-length", "8", "--quiet", "--out", str(out)])
    assert code == 130
    assert [json.loads(l)["method"] for l in out.read_text().splitlines()] == ["greedy", "greedy"]
    (line,) = capsys.readouterr().err.strip().splitlines()      # it used to say nothing
    assert line == (f"interrupted: {out} holds the records of greedy (the methods that finished); there is no "
                    f"resume: run again with --overwrite, or with --methods the rest and another --out"), line


def test_huge_counts_are_refused_or_cost_what_the_whole_row_costs(ckpt, capsys):
    """Integers beyond 2**31 - 1 are no setting (they overflowed tensors: tracebacks); up to it, a window
    wider than the block decodes as the widest real one (the window's padding was allocated), and billions
    of topk steps are refused at once (a list of the steps was built: a hang eating GBs)."""
    from engine.generate import main

    from support import run_main

    base = ["t5 t6", "--model", str(ckpt), "--gen-length", "16", "--block-length", "8", "--json", "--threads", "1"]
    for flags, msg in ((["--method", "localleap", "--window", str(10 ** 23)], "window must be <= 2147483647"),
                       (["--method", "threshold", "--editing-threshold", "0.5", "--max-post-steps", str(10 ** 23)],
                        "max post steps must be <= 2147483647")):
        rc, out, err = run_main(main, base + flags, capsys)
        assert rc == 2 and out == "" and err.strip().splitlines() == [f"error: {msg}, got {10 ** 23}"]

    def tokens(*flags):
        rc, out, err = run_main(main, base + list(flags), capsys)
        assert rc == 0, err
        return json.loads(out)["token_ids"]

    assert tokens("--method", "localleap", "--window", str(2 ** 31 - 1)) == tokens("--method", "localleap",
                                                                                     "--window", "8")
    # billions of steps (a list of them was built): now refused at once, as any count past a step a position
    rc, out, err = run_main(main, base + ["--method", "topk", "--steps", str(2 ** 31 - 2)], capsys)
    assert rc == 2 and out == "" and "steps a block, more than its 8 positions" in err, err
