"""Models whose forward asserts the way upstream code does (tests/test_asserts.py). A module of its own:
pytest rewrites the asserts of test modules into other bytecode, which is not what users' code runs."""

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
