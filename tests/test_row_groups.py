"""Row indices over groups of k rows (``x.reshape(L // 4, 4, D)[index]``: Qwen2.5-VL's window
permutation and its inverse) run padded in buckets (NOTE [padding rules] in kimi_cg/runtime/graphs.py)."""

import pytest
import torch

import kimi_cg

BUCKETS = {"cuda_graphs": True, "token_budgets": [32, 64, 128, 256]}


class GroupPermutation(torch.nn.Module):
    """Per item [h, w]: its 2 x 2 groups in reverse order, a row-local step, then back (argsort)."""

    def __init__(self, negative=False):
        super().__init__()
        self.proj = torch.nn.Linear(6, 8)
        self.negative = negative

    def forward(self, x, grid):
        hidden = self.proj(x)
        orders, start = [], 0
        for h, w in grid.tolist():
            groups = h * w // 4
            orders.append(torch.arange(groups).flip(0) + start)
            start += groups
        index = torch.cat(orders)
        rows = hidden.shape[0]
        if self.negative:
            index = index - rows // 4  # the same groups, counted from the end
        permuted = hidden.reshape(rows // 4, 4, -1)[index, :, :].reshape(rows, -1)
        permuted = torch.nn.functional.gelu(permuted) * 2
        back = torch.argsort(index % (rows // 4))
        return permuted.reshape(rows // 4, 4, -1)[back].reshape(rows, -1)


GRIDS = [[[4, 6]], [[4, 4], [6, 2]], [[2, 8], [10, 4]], [[2, 2], [2, 6], [4, 4]], [[8, 8], [6, 6]], [[14, 16]]]


def _inputs(grid, seed):
    rows = sum(h * w for h, w in grid)
    return torch.randn(rows, 6, generator=torch.Generator().manual_seed(seed)), torch.tensor(grid)


def _matches_eager_on_every_grid(model) -> dict:
    """Compiles ``model`` with buckets, checks every grid's output against eager; kimi_cg's counters."""
    compiled = torch.compile(model, backend="kimi_cg", options=BUCKETS)
    for seed, grid in enumerate(GRIDS):
        args = _inputs(grid, seed)
        with torch.no_grad():
            want, got = model(*args), compiled(*args)
        assert got.shape == want.shape and not torch.isnan(got).any(), grid
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return dict(kimi_cg.counters)


@pytest.mark.parametrize("negative", [False, True])
def test_a_permutation_of_row_groups_replays_padded_and_matches_eager(negative):
    model = GroupPermutation(negative)
    counters = _matches_eager_on_every_grid(model)
    assert counters.get("lift_fallbacks", 0) == counters.get("call_fallbacks", 0) == 0, counters
    # Every call ran in a bucket (on CPU: padded, uncaptured), none as the plain program.
    assert counters.get("eager_fallbacks", 0) == 0 and counters.get("padding_hazards", 0) == 0, counters
    assert counters.get("padded_runs", 0) + counters.get("graph_replays", 0) >= len(GRIDS) - 1, counters


class GroupIndexIntoATable(torch.nn.Module):
    """The same kind of index reading a tensor that is not row data (here one entry per group, made from
    the row count): the check cannot prove such a table has an entry for every padding group, so the
    program runs unpadded."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 8)

    def forward(self, x, grid):
        hidden = self.proj(x)
        orders, start = [], 0
        for h, w in grid.tolist():
            orders.append(torch.arange(h * w // 4) + start)
            start += h * w // 4
        index = torch.cat(orders)
        table = torch.arange(hidden.shape[0] // 4, dtype=hidden.dtype)[:, None]  # one entry per group, no rows
        return hidden.reshape(hidden.shape[0] // 4, 4, -1) + table[index][:, :, None]


def test_a_group_index_into_a_table_without_rows_is_not_padded():
    model = GroupIndexIntoATable()
    compiled = torch.compile(model, backend="kimi_cg", options=BUCKETS)
    for seed, grid in enumerate(GRIDS[:4]):
        args = _inputs(grid, seed)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-5, atol=1e-6)
    assert kimi_cg.counters["padded_runs"] == 0 and kimi_cg.counters["eager_fallbacks"] >= 3, dict(kimi_cg.counters)


class SliceThenIndex(torch.nn.Module):
    """Row data indexed with a slice first (``x[:, 0]``): not a row-group gather, and no crash deciding so."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 8)

    def forward(self, x, grid):
        hidden = self.proj(x).view(x.shape[0], 2, 4)
        position = torch.cat([torch.arange(h * w) for h, w in grid.tolist()]).to(hidden.dtype)[:, None]
        return hidden[:, 0] + position


def test_row_data_indexed_after_a_slice_is_checked_without_error():
    model = SliceThenIndex()
    compiled = torch.compile(model, backend="kimi_cg", options=BUCKETS)
    for seed, grid in enumerate(GRIDS[:4]):
        args = _inputs(grid, seed)
        torch.testing.assert_close(compiled(*args), model(*args))
    assert kimi_cg.counters["call_fallbacks"] == 0 and kimi_cg.counters["padded_runs"] >= 2, dict(kimi_cg.counters)


class AttentionOverMergedRows(torch.nn.Module):
    """Varlen attention after a 2 x 2 merge: its tensors hold a quarter of the packed rows, and its
    segment boundaries count merged rows. The bucket's trailing segment [L, C) counts packed rows, so
    padding these boundaries would describe rows the attention does not have; such a program must run
    unpadded (it ran padded before the row-count check, and the CPU reference op rejected the
    boundaries)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 8)

    def forward(self, x, grid):
        hidden = self.proj(x)
        merged = hidden.reshape(hidden.shape[0] // 4, 4 * 8)
        lengths = [h * w // 4 for h, w in grid.tolist()]
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q = merged.view(-1, 4, 8)
        out = torch.ops.kimi_cg.varlen_attention(q, q * 0.5, q + 1.0, cu_seqlens, max(lengths), 0.25)
        return out.reshape(-1, 32)


def test_attention_over_merged_rows_is_not_padded_with_the_packed_rows_segment():
    model = AttentionOverMergedRows()
    counters = _matches_eager_on_every_grid(model)
    # Before the check, the padded attention program failed on every call (call_fallbacks).
    assert counters.get("lift_fallbacks", 0) == counters.get("call_fallbacks", 0) == 0, counters
