"""The seed-style baseline (a hand-written graph-safe tower) must equal the eager tower."""

import torch

from kimi_cg.baselines.seed_style import SeedStyleMoonVit
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel


def test_seed_style_baseline_matches_eager_in_and_beyond_its_budgets():
    torch.manual_seed(0)
    tower = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    baseline = SeedStyleMoonVit(tower, max_output_tokens=256, max_items=4, capture=False)
    grids = [[[4, 6], [2, 8]], [[2, 2]], [[16, 16], [8, 8]], [[40, 40]], [[2, 2]] * 5]  # last two: eager path
    for seed, grid in enumerate(grids):
        grid_tensor = torch.tensor(grid)
        pixels = torch.randn(int(grid_tensor.prod(-1).sum()), 3, 14, 14, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            want = tower(pixels, grid_tensor)
        got = baseline(pixels, grid_tensor)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
