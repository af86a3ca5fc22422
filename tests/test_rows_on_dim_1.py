"""Towers whose activations keep a batch of one in front of the rows ([1, L, ...]: transformers'
PaddleOCR-VL patches, HunYuan-VL's layers) run padded in buckets with their rows on dim 1 (NOTE [rows
on dim 1] in kimi_cg/capture.py): equal to eager, never a padded row in an output, and a program that
mixes rows on that dim still runs unpadded."""

import pytest
import torch

import kimi_cg
from kimi_cg.capture import row_dim

BUCKETS = {"cuda_graphs": True, "token_budgets": [32, 64, 128, 256]}
HEADS, HEAD_DIM = 2, 4


class BatchOfOneTower(torch.nn.Module):
    """Patches [1, L, 3, 2] -> per-item attention on [L, H, d] -> a 4-row merge: [1, L / 4, 16], and
    the unmerged rows as [L, 8] (an output with rows on dim 0 from the same program)."""

    def __init__(self, pool_rows: bool = False):
        super().__init__()
        self.embed = torch.nn.Linear(6, 8)
        self.qkv = torch.nn.Linear(8, 3 * HEADS * HEAD_DIM)
        self.out = torch.nn.Linear(HEADS * HEAD_DIM, 8)
        self.merge = torch.nn.Linear(32, 16)
        self.pool_rows = pool_rows

    def forward(self, patches, grid):
        hidden = self.embed(patches.flatten(2))  # [1, L, 8]
        if self.pool_rows:  # mixes the rows: padding would reach every real row
            hidden = hidden - hidden.mean(dim=1, keepdim=True)
        lengths = grid.prod(-1)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        max_seqlen = int(lengths.max().item())
        q, k, v = self.qkv(hidden).squeeze(0).view(-1, 3, HEADS, HEAD_DIM).unbind(1)
        attended = torch.ops.kimi_cg.varlen_attention(q, k, v, cu_seqlens, max_seqlen, HEAD_DIM ** -0.5)
        hidden = hidden + self.out(attended.reshape(-1, HEADS * HEAD_DIM)).unsqueeze(0)
        merged = self.merge(torch.nn.functional.gelu(hidden).reshape(1, -1, 32))  # [1, L / 4, 16]
        return merged, hidden.squeeze(0) * 2


# Item counts 1-3, sizes in and across buckets, and one call over the largest bucket (runs unsplit).
GRIDS = [[[4, 6]], [[2, 8], [4, 4]], [[6, 6], [2, 2], [4, 10]], [[8, 8], [2, 6]], [[4, 2]], [[16, 20]], [[6, 4], [4, 4]]]


def _inputs(grid, seed):
    rows = sum(h * w for h, w in grid)
    patches = torch.randn(1, rows, 3, 2, generator=torch.Generator().manual_seed(seed))
    return patches, torch.tensor(grid)


def _matches_eager_on_every_grid(model) -> dict:
    compiled = torch.compile(model, backend="kimi_cg", options=BUCKETS)
    for seed, grid in enumerate(GRIDS):
        args = _inputs(grid, seed)
        with torch.no_grad():
            want, got = model(*args), compiled(*args)
        for g, w in zip(got, want):
            assert g.shape == w.shape and not torch.isnan(g).any(), (grid, tuple(g.shape), tuple(w.shape))
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    return dict(kimi_cg.counters)


def test_rows_on_dim_1_run_padded_in_buckets_and_match_eager():
    counters = _matches_eager_on_every_grid(BatchOfOneTower())
    assert counters.get("lift_fallbacks", 0) == counters.get("call_fallbacks", 0) == 0, counters
    assert counters.get("padding_hazards", 0) == 0, counters
    # Every call within the buckets ran padded, from the first (traced with dynamic rows on dim 1);
    # the one over the largest bucket ran the plain program (parts are cut on dim 0 only).
    assert counters.get("padded_runs", 0) == len(GRIDS) - 1, counters
    assert counters.get("eager_fallbacks", 0) == 1, counters
    assert counters.get("device_programs_compiled", 0) == 1, counters


def test_rows_on_dim_1_mixed_by_an_op_run_unpadded():
    counters = _matches_eager_on_every_grid(BatchOfOneTower(pool_rows=True))
    assert counters.get("padding_hazards", 0) >= 1 and counters.get("padded_runs", 0) == 0, counters
    assert counters.get("lift_fallbacks", 0) == counters.get("call_fallbacks", 0) == 0, counters


@pytest.mark.parametrize("shape, expected", [
    (("s", 8), 0), ((1, "s", 8), 1), ((1, 1, "s"), 2), ((1, 5, "s"), 0), ((2, "s"), 0), ((1, 24, 3), 0), ((), 0)])
def test_row_dim_is_the_first_symbolic_dim_after_literal_ones(shape, expected):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    sizes = [env.create_unbacked_symint() if size == "s" else size for size in shape]
    with FakeTensorMode(shape_env=env):
        value = torch.empty(sizes)
    assert row_dim(value) == expected
    assert row_dim(None) == 0


def test_warm_up_takes_rows_on_dim_1():
    """kimi_cg.warm_up copies the first item's rows where the tower keeps them: PaddleOCR-VL's patches are
    [1, L, 3, p, p] (NOTE [rows on dim 1]); after the warm-up no call of 1-3 items compiles."""
    from towers import TowerUnavailable
    from towers.transformers_towers import build_paddleocr_vl

    try:
        tower = build_paddleocr_vl("sdpa", seed=0)
    except TowerUnavailable as reason:
        pytest.skip(str(reason))
    compiled = torch.compile(tower.model, backend="kimi_cg", options={"cuda_graphs": True, "token_budgets": [32, 64, 128]})
    pixels, grid = tower.make_inputs([[1, 4, 6]])
    report = kimi_cg.warm_up(compiled, pixels, grid, max_items=3)
    assert [call["items"] for call in report["per_call"]] == [1, 2, 1, 3]
    traced = kimi_cg.counters["dynamo_graphs"]
    for grid in ([[1, 2, 6], [1, 4, 4]], [[1, 8, 2]], [[1, 2, 2], [1, 4, 2], [1, 2, 4]]):
        args = tower.make_inputs(grid)
        with torch.no_grad():
            for g, w in zip(tower.extract_outputs(compiled(*args)), tower.extract_outputs(tower.model(*args))):
                assert g.shape == w.shape and float((g - w).abs().max() / w.abs().max()) <= 1e-5, grid
    assert kimi_cg.counters["dynamo_graphs"] == traced, dict(kimi_cg.counters)
