"""Tests for bench.sandbox: verdicts, limits, clean-up, and that the harness
survives hostile-looking programs."""

import os
import re
import time
from pathlib import Path

import pytest

from bench.sandbox import SandboxResult, run_python, run_python_batch


def test_passing_code_passes():
    r = run_python("def f(x):\n    return x + 1\nassert f(1) == 2\n")
    assert isinstance(r, SandboxResult)
    assert r.ok and r.status == "passed" and r.stderr_tail == ""


def test_failing_assert_fails_with_traceback():
    r = run_python("def f(x):\n    return x\nassert f(1) == 2, 'wrong answer'\n")
    assert not r.ok and r.status == "failed"
    assert "AssertionError: wrong answer" in r.stderr_tail
    assert "worker.py" not in r.stderr_tail  # the harness frame is hidden


@pytest.mark.parametrize("code", ["def f(:\n", "x = undefined_name\n", "1 / 0\n", "a\x00b\n"])
def test_errors_are_failures(code):
    r = run_python(code)
    assert not r.ok and r.status == "failed"


def test_infinite_loop_times_out_quickly():
    t = time.monotonic()
    r = run_python("while True:\n    pass\n", timeout_s=1.0)
    assert not r.ok and r.status == "timeout"
    assert time.monotonic() - t < 4.0


def test_loop_that_swallows_the_timer_is_still_killed():
    code = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"
    t = time.monotonic()
    r = run_python(code, timeout_s=0.5)
    assert not r.ok and r.status == "timeout"
    assert time.monotonic() - t < 4.0


def test_sleep_times_out():
    r = run_python("import time\ntime.sleep(60)\n", timeout_s=0.5)
    assert r.status == "timeout"


@pytest.mark.parametrize("code", [
    "x = []\nwhile True:\n    x.append(' ' * 10**7)\n",   # gradual memory bomb
    "x = [0] * 10**10\n",                                  # one huge allocation
    "x = bytearray(8 * 1024**3)\n",
])
def test_memory_bomb_is_a_failure(code):
    r = run_python(code, memory_mb=256)
    assert not r.ok and r.status == "crashed"
    assert "MemoryError" in r.stderr_tail


def test_os_exit_is_a_failure():
    r = run_python("import os\nos._exit(3)\n")
    assert not r.ok and r.status == "crashed"
    assert "status 3" in r.stderr_tail


def test_exit_before_the_asserts_is_not_a_pass():
    r = run_python("import sys\nsys.exit(0)\nassert False\n")
    assert not r.ok and r.status == "crashed"


def test_segfault_is_a_failure():
    r = run_python("import ctypes\nctypes.string_at(0)\n")
    assert not r.ok and r.status == "crashed"


def test_file_size_limit():
    r = run_python("with open('big.bin', 'wb') as f:\n    f.write(b'x' * (64 * 1024 * 1024))\n")
    assert not r.ok


def test_no_inherited_environment(monkeypatch):
    monkeypatch.setenv("PSD_FAKE_SECRET_TOKEN", "hunter2")
    r = run_python("import os\nassert 'PSD_FAKE_SECRET_TOKEN' not in os.environ, dict(os.environ)\n"
                   "assert not any('hunter2' in v for v in os.environ.values())\n")
    assert r.ok, r.stderr_tail


def test_runs_isolated_in_a_temporary_directory_that_is_deleted():
    r = run_python("import os, sys\nopen('scratch.txt', 'w').write('x')\n"
                   "assert 'scratch.txt' in os.listdir('.')\n"
                   "assert sys.flags.isolated and sys.flags.no_site\n"
                   "raise RuntimeError('CWD=' + os.getcwd() + '=')\n")
    assert r.status == "failed"
    cwd = re.search(r"CWD=(.*?)=", r.stderr_tail).group(1)
    assert cwd != os.getcwd()
    assert not Path(cwd).exists()


def test_destructive_os_functions_are_disabled():
    r = run_python("import os\nos.system('true')\n")
    assert r.status == "failed" and "NoneType" in r.stderr_tail


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
        return "Z" in state  # a zombie waiting for its reaper is gone too
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return True


def test_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = ("import subprocess\n"
            "p = subprocess.Popen(['sleep', '60'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            "while True:\n    pass\n")
    r = run_python(code, timeout_s=1.0)
    assert r.status == "timeout"
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 2.0
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


def test_batch_matches_individual_runs_and_survives_everything():
    programs = [
        "assert 1 + 1 == 2\n",
        "assert 1 + 1 == 3\n",
        "while True:\n    pass\n",
        "x = [0] * 10**10\n",
        "import os\nos._exit(3)\n",
        "import sys\nsys.exit(0)\n",
        "def f(:\n",
        "import ctypes\nctypes.string_at(0)\n",
        "x = 5\nassert x == 5\n",
        "assert 'x' not in globals()\n",  # fresh namespace per program
    ]
    batch = run_python_batch(programs, timeout_s=0.5)
    single = [run_python(p, timeout_s=0.5) for p in programs]
    assert [r.status for r in batch] == [r.status for r in single]
    assert [r.status for r in batch] == ["passed", "failed", "timeout", "crashed", "crashed",
                                         "crashed", "failed", "crashed", "passed", "passed"]
    # the harness is still fine afterwards
    assert run_python("assert True\n").ok
    assert run_python_batch([]) == []


def test_batch_is_fast_for_many_programs():
    t = time.monotonic()
    res = run_python_batch([f"assert {i} * 2 == {2 * i}\n" for i in range(200)])
    assert all(r.ok for r in res)
    assert time.monotonic() - t < 5.0
