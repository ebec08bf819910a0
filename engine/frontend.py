"""What every command-line front end shares (engine.generate, engine.calibrate, engine.serve, bench.eval,
bench.speed, bench.lm_eval): the parser with one-line errors, one flag per decoding option of the
table, the device and model-directory defaults, `--threads`, the error guard, progress that a log
shows too, and plugins: modules that register their own policies and methods (`engine.register`)
before any parser is built, so that their methods and flags appear everywhere (`--plugin
MODULE_OR_FILE`, `$PSD_PLUGINS`, or the `psd_engine.plugins` entry-point group of an installed package).
"""
from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

from models import DTYPES, GEMMS, CheckpointError, check_gemm
from models._torch import loud_interrupts
from models.config import SUGGESTED

from .errors import DecodingError, InputError
from .graph import DraftGraph
from .methods import METHODS, methods_taking, policy_methods
from .options import OPTIONS, POLICY_NAMES, join

PLUGIN_ENV = "PSD_PLUGINS"                  # comma-separated modules or .py files
PLUGIN_GROUP = "psd_engine.plugins"         # entry points of installed packages
PLUGIN_REPLACES = "REPLACES"                # a plugin's names of the methods/options it replaces on purpose
_LOADED: dict[str, object] = {}


DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "default"
DTYPE_CHOICES = [d for d in DTYPES if d != "float16"]      # the kernels' parity dtypes and bf16


class Parser(argparse.ArgumentParser):
    """One-line errors; no abbreviated flags (`--prompt` must not silently mean `--prompt-file`); run
    as a console script (psd-generate, psd-eval, psd-serve: setup.py), the usage names that script."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        if script.startswith("psd-"):      # not the `python -m ...` a front end names as its prog
            kwargs["prog"] = script
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, exit 2 (argparse would print the whole usage first)
        self.exit(2, f"error: {message} (see --help)\n")

    def add_argument(self, *args, **kwargs):
        try:
            return super().add_argument(*args, **kwargs)
        except argparse.ArgumentError as e:      # a plugin's option named like one of this command's flags
            taken = "/".join(a for a in args if a.startswith("-"))
            self.exit(2, f"error: {self.prog} cannot take the flag {taken} twice: a plugin's option and this "
                         f"command's own flag share the name ({e.message}); rename the plugin's option\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        hint = hub_id_hint(getattr(ns, "model", None))     # every front end's --model, before any file is read
        if hint is not None:
            self.exit(2, f"error: {hint}\n")
        return ns, rest


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def hub_id_hint(value, flag: str = "--model") -> str | None:
    """The one-line hint for a model path that is no local path but looks like a Hugging Face hub
    id (`owner/name`, neither existing here nor `owner` a local directory); None otherwise."""
    if not isinstance(value, str) or not _HUB_ID.fullmatch(value) or os.path.lexists(value) \
            or os.path.isdir(value.split("/")[0]) or value.startswith("."):
        return None
    return (f"{flag} {value} is not a local directory; it looks like a Hugging Face hub id — this engine "
            f"loads weights from local paths only: download it first (e.g. huggingface-cli download {value} "
            f"--local-dir DIR) and pass {flag} DIR")


def thread_count(text: str) -> int:
    """argparse type of `--threads`: an integer >= 1 (the parser's own one-line error otherwise)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


THREADS_PER_CPU = 4         # --threads above this many per usable CPU only slows a run (and 100000 crashes OpenMP)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_value(text: str) -> int:
    """argparse type of a `--threads` flag: an integer from 1 to THREADS_PER_CPU per usable CPU."""
    n = thread_count(text)
    most = THREADS_PER_CPU * usable_cpus()
    if n > most:
        raise argparse.ArgumentTypeError(f"must be at most {most} ({THREADS_PER_CPU} per CPU this process may "
                                         f"run on, {usable_cpus()}), got {n}")
    return n


THREADS_HELP = ("torch CPU threads (default: torch's, one per core, as engine.serve; on a busy or shared CPU "
                "fewer, often 1, can be many times faster)")


def add_threads_flag(p: argparse.ArgumentParser, help: str = THREADS_HELP) -> None:
    p.add_argument("--threads", type=threads_value, metavar="N", help=help)


GEMM_HELP = ("how the model's dense projections multiply: torch (F.linear; MKL on a CPU, the default) or onednn "
             "(oneDNN's matmul over the same weights; CPU, float32 or bfloat16; faster on this project's CPUs, but it "
             "rounds differently, so where two tokens nearly tie a result may differ: docs/results.md, oneDNN matmuls)")


def add_gemm_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gemm", default="torch", choices=list(GEMMS), help=GEMM_HELP)


def checked_gemm(kind: str, device, dtype: str, tensor_parallel: bool = False) -> str:
    """`kind` if a model on `device` with `dtype` weights can run it (checked before loading), else
    InputError naming the problem."""
    try:
        check_gemm(kind, device, DTYPES[dtype], tensor_parallel)
    except ValueError as e:
        raise InputError(str(e)) from None
    return kind


# glibc's mallopt parameters (malloc.h); the heap keeps freed memory below these
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20        # glibc's largest: blocks above it are mmapped (and unmapped when freed)
TRIM_THRESHOLD = 1 << 30         # free memory at the heap's top returned to the system only above this
MALLOC_ENV = "PSD_MALLOC"        # "default": leave the C allocator as the process found it


def tune_allocator() -> bool:
    """Keep freed tensor memory in this process's heap for the next model call (Linux, glibc).

    With glibc's defaults a CPU decode returns the activations' memory to the system after each
    call (its heap top is trimmed, blocks over the dynamic mmap threshold are unmapped) and faults
    it back in on the next: on the shipped model, PSD at batch 1 without a cache decoded 11-12% fewer
    tokens/s that way (docs/results.md, "The C allocator"). This fixes the mmap threshold at 32 MiB and the
    trim threshold at 1 GiB, so a process holds up to that much freed memory for reuse. Not done
    when PSD_MALLOC=default, when the environment already sets a MALLOC_*_ variable (the user's own
    tuning) or off glibc; True if the thresholds were set. Numerics are untouched."""
    if os.environ.get(MALLOC_ENV) == "default" or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):             # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def set_threads(n: int | None) -> None:
    """torch's intra-op threads for this process (None: torch's default, left alone), and the C
    allocator tuned for repeated model calls (`tune_allocator`)."""
    tune_allocator()
    if n is not None:
        import torch

        torch.set_num_threads(n)


