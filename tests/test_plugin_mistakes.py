"""What a plugin author gets wrong (engine/policies.py, engine/methods.py, engine/options.py): each is
one clear error naming the policy or option, never a decode that is silently wrong, a traceback from
deep in the loop, or a run that never ends."""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from engine import Method, Policy, generate, register
from engine.errors import DecodingError, InputError
from engine.methods import METHODS, unregister
from engine.options import OPTIONS, Option
from models import ModelConfig, init_random

PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62)
    return init_random(cfg, seed=3, std=0.5).double()


def _policy(name, select, **attrs):
    cls = dataclass(frozen=True)(type(name.title(), (Policy,), {"name": name, "select": select, **attrs}))
    register(Method(name, "a test policy", cls, is_policy=True))
    return name


@pytest.mark.parametrize("returns, words", [
    (lambda conf, masked: masked[:, :1], "a torch.bool tensor of shape (2, 1)"),        # broadcast: whole blocks
    (lambda conf, masked: masked.any(-1), "a torch.bool tensor of shape (2,)"),
    (lambda conf, masked: conf, "a torch.float64 tensor"),
    (lambda conf, masked: masked.long(), "a torch.int64 tensor"),
    (lambda conf, masked: masked[:, 1:], "of shape (2, 7)"),
    (lambda conf, masked: None, "a NoneType"),
])
def test_a_select_of_the_wrong_kind_is_one_error_naming_the_policy(model, returns, words):
    """[R, 1] / [R] results broadcast to whole blocks (garbage at exit 0); float, long and wrong
    widths were tracebacks from torch.where or &."""
    name = _policy("badsel", lambda self, conf, masked, step: returns(conf, masked))
    try:
        with pytest.raises(DecodingError, match=f"the policy badsel's select returned .*{re.escape(words)}.*it must return "
                                                f"a bool tensor of the masked positions' shape"):
            generate(model, PROMPTS, method=name, gen_length=8, block_length=8)
    finally:
        unregister(name)


def test_a_select_that_names_committed_positions_never_overwrites_them(model):
    """`select` returning every position (committed ones too) overwrote committed tokens: only the
    masked positions of its result commit, so it decodes as the same policy restricted to them."""
    def first_masked(self, conf, masked, step):
        return torch.zeros_like(masked).scatter_(-1, masked.long().argmax(-1, keepdim=True), True) & masked

    def first_masked_and_all_committed(self, conf, masked, step):
        return first_masked(self, conf, masked, step) | ~masked

    names = [_policy("firstm", first_masked), _policy("greedyall", first_masked_and_all_committed)]
    try:
        a, b = (generate(model, PROMPTS, method=n, gen_length=16, block_length=8) for n in names)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
    finally:
        for n in names:
            unregister(n)


class _NotADataclass(Policy):
    beta: float = 0.5
    name = "plain"
    params = {"beta": "beta"}
    declares = (Option("beta", float, "a toy"),)

    def select(self, conf, masked, step):
        return masked


@dataclass(frozen=True)
class _NoSelect(Policy):
    name = "noselect"


@dataclass(frozen=True)
class _MissingField(Policy):
    beta: float = 0.5
    name = "missing"
    params = {"beta": "bta"}
    declares = (Option("beta", float, "a toy"),)

    def select(self, conf, masked, step):
        return masked


@dataclass(frozen=True)
class _TwoDefaults(_MissingField):
    name = "twodefaults"
    params = {"beta": "beta"}
    declares = (Option("beta", float, "a toy", 0.7),)


def _spelled(name, *aliases):
    @dataclass(frozen=True)
    class Spelled(_MissingField):
        params = {name: "beta"}
        declares = (Option(name, float, "a toy", aliases=aliases),)
    Spelled.name = "spelled"
    return Spelled


