"""Every policy of the method table keeps every contract of engine/testing/contracts.py, with its own
defaults: a policy registered with `engine.register` is checked here without editing this file
(and a policy of a test module's own by subclassing `PolicyContract` there, as test_methods.py does)."""
from __future__ import annotations

import pytest

from engine.testing.contracts import PolicyContract, causal_model, contract_model  # noqa: F401  (fixtures)
from engine.methods import policy_methods


class TestEveryPolicy(PolicyContract):
    @pytest.fixture(params=policy_methods())
    def policy_case(self, request):
        return request.param, {}
