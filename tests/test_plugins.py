"""Plugins (engine/frontend.py): a policy in the user's own module reaches every front end — the CLI,
bench.eval, engine.calibrate, bench.speed and the server — through --plugin, $PSD_PLUGINS or an
installed entry point, without editing the engine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from models.random_checkpoint import make_checkpoint

REPO = Path(__file__).resolve().parent.parent

PLUGIN = textwrap.dedent('''
    """A user's policy: the left-most masked position first (one per step)."""
    from dataclasses import dataclass

    import torch

    import engine


    @dataclass(frozen=True)
    class LeftFirst(engine.Policy):
        name = "leftfirst"

        def select(self, conf, masked, step, *args):
            first = masked.long().argmax(-1, keepdim=True)
            return torch.zeros_like(masked).scatter_(-1, first, True) & masked


    engine.register(engine.Method("leftfirst", "the left-most masked position", LeftFirst, is_policy=True))
''')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugin")
    (tmp / "my_policies.py").write_text(PLUGIN)
    ckpt, _ = make_checkpoint(tmp / "ckpt", "llada", seed=1)
    return tmp, ckpt


def _run(args, tmp, env=None, check_rc=0):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    p = subprocess.run([sys.executable, "-m", *args], cwd=tmp, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == check_rc, (args, p.stdout[-2000:], p.stderr[-2000:])
    return p


@pytest.mark.slow
def test_cli_takes_a_plugin_module_file_and_env(setup):
    tmp, ckpt = setup
    base = ["engine.generate", "t5 t6", "--model", str(ckpt), "--gen-length", "16", "--block-length", "8", "--json"]
    out = json.loads(_run([*base, "--plugin", "my_policies", "--method", "leftfirst"], tmp).stdout)
    assert out["method"] == "leftfirst" and out["calls"] == 16
    assert out["commit_step"] == list(range(8)) * 2                # left to right, one per step
    # the same from a file path and from the environment, and under PSD (lossless in exact mode)
    by_file = json.loads(_run([*base, "--plugin", str(tmp / "my_policies.py"), "--method", "leftfirst"], tmp).stdout)
    assert by_file["token_ids"] == out["token_ids"]
    psd = json.loads(_run([*base, "--method", "psd", "--policy", "leftfirst", "--acceptance", "exact", "--depth", "2"],
                          tmp, env={"PSD_PLUGINS": "my_policies"}).stdout)
    assert psd["token_ids"] == out["token_ids"]
    assert "leftfirst" in _run(["engine.generate", "--plugin", "my_policies", "--help"], tmp).stdout


@pytest.mark.slow
def test_a_missing_or_broken_plugin_is_one_error_line(setup):
    tmp, ckpt = setup
    p = _run(["engine.generate", "x", "--plugin", "no_such_module_xyz"], tmp, check_rc=2)
    assert p.stderr.startswith("error: cannot load plugin 'no_such_module_xyz'") and p.stderr.count("\n") == 1
    (tmp / "broken_plugin.py").write_text("raise RuntimeError('boom')\n")
    p = _run(["bench.eval", "--plugin", "broken_plugin", "--methods", "greedy"], tmp, check_rc=2)
    assert "boom" in p.stderr and p.stderr.count("\n") == 1
    p = _run(["engine.calibrate", "--plugin", str(tmp / "missing.py"), "--model", str(ckpt), "--prompts", "x",
              "--out", "g.json"], tmp, check_rc=2)
    assert "plugin file" in p.stderr and "not found" in p.stderr


@pytest.mark.slow
def test_bench_eval_calibrate_speed_and_server_see_the_plugin(setup):
    tmp, ckpt = setup
    out = tmp / "eval.jsonl"
    _run(["bench.eval", "--plugin", "my_policies", "--model", str(ckpt), "--task", "math", "--limit", "2",
          "--methods", "leftfirst", "psd:policy=leftfirst,d=2", "--gen-length", "16", "--block-length", "8",
          "--out", str(out)], tmp)
    methods = {json.loads(line)["method"] for line in out.read_text().splitlines()}
    assert any("leftfirst" in m for m in methods) and any(m.startswith("psd(leftfirst") for m in methods)
    prompts = tmp / "prompts.txt"
    prompts.write_text("t5 t6\nt7 t8 t9\n")
    _run(["engine.calibrate", "--plugin", "my_policies", "--model", str(ckpt), "--policy", "leftfirst", "--depth", "2",
          "--nodes", "3", "--prompts", str(prompts), "--out", str(tmp / "graph.json"), "--gen-length", "16",
          "--block-length", "8"], tmp)
    assert json.loads((tmp / "graph.json").read_text())
    speed = ["bench.speed", "--shape", "tiny", "--methods", "leftfirst", "--batch-sizes", "1", "--num-prompts", "1",
             "--gen-length", "16", "--block-length", "8", "--repeats", "1", "--no-warmup", "--out", str(tmp / "speed")]
    assert "leftfirst" in _run(speed, tmp, check_rc=2).stderr           # not a method without the plugin
    _run([*speed[:1], "--plugin", "my_policies", *speed[1:]], tmp)
    assert "leftfirst" in (tmp / "speed").joinpath("speed.csv").read_text()
    assert "leftfirst" in _run(["engine.serve", "--plugin", "my_policies", "--help"], tmp).stdout


# ------------------------------------------------------------------------ replacing, exiting (issue 33 item 5)
REPLACING = '''
import engine

