"""Video calls split across replays (NOTE [splitting] in kimi_cg/runtime/graphs.py).

A video chunk's merged output follows its gather-plan rows (``h * w / 4``: the frames are averaged),
not its patch rows (``t * h * w``), so the split must put outputs back by each item's own row count.
"""

from __future__ import annotations

import pytest
import torch

import kimi_cg
import kimi_cg.testing
from kimi_cg.models import KimiK25VisionEncoder, MoonViT3dConfig
from kimi_cg.testing.targets import pixel_inputs
from test_runtime import assert_matches_eager  # one grid through kimi_cg.testing

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
    monkeypatch.setattr(BucketedGraphs, "run", lambda self, inputs, capacity, **kwargs: runs.append(capacity) or original(self, inputs, capacity, **kwargs))
    with torch.no_grad():
        assert_matches_eager(compiled, model, [[1, 4, 6]], seed=0)
        runs.clear()
        assert_matches_eager(compiled, model, [[2, 8, 12], [4, 4, 14], [1, 14, 12], [4, 14, 2]], seed=1)
    assert runs == [384, 384]
    assert kimi_cg.counters["split_calls"] == 1
    assert kimi_cg.counters["call_fallbacks"] == 0


def test_fuzzed_video_splits_match_eager():
    model, compiled = compiled_video_tower({"cuda_graphs": True, "token_budgets": SMALL_BUDGETS})
    largest = max(SMALL_BUDGETS)

    def splits_when_too_large(grid, changes):
        must_split = sum(t * h * w for t, h, w in grid) > largest
        assert changes.get("split_calls", 0) == int(must_split), f"split_calls {changes.get('split_calls', 0)}"

    # Two or three chunks, t in 1..4 (three quarters video), even sides up to 12: at most 576 patches a chunk.
    chunks = kimi_cg.testing.grids(dims=3, min_items=2, max_items=3, max_side=12, max_patches=3 * 576,
                                   video_fraction=0.75, families=("uniform",))
    warm = [[[1, 4, 6]], [[2, 4, 20], [3, 10, 8]], [[1, 12, 12], [4, 8, 8], [2, 6, 10]]]
    report = kimi_cg.testing.assert_matches_eager(model, compiled, pixel_inputs("cpu", torch.float32), chunks,
                                                  max_examples=24, warm_up=warm, expect=splits_when_too_large,
                                                  no_fallbacks=True)
    assert kimi_cg.counters["call_fallbacks"] == 0
    assert kimi_cg.counters["split_calls"] >= report.examples // 4  # the sweep must split
