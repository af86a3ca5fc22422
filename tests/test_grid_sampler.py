"""NOTE [grid sampler]: in kimi_cg traces ``F.grid_sample`` is traced as the kernel its composite picks,
without the cuDNN question dynamo cannot answer for an unbacked grid; the same result bit for bit, and
nothing changes outside kimi_cg traces."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.nn.functional as F

import kimi_cg
from kimi_cg import dynamo_settings
from kimi_cg.grid_sampler import grid_sampler


@pytest.mark.parametrize("dims", [4, 5])
def test_the_kernel_is_the_composite_bit_for_bit(monkeypatch, dims):
    monkeypatch.setattr(dynamo_settings, "active", lambda: True)
    torch.manual_seed(0)
    spatial = (5, 7) if dims == 4 else (3, 5, 7)
    input = torch.randn(2, 3, *spatial, dtype=torch.float64)
    grid = torch.rand(2, *(4,) * (dims - 2), dims - 2, dtype=torch.float64) * 2.4 - 1.2  # some points outside
    for mode, padding, align in itertools.product(range(3), range(3), (False, True)):
        try:
            want = torch.grid_sampler(input, grid, mode, padding, align)
        except RuntimeError as error:  # bicubic on a 5-D input: the same error either way
            with pytest.raises(RuntimeError, match=re.escape(str(error).split("\n")[0])):
                grid_sampler(input, grid, mode, padding, align)
            continue
        got = grid_sampler(input, grid, mode, padding, align)
        assert torch.equal(got, want), (mode, padding, align)


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a CUDA build of torch")
def test_an_unbacked_grid_on_cuda_traces_in_kimi_cg_frames(monkeypatch):
    """The break GLM-4V hit on the GPU, reproduced with fake CUDA tensors (no GPU needed)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

    def sample(active, mode, padding, align):
        monkeypatch.setattr(dynamo_settings, "active", lambda: active)
        shape_env = ShapeEnv()
        with FakeTensorMode(shape_env=shape_env), enable_python_dispatcher():
            table = torch.empty(1, 8, 6, 6, device="cuda")
            length = shape_env.create_unbacked_symint()
            torch._check(length >= 0)
            return F.grid_sample(table, table.new_empty((1, length, 1, 2)), mode=mode, padding_mode=padding,
                                 align_corners=align)

    assert sample(True, "bicubic", "border", False).shape[:2] == (1, 8)  # GLM-4V's call
    assert sample(True, "bilinear", "zeros", False).shape[:2] == (1, 8)
    with pytest.raises(GuardOnDataDependentSymNode):  # outside kimi_cg traces: as torch traces it
        sample(False, "bicubic", "border", False)
    with pytest.raises(GuardOnDataDependentSymNode):  # cuDNN's kind: the composite's question stays
        sample(True, "bilinear", "zeros", True)


class ResizedTable(torch.nn.Module):
    """A learned position table sampled at each image's size (GLM-4V's way), added to the rows."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(1, 4, 6, 6))

    def forward(self, rows, grid_hw):
        pieces = []
        for h, w in grid_hw.tolist():
            ys = (torch.arange(h, dtype=torch.float32) + 0.5) / h * 2 - 1
            xs = (torch.arange(w, dtype=torch.float32) + 0.5) / w * 2 - 1
            points = torch.stack([xs.repeat(h), ys.repeat_interleave(w)], -1).view(1, h * w, 1, 2)
            sampled = F.grid_sample(self.table, points, mode="bicubic", padding_mode="border", align_corners=False)
            pieces.append(sampled.view(4, h * w).t())
        return rows + torch.cat(pieces)


def test_kimi_cg_traces_it_directly_and_matches_eager():
    model = ResizedTable().eval()
    compiled = torch.compile(model, backend="kimi_cg")
    for grid in ([[3, 4]], [[5, 2], [2, 2]], [[4, 6]], [[2, 3], [3, 3], [1, 4]]):
        grid = torch.tensor(grid)
        rows = torch.randn(int(grid.prod(-1).sum()), 4)
        want, got = model(rows, grid), compiled(rows, grid)
        assert got.shape == want.shape and not torch.isnan(got).any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert kimi_cg.counters["grid_samplers_traced_direct"] > 0, dict(kimi_cg.counters)
    assert kimi_cg.counters["lift_fallbacks"] == kimi_cg.counters["call_fallbacks"] == 0, dict(kimi_cg.counters)


def test_other_compiles_trace_the_composite():
    model = ResizedTable().eval()
    grid = torch.tensor([[3, 4]])
    rows = torch.randn(12, 4)
    got = torch.compile(model, backend="aot_eager")(rows, grid)
    torch.testing.assert_close(got, model(rows, grid))
    assert kimi_cg.counters["grid_samplers_traced_direct"] == 0


def test_glm4v_samples_its_position_table_directly():
    """transformers' GLM-4V tower (tiny): its bicubic table resize is the call NOTE [grid sampler] is for."""
    from towers import TowerUnavailable, relative_error
    from towers.transformers_towers import FACTORIES

    try:
        tower = FACTORIES["glm4v"]("sdpa", seed=0)
    except TowerUnavailable as reason:
        pytest.skip(str(reason))
    compiled = torch.compile(tower.model, backend="kimi_cg")
    for grid in ([[1, 4, 6]], [[1, 4, 4], [1, 6, 2]]):
        args = tower.make_inputs(grid)
        want = tower.extract_outputs(tower.model(*args))
        got = tower.extract_outputs(compiled(*args))
        for g, w in zip(got, want):
            assert g.shape == w.shape and not torch.isnan(g).any()
            assert relative_error(g, w) <= 1e-5, grid
    assert kimi_cg.counters["grid_samplers_traced_direct"] > 0, dict(kimi_cg.counters)
    assert kimi_cg.counters["graph_breaks"] == kimi_cg.counters["lift_fallbacks"] == 0, dict(kimi_cg.counters)
