"""Every documented command runs as written (CPU, the shipped model), so the README and docs/
cannot drift from the code.

README: fenced `bash` blocks are commands and `python` blocks are programs; `text` blocks are
usage synopses with placeholders and are not run. Blocks that talk to http://127.0.0.1:8000 run
against the server the README starts, as the README starts it.

docs/*.md: every `bash` block runs, from the repository root, with the console scripts of
setup.py on PATH (as pip installs them), unless an HTML comment on the line before it says
`<!-- not run: WHY -->` (a GPU, a real checkpoint, minutes of measurement: the reason is part
of the page) or it starts a server, which runs until stopped (engine.serve, psd-serve,
bench.serve_load). Blocks that are not run are still checked, like every command line of every
page (`$ ` lines of transcripts included): the module of each `python -m X` / `torchrun -m X` /
console script exists and takes its arguments (its own argparse parser parses them, then the
command stops), method specs and lm-eval model_args name real options, and scripts and test
files exist. `...` in a command stands for "more flags" and is not checked. The docs blocks that
run cost about 50 s of CPU (3-4 min wall on the shared 2-core machine at a load average of 11),
the check of every command about 10 s (one process imports every front end).

A few lines cannot run inside the test suite; each is listed in SKIP with the reason."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
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
@pytest.mark.slow
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
@pytest.mark.slow
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


# ---------------------------------------------------------------------- every page's commands
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
FENCE = re.compile(r"\s*```(\w*)\s*$")
SERVERS = {"engine.serve", "bench.serve_load"}      # modules that serve until stopped (or start servers)
PLAIN = {"cd", "cat", "curl", "pip", "echo", "mkdir", "export"}     # shell and installer commands: nothing to check
SCRIPTS = dict(re.findall(r'"(psd-[\w-]+)=([\w.]+:\w+)"', (ROOT / "setup.py").read_text(encoding="utf-8")))
LOOKS_RUN = re.compile(r"(\w+=\S+ )*(python|torchrun|bash|pip|psd-)")


@dataclass(frozen=True)
class Block:
    page: str            # path relative to the repository root
    line: int            # of the opening fence
    lang: str
    text: str
    why: str | None      # the `not run:` reason on the line before the fence


def _page_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.fullmatch(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        why = NOT_RUN.fullmatch(lines[i - 1].strip()) if i else None
        out.append(Block(path.relative_to(ROOT).as_posix(), i + 1, m.group(1), "\n".join(lines[i + 1:j]) + "\n",
                         why.group(1) if why else None))
        i = j + 1
    return out


BLOCKS = [b for page in DOCS for b in _page_blocks(page)]


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block as argv lists: continued lines joined, comments, heredoc
    bodies, redirections and leading VAR=value dropped, split at && || ; | and &; `$'...'` read
    as '...' (its escapes do not matter to a parser)."""
    out, lines = [], text.replace("\\\n", " ").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        heredoc = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
            line = line[:heredoc.start()]
        while True:
            lex = shlex.shlex(line.replace("$'", "'"), posix=True, punctuation_chars=";&|<>")
            lex.whitespace_split = True
            try:
                tokens = list(lex)
                break
            except ValueError:                              # a quoted string goes on on the next line
                assert i < len(lines), f"unclosed quote in {line!r}"
                line, i = line + "\n" + lines[i], i + 1
        argv: list[str] = []
        for tok in [*tokens, ";"]:
            if tok and set(tok) <= set(";&|"):
                while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append(argv)
                argv = []
            elif argv and argv[-1] in (">", ">>", "<"):
                argv.pop()                                  # a redirection and its target
            else:
                argv.append(tok)
    return out


def _commands() -> list[tuple[str, list[str]]]:
    """(page:line, argv) of every command line: bash blocks, and `$ ` lines of other blocks."""
    out = []
    for b in BLOCKS:
        if b.lang == "bash":
            out += [(f"{b.page}:{b.line}", argv) for argv in shell_commands(b.text)]
        else:
            for line in b.text.splitlines():
                if line.startswith("$ "):
                    out += [(f"{b.page}:{b.line}", argv) for argv in shell_commands(line[2:])]
    return out


