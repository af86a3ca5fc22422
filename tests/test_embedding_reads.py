"""NOTE [embedding reads] (kimi_cg/canonicalize/embedding_reads.py): a module-state table read by a grid-made index
(``table[index]``, ``F.embedding``, ``F.embedding_bag``) becomes a device table gather with a host-made plan.

- ``embedding_plan`` against the real ops (hypothesis: any index, negative ones for ``table[index]``, weights or
  none, sum and mean), through the gather op; out-of-range indices raise as eager's do;
- a custom tower of every matched form, on the plain program and the padded bucket path in a NaN-poisoned pool:
  results equal eager's, no host program reads a table (so no content check), a ``.data`` write shows next call;
  an index out of range raises where eager raises; forms left alone (max_norm, offsets, a value the host reads
  back) stay host reads and stay right;
- transformers' Kimi-K2.5 tower (its position term: an embedding_bag of bicubic taps plus a time-table row).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kimi_cg
from kimi_cg.canonicalize.embedding_reads import embedding_plan
from kimi_cg.errors import UnsupportedGraphError
from kimi_cg.ops.table_gather import table_gather_reference

sys.path.insert(0, os.path.dirname(__file__))


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 12), reads=st.integers(0, 20), terms=st.integers(1, 5), data=st.data())
def test_plans_gather_what_the_real_reads_return(rows, reads, terms, data):
    table = torch.randn(rows, 7, generator=torch.Generator().manual_seed(rows * 100 + reads))
    signed = data.draw(st.lists(st.integers(-rows, rows - 1), min_size=reads, max_size=reads))
    index = torch.tensor(signed, dtype=torch.int64)
    assert torch.equal(table_gather_reference(table, *embedding_plan(index, None, rows, "getitem")), table[index])
    assert torch.equal(table_gather_reference(table, *embedding_plan(index.abs() % rows, None, rows, "sum")),
                       F.embedding(index.abs() % rows, table))
    bags = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, rows - 1), min_size=terms, max_size=terms),
                                           min_size=reads, max_size=reads)), dtype=torch.int32).view(reads, terms)
    weight = torch.randn(reads, terms, generator=torch.Generator().manual_seed(reads))
    torch.testing.assert_close(table_gather_reference(table, *embedding_plan(bags, weight, rows, "sum")),
                               F.embedding_bag(bags, table, per_sample_weights=weight, mode="sum"), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(table_gather_reference(table, *embedding_plan(bags, None, rows, "mean")),
                               F.embedding_bag(bags, table, mode="mean"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("index, kind", [([0, 4], "getitem"), ([-5, 1], "getitem"), ([-1, 0], "sum"), ([[0, 4]], "sum")])
def test_an_index_out_of_range_is_refused(index, kind):
    with pytest.raises(UnsupportedGraphError, match="out of range"):
        embedding_plan(torch.tensor(index), None, 4, kind)


class _Reads(torch.nn.Module):
    """Per item: bicubic-like taps of a [16, D] table by embedding_bag, a time-table row by ``table[index]``
    (negative indices), an embedding row; ``form`` swaps the reads for forms the pass leaves alone."""

    def __init__(self, form: str = "matched", dim: int = 6):
        super().__init__()
        self.grid_table = torch.nn.Parameter(torch.randn(16, dim))
        self.register_buffer("time_table", torch.randn(5, dim))
        self.ids = torch.nn.Embedding(7, dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.form = form

    def forward(self, x, grid):
        counts = grid[:, 0] * grid[:, 1]
        rows = torch.arange(int(counts.sum()))
        taps = torch.stack([(rows + k) % 16 for k in range(4)], dim=1)
        weights = torch.stack([torch.cos(rows.float() * 0.1 * (k + 1)) for k in range(4)], dim=1)
        frame = torch.repeat_interleave(grid[:, 0] - 3, counts)  # in [-2, ...]: rows from the end
        if self.form == "max_norm":
            pos = F.embedding_bag(taps, self.grid_table, per_sample_weights=weights, mode="sum", max_norm=1e9)
        elif self.form == "offsets":
            pos = F.embedding_bag(taps.flatten(), self.grid_table, torch.arange(0, taps.numel(), 4), mode="mean")
        else:
            pos = F.embedding_bag(taps, self.grid_table, per_sample_weights=weights, mode="sum")
        pos = pos + self.time_table[frame] + self.ids(rows % 7)
        if self.form == "read_back":  # a value the host reads: the reads stay with the host
            pos = pos[: int((pos[:, 0] > -1e9).sum())]
        elif self.form == "grid_number":  # a number from the grid in an op after the reads: they stay too
            pos = pos * (1 + int(grid[0, 0] > 6))
        return self.proj(x + pos)


GRIDS = [[[1, 4], [3, 5]], [[2, 2]], [[4, 1], [5, 3], [2, 6]], [[1, 4], [3, 5]], [[7, 9]]]
PATHS = [{}, {"cuda_graphs": True, "token_budgets": [32, 128], "poison_graph_pool": True}]


def _compiled(model, options):
    torch.manual_seed(0)
    kimi_cg.reset()
    model = model.eval()
    return torch.compile(model, backend="kimi_cg", options={"table_gathers": True, **options})


def _call(model, grid, seed):
    grid = torch.tensor(grid)
    x = torch.randn(int(grid.prod(-1).sum()), 6, generator=torch.Generator().manual_seed(seed))
    return model(x, grid)


@pytest.mark.parametrize("options", PATHS)
def test_matched_reads_run_on_the_device_and_equal_eager(options):
    torch.manual_seed(0)
    model = _Reads()
    compiled = _compiled(model, {"strict": True, **options})
    with torch.no_grad():
        for seed, grid in enumerate(GRIDS):
            torch.testing.assert_close(_call(compiled, grid, seed), _call(model, grid, seed), atol=1e-5, rtol=1e-5)
        # The device reads the live tables: a loader's write through .data shows next call.
        model.grid_table.data.mul_(2.0)
        model.time_table.data.mul_(-1.5)
        model.ids.weight.data.add_(1.0)
        torch.testing.assert_close(_call(compiled, GRIDS[2], 2), _call(model, GRIDS[2], 2), atol=1e-5, rtol=1e-5)
    assert kimi_cg.counters["embedding_reads_gathered"] >= 3
    assert kimi_cg.counters["state_content_checks"] == 0 and kimi_cg.counters["state_snapshots_taken"] == 0
    if options:
        assert kimi_cg.counters["padded_runs"] > 0


@pytest.mark.parametrize("options", PATHS)
def test_an_index_out_of_range_raises_as_in_eager(options):
    torch.manual_seed(0)
    model = _Reads()
    compiled = _compiled(model, options)
    with torch.no_grad():
        _call(compiled, GRIDS[0], 0)
        with pytest.raises(IndexError):
            _call(model, [[9, 2]], 1)  # frame 9 - 3 = 6 of a 5-row table
        with pytest.raises(Exception, match="out of range|index"):
            _call(compiled, [[9, 2]], 1)
        torch.testing.assert_close(_call(compiled, GRIDS[1], 2), _call(model, GRIDS[1], 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["max_norm", "offsets", "read_back", "grid_number"])
def test_forms_left_alone_stay_host_reads_and_stay_right(form):
    torch.manual_seed(0)
    model = _Reads(form)
    compiled = _compiled(model, {})
    with torch.no_grad():
        for seed, grid in enumerate([*GRIDS[:3], [[7, 2]]]):
            torch.testing.assert_close(_call(compiled, grid, seed), _call(model, grid, seed), atol=1e-5, rtol=1e-5)
    if form in ("read_back", "grid_number"):
        assert kimi_cg.counters["embedding_reads_gathered"] == 0
    if form == "grid_number":  # left to the host, the graph is still lifted
        assert not kimi_cg.fallbacks, dict(kimi_cg.fallbacks)
    elif form == "offsets":  # the time row and the embedding still move; the bag does not
        assert kimi_cg.counters["embedding_reads_gathered"] >= 2
    # (max_norm writes the table in place where a row's norm exceeds it: the graph is not lifted at all)
    if form != "max_norm":
        assert kimi_cg.counters["state_content_checks"] > 0  # a table the host still reads is checked


@pytest.mark.parametrize("options", PATHS)
def test_transformers_kimi_k25_tower_reads_its_position_tables_on_the_device(options):
    pytest.importorskip("transformers")
    from towers.transformers_towers import build_kimi_k25

    tower = build_kimi_k25("sdpa")
    compiled = _compiled(tower.model, options)
    # One t per batch: transformers before 5.24 concatenates per-chunk [h * w / 4, t, 4] index rows, so its eager
    # rejects a batch mixing frame counts (and kimi_cg, rightly, with it).
    grids = [[[1, 4, 6]], [[2, 4, 4], [2, 6, 8]], [[1, 8, 6], [1, 4, 2]], [[3, 2, 4], [3, 4, 4]], [[2, 4, 4], [2, 6, 8]]]
    with torch.no_grad():
        for grid in grids:
            inputs = tower.make_inputs(grid)
            for got, want in zip(tower.extract_outputs(compiled(*inputs)), tower.extract_outputs(tower.model(*inputs))):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        tower.model.get_submodule("patch_embed.pos_emb").position_embeddings.data.mul_(2.0)
        inputs = tower.make_inputs(grids[3])
        for got, want in zip(tower.extract_outputs(compiled(*inputs)), tower.extract_outputs(tower.model(*inputs))):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the bicubic taps' embedding_bag and the time-table row, per dynamo graph; the RoPE table stays a host
    # value (a product of the grid's positions with inv_freq, not a read): one content check a call
    assert kimi_cg.counters["embedding_reads_gathered"] >= 2
    assert kimi_cg.counters["state_content_checks"] <= len(grids)


class _FactoredReads(torch.nn.Module):
    """Per item a row table's rows 0..h-1 plus a column table's rows 0..w-1, broadcast to [h, w] and flattened: the
    reads' rows are not patch rows (a factored 2D position embedding)."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.row_emb = torch.nn.Embedding(8, dim)
        self.col_emb = torch.nn.Embedding(8, dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, grid):
        terms = []
        for h, w in grid.tolist():
            terms.append((self.row_emb(torch.arange(h))[:, None] + self.col_emb(torch.arange(w))[None]).flatten(0, 1))
        return self.proj(x + torch.cat(terms))


def test_reads_whose_rows_are_not_patch_rows_stay_host_reads_and_keep_the_buckets():
    """The host-made value the device takes keeps its rows, the bucket's padding rule unchanged: reads of h or w
    rows broadcast and flattened per item stay with the host (moved, their plans would be padded as patch rows)."""
    torch.manual_seed(0)
    model = _FactoredReads()
    compiled = _compiled(model, PATHS[1])
    with torch.no_grad():
        for seed, grid in enumerate([[[1, 4], [3, 5]], [[2, 2]], [[4, 1], [5, 3], [2, 6]], [[1, 4], [3, 5]]]):
            torch.testing.assert_close(_call(compiled, grid, seed), _call(model, grid, seed), atol=1e-5, rtol=1e-5)
    assert kimi_cg.counters["embedding_reads_gathered"] == 0
    assert kimi_cg.counters["padded_runs"] > 0 and kimi_cg.counters["eager_fallbacks"] == 0, dict(kimi_cg.counters)
