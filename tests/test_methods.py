"""The method and option tables (engine/methods.py, engine/options.py): every front end is derived
from them, so a policy defined in this file — a class and one table entry, nothing else edited —
is usable through engine.generate, the CLI and bench.eval, and under PSD."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from bench.eval import main as eval_main
from engine.testing.contracts import PolicyContract, causal_model, contract_model  # noqa: F401  (fixtures)
from bench.eval import parse_method
from engine import DecodeConfig, InputError, Method, Option, Policy, generate, register
from engine.cli import build_parser
from engine.cli import main as cli_main
from engine.methods import METHODS, methods_taking, policy_methods, unregister
from engine.options import OPTIONS
from engine.policies import masked_conf
from models import load_model
from models.random_checkpoint import make_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


@dataclass(frozen=True)
class TopFraction(Policy):
    """Toy policy: commit the most confident ceil(frac * masked) positions (at least one)."""

    frac: float = 0.25
    name = "topfrac"
    params = {"frac": "frac"}
    declares = (Option("frac", float, "share of the masked positions committed per step",
                       check=lambda label, v: None if 0 < v <= 1 else f"{label} {v} is outside (0, 1]"),)

    def select(self, conf, masked, step):
        k = torch.ceil(masked.sum(-1, keepdim=True) * self.frac).clamp_min(1)
        order = torch.argsort(masked_conf(conf, masked), dim=-1, descending=True, stable=True).argsort(-1)
        return (order < k) & masked

    def describe(self):
        return f"topfrac({self.frac})"


@pytest.fixture
def toy():
    register(Method("topfrac", "toy: a fixed share of the masked positions", TopFraction, is_policy=True))
    yield
    unregister("topfrac")
    assert "frac" not in OPTIONS          # unregister takes the options its policy declared


class TestTopFractionKeepsEveryContract(PolicyContract):
    """The toy policy gets every policy contract (engine/testing/contracts.py) from this one class."""

    @pytest.fixture(params=[0.25, 0.5])
    def policy_case(self, request, toy):
        return "topfrac", {"frac": request.param}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("toy") / "llada", "llada", seed=1, eos_bias=8.0)
    return path


def test_toy_policy_through_the_api(toy, ckpt):
    model = load_model(ckpt)
    kw = dict(gen_length=16, block_length=8)
    half = generate(model, PROMPTS, method="topfrac", frac=0.5, **kw)
    one = generate(model, PROMPTS, method="topfrac", frac=1.0, **kw)
    assert all(r.calls < 16 for r in half) and all(r.calls <= 2 for r in one)
    assert sum(r.calls for r in one) < sum(r.calls for r in half)
    # under PSD: lossless in exact mode, with fewer or equal calls
    spec = generate(model, PROMPTS, method="psd", policy_name="topfrac", frac=0.5, depth=2, acceptance="exact", **kw)
    assert [r.token_ids for r in spec] == [r.token_ids for r in half]
    assert sum(r.calls for r in spec) <= sum(r.calls for r in half)
    with pytest.raises(InputError, match="frac 2.0 is outside"):
        generate(model, PROMPTS, method="topfrac", frac=2.0, **kw)
    with pytest.raises(InputError, match="frac applies to psd and topfrac, not to greedy"):
        generate(model, PROMPTS, method="greedy", frac=0.5, **kw)


def test_toy_policy_through_the_cli(toy, ckpt, capsys):
    args = build_parser().parse_args(["x", "--method", "topfrac", "--frac", "0.5"])
    assert args.method == "topfrac" and args.frac == 0.5
    assert "--frac" in build_parser().format_help()
    code = cli_main(["t5 t6", "--model", str(ckpt), "--method", "topfrac", "--frac", "1.0", "--gen-length", "16",
                     "--block-length", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["policy"] == "topfrac(1.0)" and out["calls"] <= 2
    assert "topfrac" in build_parser().parse_args(["x", "--method", "psd", "--policy", "topfrac"]).policy_name


def test_toy_policy_through_bench_eval(toy, ckpt, tmp_path, capsys):
    assert parse_method("topfrac:frac=0.5") == ("topfrac", {"frac": 0.5})
    out = tmp_path / "r.jsonl"
    code = eval_main(["--model", str(ckpt), "--task", "math", "--methods", "topfrac:frac=0.5",
                      "psd:policy=topfrac,frac=0.5,d=2", "--limit", "3", "--gen-length", "16", "--block-length", "8",
                      "--out", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    methods = {json.loads(l)["method"] for l in out.read_text().splitlines()}
    assert methods == {"greedy", "topfrac(0.5)", "psd(topfrac(0.5),d=2,policy)"}


def test_the_table_is_gone_with_the_entry():
    assert "topfrac" not in METHODS and "frac" not in OPTIONS
    assert policy_methods() == ("greedy", "topk", "confidence", "localleap", "left", "random", "threshold", "eb")


def test_options_that_do_not_apply_are_errors():
    for method, opts, msg in [
        ("greedy", {"threshold": 0.5}, "threshold applies to"),
        ("confidence", {"steps": 8}, "steps applies to topk, random and psd, not to confidence"),
        ("greedy", {"depth": 2}, "draft depth applies to spiffy and psd, not to greedy"),
        ("greedy", {"acceptance": "exact"}, "acceptance mode applies to psd, not to greedy"),
        ("psd", {"policy_name": "greedy", "threshold": 0.5}, "threshold applies to"),
        ("lopa", {"depth": 2}, "draft depth applies to"),
    ]:
        with pytest.raises(InputError, match=msg):
            DecodeConfig(method=method, **opts).validate()
    from engine import DraftGraph

    with pytest.raises(InputError, match="not both"):
        DecodeConfig(method="psd", graph=DraftGraph.chain(2), depth=2).validate()
    with pytest.raises(InputError, match="unknown decoding option 'nope'"):
        DecodeConfig(method="greedy", nope=1)
    for name, bad in (("gen_length", "64"), ("threshold", True), ("seed", 2 ** 64), ("temperature", float("inf"))):
        with pytest.raises(InputError):
            DecodeConfig(method="confidence", **{name: bad}).validate()


def test_every_option_is_described_and_taken_by_someone():
    for o in OPTIONS.values():
        assert o.help and (o.general or methods_taking(o.name)), o.name
    assert set(methods_taking("k")) == {"lopa", "ete", "fdm"}
    assert set(methods_taking("threshold")) == {"confidence", "localleap", "left", "threshold", "psd", "lopa", "ete",
                                                "fdm"}


def test_decode_config_attributes_are_the_option_table():
    """Every option of the table, a policy's declared ones included, is a typed field of DecodeConfig
    (derived from the table, engine/config.py `_derive_fields`), annotated with the table's kind
    (`kind | None` where the default is None), and set on the instance (not looked up on demand)."""
    import typing

    hints = typing.get_type_hints(DecodeConfig)
    declared = {o.name for m in METHODS.values() for o in getattr(m.policy, "declares", ())}
    assert declared and declared <= set(hints)
    assert list(hints) == ["method", *OPTIONS] and hints["method"] is str
    for name, option in OPTIONS.items():
        assert hints[name] == (option.kind if option.default is not None else option.kind | None), name
    assert hints["k"] is int and hints["threshold"] == float | None and hints["schedule"] == str | None
    cfg = DecodeConfig(method="confidence", threshold=0.5)
    assert vars(cfg)["threshold"] == 0.5 and vars(cfg)["gen_length"] == OPTIONS["gen_length"].default
    assert vars(cfg)["steps"] is None and vars(cfg)["schedule"] is None
