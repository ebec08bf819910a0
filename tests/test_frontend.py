"""engine/frontend.py, what every command line shares: `--threads` on engine.generate and every bench
command that computes, the C allocator tuned for repeated model calls, and progress that a log shows
(lines on stderr when it is no terminal)."""
from __future__ import annotations

import importlib
import io
import os
import sys
from pathlib import Path

import pytest

from engine import frontend
from engine.frontend import LogProgress, progress
from support import run_main

# every command that runs torch
THREADED = ["engine.cli", "bench.speed", "bench.eval", "bench.cache_agreement", "bench.arith_probe",
            "bench.fingerprint", "bench.serve_load", "bench.serve_sim", "bench.bench_top1", "bench.bench_draft",
            "bench.bench_sparse_attn", "bench.train", "engine.serve.cli", "bench.gemm_agreement", "bench.peer_answers"]


@pytest.mark.parametrize("module", THREADED)
def test_every_command_takes_threads(module, capsys):
    main = importlib.import_module(module).main
    rc, out, _ = run_main(main, ["--help"], capsys)
    assert rc == 0 and "--threads N" in out
    for bad in ("0", "-2", "two", "100000", str(frontend.THREADS_PER_CPU * frontend.usable_cpus() + 1)):
        rc, out, err = run_main(main, ["--threads", bad], capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: argument --threads"), err


@pytest.mark.parametrize("module", ["engine.cli", "engine.serve.cli"])
def test_help_states_the_defaults_that_apply(module, capsys):
    """README: --help lists every flag with its default. --dtype and --device had none in
    engine.generate, and --gen-length said 128 where the checkpoint's generation_config.json (64 for
    the shipped model) is what decodes."""
    rc, out, _ = run_main(importlib.import_module(module).main, ["--help"], capsys)
    text = " ".join(out.split())
    assert rc == 0 and "(default: float32)" in text and "(default: auto)" in text, text
    assert "(default: the checkpoint's generation_config.json gen_length, else 128)" in text, text


def test_set_threads_sets_torch_and_none_leaves_it(monkeypatch):
    import torch

    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    frontend.set_threads(None)
    frontend.set_threads(3)
    assert seen == [3]


def test_serve_load_hands_threads_to_the_servers_it_starts(monkeypatch, capsys):
    from bench import serve_load

    started = []

    def start(model, flags, log):
        started.append(flags)
        raise KeyboardInterrupt          # stop before any server or request

    monkeypatch.setattr(serve_load, "start_server", start)
    with pytest.raises(KeyboardInterrupt):
        serve_load.main(["--modes", "serial", "--threads", "1"])
    assert started and started[0][started[0].index("--threads") + 1] == "1"


def _lines(buf: io.StringIO) -> list[str]:
    return buf.getvalue().splitlines()


def test_log_progress_first_line_at_once_then_rate_limited_and_the_last(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(frontend.time, "monotonic", lambda: now[0])
    buf = io.StringIO()
    with LogProgress(5, "speed: decodes", every=30, file=buf) as bar:
        assert _lines(buf) == ["speed: decodes: 0/5 (0%) 0 s"]      # a log shows what runs at once
        for step in (10, 10, 15):                  # 10 s, 20 s: too soon; 35 s: a line
            now[0] += step
            bar.update()
        assert _lines(buf)[1:] == ["speed: decodes: 3/5 (60%) 35 s, ~23 s left"]
        now[0] += 1
        bar.update()                               # 1 s after the last line: none
        now[0] += 200
        bar.update()                               # the last item: always a line
    assert _lines(buf) == ["speed: decodes: 0/5 (0%) 0 s", "speed: decodes: 3/5 (60%) 35 s, ~23 s left",
                           "speed: decodes: 5/5 (100%) 3 min 56 s"]


def test_log_progress_every_zero_is_a_line_per_item_and_the_environment_sets_it(monkeypatch):
    buf = io.StringIO()
    bar = LogProgress(3, "x", every=0, file=buf)
    for _ in range(3):
        bar.update()
    assert [line.split(" ")[1] for line in _lines(buf)] == ["0/3", "1/3", "2/3", "3/3"]
    monkeypatch.setenv(frontend.PROGRESS_ENV, "0")
    assert LogProgress(2, "y", file=io.StringIO()).every == 0
    monkeypatch.setenv(frontend.PROGRESS_ENV, "soon")          # not a number: the default, no crash
    assert LogProgress(2, "y", file=io.StringIO()).every == frontend.PROGRESS_SECONDS


def test_log_progress_survives_a_closed_log():
    buf = io.StringIO()
    bar = LogProgress(2, "x", every=0, file=buf)
    buf.close()
    bar.update(2)                                  # the work goes on


def test_progress_is_lines_in_a_log_a_bar_at_a_terminal_and_nothing_when_quiet(monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    with progress(2, "work") as bar:               # capsys: stderr is no terminal
        bar.update(2)
    assert capsys.readouterr().err.splitlines() == ["work: 0/2 (0%) 0 s", "work: 2/2 (100%) 0 s"]
    with progress(2, "work", quiet=True) as bar:
        bar.update(2)
    assert capsys.readouterr().err == ""
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setattr("sys.stderr", Terminal())
    bar = progress(2, "work")
    assert isinstance(bar, tqdm.tqdm)
    bar.close()


RSS_PROBE = """
import os, torch
from engine.frontend import set_threads
set_threads(None)
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page >> 20
keep = [torch.ones(10 << 18) for _ in range(20)]          # 20 blocks of 10 MiB
before = rss()
del keep
print(before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("env, kept", [({}, True), ({"PSD_MALLOC": "default"}, False),
                                       ({"MALLOC_ARENA_MAX": "2"}, False)])
def test_the_commands_keep_freed_tensor_memory_for_the_next_call(env, kept):
    """engine.frontend.tune_allocator (every command's set_threads): 200 MiB of freed activations stay
    in the process for the next model call instead of being unmapped and faulted in again; not with
    PSD_MALLOC=default or when the environment tunes malloc itself."""
    import subprocess

    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "PSD_MALLOC"}
    out = subprocess.run([sys.executable, "-c", RSS_PROBE], env={**base, **env}, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, check=True).stdout
    returned = int(out.split()[-1])
    assert returned < 50 if kept else returned > 150, out


# ---------------------------------------------------------------------- a checkpoint's suggestions
def test_every_front_end_takes_the_checkpoints_suggestions_alike(tmp_path, capsys):
    """generation_config.json's sizes apply where an option is not given, by one function
    (`frontend.with_suggestions`) in engine.generate, engine.calibrate, engine.serve and the text
    API. A None is no value there, as DecodeConfig reads it: the text API's `gen_length=None` took
    the engine's default 128 (dict.setdefault kept the None) where engine.generate takes the
    checkpoint's 16; a value given wins, whatever it is."""
    import json

    import engine
    from engine.cli import main as generate_main
    from engine.serve.cli import build_parser as serve_parser
    from engine.serve.server import Server
    from models.random_checkpoint import make_checkpoint

    path, _ = make_checkpoint(tmp_path / "m", "llada", seed=1)
    (path / "generation_config.json").write_text(json.dumps({"gen_length": 16, "block_length": 8}))
    lm = engine.load(path, device="cpu")
    sizes = lambda dc: (dc.gen_length, dc.block_length)      # noqa: E731
    assert sizes(lm.decode_config()) == sizes(lm.decode_config(gen_length=None, block_length=None)) == (16, 8)
    assert sizes(lm.decode_config(gen_length=24, block_length=4)) == (24, 4)
    rc, out, err = run_main(generate_main, ["t5 t6 t7", "--model", str(path), "--json", "--threads", "1"], capsys)
    assert rc == 0, err
    assert json.loads(out)["token_ids"] == lm.results("t5 t6 t7", gen_length=None)[0].token_ids
    server = Server(serve_parser().parse_args(["--model", str(path), "--block-length", "16"]))
    assert (server.defaults["gen_length"], server.defaults["block_length"]) == (16, 16)
    assert frontend.with_suggestions({"gen_length": None, "block_length": 32, "seed": None},
                                     {"gen_length": 16, "block_length": 8}) == {"block_length": 32, "gen_length": 16}