PROGRESS_ENV = "PSD_PROGRESS_SECONDS"     # seconds between progress lines in a log (0: one per item)
PROGRESS_SECONDS = 30.0


class _NoProgress:
    """Progress that shows nothing (`--quiet`); the calls every progress takes (update, close, `with`)."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LogProgress(_NoProgress):
    """Progress for a log (stderr is no terminal): one line per report, `desc: n/total (p%) ...`,
    the first at once, then at most one every `every` seconds, and the last when the work is done.
    It takes the calls of the tqdm bar shown at a terminal (update, close, `with`)."""

    def __init__(self, total: int, desc: str, every: float | None = None, file=None):
        if every is None:
            try:
                every = float(os.environ.get(PROGRESS_ENV, PROGRESS_SECONDS))
            except ValueError:
                every = PROGRESS_SECONDS
        self.total, self.desc, self.every, self.n = total, desc, every, 0
        self.file = file if file is not None else sys.stderr
        self.start = self.last = time.monotonic()
        self._line(self.start)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every or self.n >= self.total:
            self._line(now)

    def _line(self, now: float) -> None:
        self.last = now
        spent = now - self.start
        done = f"{self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%)"
        left = (f", ~{_duration(spent * (self.total - self.n) / self.n)} left"
                if 0 < self.n < self.total and spent > 0 else "")
        try:
            print(f"{self.desc}: {done} {_duration(spent)}{left}", file=self.file, flush=True)
        except (OSError, ValueError):       # a closed or full log never stops the work
            pass



def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60:02d} s"




def progress(total: int, desc: str, quiet: bool = False):
    """How a long command shows its progress on stderr: a tqdm bar at a terminal, `LogProgress`
    lines when stderr is a file or a pipe (a log: a bar would be invisible or garbage there), nothing
    with `quiet`. Use as `with progress(n, "what") as bar: ... bar.update()`."""
    if quiet:
        return _NoProgress()
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, file=sys.stderr)
        except ImportError:
            pass
    return LogProgress(total, desc)


def _option_help(o) -> str:
    """An option's help: what it is, which methods take it, its default (a policy's own where
    the policy holds it): all read from the option and method tables."""
    if o.general:
        default = "" if o.default is None else f" (default: {o.default})"
        if o.name in SUGGESTED:                  # what generation_config.json suggests comes first
            default = f" (default: the checkpoint's generation_config.json {o.name}, else {o.default})"
        return o.help + default
    takers = methods_taking(o.name)
    per_policy = [f"{m} {METHODS[m].policy.defaults()[o.name]}" for m in policy_methods()
                  if o.name in METHODS[m].policy.defaults()]
    default = f"; default: {', '.join(per_policy)}" if per_policy else "" if o.default is None else f"; default: {o.default}"
    return f"{o.help} ({join(takers)}{default})"


class DefaultsFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says it (or there is none)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower() or not action.option_strings:
            return text
        return text + (" " if text else "") + "(default: %(default)s)"


def add_decoding_flags(p: argparse.ArgumentParser, names=None) -> None:
    """One flag per decoding option of engine/options.py (all, or `names`); every default is None
    so that only what the user gave reaches DecodeConfig (options that do not apply are errors)."""
    for o in OPTIONS.values():
        if names is not None and o.name not in names:
            continue
        choices = o.allowed() or None
        if o.kind is bool:                 # a switch: given = True
            p.add_argument(o.flag, dest=o.name, default=None, action="store_const", const=True, help=_option_help(o))
            continue
        p.add_argument(o.flag, dest=o.name, default=None, choices=choices, help=_option_help(o),
                       type=str if o.kind is DraftGraph else o.kind,
                       metavar="PATH" if o.kind is DraftGraph else o.metavar)


def decoding_options(args: argparse.Namespace, names=None, suggested: dict | None = None) -> dict:
    """The decoding options the user gave on the command line (all, or those of `names`), parsed (a
    graph path is loaded); with `suggested` (a checkpoint's generation_config.json), its value where
    no flag gives one (`with_suggestions`)."""
    given = with_suggestions({o.name: getattr(args, o.name, None) for o in OPTIONS.values()}, suggested)
    return {o.name: o.parse(given[o.name]) if o.kind is DraftGraph else given[o.name] for o in OPTIONS.values()
            if o.name in given and (names is None or o.name in names)}


def with_suggestions(options: dict, suggested: dict | None) -> dict:
    """`options` (decoding options by name; None: not given, as `DecodeConfig` reads it) without the
    ones not given, and the checkpoint's suggestion (`suggested`: its generation_config.json sizes,
    `ModelConfig.generation_defaults`) for each option not given. The one way every front end
    (engine.generate, engine.calibrate, engine.serve, the text API) applies a checkpoint's
    suggestions: a value given always wins, whatever it is; a None is no value."""
    out = {name: value for name, value in options.items() if value is not None}
    for name, value in (suggested or {}).items():
        if name not in out and value is not None:
            out[name] = value
    return out


def suggested_config(build, given: dict, suggested: dict | None, model_dir):
    """`build(options)` (a validated DecodeConfig) of the options `given` with the checkpoint's
    `suggested` sizes where no flag gives one (`with_suggestions`). Its InputError, where the
    suggestions are what fails (without them it builds, or fails otherwise), names them and
    generation_config.json: the user gave no flag to fix."""
    try:
        return build(with_suggestions(given, suggested))
    except InputError as e:
        taken = {k: v for k, v in (suggested or {}).items() if given.get(k) is None}
        if not taken or _same_error(build, given, e):
            raise
        names = " and ".join(f"{OPTIONS[k].flag} {v}" for k, v in taken.items())
        raise InputError(f"{e} ({names} from {Path(model_dir) / 'generation_config.json'}, the checkpoint's "
                         f"suggestion: give the flag to override)") from None


def _same_error(build, given: dict, error: InputError) -> bool:
    """Whether `build` of the options `given` alone (no suggestions) fails with `error`'s message."""
    try:
        build(with_suggestions(given, None))
    except InputError as plain:
        return str(plain) == str(error)
    return False


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)    # a write the disk cannot take


