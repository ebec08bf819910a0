"""`DecodeConfig`'s fields are the option table (engine/options.py), derived, never restated: an option
a plugin policy registers after import is a typed field at once, checked like any other, and gone when
the table drops it; a value of the wrong type is refused when the config is made; the config is frozen
and hashable (engine/config.py)."""
from __future__ import annotations

import pickle
import re
import typing
from dataclasses import dataclass

import pytest
import torch

from engine import DecodeConfig, DraftGraph, InputError, Method, Option, Policy, register
from engine.methods import unregister
from engine.options import OPTIONS
from engine.options import register as register_option


@dataclass(frozen=True)
class Spread(Policy):
    """A user's policy with one parameter of its own (`spread`), declared with its Option."""

    spread: float = 0.5
    name = "spread"
    params = {"spread": "spread"}
    declares = (Option("spread", float, "share of the masked positions per step",
                       check=lambda label, v: None if 0 < v <= 1 else f"{label} {v} is outside (0, 1]"),)

    def select(self, conf, masked, step, *args):
        return masked & (torch.rand_like(conf) < self.spread)


@pytest.fixture
def spread():
    before = DecodeConfig(method="confidence")
    assert "spread" not in typing.get_type_hints(DecodeConfig)
    register(Method("spread", "toy: a share of the masked positions", Spread, is_policy=True))
    yield before
    unregister("spread")
    assert "spread" not in OPTIONS          # unregister takes the options its policy declared


def test_a_plugin_option_is_a_typed_field(spread):
    hints = typing.get_type_hints(DecodeConfig)
    assert hints["spread"] == float | None and list(hints)[-1] == "spread"
    cfg = DecodeConfig(method="spread", spread=0.25).validate()
    assert vars(cfg)["spread"] == 0.25 and cfg.policy().spread == 0.25
    assert cfg.as_dict()["spread"] == 0.25 and DecodeConfig().as_dict()["spread"] is None
    assert DecodeConfig(method="spread").validate().policy().spread == 0.5        # None: the policy's default
    assert spread.spread is None and "spread" in spread.as_dict()      # made before: reads the default


def test_a_plugin_option_is_checked_like_any_other(spread):
    with pytest.raises(InputError, match=r"^spread must be float, got 'x'$"):
        DecodeConfig(method="spread", spread="x")                       # wrong type: refused when made
    with pytest.raises(InputError, match=r"^spread must be float, got True$"):
        DecodeConfig(method="spread", spread=True)
    with pytest.raises(InputError, match=r"^spread 2 is outside \(0, 1\]$"):
        DecodeConfig(method="spread", spread=2).validate()              # out of range: validate
    with pytest.raises(InputError, match="^spread applies to psd and spread, not to confidence$"):
        DecodeConfig(method="confidence", spread=0.5).validate()


def test_the_fields_follow_the_table():
    register_option(Option("tmp_width", int, "a test option", 4))
    try:
        assert typing.get_type_hints(DecodeConfig)["tmp_width"] is int       # a default: not Optional
        assert DecodeConfig().tmp_width == 4 and DecodeConfig(tmp_width=5).as_dict()["tmp_width"] == 5
    finally:
        OPTIONS.pop("tmp_width")
    assert "tmp_width" not in DecodeConfig.__annotations__
    with pytest.raises(InputError, match="unknown decoding option 'tmp_width'"):
        DecodeConfig(tmp_width=5)


@pytest.mark.parametrize("name", ["given", "method", "validate", "replace", "policy", "exact", "_valid"])
def test_an_option_cannot_shadow_what_the_config_uses(name):
    fields, table = dict(DecodeConfig.__annotations__), dict(OPTIONS)
    with pytest.raises(ValueError, match="name the option differently"):
        register_option(Option(name, int, "a clash"))
    assert dict(OPTIONS) == table and DecodeConfig.__annotations__ == fields     # undone


@pytest.mark.parametrize("options, message", [
    ({"k": "3"}, "k must be int, got '3'"),
    ({"gen_length": 1.5}, "gen length must be int, got 1.5"),
    ({"temperature": True}, "temperature must be float, got True"),
    ({"cache": 1}, "cache mode must be str, got 1"),
    ({"ignore_eos": 1}, "--ignore-eos must be bool, got 1"),
    ({"graph": [[0]]}, "a draft graph must be a DraftGraph, got list"),
])
def test_a_wrong_type_is_refused_when_the_config_is_made(options, message):
    with pytest.raises(InputError) as e:
        DecodeConfig(method="psd", **options)
    assert str(e.value) == message


