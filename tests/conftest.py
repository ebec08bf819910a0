"""Shared pytest setup.

Without CUDA the Triton kernels run under Triton's interpreter, which triton.jit selects when
the kernel modules are imported; the variable must therefore be set before anything imports
triton, i.e. here, at conftest import. With CUDA nothing is forced: the same tests run compiled.
The ``gpu`` marker tags tests that need CUDA; they are skipped without it; ``slow`` tags the tests
that ``python -m pytest -m "not slow"`` leaves out (README: what the suite costs).

Every test process and every process a test starts runs torch on one intra-op thread (OMP_NUM_THREADS,
read when torch loads; PSD_TEST_THREADS=N for another count): the tests' models are tiny, and on a
busy CPU threads that wait for each other made the suite many times slower (on a loaded 2-core
machine `tests/test_contracts.py -k "confidence and not localleap"` took 601 s with torch's 2 threads
and 60 s with 1).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

THREADS = int(os.environ.get("PSD_TEST_THREADS") or 1)
os.environ["OMP_NUM_THREADS"] = str(THREADS)      # before torch loads, here and in every child
# measured call costs (--draft-budget auto) are not kept between tests or runs: each test measures its
# own (tests/test_budget.py turns the store on in a temporary directory)
os.environ.setdefault("PSD_COST_CACHE", "off")
# nor tokenizers converted from a SentencePiece model (tests/test_sentencepiece.py turns that store on)
os.environ.setdefault("PSD_TOKENIZER_CACHE", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(THREADS)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("PSD_TEST_PLAIN_INTERPRETER") != "1":
    # the interpreter without its repeated language patching (tests/triton_interpreter.py): the same kernels in
    # 0.6-0.7x the time (the kernel test files: 155 against 220 CPU-s); PSD_TEST_PLAIN_INTERPRETER=1: triton's own
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import triton_interpreter  # noqa: E402

    triton_interpreter.install()

HAS_CUDA = torch.cuda.is_available()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sandbox_opt_in() -> str:
    """Where namespace isolation for generated code is unavailable, the suite opts in to the sandbox's
    reduced level explicitly (PSD_SANDBOX=fallback, as a user would with --unsafe-sandbox): the code it
    scores comes from its own tiny models and fixtures. The refusal without the opt-in is tested in
    tests/test_sandbox.py. Returns the reason, or "" where namespaces work."""
    if os.environ.get("PSD_SANDBOX"):
        return ""
    sys.path.insert(0, REPO)
    import bench.sandbox as sandbox

    try:
        sandbox.isolation_details("namespaces")
        return ""
    except sandbox.SandboxUnavailable as e:
        os.environ["PSD_SANDBOX"] = "fallback"
        return str(e).split(";")[0]


SANDBOX_NOTE = ""


def pytest_configure(config):
    global SANDBOX_NOTE
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    SANDBOX_NOTE = _sandbox_opt_in()
    _load_plugins()


def _load_plugins() -> None:
    """$PSD_PLUGINS (and installed `psd_engine.plugins` entry points) register their policies and
    methods before collection, so tests/test_contracts.py, parametrized over the method table, runs
    every contract for them too (engine/testing). A plugin that cannot load stops the run in one line."""
    if not os.environ.get("PSD_PLUGINS"):
        return
    sys.path.insert(0, REPO)
    from engine.errors import InputError
    from engine.frontend import load_plugins

    try:
        load_plugins([])
    except InputError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_report_header(config):
    if SANDBOX_NOTE:
        return f"sandbox: {SANDBOX_NOTE}; generated code in tests runs at the opted-in fallback level"
    return "sandbox: namespace isolation"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """A test that changes torch's thread count (a command's main() run in the test process) would
    leave every later test of its worker on that many threads: one did (bench.train's default of 2),
    and a 30 s test after it took 170 s on the busy 2-core machine. The count is put back after each
    test, and the test that changed it fails, naming the change."""
    before = torch.get_num_threads()
    yield
    n = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(before)
        pytest.fail(f"the test left torch on {n} threads (it started on {before}): restore what it changes")


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: CUDA when present, else CPU for the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def compile_check():
    """Run ``psd_kernels.ops._compile_check`` for one kernel family in a subprocess.

    Lowers every constexpr variant to an sm_90 cubin (Triton ships ptxas), so GPU-only compile
    errors surface on a CPU machine. Skipped with a GPU, where the compiled tests cover this.
    """

    def run(family: str) -> None:
        if HAS_CUDA or importlib.util.find_spec("triton") is None:
            pytest.skip("needs triton and no GPU (on a GPU the kernel tests run compiled)")
        import triton

        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        if not (os.path.exists(ptxas) or shutil.which("ptxas")):
            pytest.skip("no ptxas to compile with")
        # the subprocess must not inherit the interpreter, which never compiles
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(PYTHONPATH=REPO, TRITON_DEFAULT_FP_FUSION="1")
        cmd = [sys.executable, "-m", "psd_kernels.ops._compile_check", "--quick", "--only", family]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        assert "compiled" in res.stdout

    return run
