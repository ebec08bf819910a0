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
