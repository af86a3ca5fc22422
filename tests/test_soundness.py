"""Never wrong, never a crash where eager runs (issue: sound lifting on code nobody here wrote).

Each test is a defect seen on foreign vision code, reduced to a few lines: compiled output equals
eager, or both raise (kimi_cg's error is also an instance of eager's class); what kimi_cg cannot
lift falls back (counted, with a reason) unless options={"strict": True}."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kimi_cg
from kimi_cg.errors import InvalidInputError, UnsupportedGraphError

GRIDS = ([[2, 3], [1, 2]], [[1, 2], [2, 3]], [[2, 2], [2, 2]], [[3, 2], [2, 2], [1, 4]])


def _rows(grid):
    return int(torch.tensor(grid).prod(-1).sum())


def _assert_matches_eager(model, grids, options=None, features=8, **compile_kwargs):
    compiled = torch.compile(model, backend="kimi_cg", options=options, **compile_kwargs)
    for grid in grids:
        x, grid_tensor = torch.randn(_rows(grid), features), torch.tensor(grid)
        want, got = model(x, grid_tensor), compiled(x, grid_tensor)
        want = want if isinstance(want, (list, tuple)) else [want]
        got = got if isinstance(got, (list, tuple)) else [got]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.shape == b.shape and not torch.isnan(a).any(), grid
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"grid {grid}: {m}")
    return compiled


def _block_mask(length, cu):
    mask = torch.zeros([1, length, length], dtype=torch.bool)
    for i in range(1, len(cu)):
        mask[..., cu[i - 1]:cu[i], cu[i - 1]:cu[i]] = True
    return mask


class MaskFilledInPlace(torch.nn.Module):
    """The sdpa path of transformers' towers: a dense mask written block by block, SDPA with scale=."""

    def __init__(self, attention: str):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.attention = attention

    def forward(self, x, grid):
        cu = F.pad((grid[:, 0] * grid[:, 1]).cumsum(0), (1, 0))
        length = x.shape[0]
        mask = _block_mask(length, cu)
        q = self.lin(x).view(1, length, 2, 4).transpose(1, 2)
        if self.attention == "sdpa_scale":
            out = F.scaled_dot_product_attention(q, q, q, mask, scale=0.5)
        elif self.attention == "sdpa_scale_2d":  # an [L, L] mask, broadcast over heads
            out = F.scaled_dot_product_attention(q, q, q, mask[0], scale=0.5)
        else:  # a hand-written softmax attention under the mask (upstream Kimi-VL's eager path, masking fixed)
            scores = (q @ q.transpose(-1, -2)) * 0.5
            out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ q
        return out.transpose(1, 2).reshape(length, 8)


@pytest.mark.parametrize("attention", ["sdpa_scale", "masked_softmax"])
@pytest.mark.parametrize("dynamic", [None, True])
def test_mask_built_in_place_is_not_taken_for_a_constant(attention, dynamic):
    torch.manual_seed(0)
    _assert_matches_eager(MaskFilledInPlace(attention), GRIDS, dynamic=dynamic)