@pytest.mark.parametrize("policy, words", [
    (_NotADataclass, "which is not one of its fields (none) (is the class a @dataclass(frozen=True)?)"),  # crashed
    (int, "must be a subclass of engine.Policy"),
    (_NoSelect, "does not define select"),                                  # NotImplementedError mid-decode
    (_MissingField, "maps the option 'beta' to 'bta', which is not one of its fields"),
    (_TwoDefaults, "has the default 0.7 and the policy's field 'beta' 0.5"),   # --help said 0.5, decoded 0.7
    (_spelled("tau"), "'tau' already spells the option 'threshold'"),      # specs resolved tau to threshold
    (_spelled("beta", "d"), "'d' already spells the option 'depth'"),
    (_spelled("two words"), "is not an identifier"),
])
def test_a_policy_the_loop_cannot_drive_is_refused_at_registration(policy, words):
    before = dict(METHODS), dict(OPTIONS)
    with pytest.raises(ValueError, match=re.escape(words)):
        register(Method(getattr(policy, "name", "x"), "a test policy", policy, is_policy=True))
    assert (dict(METHODS), dict(OPTIONS)) == before


def test_a_plugin_option_named_like_a_commands_flag_is_one_error_line(tmp_path, capsys):
    """`device` (or dtype, model, json, help, ...) crashed argparse with a traceback, exit 1."""
    from engine.cli import main
    from support import run_main

    plugin = tmp_path / "clash.py"
    plugin.write_text("from dataclasses import dataclass\nimport engine\nfrom engine.options import Option\n\n\n"
                      "@dataclass(frozen=True)\nclass Clash(engine.Confidence):\n    device: float = 0.5\n"
                      "    name = 'clash'\n    params = {**engine.Confidence.params, 'device': 'device'}\n"
                      "    declares = (Option('device', float, 'a toy'),)\n\n\n"
                      "engine.register(engine.Method('clash', 'a test policy', Clash, is_policy=True))\n")
    try:
        rc, _, err = run_main(main, ["t5", "--plugin", str(plugin), "--method", "clash"], capsys)
    finally:
        if "clash" in METHODS:
            unregister("clash")
    assert rc == 2 and err.count("\n") == 1 and "cannot take the flag --device twice" in err, err


def test_a_policy_that_may_always_idle_ends_at_its_step_bound(model):
    """may_idle always True and a select that commits nothing ran forever (engine.serve: a worker
    held for good); idling is honoured for Policy.step_bound steps of a block, then it is a failure."""
    name = _policy("idle", lambda self, conf, masked, step: torch.zeros_like(masked),
                   may_idle=lambda self, step: torch.ones_like(step, dtype=torch.bool))
    try:
        with pytest.raises(DecodingError, match="idle past its step bound"):
            generate(model, PROMPTS, method=name, gen_length=8, block_length=8)
    finally:
        unregister(name)


@pytest.fixture
def restored(monkeypatch):
    """The method and option tables and the loaded plugins, as they were after the test."""
    from engine import frontend
    from engine.options import POLICY_NAMES

    monkeypatch.delenv(frontend.PLUGIN_ENV, raising=False)
    saved = dict(METHODS), dict(OPTIONS), list(POLICY_NAMES), dict(frontend._LOADED)
    yield frontend
    METHODS.clear(), METHODS.update(saved[0])
    OPTIONS.clear(), OPTIONS.update(saved[1])
    POLICY_NAMES[:] = saved[2]
    frontend._LOADED.clear(), frontend._LOADED.update(saved[3])


PLUGIN = ("from dataclasses import dataclass\nimport engine\n\n\n@dataclass(frozen=True)\n"
          "class Mine(engine.Confidence):\n    name = '{name}'\n\n\n"
          "engine.register(engine.Method('{name}', 'a test policy', Mine, is_policy=True))\n")


def test_an_installed_entry_point_in_module_attr_form_loads(tmp_path, monkeypatch, restored):
    """`[psd_engine.plugins] mine = epmod:Mine`, the standard form, was imported as a module named
    'epmod:Mine': every command failed. The module is imported; the attribute must exist."""
    (tmp_path / "epmod.py").write_text(PLUGIN.format(name="epmine"))
    dist = tmp_path / "epmine-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: epmine\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{restored.PLUGIN_GROUP}]\nmine = epmod:Mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    restored.load_plugins([])
    assert "epmine" in METHODS
    with pytest.raises(InputError, match="the module epmod has no Missing"):
        restored.load_plugins(["--plugin", "epmod:Missing"])


