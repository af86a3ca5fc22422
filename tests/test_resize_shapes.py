"""NOTE [resize traced by shape]: in dynamo's fake propagation of a kimi_cg frame, ``F.interpolate`` gives the
output's metadata without running the upsample decompositions; nothing else changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kimi_cg
from kimi_cg import dynamo_settings, resize_shapes

# (mode, input dims, F.interpolate keyword arguments)
CASES = [("nearest", 3, {}), ("linear", 3, {"align_corners": False}), ("nearest", 4, {}),
         ("bilinear", 4, {"align_corners": True}), ("bicubic", 4, {"align_corners": False}),
         ("bilinear", 4, {"antialias": True}), ("bicubic", 4, {"antialias": True}), ("nearest", 5, {}),
         ("trilinear", 5, {"align_corners": False})]


def _fake_resize(monkeypatch, mode, dims, kwargs, active, channels_last=False, unbacked=False):
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    monkeypatch.setattr(dynamo_settings, "active", lambda: active)
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env), enable_python_dispatcher():
        input = torch.empty(2, 3, *(5, 6, 7)[:dims - 2])
        if channels_last:
            input = input.contiguous(memory_format=torch.channels_last)
        size = [4, 9, 3][:dims - 2]
        if unbacked:
            size = [shape_env.create_unbacked_symint() for _ in size]
            for s in size:
                torch._check(s >= 1)
        before = dict(kimi_cg.counters)
        output = F.interpolate(input, size=size, mode=mode, **kwargs)
        by_shape = kimi_cg.counters["resizes_traced_by_shape"] - before.get("resizes_traced_by_shape", 0)
        return output, by_shape


@pytest.mark.parametrize("mode,dims,kwargs", CASES, ids=[f"{m}{d}d{'-aa' if k.get('antialias') else ''}"
                                                         for m, d, k in CASES])
def test_the_metadata_is_the_decompositions(monkeypatch, mode, dims, kwargs):
    layouts = [False, True] if dims == 4 else [False]
    for channels_last in layouts:
        want, taken = _fake_resize(monkeypatch, mode, dims, kwargs, active=False, channels_last=channels_last)
        assert taken == 0
        got, taken = _fake_resize(monkeypatch, mode, dims, kwargs, active=True, channels_last=channels_last)
        assert taken == 1, "the call did not reach the wrapped kernel"
        assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), want.dtype, want.device)


def test_unbacked_sizes_take_the_short_path(monkeypatch):
    got, taken = _fake_resize(monkeypatch, "bicubic", 4, {"align_corners": False}, active=True, unbacked=True)
    assert taken == 1 and got.shape[:2] == (2, 3)


def test_real_tensors_and_recording_traces_run_the_decomposition(monkeypatch):
    """Outside dynamo's fake propagation (real tensors, make_fx) the wrapped kernels are torch's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(dynamo_settings, "active", lambda: True)
    before = kimi_cg.counters["resizes_traced_by_shape"]
    x = torch.randn(1, 2, 5, 6)
    want = F.interpolate(x, size=(7, 3), mode="bicubic", align_corners=False)
    graph = make_fx(lambda t: F.interpolate(t, size=(7, 3), mode="bicubic", align_corners=False),
                    tracing_mode="fake")(x)
    assert torch.equal(graph(x), want)
    assert any("upsample" in str(node.target) or "index" in str(node.target) for node in graph.graph.nodes)
    assert kimi_cg.counters["resizes_traced_by_shape"] == before


class ResizedTable(torch.nn.Module):
    """A learned position table resized to each item's size (MoonViT's way), added to the rows."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.table = torch.nn.Parameter(torch.randn(1, 4, 6, 6))

    def forward(self, rows, grid_hw):
        pieces = []
        for h, w in grid_hw.tolist():
            resized = F.interpolate(self.table, size=(h, w), mode=self.mode)
            pieces.append(resized.flatten(2)[0].t())
        return rows + torch.cat(pieces)


@pytest.mark.parametrize("mode", ["bicubic", "bilinear", "nearest"])
def test_a_tower_that_resizes_per_item_traces_and_equals_eager(mode):
    torch.manual_seed(0)
    model = ResizedTable(mode).eval()
    compiled = torch.compile(model, backend="kimi_cg")
    for sizes in ([[3, 5]], [[4, 4], [2, 7]], [[5, 3], [6, 6], [1, 9]], [[2, 2], [7, 3]]):
        grid = torch.tensor(sizes)
        rows = torch.randn(int(grid.prod(-1).sum()), 4)
        want, got = model(rows, grid), compiled(rows, grid)
        assert got.shape == want.shape and not torch.isnan(got).any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert kimi_cg.counters["resizes_traced_by_shape"] >= 6, dict(kimi_cg.counters)
    assert kimi_cg.counters["graph_breaks"] == kimi_cg.counters["lift_fallbacks"] == 0, dict(kimi_cg.counters)
    assert kimi_cg.counters["call_fallbacks"] == 0, dict(kimi_cg.counters)


def test_other_compiles_run_the_decomposition():
    model = ResizedTable("bicubic").eval()
    grid = torch.tensor([[3, 4]])
    rows = torch.randn(12, 4)
    torch.testing.assert_close(torch.compile(model, backend="aot_eager")(rows, grid), model(rows, grid))
    assert kimi_cg.counters["resizes_traced_by_shape"] == 0


@pytest.mark.parametrize("by_shape, regions", [(True, False), (False, False), (True, True)])
def test_trace_bench_runs_on_cpu(tmp_path, by_shape, regions):
    """scripts/trace_bench.py (trace time per item count) on the tiny reference tower, with and without;
    with its blocks marked as nested compile regions, its outputs are compared with eager's."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "trace.json"
    command = [sys.executable, "-P", "scripts/trace_bench.py", "--family", "moonvit", "--smoke-test-on-cpu",
               "--max-items", "3", "--out", str(out)] + ([] if by_shape else ["--no-resize-by-shape"])
    command += ["--blocks-as-regions"] if regions else []
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [c["items"] for c in report["counts"]] == [1, 2, 3] and report["resize_by_shape"] == by_shape
    assert (report["counters"].get("resizes_traced_by_shape", 0) > 0) == by_shape
    if regions and dynamo_settings.TORCH_2_13:
        assert report["blocks_as_regions"] == ["MoonVitEncoderLayer"]
        assert report["max_abs_difference_vs_eager_at_the_largest_count"] <= 1e-5
    else:
        assert not report["blocks_as_regions"] and report["max_abs_difference_vs_eager_at_the_largest_count"] is None
    assert report["counters"].get("call_fallbacks", 0) == 0 and report["counters"].get("graph_breaks", 0) == 0
