"""Video calls split across replays (NOTE [splitting] in kimi_cg/runtime/graphs.py).

A video chunk's merged output follows its gather-plan rows (``h * w / 4``: the frames are averaged),
not its patch rows (``t * h * w``), so the split must put outputs back by each item's own row count.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import kimi_cg
from kimi_cg.models import KimiK25VisionEncoder, MoonViT3dConfig
from test_runtime import assert_matches_eager  # the bucketed runtime's own helper

SMALL_BUDGETS = [128, 256, 384]


def compiled_video_tower(options):
    torch.manual_seed(0)
    model = KimiK25VisionEncoder(MoonViT3dConfig.tiny()).eval()
    return model, torch.compile(model, backend="kimi_cg", options=options)


@pytest.mark.parametrize("grid, options", [
    # 160 + 240 patches, 80 + 80 plan rows, largest bucket 384: sorted packing runs item 1 first.
    ([[2, 4, 20], [3, 10, 8]], {"cuda_graphs": True, "token_budgets": [384]}),
    # The reported default-ladder case ([[1, 64, 128], [4, 64, 64]], largest bucket 16384) at a
    # sixteenth of its size: a geometric ladder 256..1024, 512 + 1024 patches, item 1 first.
    ([[1, 16, 32], [4, 16, 16]], {"cuda_graphs": True, "min_tokens": 256, "max_tokens": 1024}),
], ids=["small_buckets", "ladder_buckets"])
def test_video_split_out_of_call_order_matches_eager(grid, options):
    model, compiled = compiled_video_tower(options)
    with torch.no_grad():
        assert_matches_eager(compiled, model, [[1, 4, 6]], seed=0)  # the static first trace
        assert_matches_eager(compiled, model, grid, seed=1)
    assert kimi_cg.counters["split_calls"] == 1
    assert kimi_cg.counters["call_fallbacks"] == 0  # the lifted program ran it, not the captured graph
    assert kimi_cg.counters["eager_fallbacks"] == 0  # every item fits the largest bucket


def test_video_split_keeps_sorted_packing_when_ratios_are_ambiguous(monkeypatch):
    """Patches 192, 224, 168, 112 (plan rows 96, 56, 168, 28) with a largest bucket of 384: call
    order needs 3 replays ([192], [224], [168, 112]), first-fit decreasing 2 ([224, 112], [192, 168]),
    both out of call order. Each item's output rows (its plan rows / 4) are not its share of the
    patches, although that share is a whole number for every item too."""
    from kimi_cg.runtime.graphs import BucketedGraphs

    model, compiled = compiled_video_tower({"cuda_graphs": True, "token_budgets": [384]})
    runs = []
    original = BucketedGraphs.run
    monkeypatch.setattr(BucketedGraphs, "run", lambda self, inputs, capacity: runs.append(capacity) or original(self, inputs, capacity))
    with torch.no_grad():
        assert_matches_eager(compiled, model, [[1, 4, 6]], seed=0)
        runs.clear()
        assert_matches_eager(compiled, model, [[2, 8, 12], [4, 4, 14], [1, 14, 12], [4, 14, 2]], seed=1)
    assert runs == [384, 384]
    assert kimi_cg.counters["split_calls"] == 1
    assert kimi_cg.counters["call_fallbacks"] == 0


@st.composite
def video_grids(draw):
    """Two or three chunks, t in 1..4, even sides: at most 4 * 12 * 12 = 576 patches per chunk."""
    count = draw(st.integers(2, 3))
    side = st.integers(1, 6).map(lambda half: 2 * half)
    return [[draw(st.integers(1, 4)), draw(side), draw(side)] for _ in range(count)]


BATCHES_PER_EXAMPLE = 3


def test_fuzzed_video_splits_match_eager():
    model, compiled = compiled_video_tower({"cuda_graphs": True, "token_budgets": SMALL_BUDGETS})
    largest = max(SMALL_BUDGETS)
    grids: list[list[list[int]]] = []
    with torch.no_grad():
        assert_matches_eager(compiled, model, [[1, 4, 6]], seed=0)

    # One compiled model for every example (see test_backend's fuzz test); no shrinking: each
    # failure names its grid.
    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              phases=[Phase.explicit, Phase.generate])
    @given(st.lists(video_grids(), min_size=BATCHES_PER_EXAMPLE, max_size=BATCHES_PER_EXAMPLE))
    @example([[[2, 4, 20], [3, 10, 8]], [[1, 12, 12], [4, 8, 8], [2, 6, 10]], [[4, 2, 2], [1, 10, 12], [3, 8, 6]]])
    def run(sequence):
        with torch.no_grad():
            for grid in sequence:
                splits_before = kimi_cg.counters["split_calls"]
                try:
                    assert_matches_eager(compiled, model, grid, seed=len(grids) + 1)
                except AssertionError as error:
                    raise AssertionError(f"grid {grid}: {error}") from error
                must_split = sum(t * h * w for t, h, w in grid) > largest
                assert kimi_cg.counters["split_calls"] - splits_before == int(must_split), f"grid {grid}"
                grids.append(grid)

    run()
    assert kimi_cg.counters["call_fallbacks"] == 0
    assert kimi_cg.counters["split_calls"] >= len(grids) // 4  # the sweep must split
