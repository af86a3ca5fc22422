"""NOTE [asserts with a computed message] (kimi_cg/asserts.py): asserts on grid values whose message is
an expression trace without a graph break in kimi_cg's frames; asserts on activations keep their break
(and eager's AssertionError); other backends' compiles see dynamo unchanged. The models live in
tests/upstream_forms.py: pytest rewrites the asserts of test modules into other bytecode."""

from __future__ import annotations

import pytest
import torch

import kimi_cg
from upstream_forms import ActivationAssert, GridAssert, assert_compiled_matches_eager
from kimi_cg.errors import InvalidInputError

OPTIONS = {"cuda_graphs": True, "token_budgets": [32, 64, 128]}
GRIDS = ([[4, 6]], [[2, 4], [6, 2]], [[2, 2], [4, 4]], [[4, 4]])


@pytest.mark.parametrize("chained", [False, True], ids=["plain", "chained"])
def test_grid_assert_with_a_computed_message_traces_without_a_break(chained):
    model = GridAssert(chained)
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    assert_compiled_matches_eager(compiled, model, GRIDS)
    counters = dict(kimi_cg.counters)
    assert counters.get("graph_breaks", 0) == 0 and counters.get("frames_skipped", 0) == 0, counters
    assert counters["asserts_with_computed_messages"] >= 1 + chained, counters
    assert counters.get("padded_runs", 0) == len(GRIDS) and counters.get("eager_fallbacks", 0) == 0, counters
    # A failing assert is the caller's error, named by its source line (eager: AssertionError).
    grid, x = torch.tensor([[4, 4]]), torch.randn(15, 8)
    with pytest.raises(AssertionError):
        model(x, grid)
    with pytest.raises(InvalidInputError, match="assertion failed at .*upstream_forms.py:[0-9]+: assert cu_seqlens"):
        with torch.no_grad():
            compiled(x, grid)


def test_activation_assert_keeps_its_break_and_eager_error():
    """A condition on activations would be a device-side assert inside a CUDA graph (fatal to the
    process's CUDA context where eager raises): dynamo's graph break and eager's AssertionError stay."""
    model = ActivationAssert()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    assert_compiled_matches_eager(compiled, model, GRIDS)
    assert kimi_cg.counters["asserts_with_computed_messages"] == 0, dict(kimi_cg.counters)
    assert kimi_cg.counters["graph_breaks"] >= 1, dict(kimi_cg.counters)
    grid = torch.tensor([[4, 4]])
    x = torch.randn(16, 8)
    x[3, 1] = float("nan")
    with pytest.raises(AssertionError):
        with torch.no_grad():
            compiled(x, grid)


def test_other_backends_trace_asserts_as_dynamo_does():
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    kimi_cg.reset()  # the backend module is imported: its detector is installed
    model = GridAssert()
    compiled = torch.compile(model, backend=counting_backend)
    grid = torch.tensor([[4, 6]])
    x = torch.randn(24, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, grid), model(x, grid))
    assert len(graphs) >= 2, graphs  # dynamo breaks at the assert outside kimi_cg's frames
    assert kimi_cg.counters["asserts_with_computed_messages"] == 0, dict(kimi_cg.counters)
