"""Shared fixtures: every test starts with fresh dynamo caches and zeroed kimi_cg counters, in no_grad mode."""


import pytest
import torch

import kimi_cg

# kimi_cg.testing's fixture (kimi_cg_fuzz), as a user enables it.
pytest_plugins = ["kimi_cg.testing.pytest_plugin"]


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    kimi_cg.reset()
    # Tests run as serving runs, without gradients: a call in grad mode with weights that require
    # grad runs the captured graph (kimi_cg is inference-only), which would test the fallback
    # instead of the lifted program. Tests of grad mode enable it themselves.
    with torch.no_grad():
        yield
    torch._dynamo.reset()
