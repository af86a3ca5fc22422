"""Towers whose repeated blocks are nested compile regions (NOTE [compile regions inlined]): dynamo traces
one block and reuses it, kimi_cg inlines the calls back and lifts the graph as if dynamo had inlined them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import kimi_cg
import kimi_cg.backend as kimi_cg_backend
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel
from kimi_cg.models.moonvit import MoonVitEncoderLayer
from kimi_cg.dynamo_settings import TORCH_2_13
from kimi_cg.warmup import mark_repeated_blocks

GRIDS = [[[4, 6]], [[6, 4], [2, 8]], [[8, 8], [4, 4], [2, 6]], [[2, 2], [6, 6]]]


def _pixels(grid: torch.Tensor, seed: int) -> torch.Tensor:
    rows = int((grid[:, 0] * grid[:, 1]).sum())
    return torch.randn(rows, 3, 14, 14, generator=torch.Generator().manual_seed(seed))


def _features(grid: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(int((grid[:, 0] * grid[:, 1]).sum()), 8, generator=torch.Generator().manual_seed(seed))


def _compiled_with_regions(monkeypatch, block_class, model):
    """``model`` compiled with kimi_cg, ``block_class`` marked as a region (undone after the test), and the
    list that receives every graph dynamo hands the backend."""
    monkeypatch.setattr(block_class, "forward", torch.compiler.nested_compile_region(block_class.forward))
    graphs = []
    monkeypatch.setattr(kimi_cg_backend, "report_graph_break", graphs.append)
    return torch.compile(model, backend="kimi_cg"), graphs


def _regions_in(graphs) -> int:
    return sum(node.target is torch.ops.higher_order.invoke_subgraph for gm in graphs for node in gm.graph.nodes)


def test_mark_repeated_blocks_marks_the_block_class_once(monkeypatch):
    monkeypatch.setattr(MoonVitEncoderLayer, "forward", MoonVitEncoderLayer.forward)  # undone after the test
    model = MoonVitPretrainedModel(MoonVitConfig.tiny(num_hidden_layers=3)).eval()
    before = MoonVitEncoderLayer.forward
    if not TORCH_2_13:  # torch 2.11 reuses no traced block: nothing is marked
        assert mark_repeated_blocks(model) == [] and MoonVitEncoderLayer.forward is before
        return
    assert mark_repeated_blocks(model) == [MoonVitEncoderLayer]
    marked = MoonVitEncoderLayer.forward
    assert marked is not before and hasattr(marked, "__marked_compile_region_fn__")
    assert mark_repeated_blocks(model) == [MoonVitEncoderLayer] and MoonVitEncoderLayer.forward is marked


def test_marked_blocks_are_inlined_and_lifted(monkeypatch):
    # Marked by hand, as on any torch (mark_repeated_blocks marks nothing before 2.13).
    monkeypatch.setattr(MoonVitEncoderLayer, "forward", torch.compiler.nested_compile_region(MoonVitEncoderLayer.forward))
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny(num_hidden_layers=4)).eval()
    compiled = torch.compile(model, backend="kimi_cg")
    for seed, grid in enumerate(GRIDS):
        grid = torch.tensor(grid)
        pixels = _pixels(grid, seed)
        got, want = compiled(pixels, grid), model(pixels, grid)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    counters = dict(kimi_cg.counters)
    assert counters.get("compile_region_calls_inlined", 0) >= 4 * 2, counters  # 4 blocks, at least 2 traces
    assert counters.get("lift_fallbacks", 0) == 0 and counters.get("call_fallbacks", 0) == 0, counters
    assert counters.get("device_programs_run", 0) >= 1, counters


class _WritingBlock(nn.Module):
    """Writes in place into a view of its input's clone and into a view of a tensor it makes: the
    aliasing analysis must keep each inlined copy's writes with that copy's tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).clone()
        y[:, :2].mul_(2.0)
        buffer = torch.zeros_like(y)
        buffer[:, 4:].copy_(y[:, 4:] * scale)
        return y + buffer


