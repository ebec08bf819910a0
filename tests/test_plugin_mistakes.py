"""What a plugin author gets wrong (engine/policies.py, engine/methods.py, engine/options.py): each is
one clear error naming the policy or option, never a decode that is silently wrong, a traceback from
deep in the loop, or a run that never ends."""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from engine import Method, Policy, generate, register
from engine.errors import DecodingError
from engine.methods import unregister
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
