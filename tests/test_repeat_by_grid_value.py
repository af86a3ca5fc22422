"""NOTE [repeat by a grid value] (kimi_cg/repeat_by_grid_value.py): ``repeat_interleave`` by an unbacked count
traces in kimi_cg frames on every supported torch, with the composite's own ops and values."""

from __future__ import annotations

import pytest
import torch

import kimi_cg
from kimi_cg import dynamo_settings

CASES = [((5,), None), ((3, 4), None), ((3, 4), 0), ((3, 4), 1), ((3, 4), -1), ((2, 3, 4), 1), ((0, 3), 1)]


@pytest.mark.parametrize("shape,dim", CASES)
def test_the_traced_ops_give_the_composites_values(monkeypatch, shape, dim):
    """A recording trace with a symbolic count (from ``.item()``; make_fx gives it a hint, so it counts as a
    grid value here) runs the kernel's ops; the graph equals eager bit for bit at every count, 0 included."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    from kimi_cg import repeat_by_grid_value

    monkeypatch.setattr(dynamo_settings, "active", lambda: True)
    monkeypatch.setattr(repeat_by_grid_value, "_unbacked", lambda value: isinstance(value, torch.SymInt))
    before = kimi_cg.counters["repeats_by_grid_value"]

    def repeat(x, count):
        n = count.item()
        torch._check(n >= 0)
        return x.repeat_interleave(n) if dim is None else x.repeat_interleave(n, dim)

    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    with enable_python_dispatcher():  # as dynamo's and AOT's traces run
        graph = make_fx(repeat, tracing_mode="symbolic")(x, torch.tensor(2))
    assert kimi_cg.counters["repeats_by_grid_value"] == before + 1
    assert any(node.target is torch.ops.aten.expand.default for node in graph.graph.nodes)
    for count in (0, 1, 3):
        want = repeat(x, torch.tensor(count))
        got = graph(x, torch.tensor(count))
        assert got.shape == want.shape and got.is_contiguous() and torch.equal(got, want), count


def test_an_unbacked_count_gets_a_runtime_check_instead_of_a_guard(monkeypatch):
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    monkeypatch.setattr(dynamo_settings, "active", lambda: True)
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env), enable_python_dispatcher():
        h, w = shape_env.create_unbacked_symint(), shape_env.create_unbacked_symint()
        out = torch.empty(3, dtype=torch.int64).repeat_interleave(h * w)  # torch 2.11's composite guards here
    assert kimi_cg.counters["repeats_by_grid_value"] == 1 and out.shape[0] == 3 * h * w
    assert shape_env.deferred_runtime_asserts, "the count's check is a runtime assertion"


def test_outside_kimi_cg_traces_the_composite_runs(monkeypatch):
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(dynamo_settings, "active", lambda: False)
    x = torch.arange(6.0).reshape(2, 3)
    with enable_python_dispatcher():
        graph = make_fx(lambda t: t.repeat_interleave(2, 1), tracing_mode="symbolic")(x)
    assert torch.equal(graph(x), x.repeat_interleave(2, 1))
    assert kimi_cg.counters["repeats_by_grid_value"] == 0


class FrameIndexTower(torch.nn.Module):
    """Kimi-K2.5's per-patch frame index (``arange(t) + int(t > 1)`` repeated ``h * w`` times per item) as a
    row embedding of the packed patches."""

    def __init__(self):
        super().__init__()
        self.time = torch.nn.Embedding(8, 4)

    def forward(self, rows, grid_thw):
        parts = []
        for t, h, w in grid_thw.tolist():
            parts.append((torch.arange(t) + int(t > 1)).repeat_interleave(h * w))
        return rows + self.time(torch.cat(parts))


def test_a_frame_index_traces_whole_and_equals_eager():
    torch.manual_seed(0)
    model = FrameIndexTower().eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"cuda_graphs": True, "token_budgets": [32, 64, 128]})
    for grid in ([[1, 4, 6]], [[2, 2, 4], [1, 6, 2]], [[3, 2, 2]], [[1, 2, 2], [4, 2, 4]]):
        grid = torch.tensor(grid)
        rows = torch.randn(int(grid.prod(-1).sum()), 4)
        want, got = model(rows, grid), compiled(rows, grid)
        assert got.shape == want.shape and torch.equal(got, want)
    counters = dict(kimi_cg.counters)
    assert counters.get("repeats_by_grid_value", 0) > 0, counters
    assert counters.get("graph_breaks", 0) == 0 and counters.get("frames_skipped", 0) == 0, counters
    assert counters.get("lift_fallbacks", 0) == 0 and counters.get("call_fallbacks", 0) == 0, counters


def test_a_negative_count_fails_as_eager_fails():
    model = FrameIndexTower().eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"cuda_graphs": True, "token_budgets": [32, 64, 128]})
    rows = torch.randn(4, 4)
    compiled(rows, torch.tensor([[1, 2, 2]]))
    grid = torch.tensor([[1, 2, 2], [1, 2, -2]])  # one item's count is -4
    with pytest.raises(RuntimeError, match="non-negative"):
        model(rows, grid)
    with pytest.raises(RuntimeError):
        compiled(rows, grid)
    assert kimi_cg.counters["invalid_inputs"] == 1, dict(kimi_cg.counters)