class _Tower(nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(_WritingBlock() for _ in range(blocks))

    def forward(self, x: torch.Tensor, grid_hws: torch.Tensor) -> list[torch.Tensor]:
        scale = (grid_hws[:, 0] * grid_hws[:, 1]).sum().to(x.dtype) / 64
        for block in self.blocks:
            x = block(x, scale)
        out, start = [], 0
        for h, w in grid_hws.tolist():
            out.append(x[start : start + h * w])
            start += h * w
        return out


def test_regions_that_write_in_place_match_eager(monkeypatch):
    torch.manual_seed(0)
    model = _Tower(3).eval()
    compiled, graphs = _compiled_with_regions(monkeypatch, _WritingBlock, model)
    for seed, grid in enumerate(GRIDS):
        grid = torch.tensor(grid)
        x = _features(grid, seed)
        for g, w in zip(compiled(x, grid), model(x, grid), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert _regions_in(graphs) > 0  # dynamo made regions: this tests the inlining, not plain inlined blocks
    counters = dict(kimi_cg.counters)
    assert counters.get("compile_region_calls_inlined", 0) > 0 and counters.get("lift_fallbacks", 0) == 0, counters


class _ItemBlock(nn.Module):
    """Reads a value of its input inside the region (an unbacked symbol bound in the subgraph), as
    MoonViT's blocks check ``cu_seqlens[-1].item()`` against the rows."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        total = lengths.sum().item()
        torch._check(total == x.shape[0])
        return self.lin(x)


class _ItemTower(nn.Module):
    def __init__(self, same_lengths: bool):
        super().__init__()
        self.same_lengths = same_lengths
        self.blocks = nn.ModuleList(_ItemBlock() for _ in range(3))

    def forward(self, x: torch.Tensor, grid_hws: torch.Tensor) -> torch.Tensor:
        lengths = grid_hws[:, 0] * grid_hws[:, 1]
        for block in self.blocks:  # equal lengths either way; computed again, they are other graph values
            x = block(x, lengths if self.same_lengths else grid_hws[:, 0] * grid_hws[:, 1])
        return x


@pytest.mark.parametrize("same_lengths", [True, False])
def test_regions_that_bind_unbacked_symbols(monkeypatch, same_lengths):
    """The same lengths in every call: the binding is made once and the graph lifts. Lengths that are
    other graph values in each call (equal here, but kimi_cg cannot know): one symbol for every copy could
    be wrong, so the graph runs unlifted. Both equal eager."""
    torch.manual_seed(0)
    model = _ItemTower(same_lengths).eval()
    compiled, graphs = _compiled_with_regions(monkeypatch, _ItemBlock, model)
    for seed, grid in enumerate(GRIDS):
        grid = torch.tensor(grid)
        x = _features(grid, seed)
        try:
            got = compiled(x, grid)
        except torch._dynamo.exc.UncapturedHigherOrderOpError:
            pytest.skip("this torch cannot trace a region that binds unbacked symbols (dynamo's error, not kimi_cg's)")
        torch.testing.assert_close(got, model(x, grid), rtol=1e-5, atol=1e-5)
    if not _regions_in(graphs):
        pytest.skip("dynamo inlined the blocks itself: nothing for kimi_cg to inline")
    counters = dict(kimi_cg.counters)
    if same_lengths:
        assert counters.get("compile_region_calls_inlined", 0) > 0 and counters.get("lift_fallbacks", 0) == 0, counters
    else:
        assert counters.get("lift_fallbacks", 0) > 0 and "nested compile region kimi_cg cannot inline" in kimi_cg.fallbacks


@pytest.mark.skipif(not TORCH_2_13, reason="mark_repeated_blocks marks nothing before torch 2.13")
def test_blocks_with_their_own_forward_are_not_marked(monkeypatch):
    monkeypatch.setattr(MoonVitEncoderLayer, "forward", MoonVitEncoderLayer.forward)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny(num_hidden_layers=2)).eval()
    for block in model.encoder.blocks:  # as hooks that wrap each instance do
        block.forward = block.forward
    before = MoonVitEncoderLayer.forward
    assert mark_repeated_blocks(model) == [] and MoonVitEncoderLayer.forward is before


class _InputWritingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, :2].mul_(2.0)  # writes its input, through a view
        return self.lin(x)


class _InputWritingTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_InputWritingBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x.clone())
        return x


def test_each_inlined_copy_writes_its_own_input(monkeypatch):
    """The copies share one set of fake tensors; the aliasing analysis must still put each copy's write in
    the group of that call's input (its own clone), not of the first call's."""
    from kimi_cg.aliasing import Aliasing
    from kimi_cg.canonicalize import InlineRegionsPass
    from kimi_cg.capture import working_copy

    monkeypatch.setattr(_InputWritingBlock, "forward", torch.compiler.nested_compile_region(_InputWritingBlock.forward))
    graphs = []
    model = _InputWritingTower().eval()
    compiled = torch.compile(model, backend=lambda gm, example_inputs: (graphs.append(gm), gm.forward)[1])
    x = torch.randn(5, 8)
    torch.testing.assert_close(compiled(x), model(x))
    (gm,) = graphs
    if _regions_in(graphs) != 3:
        pytest.skip("dynamo did not make one region call per block")
    work = working_copy(gm)
    InlineRegionsPass()(work)
    clones = [n for n in work.graph.nodes if n.op == "call_method" and n.target == "clone"]
    groups = Aliasing(work.graph).groups
    assert len(clones) == 3 and len(groups) == 3
    for clone in clones:
        (group,) = [g for g in groups if clone in g.members]
        assert len(group.writes) == 1 and not any(other in group.members for other in clones if other is not clone)


class _BranchingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on a value: a graph break, so dynamo cannot trace the block whole
            x = x * 2
        return self.lin(x)


class _BranchingTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_BranchingBlock() for _ in range(3))

    def forward(self, x: torch.Tensor, grid_hws: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_marked_block_with_a_graph_break_runs_as_eager_does(monkeypatch):
    """NOTE [regions fall back]: dynamo would raise UncapturedHigherOrderOpError (never suppressed) for a
    region it cannot trace whole; in kimi_cg frames the block becomes a graph break instead, and another
    compile of the same tower still sees dynamo's own behaviour."""
    monkeypatch.setattr(_BranchingBlock, "forward", torch.compiler.nested_compile_region(_BranchingBlock.forward))
    model = _BranchingTower().eval()
    for seed, grid in enumerate([[[1, 5]], [[2, 3]], [[1, 4], [1, 2]]]):
        grid = torch.tensor(grid)
        x = _features(grid, seed) * (1 if seed % 2 else -1)  # both sides of the branch
        torch.testing.assert_close(torch.compile(model, backend="kimi_cg")(x, grid), model(x, grid))
    assert kimi_cg.counters.get("graph_breaks", 0) > 0
    with pytest.raises(torch._dynamo.exc.UncapturedHigherOrderOpError):
        torch.compile(model, backend="eager")(x, grid)
