"""Hostile files and benchmark settings (issue 22, classes 4 and 5): every file a user names is
checked to be a regular file of sane size before it is read (a FIFO must not block, /dev/zero must
not be read until memory runs out), its contents are checked before anything is allocated, and
the benchmarks refuse impossible settings up front: one `error:` line, exit status 2, never a
traceback, a hang or silently wrong output."""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bench.eval as ev
import bench.speed as speed
from bench import sandbox
from bench.tasks import code as code_suite
from bench.tasks import common, mbpp
from engine import DecodeConfig, Decoder, InputError
from engine.cost import CostModel, read_profile
from engine.errors import read_json as engine_read_json
from models import CheckpointError, ModelConfig, Tokenizer, load_model
from models.config import MAX_FILE_BYTES, read_json, read_text
from models.random_checkpoint import make_checkpoint
from support import run_main

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "models" / "default"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
needs_default = pytest.mark.skipif(not (DEFAULT / "config.json").is_file(), reason="no shipped model")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("hostile_files") / "llada", "llada", seed=1, eos_bias=8.0)
    return path


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def huge(path: Path) -> Path:
    """A sparse file one byte over the cap (no disk space used)."""
    with open(path, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    return path


def run(args, timeout=120, module="engine.generate"):
    """`python -m MODULE ARGS` in a subprocess: a hang is a timeout, not a stuck test run."""
    try:
        return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=ENV,
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -m {module} {' '.join(map(str, args))} hung")


def one_error_line(rc: int, err: str, *msgs: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for m in msgs:
        assert m in lines[0], lines[0]
    return lines[0]


def cli_error(res, *msgs: str) -> str:
    assert res.stdout == b"", res.stdout
    return one_error_line(res.returncode, res.stderr.decode("utf-8", "replace"), *msgs)


# ---------------------------------------------------------------------- the one checked reader
BAD_FILES = {
    "dev zero": (lambda t: Path("/dev/zero"), "not a regular file (a character device)"),
    "fifo": (lambda t: fifo(t / "f.json"), "not a regular file (a FIFO)"),
    "directory": (lambda t: t, "not a regular file (a directory)"),
    "too large": (lambda t: huge(t / "big.json"), "too large"),
    "missing": (lambda t: t / "nope.json", "not found"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_checked_reader_refuses_what_is_not_a_sane_regular_file(case, tmp_path):
    """models.config.read_json (checkpoints) and engine.errors.read_json (cost profiles, draft graphs)
    are one reader: both refuse, with their own error type, before opening the file."""
    make, msg = BAD_FILES[case]
    path = make(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(msg)):
        read_json(path)
    with pytest.raises(InputError, match=re.escape(msg)):
        engine_read_json(path, "cost profile")
    with pytest.raises(CheckpointError, match=re.escape(msg)):
        read_text(path, "prompt file")


def test_checked_reader_reads_a_regular_file(tmp_path):
    f = tmp_path / "ok.json"
    f.write_text('{"a": [1, 2]}')
    assert read_json(f) == engine_read_json(f, "x") == {"a": [1, 2]}
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(InputError, match="not valid UTF-8"):
        engine_read_json(f, "draft graph file")


# ---------------------------------------------------------------------- checkpoint files
def _copy(ckpt: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in ckpt.iterdir():
        (dst / f.name).symlink_to(f)
    return dst


CKPT_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model.safetensors.index.json"]


@pytest.mark.parametrize("name", CKPT_FILES)
@pytest.mark.parametrize("kind", ["fifo", "dev zero"])
@pytest.mark.slow
def test_checkpoint_file_that_is_a_fifo_or_a_device_is_one_error(ckpt, tmp_path, name, kind):
    d = _copy(ckpt, tmp_path / "m")
    if os.path.lexists(d / name):
        (d / name).unlink()
    if kind == "fifo":
        fifo(d / name)
    else:
        (d / name).symlink_to("/dev/zero")
    res = run(["t5", "--model", d, "--gen-length", "8", "--block-length", "8"], timeout=90)
    cli_error(res, name, "not a regular file")


def _config(ckpt: Path, dst: Path, **changes) -> Path:
    d = _copy(ckpt, dst)
    raw = json.loads((ckpt / "config.json").read_text())
    raw.update(changes)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(raw))
    return d


@pytest.mark.parametrize("changes", [{"n_layers": 10 ** 9}, {"d_model": 2 ** 40, "n_heads": 2 ** 10,
                                                               "n_kv_heads": 2 ** 10},
                                     {"embedding_size": 10 ** 12, "vocab_size": 10 ** 12}, {"n_layers": 10 ** 6}],
                         ids=["layers", "hidden", "vocab", "layers-1e6"])
def test_absurd_config_sizes_fail_before_anything_is_built(ckpt, tmp_path, changes, monkeypatch):
    """The parameters a config implies are checked against the machine's memory and the checkpoint's
    tensor files before the model is built (10^9 layers would build 10^9 modules first)."""
    import models.checkpoint as ck

    d = _config(ckpt, tmp_path / "m", **changes)
    monkeypatch.setattr(ck, "Transformer", lambda c: pytest.fail("model built before the size check"))
    with pytest.raises(CheckpointError, match="implies .* parameters") as ei:
        load_model(d)
    assert "config.json" in str(ei.value)


def test_config_larger_than_memory_names_the_memory(ckpt, monkeypatch):
    import models.checkpoint as ck

    monkeypatch.setattr(ck, "available_memory", lambda device="cpu": 1 << 10)
    with pytest.raises(CheckpointError, match="more than this machine's .* of memory"):
        load_model(ckpt)
    assert ModelConfig.from_dir(ckpt).parameter_count() == sum(p.numel() for p in
                                                               load_model.__wrapped__(ckpt).parameters()) \
        if hasattr(load_model, "__wrapped__") else True


def test_parameter_count_is_the_models_own():
    from models.checkpoint import init_random

    for fam in ("llada", "dream", "pangu"):
        for tie in (False, True):
            c = ModelConfig.tiny(fam, tie_embeddings=tie)
            assert c.parameter_count() == sum(p.numel() for p in init_random(c).parameters())


def test_tokenizer_json_too_large_is_refused_unread(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    huge(d / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json is too large"):
        Tokenizer(d)



# ---------------------------------------------------------------------- files named on the command line
@pytest.mark.parametrize("kind", ["fifo", "dev zero", "too large"])
@pytest.mark.slow
def test_prompt_file_cost_profile_and_graph_are_checked(ckpt, tmp_path, kind):
    bad = {"fifo": lambda: fifo(tmp_path / "x"), "dev zero": lambda: Path("/dev/zero"),
           "too large": lambda: huge(tmp_path / "x")}[kind]()
    msg = "too large" if kind == "too large" else "not a regular file"
    base = ["--model", ckpt, "--gen-length", "8", "--block-length", "8"]
    cli_error(run(["--prompt-file", bad, *base], timeout=90), "prompt file", msg)
    cli_error(run(["t5", "--method", "psd", "--graph", bad, *base], timeout=90), "draft graph file", msg)
    cli_error(run(["t5", "--method", "psd", "--draft-budget", "auto", "--cost-profile", bad, *base], timeout=90),
              "cost profile", msg)
    cli_error(run(["--model", ckpt, "--policy", "greedy", "--depth", "2", "--nodes", "2", "--prompts", bad,
                   "--out", tmp_path / "g.json"], module="engine.calibrate", timeout=90), "prompts file", msg)


def _profile(tmp_path: Path, **curve) -> Path:
    c = {"cache": "none", "block_length": 8, "prefix": 4, "batch": 1, "rows": [1, 2], "ms": [1.0, 1.5], **curve}
    f = tmp_path / "profile.json"
    f.write_text(json.dumps({"format": "psd-cost-profile/1", "curves": [c]}))
    return f


@pytest.mark.parametrize("curve,msg", [
    ({"ms": ["1", "2"]}, "ms must be a list of positive finite numbers"),
    ({"batch": "xx"}, "batch must be a positive integer"),            # "xx" * rows would repeat a string
    ({"batch": 10 ** 12, "rows": "ab"}, "rows must be a non-empty list"),
    ({"rows": [1, 2, 3]}, "3 rows but 2 ms values"),
    ({"prefix": -1}, "prefix must be a non-negative integer"),
    ({"block_length": True}, "block_length must be a positive integer"),
])
def test_cost_profile_contents_are_checked_when_the_decoder_is_built(ckpt, tmp_path, curve, msg):
    prof = _profile(tmp_path, **curve)
    with pytest.raises(InputError, match=msg):
        read_profile(prof)
    model = load_model(ckpt)
    cfg = DecodeConfig(method="psd", draft_budget="auto", cost_profile=str(prof), gen_length=8, block_length=8)
    with pytest.raises(InputError, match=msg):
        Decoder(model, cfg)                                       # before anything is decoded


def test_a_good_cost_profile_still_reads(tmp_path):
    prof = _profile(tmp_path)
    m = CostModel.from_profile(prof, "none", 8, 4)
    assert m.ms(1) == 1.0 and m.ms(2) == 1.5


def test_cost_profile_with_string_costs_is_one_cli_line(ckpt, tmp_path):
    prof = _profile(tmp_path, ms=["fast", "slow"])
    res = run(["t5", "--method", "psd", "--draft-budget", "auto", "--cost-profile", prof, "--model", ckpt,
               "--gen-length", "8", "--block-length", "8"], timeout=90)
    cli_error(res, "cost profile", "ms must be")


# ---------------------------------------------------------------------- bench data files
def test_task_data_files_are_checked(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        common.read_jsonl(fifo(tmp_path / "d.jsonl"))
    with pytest.raises(ValueError, match="not a regular file"):
        common.read_jsonl("/dev/zero")
    with pytest.raises(ValueError, match="too large"):
        common.read_jsonl(huge(tmp_path / "big.jsonl"))
    with pytest.raises(FileNotFoundError):
        common.read_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="not a regular file"):
        mbpp.load(fifo(tmp_path / "s.json"))


def test_gzip_bomb_is_refused(tmp_path):
    bomb = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as g:
        chunk = b" " * (1 << 24)
        for _ in range(MAX_FILE_BYTES // len(chunk) + 1):
            g.write(chunk)
    assert bomb.stat().st_size < MAX_FILE_BYTES // 100
    with pytest.raises(ValueError, match="decompresses to more than"):
        common.read_jsonl(bomb)


@needs_default
@pytest.mark.parametrize("kind", ["fifo", "dev zero"])
def test_eval_data_fifo_or_device_is_one_error_line(tmp_path, kind):
    bad = fifo(tmp_path / "d.jsonl") if kind == "fifo" else "/dev/zero"
    res = run(["--data", bad, "--out", tmp_path / "r.jsonl"], module="bench.eval", timeout=90)
    cli_error(res, "not a regular file")
    res = run(["--few-shot-data", bad, "--few-shot", "1", "--task", "mbpp", "--gen-length", "64", "--out", tmp_path / "r.jsonl"],
              module="bench.eval", timeout=90)
    cli_error(res, "not a regular file")


# ---------------------------------------------------------------------- bench.eval settings
def _no_weights(monkeypatch):
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))


def _eval(argv, capsys):
    return run_main(ev.main, argv, capsys)


@needs_default
@pytest.mark.parametrize("task", ["math", "code", "mbpp"])
def test_eval_few_shot_beyond_the_window_is_refused_up_front(task, tmp_path, capsys, monkeypatch):
    """--few-shot 100000 used to build 100000 examples and encode every prompt (a hang)."""
    _no_weights(monkeypatch)
    monkeypatch.setattr(ev.get_task(task), "few_shot", lambda *a, **k: pytest.fail("examples built"))
    rc, out, err = _eval(["--task", task, "--few-shot", "100000", "--out", str(tmp_path / "r.jsonl")], capsys)
    one_error_line(rc, err, "--few-shot 100000 cannot fit the model's 256-token window")


@needs_default
def test_eval_few_shot_that_fits_no_problem_suggests_quickly(tmp_path, capsys, monkeypatch):
    _no_weights(monkeypatch)
    rc, out, err = _eval(["--few-shot", "150", "--out", str(tmp_path / "r.jsonl")], capsys)
    one_error_line(rc, err, "150-shot prompts", "use --few-shot ")


@needs_default
def test_eval_few_shot_more_than_the_data_holds(tmp_path, capsys, monkeypatch):
    _no_weights(monkeypatch)
    shots = tmp_path / "shots.jsonl"
    rec = json.loads((ROOT / "bench" / "data" / "mbpp" / "mbpp.jsonl").read_text().splitlines()[0])
    shots.write_text(json.dumps(rec) + "\n")
    rc, out, err = _eval(["--task", "mbpp", "--few-shot", "2", "--gen-length", "64", "--few-shot-data", str(shots),
                          "--out", str(tmp_path / "r.jsonl")], capsys)
    one_error_line(rc, err, "--few-shot 2: the few-shot data holds only 1 examples")


@needs_default
@pytest.mark.parametrize("spec", ["psd:cross_block=1,cache=dual", "psd:cache=prefix,cross_block=1"])
def test_eval_spec_cross_block_with_a_cache_is_the_configs_error(spec, tmp_path, capsys, monkeypatch):
    """A spec's cache clashed with --cache as a keyword argument: a TypeError traceback."""
    _no_weights(monkeypatch)
    rc, out, err = _eval(["--methods", spec, "--out", str(tmp_path / "r.jsonl")], capsys)
    one_error_line(rc, err, "--cross-block needs --cache none")


def test_spec_options_override_the_run_settings():
    cfg = ev.method_config("confidence", {"cache": "dual"}, gen_length=32, block_length=32, cache="none")
    assert cfg.cache == "dual" and cfg.gen_length == 32


@needs_default
@pytest.mark.parametrize("drop,msg", [
    (("target",), "lacks the field 'target'"),
    (("target", "tests"), "lacks the field 'target.tests'"),
    (("target", "entry_point"), "lacks the field 'target.entry_point'"),
    (("prompt",), "lacks the field 'prompt'"),
])
def test_eval_code_rows_are_checked_before_decoding(drop, msg, tmp_path, capsys, monkeypatch):
    """A row without target used to fail with a KeyError only when it was scored, after decoding."""
    _no_weights(monkeypatch)
    rows = code_suite.load(limit=3)
    victim = rows[2]
    for key in drop[:-1]:
        victim = victim[key]
    del victim[drop[-1]]
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out, err = _eval(["--task", "code", "--data", str(data), "--out", str(tmp_path / "r.jsonl")], capsys)
    line = one_error_line(rc, err, msg)
    assert str(data) in line and rows[2]["id"] in line


@needs_default
def test_eval_code_row_with_mistyped_tests_is_refused(tmp_path, capsys, monkeypatch):
    _no_weights(monkeypatch)
    rows = code_suite.load(limit=2)
    rows[1]["target"]["tests"] = "assert f(1) == 2"           # a string: "\n".join would split its characters
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out, err = _eval(["--task", "code", "--data", str(data), "--out", str(tmp_path / "r.jsonl")], capsys)
    one_error_line(rc, err, "'target.tests' must be a non-empty list of strings (with no test any code would "
                            "pass), got a string")


@needs_default
@pytest.mark.parametrize("task", ["code", "mbpp"])
def test_eval_code_row_without_tests_is_refused(task, tmp_path, capsys, monkeypatch):
    """A row with an empty test list scored any code that compiles as solved."""
    _no_weights(monkeypatch)
    if task == "code":
        rows = code_suite.load(limit=2)
        rows[1]["target"]["tests"] = []
    else:                               # MBPP's own rows (test_list), of the test split (task ids 11-510)
        rows = [json.loads(line) for line in (ROOT / "bench" / "data" / "mbpp" / "mbpp.jsonl").read_text().splitlines()]
        rows = [r for r in rows if 11 <= r["task_id"] <= 510][:2]
        rows[1]["test_list"] = []
    data = tmp_path / f"{task}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out, err = _eval(["--task", task, "--data", str(data), "--out", str(tmp_path / "r.jsonl")], capsys)
    one_error_line(rc, err, "'target.tests' must be a non-empty list of strings")


@needs_default
def test_eval_a_prompt_the_decoder_refuses_names_its_problem_before_the_weights_load(tmp_path, capsys, monkeypatch):
    """A question holding the mask token was refused only when its batch decoded (after the others had), as
    'prompt 1 contains the mask token': a position in a batch, not the problem."""
    _no_weights(monkeypatch)
    rows = [json.loads(line) for line in (ROOT / "bench" / "data" / "math_test.jsonl").read_text().splitlines()[:6]]
    rows[4]["prompt"] = rows[4]["prompt"].replace("?", " <|mask|>?", 1) + "<|mask|>"
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out, err = _eval(["--task", "math", "--data", str(data), "--batch-size", "2", "--methods", "greedy",
                          "--out", str(tmp_path / "r.jsonl")], capsys)
    one_error_line(rc, err, f"problem {rows[4]['id']!r}: its prompt contains the mask token (id 1)")


def test_gsm8k_answer_without_its_final_line_names_the_record(tmp_path):
    from bench.tasks import gsm8k
    rows = [{"question": f"q{i}", "answer": f"a #### {i}"} for i in range(4)]
    rows[2]["answer"] = "no final line"
    data = tmp_path / "g.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=re.escape(f"{data}: record 3 (gsm8k-2): GSM8K answer has no '####' line")):
        gsm8k.load(data)


def test_mbpp_test_list_must_be_a_list(tmp_path):
    rec = json.loads((ROOT / "bench" / "data" / "mbpp" / "mbpp.jsonl").read_text().splitlines()[0])
    rec["test_list"] = "assert f() == 1"
    data = tmp_path / "m.jsonl"
    data.write_text(json.dumps(rec) + "\n")
    with pytest.raises(TypeError, match="test_list"):
        mbpp.load(data, split="all")


# ---------------------------------------------------------------------- bench.eval and the sandbox
@needs_default
def test_eval_code_without_namespaces_says_so_before_decoding(tmp_path, capsys, monkeypatch):
    _no_weights(monkeypatch)
    asked = []

    def unavailable(mode=None):
        asked.append(mode)
        raise sandbox.SandboxUnavailable(
            "Linux namespace isolation for generated code is unavailable here (unshare: Operation not permitted); "
            "refusing to run generated code without it. To run it ...")

    monkeypatch.setattr(sandbox, "isolation", unavailable)
    rc, out, err = _eval(["--task", "code", "--limit", "1", "--out", str(tmp_path / "r.jsonl")], capsys)
    line = one_error_line(rc, err, "namespace isolation", "unshare: Operation not permitted", "--unsafe-sandbox")
    assert "refusing" not in line and asked == [None]
    monkeypatch.setattr(sandbox, "isolation", lambda mode=None: pytest.fail("math runs no code"))
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: (_ for _ in ()).throw(InputError("stop here")))
    rc, out, err = _eval(["--task", "math", "--limit", "1", "--out", str(tmp_path / "m.jsonl")], capsys)
    one_error_line(rc, err, "stop here")                   # math never probes the sandbox


@needs_default
def test_eval_unsafe_sandbox_opts_in_to_the_fallback(tmp_path, capsys, monkeypatch):
    asked, batches = [], []

    def isolation(mode=None):              # a machine without Linux namespaces
        asked.append(mode)
        if mode == "namespaces":
            raise sandbox.SandboxUnavailable("no user namespaces here")
        return "fallback"

    monkeypatch.setattr(sandbox, "isolation", isolation)

    def fake_batch(programs, timeout_s=5.0, **kw):
        batches.append(kw)
        return [sandbox.SandboxResult(False, "failed", "") for _ in programs]

    monkeypatch.setattr(sandbox, "run_python_batch", fake_batch)
    good = tmp_path / "code.jsonl"
    rows = code_suite.load(limit=1)
    good.write_text(json.dumps(rows[0]) + "\n")
    rc, out, err = _eval(["--task", "code", "--data", str(good), "--methods", "greedy", "--unsafe-sandbox",
                          "--gen-length", "32", "--block-length", "32", "--quiet",
                          "--out", str(tmp_path / "r.jsonl")], capsys)
    assert rc == 0, err
    assert asked[0] == "namespaces" and set(asked) == {"namespaces", "fallback"}   # the flag never lowers them
    assert all(kw == {"isolation": "fallback"} for kw in batches)     # every scored batch, when code was extracted


def test_code_suites_pass_the_isolation_to_the_sandbox(monkeypatch):
    seen = []
    monkeypatch.setattr(sandbox, "run_python_batch",
                        lambda programs, timeout_s=5.0, **kw: seen.append(kw) or
                        [sandbox.SandboxResult(True, "passed", "") for _ in programs])
    p = code_suite.load(limit=1)[0]
    assert code_suite.score_batch([p["answer"]], [p], isolation="fallback") == [True]
    assert code_suite.score(p["answer"], p) is True
    assert seen == [{"isolation": "fallback"}, {}]


# ---------------------------------------------------------------------- bench.speed
def _speed(argv, capsys):
    return run_main(speed.main, argv, capsys)


def _nothing_measured(monkeypatch):
    monkeypatch.setattr(speed, "build_random", lambda *a, **k: pytest.fail("weights built before the check"))
    monkeypatch.setattr(speed, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))


def test_speed_cost_profile_out_is_checked_before_measuring(tmp_path, capsys, monkeypatch):
    _nothing_measured(monkeypatch)
    base = ["--cost-curve", "--shape", "tiny", "--out", str(tmp_path / "o")]
    rc, out, err = _speed(base + ["--cost-profile-out", str(tmp_path)], capsys)
    one_error_line(rc, err, "--cost-profile-out", "is a directory")
    existing = tmp_path / "p.json"
    existing.write_text("{}")
    rc, out, err = _speed(base + ["--cost-profile-out", str(existing)], capsys)
    one_error_line(rc, err, "exists; pass --overwrite")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, out, err = _speed(base + ["--cost-profile-out", str(blocker / "p.json")], capsys)
    one_error_line(rc, err, "cannot create its directory")
    rc, out, err = _speed(["--shape", "tiny", "--cost-profile-out", str(tmp_path / "q.json")], capsys)
    one_error_line(rc, err, "applies to --cost-curve only")
    assert existing.read_text() == "{}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_speed_cost_profile_out_unwritable(tmp_path, capsys, monkeypatch):
    _nothing_measured(monkeypatch)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        rc, out, err = _speed(["--cost-curve", "--shape", "tiny", "--cost-profile-out", str(ro / "p.json")], capsys)
        one_error_line(rc, err, "not writable")
    finally:
        ro.chmod(0o700)


def test_speed_cost_profile_out_overwrite_replaces(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text("{}")
    rc, out, err = _speed(["--cost-curve", "--shape", "tiny", "--prefix", "8", "--rows", "1", "--block-length", "8",
                           "--cost-reps", "1", "--dtype", "float32", "--threads", "1", "--out", str(tmp_path / "o"),
                           "--cost-profile-out", str(prof), "--overwrite"], capsys)
    assert rc == 0, err
    assert json.loads(prof.read_text())["format"] == speed.PROFILE_FORMAT


@pytest.mark.parametrize("mode,name", [(["--cost-curve"], "cost_profile.json"), (["--cost-curve"], "cost_curve.csv"),
                                       (["--cost-curve"], "cost_curve.md"), ([], "speed.json"), ([], "speed.md"),
                                       (["--simulate", "h100-sxm"], "projection.csv")])
def test_speed_out_files_are_not_overwritten(tmp_path, capsys, monkeypatch, mode, name):
    """A file an earlier run left in --out (the default cost profile included) is replaced only with
    --overwrite: one error line before anything is measured, the file as it was."""
    _nothing_measured(monkeypatch)
    out = tmp_path / "o"
    out.mkdir()
    (out / name).write_text("mine")
    rc, _, err = _speed(mode + ["--shape", "tiny", "--out", str(out)], capsys)
    one_error_line(rc, err, f"--out {out / name} exists; pass --overwrite to replace it")
    assert (out / name).read_text() == "mine" and os.listdir(out) == [name]


def test_speed_cost_curve_out_overwrite_replaces(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "cost_profile.json").write_text("{}")
    argv = ["--cost-curve", "--shape", "tiny", "--prefix", "8", "--rows", "1", "--block-length", "8", "--cost-reps",
            "1", "--dtype", "float32", "--threads", "1", "--quiet", "--out", str(out)]
    rc, _, err = _speed(argv + ["--cost-profile-out", str(tmp_path / "p.json")], capsys)
    assert rc == 0, err                         # the profile goes elsewhere: the one in --out is not this run's
    assert (out / "cost_profile.json").read_text() == "{}"
    rc, _, err = _speed(argv, capsys)
    one_error_line(rc, err, "cost_profile.json exists; pass --overwrite")
    rc, _, err = _speed(argv + ["--overwrite"], capsys)
    assert rc == 0, err
    assert json.loads((out / "cost_profile.json").read_text())["format"] == speed.PROFILE_FORMAT


def test_speed_shape_too_large_for_memory_fails_up_front(tmp_path, capsys, monkeypatch):
    _nothing_measured(monkeypatch)
    monkeypatch.setattr(speed, "available_memory", lambda device="cpu": 8 << 30)
    rc, out, err = _speed(["--shape", "llada-8b", "--out", str(tmp_path / "o")], capsys)
    line = one_error_line(rc, err, "--shape llada-8b needs at least", "more than this machine's 8 GiB")
    assert "bfloat16 weights" in line
    rc, out, err = _speed(["--shape", "llada-8b", "--cost-curve", "--out", str(tmp_path / "o")], capsys)
    one_error_line(rc, err, "--shape llada-8b needs at least")
    assert not (tmp_path / "o").exists()


def test_speed_spec_cache_does_not_clash_with_cache(tmp_path, capsys, monkeypatch):
    _nothing_measured(monkeypatch)
    rc, out, err = _speed(["--methods", "psd:cross_block=1,cache=dual", "--out", str(tmp_path / "o")], capsys)
    one_error_line(rc, err, "--cross-block needs --cache none")


def test_speed_prompts_fifo_is_one_error_line(tmp_path, capsys, monkeypatch):
    _nothing_measured(monkeypatch)
    rc, out, err = _speed(["--prompts", str(fifo(tmp_path / "p.txt")), "--out", str(tmp_path / "o")], capsys)
    one_error_line(rc, err, "prompt file", "not a regular file (a FIFO)")
