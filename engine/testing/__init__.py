"""Test helpers for code built on the engine (your own policies, methods, plugins): import them in
your own pytest files. Nothing in the engine imports this package; it needs pytest.

    from engine.testing.contracts import PolicyContract, contract_model, causal_model  # noqa: F401

    class TestMyPolicyContract(PolicyContract):
        @pytest.fixture
        def policy_case(self, my_registration):        # registers the policy, returns (method, options)
            return "mypolicy", {"my_option": 0.5}

`contracts.PolicyContract`: every check the project's own policies pass (docs/algorithms.md §2-§3).
`hostsync.SyncCounter` / `Profile`: the host reads a decode makes per step and inside model calls.
With `PSD_PLUGINS=my_policies python -m pytest tests/test_contracts.py` the project's own contract
run covers the plugin's policies too (tests/conftest.py loads them).
"""