COMMANDS = _commands()


def _target(argv: list[str]) -> dict | None:
    """What a command runs, for the parse check: {"module" | "entry", args, torchrun options}, or
    None for a command with nothing to parse. An AssertionError for a command this test cannot check."""
    argv = [a for a in argv if a != "..."]
    head = argv[0]
    if head in ("python", "python3") and argv[1:2] == ["-m"]:
        if argv[2] == "pytest":                 # the test suite: its files are checked below
            return None
        return {"module": argv[2], "args": argv[3:]}
    if head == "torchrun":
        assert "-m" in argv, f"torchrun without -m: {argv}"
        m = argv.index("-m")
        return {"module": argv[m + 1], "args": argv[m + 2:], "torchrun": argv[1:m]}
    if head in SCRIPTS:
        return {"entry": SCRIPTS[head], "args": argv[1:]}
    if head == "bash":
        assert (ROOT / argv[1]).is_file(), f"bash {argv[1]}: no such script"
        return None
    assert head in PLAIN, f"{head}: a command tests/test_readme.py does not know how to check"
    return None


CHECKER = r"""
import argparse, contextlib, importlib, importlib.util, io, json, sys

class Parsed(BaseException):
    pass

parse_args = argparse.ArgumentParser.parse_args

def stop_after_parsing(self, args=None, namespace=None):
    raise Parsed(parse_args(self, args, namespace))

argparse.ArgumentParser.parse_args = stop_after_parsing

def main_of(item):
    if "entry" in item:
        module, fn = item["entry"].split(":")
        return getattr(importlib.import_module(module), fn)
    name = item["module"]
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise LookupError(f"no module named {name}")
    if spec.submodule_search_locations is not None:           # a package: python -m runs its __main__
        name += ".__main__"
        if importlib.util.find_spec(name) is None:
            raise LookupError(f"{item['module']} is a package without __main__")
    elif "__main__" not in open(spec.origin, encoding="utf-8").read():
        raise LookupError(f"{name} has no `if __name__ == '__main__'` entry")
    module = importlib.import_module(name)
    if not callable(getattr(module, "main", None)):
        raise LookupError(f"{name} has no main(argv)")
    return module.main

def values(item, ns):
    # what a parser takes as any string but the command checks later: method specs, card names, model_args
    if item.get("module") in ("bench.eval", "bench.speed") or item.get("entry", "").startswith("bench.eval:"):
        from bench.eval import parse_method
        from engine.methods import METHODS
        for spec in getattr(ns, "methods", None) or ():
            name, _ = parse_method(spec)
            if name not in METHODS:
                return f"--methods {spec}: no method {name}"
    if item.get("module") == "bench.speed" and getattr(ns, "simulate", None):
        from bench.simulate import card
        for name in ns.simulate:
            card(name)
    if item.get("module") == "bench.lm_eval" and getattr(ns, "model", None) == "psd":
        from bench.lm_eval import MODEL_ARGS, decode_options
        bad = sorted(set(ns.model_args or {}) - set(MODEL_ARGS) - set(decode_options()) - {"pretrained"})
        if bad:
            return f"--model_args: {', '.join(bad)} is no model_arg of the psd model"
    return ""

results = []
for item in json.load(sys.stdin):
    argv, err = sys.argv[:], io.StringIO()
    try:
        if item.get("torchrun") is not None:
            from torch.distributed.run import get_args_parser
            with contextlib.redirect_stderr(err):
                parse_args(get_args_parser(), item["torchrun"] + ["-m", item["module"]])
        main = main_of(item)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(list(item["args"]))
        result = "it returned without parsing its arguments with argparse"
    except Parsed as p:
        try:
            result = values(item, p.args[0])
        except Exception as e:
            result = f"{type(e).__name__}: {e}"
    except SystemExit as e:
        result = "" if e.code in (0, None) else f"exit status {e.code}: {err.getvalue().strip()[-1500:]}"
    except BaseException as e:
        result = f"{type(e).__name__}: {e} {err.getvalue().strip()[-1500:]}"
    finally:
        sys.argv[:] = argv
    results.append(result)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def parsed() -> dict[str, str]:
    """Every command's parse result ("" when accepted), from one process that imports them all."""
    items = {}
    for where, argv in COMMANDS:
        try:
            target = _target(argv)
        except AssertionError:
            continue                                        # the test of that command says why
        if target is not None:
            items[json.dumps(argv)] = target
    env = {**ENV, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", CHECKER], input=json.dumps(list(items.values())), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(zip(items, json.loads(res.stdout.strip().splitlines()[-1])))


def _command_id(where: str, argv: list[str]) -> str:
    return f"{where}:{' '.join(argv[:3])[:40]}"


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[_command_id(w, a) for w, a in COMMANDS])
def test_documented_command_is_accepted(where, argv, parsed):
    if _target(argv) is None:
        return
    assert parsed[json.dumps(argv)] == "", f"{where}: {shlex.join(argv)}\n{parsed[json.dumps(argv)]}"


