"""Shared fixtures: every test starts with fresh dynamo caches and zeroed kimi_cg counters."""

import pytest
import torch

import kimi_cg


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    kimi_cg.reset()
    yield
    torch._dynamo.reset()
