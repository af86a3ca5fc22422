"""NOTE [int of a grid comparison] (kimi_cg/grid_comparisons.py): ``int(t > 1)`` on a grid value read
with ``.tolist()`` traces as an integer expression in kimi_cg's frames (no graph break, one lifted
piece); other backends' compiles see dynamo's own ``sym_int``."""

from __future__ import annotations

import pytest
import torch

import kimi_cg
from upstream_forms import FrameIndex, assert_compiled_matches_eager

OPTIONS = {"cuda_graphs": True, "token_budgets": [32, 64, 128]}
GRIDS = ([[1, 4, 6]], [[2, 2, 4], [1, 6, 2]], [[1, 2, 2], [3, 2, 4]], [[4, 2, 2]], [[1, 4, 4], [1, 2, 4]])
# The next line, `repeat_interleave(h * w)`, traces on torch 2.11 too: NOTE [repeat by a grid value].


def test_int_of_a_grid_comparison_traces_as_one_piece():
    model = FrameIndex()
    assert_compiled_matches_eager(torch.compile(model, backend="kimi_cg", options=OPTIONS), model, GRIDS)
    counters = dict(kimi_cg.counters)
    assert counters.get("graph_breaks", 0) == 0 and counters.get("frames_skipped", 0) == 0, counters
    assert counters.get("padded_runs", 0) == len(GRIDS) and counters.get("eager_fallbacks", 0) == 0, counters
    assert counters.get("lift_fallbacks", 0) == 0 and counters.get("call_fallbacks", 0) == 0, counters


def test_outside_kimi_cg_traces_the_wrapper_is_torchs_sym_int():
    """Outside a kimi_cg trace an undecidable comparison fails as torch.sym_int makes it fail (what
    other compiles see); decidable values convert as before."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

    from kimi_cg import grid_comparisons

    unbacked = ShapeEnv().create_unbacked_symint()
    with pytest.raises(GuardOnDataDependentSymNode):
        torch.sym_int(unbacked > 1)
    with pytest.raises(GuardOnDataDependentSymNode):
        grid_comparisons.sym_int(unbacked > 1)
    assert grid_comparisons.sym_int(True) == 1 and grid_comparisons.sym_int(2.7) == 2
