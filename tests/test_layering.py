"""The product is psd_kernels <- models <- engine; bench/ (tooling, training, evaluation) sits on
top. No module of the product may import its tooling, at any depth: a static scan of every
import statement (function-level ones included) and a runtime check of what importing the whole
product pulls in."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# package -> packages of this repo it may import (besides itself)
ALLOWED = {"psd_kernels": set(), "models": {"psd_kernels"}, "engine": {"psd_kernels", "models"}}
OWN = {"psd_kernels", "models", "engine", "bench", "tests"}
OPTIONAL = {"lm_eval", "fastapi", "uvicorn", "openai"}   # optional extras: only bench/ and engine.serve use them


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    pkg = path.relative_to(root).parts[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:     # relative: stays inside its own package unless it climbs above it
                depth = len(path.relative_to(root / pkg).parts) - 1
                out.append((node.lineno, pkg if node.level <= depth + 1 else "<above " + pkg + ">"))
            else:
                out.append((node.lineno, node.module or ""))
    return out


def violations(root: Path = REPO) -> list[str]:
    bad = []
    for pkg, allowed in ALLOWED.items():
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root)
            # the server (engine/serve/) is an optional entry point: it alone may import its extras
            server_extras = {"fastapi", "starlette", "uvicorn"} if rel.as_posix().startswith("engine/serve/") else set()
            for line, mod in _imports(f, root):
                top = mod.split(".")[0]
                if top in server_extras:
                    continue
                if top.startswith("<above"):
                    bad.append(f"{rel}:{line} relative import climbs out of {pkg}")
                elif (top in OWN and top != pkg and top not in allowed) or top in OPTIONAL:
                    bad.append(f"{rel}:{line} imports {mod}")
    return bad


def test_product_never_imports_its_tooling():
    assert violations() == []


def test_the_scan_finds_a_planted_import(tmp_path):
    for pkg in ALLOWED:
        (tmp_path / pkg).mkdir()
    (tmp_path / "models" / "x.py").write_text("def f():\n    from bench.tasks import get_task\n")
    (tmp_path / "engine" / "y.py").write_text("import bench.train as t\n")
    (tmp_path / "psd_kernels" / "z.py").write_text("from models import load_model\n")
    bad = violations(tmp_path)
    assert len(bad) == 3, bad


def test_importing_the_product_loads_no_tooling():
    code = ("import pkgutil, importlib, sys\n"
            "import psd_kernels, models, engine\n"
            "for pkg in (psd_kernels, models, engine):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        if m.name in ('psd_kernels.ops._compile_check', 'engine.__main__', 'engine.serve.__main__'):\n"
            "            continue\n"
            "        importlib.import_module(m.name)\n"
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'bench', 'lm_eval', 'fastapi', 'openai'}))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[]"


def _import_graph(package: str = "engine", root: Path = REPO) -> dict[str, set[str]]:
    """module of `package` -> the modules of `package` it imports (relative and absolute imports,
    function-level ones included; `from . import x` names the module x)."""
    graph: dict[str, set[str]] = {}
    for f in sorted((root / package).rglob("*.py")):
        mod = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        deps = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                    target = base + ("." + node.module if node.module else "")
                else:
                    target = node.module or ""
                deps.add(target)
                deps.update(f"{target}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
    return {m: {d for d in ds if d in graph and d != m} for m, ds in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                found.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_no_import_cycles_inside_the_engine():
    """The package's own modules import each other one way (the package __init__ aside, which
    re-exports): options no longer reaches back into the method table for the policy names."""
    graph = _import_graph("engine")
    graph = {m: ds - {"engine"} for m, ds in graph.items() if m != "engine"}
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]   # the check can fail


def test_no_import_cycles_inside_bench(tmp_path):
    """bench.speed runs bench.simulate's projection; the shapes and prompts both decode live in
    bench.workload, so neither imports the other back (a function-level import counts too)."""
    graph = _import_graph("bench")
    graph = {m: ds - {"bench"} for m, ds in graph.items() if m != "bench"}
    assert _cycles(graph) == []
    (tmp_path / "bench").mkdir()                    # the check can fail: the cycle this replaced
    (tmp_path / "bench" / "speed.py").write_text("from .simulate import CARDS\n")
    (tmp_path / "bench" / "simulate.py").write_text("def run():\n    from .speed import shape_config\n")
    assert _cycles(_import_graph("bench", tmp_path)) == [["bench.simulate", "bench.speed", "bench.simulate"]]
