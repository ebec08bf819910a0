"""The test suite says what it costs: the README states how long `python -m pytest` takes on a
2-core machine and names the fast subset, `-m "not slow"`, which still runs tests of every test
module (pytest.ini declares the marker; a module whose every test is slow would drop out of it)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def _fast_modules(request) -> set[str]:
    """Test modules with a test outside the slow marker: read from this session's items when it
    collected the whole suite (none is left to deselect then), else from a collection of its own."""
    items = request.session.items
    if {Path(str(i.fspath)).name for i in items} >= _modules():
        return {Path(str(i.fspath)).name for i in items if i.get_closest_marker("slow") is None}
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # -q twice (pytest.ini adds one): one line per module, "tests/test_x.py: N"
    return {Path(m.group(1)).name for m in re.finditer(r"^(tests/test_\w+\.py): \d+$", res.stdout, re.M)}


def _modules() -> set[str]:
    return {p.name for p in TESTS.glob("test_*.py")}


def test_the_fast_subset_runs_every_test_module(request):
    missing = _modules() - _fast_modules(request)
    assert not missing, f"every test of {sorted(missing)} is marked slow: keep a quick one outside the marker"


def test_readme_states_the_suite_time_and_the_fast_subset():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ini = (ROOT / "pytest.ini").read_text(encoding="utf-8")
    assert re.search(r"^\s+slow:", ini, re.M)
    para = next((p for p in readme.split("\n\n") if 'python -m pytest -m "not slow"' in p), None)
    assert para is not None, "the README names no fast subset"
    assert re.search(r"\d+ min", para) and "2-core" in para, para
