"""Diagnostics that point at the right fix: graph breaks, skipped frames, once per source location."""

from __future__ import annotations

import logging

import torch

import kimi_cg


class BranchesOnAGridValue(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, grid):
        y = self.lin(x)
        if grid[0, 0].item() > 2:  # a value branch: torch._check would change the program
            return y * 2
        return y


class AssertsOnAGridValue(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, grid):
        y = self.lin(x)
        assert grid[0, 0].item() <= 8 and grid[0, 1].item() <= 8  # `and` needs a Python bool: a break
        return y


class AssertsInALoop(torch.nn.Module):
    """Upstream MoonViT's RoPE bounds check: a generator over unbacked values inside the frame."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, grid):
        shapes = grid.tolist()
        assert all(1 <= h <= 64 and 1 <= w <= 64 for h, w in shapes)
        return self.lin(x)


def _run(model, grids, caplog):
    compiled = torch.compile(model, backend="kimi_cg")
    with caplog.at_level(logging.WARNING, logger="kimi_cg"):
        for grid in grids:
            x, grid_tensor = torch.randn(6, 4), torch.tensor(grid)
            torch.testing.assert_close(compiled(x, grid_tensor), model(x, grid_tensor))
    return [record.getMessage() for record in caplog.records if record.name.startswith("kimi_cg")]


def test_a_value_branch_is_not_told_to_become_a_check(caplog):
    messages = _run(BranchesOnAGridValue(), ([[3, 2]], [[1, 6]], [[4, 1]], [[2, 3]]), caplog)
    breaks = [m for m in messages if "graph break" in m]
    assert len(breaks) == 1, messages  # once per source location, although dynamo retraces
    assert "torch.where" in breaks[0] and "torch.cond" in breaks[0]
    assert "if grid[0, 0].item() > 2" in breaks[0]
    assert kimi_cg.counters["graph_breaks"] >= 1


def test_an_assert_is_told_to_become_a_check(caplog):
    messages = _run(AssertsOnAGridValue(), ([[3, 2]], [[1, 6]]), caplog)
    breaks = [m for m in messages if "graph break" in m or "skipped" in m]
    assert breaks and all("torch._check" in m for m in breaks), messages


def test_a_skipped_frame_is_reported(caplog):
    messages = _run(AssertsInALoop(), ([[3, 2]], [[1, 6]]), caplog)
    reported = [m for m in messages if "graph break" in m or "skipped" in m]
    assert reported and all("torch._check" in m for m in reported), messages
    assert kimi_cg.counters["graph_breaks"] + kimi_cg.counters["frames_skipped"] >= 1