class AccumulatesIntoZeros(torch.nn.Module):
    """A temporal merge by index_add_ into a zeros buffer (Kimi-K2.5 style), read through a view made
    before the write."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, grid):
        y = self.lin(x)
        items = torch.repeat_interleave(torch.arange(grid.shape[0]), grid[:, 0] * grid[:, 1])
        pooled = torch.zeros(grid.shape[0], 8)
        first = pooled[:1]
        pooled.index_add_(0, items, y)
        return pooled * 2 + first.sum()


def test_in_place_accumulation_and_views_of_the_written_buffer():
    torch.manual_seed(0)
    _assert_matches_eager(AccumulatesIntoZeros(), GRIDS)


class ScalarIntoDeviceOp(torch.nn.Module):
    """A grid value handed to a device op (flash attention's max_seqlen from .item() is the real case)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, grid):
        longest = (grid[:, 0] * grid[:, 1]).max().item()
        return torch.roll(self.lin(x), shifts=longest, dims=0)


def test_compiler_limit_falls_back_by_default_and_raises_in_strict_mode():
    torch.manual_seed(0)
    model = ScalarIntoDeviceOp()
    _assert_matches_eager(model, GRIDS)
    assert kimi_cg.counters["lift_fallbacks"] >= 1
    assert sum(kimi_cg.fallbacks.values()) >= 1
    torch._dynamo.reset()
    kimi_cg.reset()  # torch._dynamo.reset() drops kimi_cg's compile callbacks (NOTE [dynamo settings])
    strict = torch.compile(model, backend="kimi_cg", options={"strict": True})
    x, grid = torch.randn(8, 8), torch.tensor(GRIDS[0])
    with pytest.raises(UnsupportedGraphError, match="grid-dependent"):
        strict(x, grid)


class RopeThenUnliftable(torch.nn.Module):
    """Passes rewrite the attention of a graph that then fails to lift: the fallback must run the graph
    as captured, not the half-rewritten one."""

    def __init__(self):
        super().__init__()
        self.attention = MaskFilledInPlace("sdpa_scale")
        self.tail = ScalarIntoDeviceOp()

    def forward(self, x, grid):
        return self.tail(self.attention(x, grid), grid)


def test_fallback_runs_the_graph_as_captured():
    torch.manual_seed(0)
    _assert_matches_eager(RopeThenUnliftable(), GRIDS)
    assert kimi_cg.counters["lift_fallbacks"] >= 1


class PermuteReshapeMerger(torch.nn.Module):
    """A patch merger that ends in permute + reshape, and one that flattens the window into features."""

    def __init__(self, flatten_window: bool):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.flatten_window = flatten_window

    def forward(self, x, grid):
        y = self.lin(x)
        outputs, start = [], 0
        for h, w in grid.tolist():
            piece = y[start:start + h * w].view(h // 2, 2, w // 2, 2, 8).permute(0, 2, 1, 3, 4)
            outputs.append(piece.reshape(h * w // 4, 32) if self.flatten_window else piece.reshape(h * w // 4, 4, 8))
            start += h * w
        return outputs


@pytest.mark.parametrize("flatten_window", [False, True])
def test_merger_variants_are_never_blamed_on_the_input(flatten_window):
    torch.manual_seed(0)
    grids = ([[4, 6]], [[2, 2], [4, 4]], [[6, 2], [2, 4]])
    _assert_matches_eager(PermuteReshapeMerger(flatten_window), grids)
    assert kimi_cg.counters["invalid_inputs"] == 0


class ChecksItsGrid(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, grid):
        for h, w in grid.tolist():
            torch._check(h <= 4)
        return self.lin(x)


def test_invalid_input_is_raised_as_eager_raises_it():
    torch.manual_seed(0)
    model = ChecksItsGrid()
    compiled = _assert_matches_eager(model, GRIDS)
    x, grid = torch.randn(12, 8), torch.tensor([[2, 3], [6, 1]])
    with pytest.raises(RuntimeError) as eager_error:
        model(x, grid)
    with pytest.raises(InvalidInputError) as error:
        compiled(x, grid)
    assert isinstance(error.value, type(eager_error.value))
    assert kimi_cg.counters["invalid_inputs"] == 1


class WritesItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, grid):
        self.calls += 1
        sizes = (grid[:, 0] * grid[:, 1]).tolist()
        return [piece * self.calls for piece in torch.split(self.lin(x), sizes)]


def test_in_place_write_to_module_state_falls_back():
    torch.manual_seed(0)
    eager_model, compiled_model = WritesItsInput(), WritesItsInput()
    compiled_model.load_state_dict(eager_model.state_dict())
    compiled = torch.compile(compiled_model, backend="kimi_cg")
    for grid in GRIDS:
        x, grid_tensor = torch.randn(_rows(grid), 8), torch.tensor(grid)
        for a, b in zip(compiled(x, grid_tensor), eager_model(x, grid_tensor)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert compiled_model.calls.item() == eager_model.calls.item() == len(GRIDS)


class ReturnsGridMetadata(torch.nn.Module):
    """Returns a host-made tensor (cu_seqlens) beside the activations: found by the program fuzzer."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, grid):
        return self.lin(x), F.pad((grid[:, 0] * grid[:, 1]).cumsum(0), (1, 0))


def test_an_output_the_caller_writes_does_not_change_a_later_call():
    torch.manual_seed(0)
    model = ReturnsGridMetadata()
    compiled = torch.compile(model, backend="kimi_cg")
    x, grid = torch.randn(13, 8), torch.tensor([[1, 8], [5, 1]])
    first = compiled(x, grid)
    first[1].fill_(-7)  # the caller owns what it gets back
    second = compiled(x, grid)  # same grid: the host pass is served from the batch cache
    torch.testing.assert_close(second[1], model(x, grid)[1], rtol=0, atol=0)
    assert second[1].data_ptr() != first[1].data_ptr()


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_dense_host_mask_on_the_bucketed_path_matches_eager(dynamic):
    """A [1, L, L] mask made on the host cannot be padded by rows: such calls run unbucketed."""
    torch.manual_seed(0)
    _assert_matches_eager(MaskFilledInPlace("sdpa_scale_2d"), GRIDS,
                          options={"cuda_graphs": True, "token_budgets": [16, 64]}, dynamic=dynamic)
    assert kimi_cg.counters["call_fallbacks"] == 0  # planned (unbucketed), not a failure caught at run time


class ViewBeforeAWrite(torch.nn.Module):
    """A per-item slice of a tensor that is written in place afterwards (found by the program fuzzer):
    the slice must see the write, so it cannot become a gather copied earlier."""

    def forward(self, x, grid):
        sizes = (grid[:, 0] * grid[:, 1]).tolist()
        y = x.clone()
        first = y[:sizes[0]]
        y.mul_(2.0)
        return y + first.mean(0)


def test_a_slice_taken_before_an_in_place_write_sees_the_write():
    _assert_matches_eager(ViewBeforeAWrite(), GRIDS)


class ViewsAcrossAGraphBreak(torch.nn.Module):
    """A buffer and a view of it returned by the graph before a break, written and read after it (how
    dynamo 2.11 splits `buf[:n] += x[:n]`; found by the program fuzzer on the H200): the outputs must
    alias as they did in eager."""

    def forward(self, x, grid):
        x = x * 2
        n = int(grid[0].prod())
        buf = torch.zeros(x.shape[0], 8)
        first = buf[:n]
        torch._dynamo.graph_break()
        buf[:n] += x[:n]
        return x + buf + first.mean(0)


def test_outputs_that_alias_each_other_still_alias():
    _assert_matches_eager(ViewsAcrossAGraphBreak(), GRIDS)


class RowReductions(torch.nn.Module):
    """Ops that mix the packed rows: a bucket's zero padding rows would change their results."""

    def forward(self, x, grid):
        y = x * grid.sum()
        q = y.view(1, 1, y.shape[0], y.shape[1])
        return y.mean(0), torch.softmax(y, dim=0), torch.nn.functional.scaled_dot_product_attention(q, q, q), y.cumsum(0)


def test_ops_that_mix_rows_never_run_padded():
    """The bucketed path pads the packed rows with zeros. A device program that reduces, normalises,
    scans or attends across all rows must not run padded (it runs the plain program): same numbers."""
    model = RowReductions()
    compiled = torch.compile(model, backend="kimi_cg", options={"cuda_graphs": True, "token_budgets": [32, 64]})
    with torch.no_grad():
        for rows in (7, 20, 13, 9):
            x, grid = torch.randn(rows, 4) + 1, torch.tensor([[1, 2]])
            for got, want in zip(compiled(x, grid), model(x, grid)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