def test_pytest_commands_name_real_test_files():
    for where, argv in COMMANDS:
        if argv[:3] == ["python", "-m", "pytest"]:
            for arg in argv[3:]:
                assert arg.startswith("-") or (ROOT / arg.split("::")[0]).exists(), f"{where}: {arg}"


def test_every_not_run_note_is_on_a_bash_block_and_says_why():
    for page in DOCS:
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            note = NOT_RUN.fullmatch(line.strip())
            if note:
                where = f"{page.relative_to(ROOT)}:{i + 1}"
                assert i + 1 < len(lines) and FENCE.fullmatch(lines[i + 1]).group(1) == "bash", \
                    f"{where}: a not-run note must be the line right before a ```bash fence"
                assert len(note.group(1).split()) >= 3, f"{where}: say why the block is not run"


def test_command_blocks_are_marked_bash():
    """An unlabelled block of commands would escape the checks above (```text is for synopses
    with placeholders, which are not commands)."""
    for b in BLOCKS:
        if b.lang == "":
            first = b.text.lstrip().split("\n", 1)[0]
            assert not LOOKS_RUN.match(first), f"{b.page}:{b.line}: a block of commands; fence it as ```bash"


def _serves(b: Block) -> bool:
    def module(argv):
        try:
            return (_target(argv) or {}).get("module")
        except AssertionError:                  # test_documented_command_is_accepted says why
            return None
    return any(module(argv) in SERVERS or argv[0] == "psd-serve" for argv in shell_commands(b.text))


DOC_RUN = [b for b in BLOCKS if b.page.startswith("docs/") and b.lang == "bash" and b.why is None and not _serves(b)]


@pytest.fixture(scope="module")
def console_scripts(tmp_path_factory) -> Path:
    """setup.py's console scripts as pip writes them (a python script calling the entry point)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, target in SCRIPTS.items():
        module, fn = target.split(":")
        (bin_dir / name).write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {fn}\nsys.exit({fn}())\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("block", DOC_RUN, ids=[f"{b.page}:{b.line}" for b in DOC_RUN])
@pytest.mark.slow
def test_doc_block_runs_as_written(block, console_scripts, tmp_path):
    script = _script(block.text)
    if not script.strip():
        pytest.skip("only skipped lines: " + "; ".join(SKIP[p] for p in SKIP if p in block.text))
    env = {**ENV, "TMPDIR": str(tmp_path), "PATH": f"{console_scripts}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}     # one intra-op thread: the suite shares a small CPU (docs/gpu.md, CPU note)
    res = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{block.page}:{block.line}\n{script}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
