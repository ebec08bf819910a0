"""Every command and code block of the README runs as written (CPU, the shipped model), so the
README cannot drift from the code. Fenced `bash` blocks are commands and `python` blocks are
programs; `text` blocks are usage synopses with placeholders and are not run. Blocks that talk
to http://127.0.0.1:8000 run against the server the README starts, as the README starts it.
A few lines cannot run inside the test suite; each is listed in SKIP with the reason."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
SERVER = "127.0.0.1:8000"

# line prefix -> why it is not run here
SKIP = {
    "python -m pytest": "the test suite itself (this test is part of it)",
    "pip install": "installation; bash install.sh (CI) installs the same extras",
    "bash bench/gpu_report.sh": "needs a GPU; its --dry mode runs in tests/test_speed.py",
}
INSTALL = "bash install.sh && "     # CI has installed already; the rest of the line is run


def _blocks() -> list[tuple[str, str]]:
    return re.findall(r"```(bash|python)\n(.*?)```", README, re.S)


def _script(block: str) -> str:
    """The block as a bash script: the install prefix dropped, skipped lines removed."""
    lines = []
    for line in block.splitlines():
        if line.startswith(INSTALL):
            line = line[len(INSTALL):]
        if not any(line.startswith(p) for p in SKIP):
            lines.append(line)
    return "\n".join(lines)


def _starts_server(block: str) -> bool:
    return "python -m engine.serve" in block


LOCAL = [(lang, b) for lang, b in _blocks() if SERVER not in b and not _starts_server(b)]
REMOTE = [(lang, b) for lang, b in _blocks() if SERVER in b]


def _run(lang: str, block: str, tmp_path) -> subprocess.CompletedProcess:
    argv = ["bash", "-e", "-c", _script(block)] if lang == "bash" else [sys.executable, "-c", block]
    return subprocess.run(argv, cwd=ROOT, env={**ENV, "TMPDIR": str(tmp_path)}, capture_output=True, text=True,
                          timeout=900)


def test_readme_has_the_two_commands():
    cmds = [l for _, b in _blocks() for l in b.splitlines()]
    assert "bash install.sh && python -m engine.generate" in cmds and "bash install.sh && python -m pytest" in cmds


@pytest.mark.parametrize("lang,block", LOCAL, ids=[b.strip().splitlines()[0][:50] for _, b in LOCAL])
def test_block_runs_as_written(lang, block, tmp_path):
    if not _script(block).strip():
        pytest.skip("only skipped lines: " + "; ".join(SKIP[p] for p in SKIP if p in block))
    res = _run(lang, block, tmp_path)
    assert res.returncode == 0, f"{block}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr


def _port_free() -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", 8000)) != 0


@pytest.mark.skipif(not REMOTE, reason="the README shows no server example")
def test_server_examples_run_as_written(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    if not _port_free():
        pytest.skip("port 8000, which the README's server uses, is taken on this machine")
    start = next(_script(b) for _, b in _blocks() if _starts_server(b))
    server = subprocess.Popen(["bash", "-c", "exec " + start.strip()], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                if urllib.request.urlopen(f"http://{SERVER}/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "the server did not become healthy"
            time.sleep(1)
        for lang, block in REMOTE:
            res = _run(lang, block, tmp_path)
            assert res.returncode == 0 and res.stdout.strip(), f"{block}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


# ---------------------------------------------------------------------- the tree and the API table
def _section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_layout_names_every_module_and_only_real_files():
    tree = _section("Layout")
    named = set(re.findall(r"([\w./-]+\.(?:py|sh|md))\b", tree))
    for pkg in ("engine", "engine/serve", "models", "psd_kernels", "psd_kernels/ops", "bench", "bench/tasks"):
        for f in sorted((ROOT / pkg).glob("*.py")):
            if f.name in ("__init__.py", "__main__.py", "_common.py", "_compile_check.py"):
                continue
            if pkg in ("bench/tasks",) and "tasks/" in tree:      # the suites are named as a folder
                continue
            assert f.name in named or f"{Path(pkg).name}/{f.name}" in named, f"{pkg}/{f.name} is not in the README's tree"
    for name in named:
        hits = [p for p in ROOT.rglob(Path(name).name) if ".git" not in p.parts and "runs" not in p.parts]
        assert hits, f"the README's tree names {name}, which does not exist"


def test_api_tables_name_what_exists():
    import importlib

    text = _section("Low-level API")
    paths = set(re.findall(r"`((?:psd_kernels|models|engine)(?:\.\w+)+)", text))
    paths |= {"psd_kernels." + p for p in re.findall(r"`((?:ops|reference)(?:\.\w+)*)", text)}
    assert len(paths) >= 15, paths
    for path in sorted(paths):
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"the README's API table names {path}, which does not exist"
                obj = getattr(obj, attr)
            break
        else:
            raise AssertionError(f"the README's API table names {path}, which does not import")