REPLACES = {asks}
engine.register(engine.Method("confidence", "greedy under confidence's name", engine.Greedy, is_policy=True))
'''
RELAXING = '''
from dataclasses import dataclass

import engine


@dataclass(frozen=True)
class Loose(engine.Confidence):
    name = "loose"
    declares = (engine.Option("threshold", float, "any threshold at all"),)


engine.register(engine.Method("loose", "confidence with any threshold", Loose, is_policy=True))
'''


@pytest.fixture
def tables(monkeypatch):
    """The method and option tables, restored after the test; no plugins from the environment."""
    from engine import frontend
    from engine.methods import METHODS
    from engine.options import OPTIONS, POLICY_NAMES

    monkeypatch.delenv(frontend.PLUGIN_ENV, raising=False)
    saved = dict(METHODS), dict(OPTIONS), list(POLICY_NAMES), dict(frontend._LOADED)
    yield METHODS, OPTIONS
    METHODS.clear(), METHODS.update(saved[0])
    OPTIONS.clear(), OPTIONS.update(saved[1])
    POLICY_NAMES[:] = saved[2]
    frontend._LOADED.clear(), frontend._LOADED.update(saved[3])


def test_a_plugin_cannot_silently_replace_a_method_or_an_option(tmp_path, tables):
    """Registering `confidence` again, or a policy declaring `threshold` anew, would change what
    every front end decodes under a built-in name: an error naming it, the tables left as they were;
    a plugin that lists the name in REPLACES does replace it."""
    from engine import InputError
    from engine.frontend import load_plugins

    methods, options = tables
    confidence, threshold = methods["confidence"], options["threshold"]
    (tmp_path / "sneaky.py").write_text(REPLACING.format(asks="()"))
    with pytest.raises(InputError, match="plugin .*sneaky.py' replaces the method 'confidence'.*REPLACES"):
        load_plugins(["--plugin", str(tmp_path / "sneaky.py")])
    assert methods["confidence"] is confidence
    (tmp_path / "loose.py").write_text(RELAXING)
    with pytest.raises(InputError, match="replaces the option 'threshold'"):
        load_plugins(["--plugin", str(tmp_path / "loose.py")])
    assert options["threshold"] is threshold and "loose" not in methods
    (tmp_path / "meant.py").write_text(REPLACING.format(asks="('confidence',)"))
    load_plugins(["--plugin", str(tmp_path / "meant.py")])
    assert methods["confidence"].policy is methods["greedy"].policy


@pytest.mark.parametrize("call", ["sys.exit(0)", "sys.exit()", "sys.exit(3)", "raise SystemExit('bye')"])
def test_sys_exit_in_a_plugin_is_an_error(tmp_path, tables, call, capsys):
    """A plugin that exits while it is imported made the front end exit 0 with no output."""
    from engine.frontend import plugins_loaded

    (tmp_path / "quits.py").write_text(f"import sys\n{call}\n")
    assert plugins_loaded(["--plugin", str(tmp_path / "quits.py")]) is False
    err = capsys.readouterr().err
    assert err.startswith("error: cannot load plugin") and "sys.exit(" in err and err.count("\n") == 1


def test_sys_exit_in_a_plugin_fails_the_command(setup):
    tmp, _ = setup
    (tmp / "exits_quietly.py").write_text("import sys\nsys.exit(0)\n")
    p = _run(["engine.generate", "x", "--plugin", "exits_quietly"], tmp, check_rc=2)
    assert p.stderr.startswith("error: cannot load plugin 'exits_quietly': it called sys.exit(0)"), p.stderr
    assert p.stderr.count("\n") == 1 and p.stdout == ""
