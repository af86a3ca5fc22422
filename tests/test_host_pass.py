"""The host pass's per-call shortcuts: each computes what the step it replaces computed, from integers."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import sympy
import torch

import kimi_cg
import kimi_cg.testing
from kimi_cg.lift import evaluate_size, register_size_expression
from kimi_cg.models import MoonViT3dConfig, MoonViT3dPretrainedModel, MoonVitConfig, MoonVitPretrainedModel
from kimi_cg.runtime import gather_plan
from kimi_cg.runtime.memory import MetadataStore, _storages
from kimi_cg.runtime.runner import live_runners
from kimi_cg.runtime.table_rows import TableRows
from kimi_cg.testing.targets import pixel_inputs


def test_slice_offsets_from_integers_equal_the_index_reduction():
    """row_slice_offset gives what row_storage_offset of the same slice of a row source gives, for every
    slice Python allows: negative, empty, past the end, None."""
    bounds = (None, -12, -3, 0, 2, 7, 10, 15)
    for total, start, stop in itertools.product((0, 1, 5, 10), bounds, bounds):
        piece = gather_plan.row_getitem(gather_plan.row_source((total,), 4), slice(start, stop))
        assert gather_plan.row_slice_offset(start, stop, total, 4) == gather_plan.row_storage_offset(piece), (total, start, stop)


def _host_programs(before: set) -> list:
    """Host programs of the runners made since ``before`` (ids of the runners alive then)."""
    return [runner.host for runner in live_runners() if id(runner) not in before and runner.host is not None]


def test_compiled_towers_read_slice_offsets_from_integers_and_match_eager():
    """MoonViT's and MoonViT3d's merge gathers check every per-item slice's storage offset; the host
    programs read them from integers (no row_storage_offset left) and the outputs equal eager's."""
    for model, grids in (
        (MoonVitPretrainedModel(MoonVitConfig.tiny()).eval(), [[[4, 6], [2, 8]], [[6, 4], [8, 2], [2, 2]]]),
        (MoonViT3dPretrainedModel(MoonViT3dConfig.tiny()).eval(), [[[1, 4, 6], [2, 2, 8]], [[3, 6, 4], [1, 8, 2]]]),
    ):
        torch.manual_seed(0)
        before = {id(runner) for runner in live_runners()}
        compiled = torch.compile(model, backend="kimi_cg", options={"cuda_graphs": True, "token_budgets": [256, 1024]})
        kimi_cg.testing.assert_matches_eager(model, compiled, pixel_inputs("cpu", torch.float32), grids=grids,
                                             no_fallbacks=True)
        hosts = _host_programs(before)
        assert sum(host.slice_offsets for host in hosts) > 0
        for host in hosts:
            assert not any(node.target is gather_plan.row_storage_offset for node in host.gm.graph.nodes), host.gm.code


def test_evaluate_size_matches_sympy():
    s0, s1 = sympy.Symbol("s0", integer=True), sympy.Symbol("s1", integer=True)
    single, _ = register_size_expression(s0)
    compound, _ = register_size_expression(s0 * s1 + 3 * s1)
    for a, b in itertools.product((0, 1, 7, 1024), (1, 5)):
        assert evaluate_size(single, a) == a
        assert evaluate_size(compound, a, b) == a * b + 3 * b
        assert type(evaluate_size(compound, a, b)) is int


@dataclasses.dataclass
class _Pair:
    first: torch.Tensor
    second: torch.Tensor
    count: int


def test_metadata_store_counts_stand_ins_by_their_distinct_storages():
    index = torch.zeros(10, 8, dtype=torch.int32)
    rows = TableRows(index, torch.zeros(10, 8), 1, 64, 4)
    pair = _Pair(index[:5], torch.zeros(3, dtype=torch.float64), 3)
    found = _storages((rows, [pair, 7], "text"))
    assert sorted(found.values()) == [24, 320, 320]  # index counted once (pair.first is a view of it)
    store = MetadataStore(1 << 20)
    store.put(("item", 1), (rows, pair), "default", 1 << 20)
    report = store.report()
    assert report["bytes"] == 664 and report["by_device"] == {"cpu": 664}


