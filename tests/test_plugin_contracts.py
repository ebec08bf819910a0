"""A user's policy gets the project's contract checks without editing the project (issue 30 item 8):
with $PSD_PLUGINS naming their module, tests/test_contracts.py (parametrized over the method table,
tests/conftest.py loads the plugins) runs every contract for it; and their own test file outside
the repository imports `engine.testing.contracts.PolicyContract` and subclasses it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

PLUGIN = textwrap.dedent('''
    """A user's policy: the two most confident masked positions per step."""
    from dataclasses import dataclass

    import torch

    import engine


    @dataclass(frozen=True)
    class TwoBest(engine.Policy):
        name = "twobest"

        def select(self, conf, masked, step, *args, **kw):
            score = torch.where(masked, conf.float(), float("-inf"))
            k = min(2, masked.shape[-1])
            top = score.topk(k, dim=-1).indices
            return torch.zeros_like(masked).scatter_(-1, top, True) & masked


    engine.register(engine.Method("twobest", "the two most confident masked positions", TwoBest, is_policy=True))
''')

USER_TEST = textwrap.dedent('''
    import pytest

    import my_policies  # noqa: F401  (registers twobest)
    from engine.testing.contracts import PolicyContract, contract_model  # noqa: F401  (fixtures)


    class TestTwoBest(PolicyContract):
        @pytest.fixture
        def policy_case(self):
            return "twobest", {}
''')


def _pytest(args, cwd, env):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), str(REPO)]), **env}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_contract_suite_runs_for_a_plugin_policy(tmp_path):
    (tmp_path / "my_policies.py").write_text(PLUGIN)
    res = _pytest(["tests/test_contracts.py", "-k", "twobest and (root_only or stream or masked)", "-rA"],
                  REPO, {"PSD_PLUGINS": "my_policies", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    passed = [line for line in res.stdout.splitlines() if line.startswith("PASSED") and "twobest" in line]
    assert len(passed) >= 3, res.stdout[-3000:]
    bad = _pytest(["tests/test_contracts.py", "--collect-only"], REPO, {"PSD_PLUGINS": "no_such_plugin_module"})
    assert bad.returncode != 0 and "no_such_plugin_module" in bad.stdout + bad.stderr


@pytest.mark.slow
def test_a_users_own_test_file_subclasses_the_contract(tmp_path):
    (tmp_path / "my_policies.py").write_text(PLUGIN)
    (tmp_path / "test_mine.py").write_text(USER_TEST)
    res = _pytest(["test_mine.py", "-q", "-k", "root_only or masked", "-rA"], tmp_path, {})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert sum(line.startswith("PASSED") for line in res.stdout.splitlines()) >= 2, res.stdout[-3000:]


def test_the_helpers_import_without_the_tests_directory(tmp_path):
    res = subprocess.run([sys.executable, "-c", "import engine.testing.contracts as c, engine.testing.hostsync as h; "
                          "print(c.PolicyContract.__name__, h.SyncCounter.__name__)"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.split() == ["PolicyContract", "SyncCounter"], res.stderr[-2000:]
