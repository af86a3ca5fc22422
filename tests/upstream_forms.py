"""Models written the way upstream towers write a construct kimi_cg must trace (tests/test_asserts.py,
tests/test_grid_comparisons.py). A module of its own: pytest rewrites the asserts of test modules into
other bytecode, which is not what users' code runs."""

from __future__ import annotations

import torch


def _cu_seqlens(grid):
    return torch.nn.functional.pad(grid.prod(-1).cumsum(0), (1, 0)).to(torch.int32)


class GridAssert(torch.nn.Module):
    """Kimi-VL's remote code's form: the packed length checked against cu_seqlens, the message a tuple."""

    def __init__(self, chained: bool = False):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.chained = chained

    def forward(self, x, grid):
        cu_seqlens = _cu_seqlens(grid)
        h = self.lin(x)
        if self.chained:
            assert cu_seqlens[-1] == h.shape[0] == x.shape[0], (cu_seqlens[-1], h.shape[0], x.shape[0])
        else:
            assert cu_seqlens[-1] == h.shape[0], (cu_seqlens[-1], h.shape[0])
        return self.lin(h) * 2


class ActivationAssert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, grid):
        h = self.lin(x)
        assert torch.isfinite(h).all(), (h.abs().max(), grid.shape)
        return self.lin(h) * _cu_seqlens(grid).numel()


class FrameIndex(torch.nn.Module):
    """Kimi-K2.5's temporal index: per item, frame ids shifted by one when the item is a video
    (t > 1), looked up in a table whose row 0 is for images."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(6, 8))
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, grid):
        parts = []
        for t, h, w in grid.tolist():
            frames = torch.arange(t, device=x.device) + int(t > 1)
            parts.append(frames.repeat_interleave(h * w))
        return self.lin(x + self.table[torch.cat(parts)])


def assert_compiled_matches_eager(compiled, model, grids) -> None:
    """Each grid's call, x of 8 features per patch: compiled equal to eager."""
    for grid in grids:
        grid = torch.tensor(grid)
        x = torch.randn(int(grid.prod(-1).sum()), 8)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, grid), model(x, grid))