def guarded(run, *args, errors: tuple = (), interrupted=None) -> int:
    """Run a command's body: bad input (InputError, CheckpointError and `errors`) becomes one
    `error:` line on stderr and exit status 2; Ctrl-C one `interrupted` line (with what
    `interrupted()` says is left, if given) and exit status 130."""
    loud_interrupts()                   # Ctrl-C is KeyboardInterrupt again (quiet while loading: models/_torch.py)
    try:
        rc = run(*args)
        if sys.stdout is not None:
            sys.stdout.flush()          # a write that fails (a full disk) fails here, not at exit
        return rc
    except (InputError, CheckpointError, DecodingError) + errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        left = interrupted() if interrupted is not None else None
        print("interrupted" + (f": {left}" if left else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:             # the reader went away (`| head`): no traceback, no more output
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        if e.errno not in _FULL:
            raise
        print(f"error: cannot write {e.filename or 'the output'}: {e.strerror}", file=sys.stderr)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())     # the rest of the buffer goes nowhere
        return 1


def add_plugin_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", metavar="MODULE", default=[],
                   help=f"import a module (or a .py file) that registers policies/methods before the flags are "
                        f"read; repeatable (also ${PLUGIN_ENV}, comma-separated, and installed "
                        f"'{PLUGIN_GROUP}' entry points)")