def test_one_plugin_file_given_two_ways_loads_once_and_a_path_without_py_is_named(tmp_path, monkeypatch, restored):
    """`--plugin mine.py --plugin ./mine.py` said the second 'replaces the method' (advice to set
    REPLACES); `--plugin ./mine` was a TypeError about relative imports."""
    (tmp_path / "mine.py").write_text(PLUGIN.format(name="twice"))
    monkeypatch.chdir(tmp_path)
    restored.load_plugins(["--plugin", "mine.py", "--plugin", str(tmp_path / "mine.py"), "--plugin", "./mine.py"])
    assert "twice" in METHODS
    with pytest.raises(InputError, match="is neither a module name .* nor a .py file"):
        restored.load_plugins(["--plugin", "./mine"])


@pytest.mark.parametrize("check, given, words", [
    (lambda label, v: 0 < v <= 1, 0.5, "returned True: a check returns the error message (a str) or None"),
    (lambda label, v: 0 < v <= 1, 5.0, "returned False"),             # was: accepted, decoded with 5
    (lambda label, v: (_ for _ in ()).throw(ValueError("must be small")), 0.5, "gamma2: must be small"),
])
def test_an_option_check_that_returns_a_bool_or_raises_is_one_error(check, given, words):
    from engine.options import register as register_option

    register_option(Option("gamma2", float, "a toy", check=check))
    try:
        with pytest.raises(InputError, match=re.escape(words)):
            OPTIONS["gamma2"].validate(given)
    finally:
        OPTIONS.pop("gamma2")


def test_lm_eval_adapter_sees_the_environments_plugins(tmp_path, monkeypatch, restored):
    """bench.lm_eval loaded no plugins: `method=mine` with PSD_PLUGINS set was 'unknown model_arg'."""
    pytest.importorskip("lm_eval")
    from bench.lm_eval import PsdLM

    (tmp_path / "lmplug.py").write_text(PLUGIN.format(name="lmmine"))
    monkeypatch.setenv(restored.PLUGIN_ENV, str(tmp_path / "lmplug.py"))
    lm = PsdLM(method="lmmine", threshold=0.5, block_length=8)
    assert lm.decode_config(8).method == "lmmine"


def test_a_plugin_policys_label_shows_its_options():
    """Without a describe() of its own, `mine:alpha=0.3` and `mine:alpha=0.9` shared the label
    `mine` (bench.eval refused them as one row); the default label names every option."""
    from engine import DecodeConfig
    from engine.options import Option as Opt

    @dataclass(frozen=True)
    class Mine(Policy):
        alpha: float = 0.5
        order: str = "conf"
        name = "labelled"
        params = {"alpha": "alpha", "order": "order"}
        declares = (Opt("alpha", float, "a toy"), Opt("order", str, "a toy", choices=("conf", "left")))

        def select(self, conf, masked, step):
            return masked

    register(Method("labelled", "a test policy", Mine, is_policy=True))
    try:
        assert DecodeConfig(method="labelled", alpha=0.3).validate().describe() == "labelled(alpha=0.3,order=conf)"
        assert DecodeConfig(method="psd", policy_name="labelled", order="left", depth=2).validate().describe() == \
            "psd(labelled(alpha=0.5,order=left),d=2,policy)"
    finally:
        unregister("labelled")


def test_unregister_names_what_it_cannot_do():
    """An unknown name was a bare KeyError('x'); unregistering confidence left psd's default policy
    pointing at nothing (a KeyError in every psd validate)."""
    with pytest.raises(KeyError, match="no method 'nosuch' is registered"):
        unregister("nosuch")
    with pytest.raises(ValueError, match="'confidence' is psd's default policy"):
        unregister("confidence")
    assert "confidence" in METHODS