def test_table_constants_fold_once_per_derivation_and_read_alike():
    """NOTE [table constants folded]: steps on a table's stand-in alone run at build, once per
    derivation for the process (programs with the same steps share the value; another table or
    step gets its own), the program reads the same as unfolded, and a step that fails is left to
    fail at call time."""
    from kimi_cg.host_program import fold_table_constants
    from kimi_cg.runtime import table_rows

    def build(shape, dims):
        graph = torch.fx.Graph()
        h, w = graph.placeholder("h"), graph.placeholder("w")
        source = graph.call_function(table_rows.table_source, (shape, 3))
        permuted = graph.call_function(table_rows.table_permute, (source, *dims))
        graph.output(graph.call_function(table_rows.table_getitem, (permuted, (slice(None, h), slice(None, w)))))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    def same(a, b):
        assert (a.axis, a.dim, a.outer) == (b.axis, b.dim, b.outer) and torch.equal(a.index, b.index)

    first, again, other = build((4, 5), (1, 0, 2)), build((4, 5), (1, 0, 2)), build((5, 4), (1, 0, 2))
    expected = {name: (gm(2, 3), gm(5, 1)) for name, gm in (("first", first), ("other", other))}
    assert [fold_table_constants(gm) for gm in (first, again, other)] == [1, 1, 1]
    assert not any(node.op == "call_function" and node.target in (table_rows.table_source, table_rows.table_permute)
                   for node in first.graph.nodes)
    assert first.table_constant_0 is again.table_constant_0 is not other.table_constant_0
    for name, gm in (("first", first), ("other", other)):
        same(gm(2, 3), expected[name][0])
        same(gm(5, 1), expected[name][1])
    broken = build((4, 5), (0, 0, 2))  # not a permutation: fails as a step, at call time
    assert fold_table_constants(broken) == 1  # the source alone
    assert any(node.target is table_rows.table_permute for node in broken.graph.nodes)
    with pytest.raises(table_rows.NotATableRead):
        broken(2, 3)


def test_grid_scalars_read_as_tensors_join_their_items_cached_values():
    """NOTE [grid scalars by item]: MoonViT3d's ``is_video = (grid_thws[i, 0] > 1)`` scales item i's time-table read;
    the read, its expand and flatten are item i's cached value, so a batch of seen sizes in a new order runs none of
    them (no per-item miss), and outputs equal eager's with videos and images mixed."""
    torch.manual_seed(0)
    model = MoonViT3dPretrainedModel(MoonViT3dConfig.tiny()).eval()
    before = {id(runner) for runner in live_runners()}
    compiled = torch.compile(model, backend="kimi_cg", options={"cuda_graphs": True, "token_budgets": [256, 1024]})
    seen = [[[1, 4, 6], [3, 2, 8]], [[2, 6, 4], [1, 8, 2]]]
    kimi_cg.testing.assert_matches_eager(model, compiled, pixel_inputs("cpu", torch.float32), grids=seen,
                                         no_fallbacks=True)
    hosts = _host_programs(before)
    assert sum(host.grid_scalars for host in hosts) >= 2
    for host in hosts:
        top = {node.target for node in host.gm.graph.nodes}
        assert not any(getattr(target, "__name__", "") in ("table_scale", "table_expand") for target in top), host.gm.code
    misses = kimi_cg.counters["metadata_cache_misses"]
    kimi_cg.testing.assert_matches_eager(model, compiled, pixel_inputs("cpu", torch.float32),
                                         grids=[[[1, 8, 2], [3, 2, 8]], [[2, 6, 4], [1, 4, 6]]], no_fallbacks=True)
    assert kimi_cg.counters["metadata_cache_misses"] == misses


class _IndexedGrid(torch.nn.Module):
    """Reads grid[i, 0] as a tensor (a scale per item) and grid[i][1] through a row; writes nothing."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(8, 4))
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, grid):
        terms = []
        for i, (t, n) in enumerate(grid.tolist()):
            scale = (grid[i, 0] * 2 + grid[i][1]).to(x.dtype)
            terms.append((self.table[:n] * scale).repeat(t, 1))
        return self.proj(x + torch.cat(terms))


def test_grid_scalar_rewrite_keeps_values_and_dtypes():
    torch.manual_seed(0)
    model = _IndexedGrid()
    before = {id(runner) for runner in live_runners()}
    compiled = torch.compile(model, backend="kimi_cg", options={"cuda_graphs": True, "token_budgets": [64]})
    with torch.no_grad():
        for grid in ([[1, 3], [2, 5]], [[2, 2], [1, 7], [3, 1]], [[2, 5], [1, 3]]):
            grid = torch.tensor(grid)
            x = torch.randn(int((grid[:, 0] * grid[:, 1]).sum()), 4)
            torch.testing.assert_close(compiled(x, grid), model(x, grid), rtol=1e-5, atol=1e-5)
    assert sum(host.grid_scalars for host in _host_programs(before)) >= 2  # grid[i, 0] and grid[i][1]