def _plugin_names(argv) -> list[str]:
    names = [n.strip() for n in os.environ.get(PLUGIN_ENV, "").split(",") if n.strip()]
    it = iter(argv)
    for a in it:
        if a == "--plugin":
            names.append(next(it, ""))
        elif a.startswith("--plugin="):
            names.append(a.split("=", 1)[1])
    return names


def _import(name: str):
    """A plugin's module: a .py file, a module name, or an entry point's `module:attr` (the module is
    imported, which registers; the attribute must exist)."""
    if not name:
        raise InputError("--plugin needs a module name or a .py file")
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise InputError(f"plugin file {name} not found")
        spec = importlib.util.spec_from_file_location(f"psd_plugin_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    module_name, _, attr = (part.strip() for part in name.partition(":"))
    if not module_name or module_name.startswith(".") or "/" in module_name or os.sep in module_name:
        raise InputError(f"plugin {name!r} is neither a module name (my_policies) nor a .py file (./my_policies.py)")
    module = obj = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part, _NONE)
        if obj is _NONE:
            raise InputError(f"plugin {name!r}: the module {module_name} has no {attr}")
    return module


_NONE = object()


def _plugin_key(name: str) -> str:
    """One plugin given twice (`./p.py` and `/abs/p.py`) is loaded once: a file by its real path."""
    return str(Path(name).resolve()) if name.endswith(".py") else name


def plugins_loaded(argv) -> bool:
    """Load the plugins `argv` names (see load_plugins) before a front end builds its parser; False
    after one `error:` line (the front end then exits with status 2)."""
    return guarded(lambda: (load_plugins(argv), 0)[1]) == 0


def load_plugins(argv=None) -> list[str]:
    """Import every plugin named in `argv` (`--plugin`), in $PSD_PLUGINS and by installed entry points,
    once each; a plugin that cannot be imported, calls sys.exit, or replaces a method or option that
    was registered before it (without naming it in REPLACES) is one InputError naming it and why."""
    argv = sys.argv[1:] if argv is None else argv
    names = _plugin_names(argv)
    try:
        from importlib.metadata import entry_points

        names += [ep.value for ep in entry_points(group=PLUGIN_GROUP)]
    except Exception:                                    # no metadata: no installed plugins
        pass
    for name in names:
        if _plugin_key(name) in _LOADED:
            continue
        before = dict(METHODS), dict(OPTIONS), list(POLICY_NAMES)
        try:
            module = _import(name)
            _check_replaced(name, module, before)
        except BaseException as e:
            METHODS.clear(), METHODS.update(before[0])   # a refused plugin leaves the tables as they were
            OPTIONS.clear(), OPTIONS.update(before[1])
            POLICY_NAMES[:] = before[2]
            if isinstance(e, InputError):
                raise
            if isinstance(e, SystemExit):                # exit 0 with no output would look like success
                raise InputError(f"cannot load plugin {name!r}: it called sys.exit({e.code!r}) while being "
                                 f"imported") from None
            if not isinstance(e, Exception):             # KeyboardInterrupt
                raise
            raise InputError(f"cannot load plugin {name!r}: {type(e).__name__}: {e}") from None
        _LOADED[_plugin_key(name)] = module
    return names


def _check_replaced(name: str, module, before) -> None:
    """A plugin adds methods and options; one that replaces or removes one already registered (a
    built-in's meaning would change under every front end) must name it in its REPLACES."""
    asked = set(getattr(module, PLUGIN_REPLACES, ()) or ())
    for kind, table, old in (("method", METHODS, before[0]), ("option", OPTIONS, before[1])):
        changed = [key for key, value in old.items() if table.get(key) is not value and key not in asked]
        if changed:
            raise InputError(f"plugin {name!r} replaces the {kind} {changed[0]!r}, which was already registered; "
                             f"a plugin that means to must say so: {PLUGIN_REPLACES} = ({changed[0]!r},)")


def resolve_device(name: str) -> str:
    """A torch device string from cpu, cuda, cuda:N or auto (CUDA when present); bad names are InputErrors."""
    from models.checkpoint import checked_device

    return str(checked_device(name, InputError))
