"""`DecodeConfig` (engine/config.py) is frozen: set once from the option table, changed only by
`replace`, checked once, and its policy and draft graph built once for the checks, the decoder and
the label alike."""
from __future__ import annotations

import pytest

from engine import DecodeConfig, Decoder, DraftGraph, InputError
from engine.methods import METHODS
from models import ModelConfig, init_random


def test_a_config_cannot_be_changed_only_replaced():
    cfg = DecodeConfig(method="psd", depth=2, gen_length=16, block_length=8)
    with pytest.raises(AttributeError, match="frozen"):
        cfg.depth = 3
    with pytest.raises(AttributeError, match="frozen"):
        del cfg.cache
    other = cfg.replace(depth=3)
    assert (cfg.depth, other.depth, other.method, other.gen_length) == (2, 3, "psd", 16)


def test_validated_once_and_the_plan_built_once(monkeypatch):
    cfg = DecodeConfig(method="psd", policy_name="topk", depth=2, gen_length=16, block_length=8)
    checks = []
    topk = METHODS["topk"].policy
    monkeypatch.setattr(topk, "check", classmethod(lambda cls, c: checks.append(c)))
    assert cfg.validate() is cfg and cfg.validate() is cfg and len(checks) == 1
    graph, policy = cfg.draft_graph(), cfg.policy()
    assert cfg.draft_graph() is graph and cfg.policy() is policy
    dec = Decoder(init_random(ModelConfig.tiny("llada"), seed=0), cfg)
    assert dec.graph is graph and dec.policy is policy and len(checks) == 1
    assert cfg.describe().startswith("psd(topk(")


def test_a_bad_config_stays_refused():
    cfg = DecodeConfig(method="psd", graph=DraftGraph.chain(2), depth=2)
    for _ in range(2):
        with pytest.raises(InputError, match="not both"):
            cfg.validate()
