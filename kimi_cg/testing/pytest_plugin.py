"""A pytest plugin: the ``kimi_cg_fuzz`` fixture makes "compiled == eager on every grid" one test.

Enable it in a conftest.py with ``pytest_plugins = ["kimi_cg.testing.pytest_plugin"]`` (it is not
loaded automatically: installing kimi_cg changes no one's test runs), then::

    def test_my_tower_compiles_exactly(kimi_cg_fuzz):
        kimi_cg_fuzz(MyTower(config).eval(), make_inputs, grids=kimi_cg.testing.grids(max_items=4))

The fixture starts each test with fresh dynamo caches and zeroed kimi_cg counters, compiles the model
with ``backend="kimi_cg"`` (keyword ``options=``), runs ``assert_matches_eager`` with the remaining
keywords and returns its report. ``--kimi-cg-examples N`` and ``--kimi-cg-seed S`` set the defaults
of ``max_examples`` and ``seed`` for the run.
"""

from __future__ import annotations

import pytest
import torch

import kimi_cg
from kimi_cg.testing.check import assert_matches_eager


def pytest_addoption(parser):
    group = parser.getgroup("kimi_cg")
    group.addoption("--kimi-cg-examples", type=int, default=None, help="kimi_cg_fuzz: examples per test (default 50)")
    group.addoption("--kimi-cg-seed", type=int, default=None, help="kimi_cg_fuzz: hypothesis and input seed (default 0)")


@pytest.fixture
def kimi_cg_fuzz(request):
    torch._dynamo.reset()
    kimi_cg.reset()
    examples, seed = request.config.getoption("--kimi-cg-examples"), request.config.getoption("--kimi-cg-seed")

    def fuzz(model, make_inputs, grids=None, *, compiled=None, **keywords):
        if examples is not None:
            keywords.setdefault("max_examples", examples)
        if seed is not None:
            keywords.setdefault("seed", seed)
        return assert_matches_eager(model, compiled, make_inputs, grids, **keywords)

    yield fuzz
    torch._dynamo.reset()
