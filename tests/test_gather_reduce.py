"""GatherReducePass: ``x[index].mean(dim)`` with a grid-made index becomes a merge gather that buckets
pad (Kimi-K2.5's temporal merge as transformers 5.17 writes it)."""

import pytest
import torch

import kimi_cg
from kimi_cg.canonicalize.gather_reduce import reduce_plan
from kimi_cg.errors import UnsupportedGraphError

BUCKETS = {"cuda_graphs": True, "token_budgets": [32, 64, 128, 256]}


@pytest.mark.parametrize("dim", [1, 2, -2])
@pytest.mark.parametrize("mean", [True, False])
def test_reduce_plan_computes_what_indexing_and_reduction_compute(dim, mean):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(30, 5, generator=generator, dtype=torch.float64)
    index = torch.randint(-30, 30, (6, 3, 4), generator=generator)
    want = x[index].mean(dim=dim) if mean else x[index].sum(dim=dim)
    plan_index, plan_weight = reduce_plan(index, dim % 4, 30, mean)  # axes of x[index]: 3 index axes + D
    assert (plan_index >= 0).all() and (plan_index < 30).all()
    got = (x[plan_index] * plan_weight.double()[..., None]).sum(1).view(want.shape)
    torch.testing.assert_close(got, want)


def test_reduce_plan_rejects_what_indexing_rejects():
    with pytest.raises(UnsupportedGraphError, match="out of range"):
        reduce_plan(torch.tensor([[0, 30]]), 1, 30, True)
    with pytest.raises(UnsupportedGraphError, match="out of range"):
        reduce_plan(torch.tensor([[0, -31]]), 1, 30, True)


class FrameMeanMerge(torch.nn.Module):
    """Per item [t, h, w]: every 2 x 2 block of patches of each frame, averaged over the frames
    (an index [merged, t, 4] made from the grid, then mean over the frame axis)."""

    def __init__(self, reduce="mean", negative=False):
        super().__init__()
        self.proj = torch.nn.Linear(6, 8)
        self.reduce, self.negative = reduce, negative

    def forward(self, x, grid):
        hidden = self.proj(x)
        rows, start = [], 0
        for t, h, w in grid.tolist():
            base = torch.arange(start, start + t * h * w).view(t, h // 2, 2, w // 2, 2)
            rows.append(base.permute(1, 3, 0, 2, 4).reshape(h // 2 * w // 2, t, 4))
            start += t * h * w
        index = torch.cat(rows)
        if self.negative:
            index = index - hidden.shape[0]
        gathered = hidden[index]
        merged = gathered.mean(dim=1) if self.reduce == "mean" else gathered.sum(dim=1)
        return merged.reshape(merged.shape[0], -1)


GRIDS = [
    [[1, 4, 6]],
    [[1, 4, 4], [1, 6, 2]],
    [[2, 2, 4], [2, 6, 2]],
    [[4, 4, 4], [4, 2, 6]],
    [[1, 8, 4], [1, 2, 6], [1, 4, 2]],
    [[1, 16, 14]],  # 224 rows: the largest bucket
]


def _inputs(grid, seed):
    rows = sum(t * h * w for t, h, w in grid)
    return torch.randn(rows, 6, generator=torch.Generator().manual_seed(seed)), torch.tensor(grid)


@pytest.mark.parametrize("reduce, negative", [("mean", False), ("sum", False), ("mean", True)])
def test_a_gather_reduced_over_frames_replays_padded_and_matches_eager(reduce, negative):
    model = FrameMeanMerge(reduce, negative)
    compiled = torch.compile(model, backend="kimi_cg", options=BUCKETS)
    for seed, grid in enumerate(GRIDS):
        args = _inputs(grid, seed)
        with torch.no_grad():
            want, got = model(*args), compiled(*args)
        assert got.shape == want.shape and not torch.isnan(got).any(), grid
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    counters = dict(kimi_cg.counters)
    assert counters.get("lift_fallbacks", 0) == counters.get("call_fallbacks", 0) == 0, counters
    # Every call replays a bucket: before the rewrite the index's frame axis kept calls unpadded.
    assert counters.get("eager_fallbacks", 0) == 0 and counters.get("padding_hazards", 0) == 0, counters


def test_an_index_out_of_range_raises_eager_error():
    model = FrameMeanMerge()
    compiled = torch.compile(model, backend="kimi_cg", options=BUCKETS)
    for seed, grid in enumerate(GRIDS[:3]):
        compiled(*_inputs(grid, seed))
    x, grid = _inputs([[1, 4, 4], [1, 6, 2]], 9)
    short = x[:-4]  # the grid names rows the call does not have
    with pytest.raises(IndexError) as eager:
        model(short, grid)
    with pytest.raises(IndexError) as error:
        compiled(short, grid)
    assert str(eager.value).splitlines()[0] in str(error.value)