def test_frozen_and_hashable():
    cfg = DecodeConfig(method="psd", depth=2, gen_length=16, block_length=8)
    with pytest.raises(AttributeError, match="frozen"):
        cfg.k = 4
    with pytest.raises(AttributeError, match="frozen"):
        cfg.spread = 4                                  # not an option (now): still frozen
    with pytest.raises(TypeError, match="frozen"):
        cfg.given["depth"] = 3
    with pytest.raises(TypeError, match="frozen"):
        cfg.given.update(depth=3)
    assert cfg.given == {"depth": 2, "gen_length": 16, "block_length": 8} and cfg.depth == 2
    same = DecodeConfig(method="psd", depth=2, gen_length=16, block_length=8)
    assert cfg == same and hash(cfg) == hash(same) and len({cfg, same, cfg.replace(depth=3)}) == 2
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    graph = DraftGraph.chain(2)
    assert hash(DecodeConfig(method="psd", graph=graph)) == hash(DecodeConfig(method="psd", graph=graph))


def test_a_method_that_is_no_string_is_an_unknown_method():
    with pytest.raises(InputError, match="unknown method"):
        DecodeConfig(method=["psd"]).validate()


@pytest.mark.parametrize("given, message", [
    (dict(kappa=0.9), "kappa applies to psd with --policy localleap, not with confidence"),
    (dict(policy_name="greedy", threshold=0.5), "threshold applies to psd with --policy confidence, localleap, left or "
                                                "threshold, not with greedy"),
    (dict(steps=8), "steps applies to psd with --policy topk or random, not with confidence"),
])
def test_a_psd_option_of_another_policy_names_the_policies_that_take_it(given, message):
    """psd takes a policy's options through that policy only: the error names which (it said "kappa
    applies to localleap and psd, not to psd")."""
    with pytest.raises(InputError) as e:
        DecodeConfig(method="psd", **given).validate()
    assert str(e.value) == message


def test_messages_name_the_real_problem(tmp_path, capsys):
    """What a user was told wrongly: an editing threshold above 1 (it never edits) is refused like the
    threshold; eb's score advice offers only values --score takes; a block longer than the model
    under --align sequence names the alignment, not the gen length; ete's k bound names ete; the
    shipped-model note is for the shipped model only."""
    from engine.generate import main
    from models.random_checkpoint import make_checkpoint
    from support import run_main

    for given, message in ((dict(method="threshold", editing_threshold=2.0), "editing threshold 2.0 is outside (0, 1]"),
                           (dict(method="eb", score="prob"), "give --score entropy or leave --score out, not prob"),
                           (dict(method="ete", k=10 ** 6), "ete's windows are bounded alike")):
        with pytest.raises(InputError, match=re.escape(message)):
            DecodeConfig(**given).validate()
    rc, _, err = run_main(main, ["x", "--threads", "1", "--align", "sequence", "--block-length", "300",
                                 "--gen-length", "32"], capsys)
    assert rc == 2 and "positions that align the sequence to whole blocks of 300" in err, err
    ckpt, _ = make_checkpoint(tmp_path / "m", "llada", eos_bias=100.0)        # answers with EOS at once
    rc, out, err = run_main(main, ["t5", "--model", str(ckpt), "--threads", "1", "--gen-length", "8",
                                   "--block-length", "8"], capsys)
    assert rc == 0 and "the model generated no text" in err and "shipped demo model" not in err, err



def test_terminal_advice_fits_the_model_and_the_output(tmp_path, capsys):
    """No text because every id is past a smaller tokenizer: said so (it blamed a stop token). A
    uniform-noise model is not advised psd or confidence, which it refuses."""
    import argparse

    from engine.cli import _explain
    from models import Tokenizer
    from models.random_checkpoint import make_checkpoint

    ckpt, _ = make_checkpoint(tmp_path / "m", "llada", tokenizer_size=8)
    args = argparse.Namespace(tokenizer=Tokenizer(ckpt), model=str(ckpt), uniform=False)
    _explain(args, {"text": "", "token_ids": [40, 41, 5], "method": "greedy"})
    err = capsys.readouterr().err
    assert f"2 of its 3 generated ids are outside the tokenizer's {args.tokenizer.size} entries" in err and "--method psd" in err, err
    args.uniform = True
    _explain(args, {"text": "x", "token_ids": [5], "method": "eb"})
    err = capsys.readouterr().err
    assert "decodes with eb alone" in err and "--method psd" not in err and "no text" not in err, err
