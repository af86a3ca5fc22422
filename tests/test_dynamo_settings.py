"""NOTE [dynamo settings]: kimi_cg's dynamo settings hold while its own frames trace, in every thread,
and nowhere else; a frame dynamo cannot trace with them is traced with dynamo's own."""

from __future__ import annotations

import inspect
import operator
import threading

import pytest
import torch

import kimi_cg
from kimi_cg import dynamo_settings
from kimi_cg.models.moonvit import MoonVitConfig, MoonVitPretrainedModel

TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1, init_pos_emb_height=8,
            init_pos_emb_width=8)


def _tiny_tower():
    torch.manual_seed(0)
    return MoonVitPretrainedModel(MoonVitConfig(**TINY)).eval()


def _inputs(grid):
    grid = torch.tensor(grid)
    return torch.randn(int(grid.prod(-1).sum()), 3, 14, 14), grid


def split_by_lengths(x, lengths):
    """Code that stock dynamo traces with graph breaks (transformers' per-segment attention)."""
    pieces = torch.split(x, lengths.tolist())
    return torch.cat([piece.softmax(0) * piece.shape[0] for piece in pieces])


def extend_from_tolist(x, lengths):
    """Qwen2.5-VL's window index builds a Python list from tensor values."""
    cu = [0]
    cu.extend(lengths.cumsum(0).tolist())
    return torch.cat([x[cu[i]:cu[i + 1]].sum(0, keepdim=True) for i in range(len(cu) - 1)])


def _run_other_compiles():
    """Outputs, graph counts and graph breaks of other models compiled with stock backends."""
    results = []
    x, lengths = torch.randn(10, 4), torch.tensor([3, 7])
    for fn in (split_by_lengths, extend_from_tolist):
        for backend in ("eager", "inductor"):
            torch._dynamo.reset()
            kimi_cg.reset()
            graphs = []

            def counting(gm, example_inputs, backend=backend):
                graphs.append(len(gm.graph.nodes))
                if backend == "eager":
                    return gm.forward
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs)

            out = torch.compile(fn, backend=counting)(x, lengths)
            torch.testing.assert_close(out, fn(x, lengths), rtol=0, atol=1e-6)
            results.append((fn.__name__, backend, graphs))
    return results


def _settings():
    config = torch._dynamo.config
    return config.capture_scalar_outputs, config.capture_dynamic_output_shape_ops


def test_other_compiles_behave_the_same_after_kimi_cg_is_used():
    before, settings_before = _run_other_compiles(), _settings()
    tower = _tiny_tower()
    pixels, grid = _inputs([[2, 4], [4, 2]])
    compiled = torch.compile(tower, backend="kimi_cg")
    for got, want in zip(compiled(pixels, grid), tower(pixels, grid)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert kimi_cg.counters["graph_breaks"] == 0  # the settings held while kimi_cg traced
    assert _settings() == settings_before
    assert _run_other_compiles() == before


def test_other_compiles_in_another_thread_are_unaffected():
    tower = _tiny_tower()
    pixels, grid = _inputs([[2, 2]])
    torch.compile(tower, backend="kimi_cg")(pixels, grid)
    results = {}
    worker = threading.Thread(target=lambda: results.setdefault("other", (_run_other_compiles(), _settings())))
    worker.start()
    worker.join()
    assert results["other"] == (_run_other_compiles(), _settings())


def test_a_tower_first_called_from_a_worker_thread_is_lifted():
    tower = _tiny_tower()
    compiled = torch.compile(tower, backend="kimi_cg")
    grids = ([[2, 4], [4, 2]], [[2, 2], [6, 2]], [[4, 4], [2, 2]])
    results, errors = [], []

    def work():
        try:
            for grid in grids:
                pixels, grid_tensor = _inputs(grid)
                results.append((compiled(pixels, grid_tensor), tower(pixels, grid_tensor)))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert not errors
    for got, want in results:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert kimi_cg.counters["graph_breaks"] == 0
    assert kimi_cg.counters["dynamo_graphs"] <= 2  # the first trace (dynamic in the rows), the RoPE-table retrace
    assert kimi_cg.counters["lift_fallbacks"] == 0


def _marks(tensor):
    return {name: getattr(tensor, name) for name in ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking",
                                                     "_dynamo_dynamic_indices") if hasattr(tensor, name)}


def test_the_first_trace_is_dynamic_in_the_rows_and_its_marks_do_not_stay():
    """NOTE [dynamic first trace]: the first image size gets the shared program (no static first-shape
    program), and the caller's tensors hold no dynamo marks afterwards (dynamo guards on them)."""
    tower = _tiny_tower()
    # Host-computed tables: the RoPE-table-building trace then has the program of the later graphs (with
    # table gathers it reads the table it builds as an intermediate: a program of its own, run once).
    compiled = torch.compile(tower, backend="kimi_cg", options={"table_gathers": False})
    for grid in ([[4, 6]], [[6, 6]], [[2, 8]], [[8, 8]]):
        pixels, grid_tensor = _inputs(grid)
        for got, want in zip(compiled(pixels, grid_tensor), tower(pixels, grid_tensor)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert _marks(pixels) == {} and _marks(grid_tensor) == {}
    assert kimi_cg.counters["traces_with_dynamic_rows"] == kimi_cg.counters["dynamo_graphs"]
    # The first trace also builds the RoPE table: it runs once, on the plain program (NOTE [a graph that
    # builds module state]), the same program the retrace's graph shares for every size after it, the
    # first one included (before the dynamic first trace: a static program for [[4, 6]], then one more).
    assert kimi_cg.counters["device_programs_compiled"] == 1
    assert kimi_cg.counters["dynamo_graphs"] == 2  # the first trace and the RoPE-table retrace: no trace per size
    # The same tensors in another compile: no guard failure from marks left behind.
    assert torch.compile(lambda x: x * 2, backend="eager")(pixels).shape == pixels.shape


def test_marks_the_caller_made_are_kept_and_dynamic_false_gets_none():
    tower = _tiny_tower()
    pixels, grid = _inputs([[4, 6]])
    torch._dynamo.mark_dynamic(pixels, 0)
    before = _marks(pixels)
    torch.compile(tower, backend="kimi_cg")(pixels, grid)
    assert _marks(pixels) == before and kimi_cg.counters["traces_with_dynamic_rows"] == 1
    torch._dynamo.reset()
    kimi_cg.reset()
    static = torch.compile(tower, backend="kimi_cg", dynamic=False)
    for grid in ([[4, 6]], [[6, 6]]):
        pixels, grid_tensor = _inputs(grid)
        for got, want in zip(static(pixels, grid_tensor), tower(pixels, grid_tensor)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert kimi_cg.counters["traces_with_dynamic_rows"] == 0  # dynamic=False: static shapes, as asked


def test_settings_come_back_after_torch_dynamo_reset_with_kimi_cg_reset():
    torch._dynamo.reset()
    assert not dynamo_settings.installed()
    kimi_cg.reset()
    assert dynamo_settings.installed()
    tower = _tiny_tower()
    pixels, grid = _inputs([[2, 4]])
    torch.compile(tower, backend="kimi_cg")(pixels, grid)
    assert kimi_cg.counters["graph_breaks"] == 0


# A custom op whose fake implementation fails on unbacked sizes: it traces with dynamo's defaults
# (the .item() breaks the graph, sizes are concrete) and fails with kimi_cg's settings.
_LIBRARY = torch.library.Library("kimi_cg_settings_test", "FRAGMENT")
_LIBRARY.define("rows_needing_backed_sizes(Tensor x) -> Tensor")
torch.library.impl(_LIBRARY, "rows_needing_backed_sizes", "CompositeExplicitAutograd")(lambda x: x * 2)


@torch.library.register_fake("kimi_cg_settings_test::rows_needing_backed_sizes", lib=_LIBRARY)
def _fake_rows(x):
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if free_unbacked_symbols(x.shape):  # as transformers' towers fail on torch.split(x, sizes.tolist())
        raise RuntimeError("this op cannot take a data-dependent size")
    return torch.empty_like(x)


class NeedsDefaultSettings(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, grid):
        rows = int(grid[:, 0].sum().item())
        return torch.ops.kimi_cg_settings_test.rows_needing_backed_sizes(self.lin(x[:rows]))


def test_a_frame_that_fails_with_kimi_cg_settings_is_traced_with_dynamo_defaults():
    model = NeedsDefaultSettings()
    compiled = torch.compile(model, backend="kimi_cg")
    for grid in ([[3, 1]], [[5, 1]], [[2, 1]], [[4, 1]]):  # DEMOTE_AFTER_FAILURES failures, then a default trace
        x, grid_tensor = torch.randn(6, 4), torch.tensor(grid)
        torch.testing.assert_close(compiled(x, grid_tensor), model(x, grid_tensor))
    assert kimi_cg.counters["dynamo_setting_fallbacks"] == 1
    assert kimi_cg.fallbacks["dynamo failed with kimi_cg's settings"] == 1
    assert torch._dynamo.config.suppress_errors is False  # restored once the next compile started


class SegmentPerFrame(torch.nn.Module):
    """One segment per frame (transformers' Qwen2-VL / GLM-4V): the segment count is the sum of the
    items' t, a data value, and the forward splits by the segment lengths as a Python list. No nested
    frame: nothing else starts a compile while the first call runs eagerly."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, grid):
        cu = torch.nn.functional.pad(torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).cumsum(0), (1, 0))
        lengths = cu[1:] - cu[:-1]
        pieces = torch.split(self.proj(x), lengths.tolist())
        return torch.cat([piece.softmax(0) for piece in pieces])


def test_a_frame_failing_on_a_data_dependent_length_is_traced_with_that_op_as_a_graph_break():
    """NOTE [settings ladder]: the first call runs eagerly; the next one traces the frame again, with the op
    of data-dependent output size as a graph break (transformers' Qwen / GLM towers: tests/test_foreign_towers.py
    checks they become one lifted piece)."""
    model = SegmentPerFrame()
    compiled = torch.compile(model, backend="kimi_cg")
    for grid in ([[1, 4, 6]], [[2, 2, 4], [1, 6, 2]], [[3, 2, 2], [1, 4, 4]]):
        grid = torch.tensor(grid)
        x = torch.randn(int(grid.prod(-1).sum()), 8)
        torch.testing.assert_close(compiled(x, grid), model(x, grid))
        if kimi_cg.counters["dynamo_trace_failures"] == 1 and kimi_cg.counters["dynamo_graphs"] == 0:
            first = dict(kimi_cg.counters)
    assert first["dynamic_shape_op_breaks"] == 1  # the first call ran eagerly and stepped down the ladder
    assert kimi_cg.counters["dynamo_trace_failures"] == 1 and kimi_cg.counters["dynamo_setting_fallbacks"] == 0
    assert kimi_cg.counters["dynamo_graphs"] >= 2 and kimi_cg.counters["graph_breaks"] >= 1, dict(kimi_cg.counters)


class RowsPerItem(torch.nn.Module):
    """A block given the packed rows and the grid: lifted when dynamo traces it as a frame of its own."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, grid):
        scale = torch.repeat_interleave(grid[:, 0].float(), grid.prod(-1), output_size=x.shape[0])
        return self.proj(x) * scale[:, None]


class SegmentPerFrameWithABlock(SegmentPerFrame):
    """SegmentPerFrame that first calls a nested module: while the first call runs the forward eagerly
    (its ladder step), dynamo compiles the block as a frame of its own."""

    def __init__(self):
        super().__init__()
        self.block = RowsPerItem()

    def forward(self, x, grid):
        return super().forward(self.block(x, grid), grid)


def test_graphs_traced_inside_a_frame_run_eagerly_for_one_call_run_as_captured(tmp_path):
    """NOTE [calls inside a frame traced again]: the block's graph, traced while the forward's first call
    runs eagerly, runs as dynamo captured it (no device program run, no bucket); the next calls trace the
    forward whole and run lifted. The block's program, built when it was lifted, never ran, so the debug
    dump counts no program for the block's piece (NOTE [programs that ran])."""
    from kimi_cg.debug.dump import read_index
    from kimi_cg.report import device_programs_per_frame

    model = SegmentPerFrameWithABlock()
    compiled = torch.compile(model, backend="kimi_cg", options={"cuda_graphs": True, "token_budgets": [32, 64, 128],
                                                                "debug_dir": str(tmp_path)})
    lifted_runs = ("padded_runs", "graph_replays", "eager_fallbacks")
    for call, grid in enumerate(([[1, 4, 6]], [[2, 2, 4], [1, 6, 2]], [[3, 2, 2], [1, 4, 4]], [[1, 4, 6]])):
        grid = torch.tensor(grid)
        x = torch.randn(int(grid.prod(-1).sum()), 8)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, grid), model(x, grid))
        if call == 0:
            assert kimi_cg.counters["dynamic_shape_op_breaks"] >= 1, dict(kimi_cg.counters)  # this forward, super()'s
            assert kimi_cg.counters["calls_inside_frames_traced_again"] == 1, dict(kimi_cg.counters)
            assert sum(kimi_cg.counters[k] for k in lifted_runs) == 0, dict(kimi_cg.counters)
            assert kimi_cg.counters["device_programs_compiled"] >= 1, dict(kimi_cg.counters)  # the block's, lifted
            assert kimi_cg.counters["device_programs_run"] == 0, dict(kimi_cg.counters)
    assert not dynamo_settings.inside_a_frame_traced_again()
    graphs = read_index(str(tmp_path))
    programs = device_programs_per_frame(graphs)
    source, first = inspect.getsourcelines(RowsPerItem.forward)
    block_lines = {f"{__file__}:{line} (forward)" for line in range(first, first + len(source))}
    block_frames = {g["frame"] for g in graphs if g["frame"] in block_lines and g.get("device_program")}
    assert block_frames and not any(programs.get(frame) for frame in block_frames), (block_frames, dict(programs))
    assert 1 <= sum(map(len, programs.values())) <= kimi_cg.counters["device_programs_run"], dict(programs)
    assert kimi_cg.counters["calls_inside_frames_traced_again"] == 1, dict(kimi_cg.counters)
    assert kimi_cg.counters["padded_runs"] >= 3 and kimi_cg.counters["eager_fallbacks"] == 0, dict(kimi_cg.counters)


def test_the_same_frame_run_eagerly_by_another_call_is_not_taken_for_its_failed_run():
    """Only the failed call's own eager run counts: the forward's code run again outside torch.compile
    (a plain call of the module, its block compiled on its own) leaves the block's graph lifted."""
    model = SegmentPerFrameWithABlock()
    options = {"cuda_graphs": True, "token_budgets": [32, 64, 128]}
    compiled = torch.compile(model, backend="kimi_cg", options=options)
    grid = torch.tensor([[1, 4, 6]])
    x = torch.randn(24, 8)
    with torch.no_grad():
        want = model(x, grid)
        compiled(x, grid)  # the forward fails to trace and runs eagerly; it is traced again at its next call
        assert kimi_cg.counters["calls_inside_frames_traced_again"] == 1, dict(kimi_cg.counters)
        block = model.block
        model.block = torch.compile(block, backend="kimi_cg", options=options)
        try:
            got = model(x, grid)  # the forward's code, eagerly, by another caller
        finally:
            model.block = block
    torch.testing.assert_close(got, want)
    assert kimi_cg.counters["calls_inside_frames_traced_again"] == 1, dict(kimi_cg.counters)
    assert kimi_cg.counters["padded_runs"] >= 1, dict(kimi_cg.counters)
    assert not dynamo_settings._eager_runs  # that lifted call found the failed call's eager run over


class FailsOnAnEmptyBatch(torch.nn.Module):
    def forward(self, x, grid):
        return x.reshape(x.shape[0], -1) * grid.shape[0]


def test_a_trace_failure_eager_shares_gives_eager_error_and_does_not_demote_the_frame():
    model = FailsOnAnEmptyBatch()
    compiled = torch.compile(model, backend="kimi_cg")
    with pytest.raises(RuntimeError, match="ambiguous"):
        model(torch.randn(0, 3), torch.zeros(0, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="ambiguous"):  # eager's error, not a dynamo crash
        compiled(torch.randn(0, 3), torch.zeros(0, 2, dtype=torch.int64))
    assert kimi_cg.counters["dynamo_trace_failures"] == 1
    assert kimi_cg.counters["dynamo_setting_fallbacks"] == 0
    kimi_cg.reset()
    assert torch._dynamo.config.suppress_errors is False


def test_list_compare_shim_follows_python_semantics():
    calls = []

    def original(op, left, right):
        calls.append((op, left, right))
        return "original"

    shim = dynamo_settings._list_vs_tuple_aware(original)
    # A list never equals a tuple or torch.Size (upstream MoonViT's position-embedding check).
    assert shim(operator.eq, [64, 64], torch.Size([64, 64])) is False
    assert shim(operator.ne, [64, 64], (64, 64)) is True
    # Same types: element-wise equality as one condition.
    assert shim(operator.eq, (1, 2), (1, 2)) is True
    assert shim(operator.eq, (1, 2), (1, 3)) is False
    # A first element that differs decides (found on torch 2.11: the shim called a torch.sym_and that no
    # torch has, and every traced frame comparing such lists was skipped, running eagerly).
    assert shim(operator.eq, (2, 1), (3, 1)) is False
    assert shim(operator.eq, ["a", 1, 2], ["b", 1, 2]) is False
    assert shim(operator.eq, [], []) is True
    assert not calls
    # Elements whose == is not a condition (tensors) go to dynamo's own polyfill.
    assert shim(operator.eq, [torch.ones(2)], [torch.ones(2)]) == "original"
    # Orderings and different lengths go to dynamo's own polyfill.
    assert shim(operator.lt, (1, 2), (1, 3)) == "original"
    assert shim(operator.eq, (1, 2), (1, 2, 3)) == "original"


def test_list_compare_shim_traces_unbacked_sizes_in_one_graph():
    # The shim runs as a polyfill inside dynamo, where a SymBool's type reads as bool: found on torch
    # 2.11, where every MoonViT frame broke its graph at apply_rope's shape check and ran unlifted.
    shim = dynamo_settings._list_vs_tuple_aware(lambda op, left, right: pytest.fail("fell back to the original"))

    @torch.compile(backend="eager", fullgraph=True)
    def grid_rows(x, grid):
        h, w = grid.tolist()
        rows = x.new_zeros(h * w, 4)
        torch._check(shim(operator.eq, rows.shape[:-1], x.shape[:-1]))
        return rows + x

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        out = grid_rows(torch.ones(6, 4), torch.tensor([2, 3]))
    torch._dynamo.reset()
    assert torch.equal(out, torch.ones(6, 4))


def test_only_a_tower_entry_gets_dynamic_rows():
    """NOTE [dynamic first trace]: float rows of one leading size beside [N, 2 | 3] grids are marked;
    a frame given an index or a smaller table (a resumed piece, a nested frame) is left to dynamo."""
    def entry(pixels, grid):
        return pixels

    def piece(table, frame_index, x):
        return x

    def window_permutation(hidden, window_index):
        return hidden

    pixels, grid = torch.randn(24, 3, 14, 14), torch.tensor([[4, 6]])
    marked = dynamo_settings._mark_leading_dims_dynamic(entry.__code__, {"pixels": pixels, "grid": grid})
    assert [tensor for tensor, _ in marked] == [pixels] and _marks(pixels)
    dynamo_settings._unmark(marked)
    assert _marks(pixels) == {}
    locals_ = {"table": torch.randn(5, 16), "frame_index": torch.arange(12) % 5, "x": torch.randn(12, 16)}
    assert dynamo_settings._mark_leading_dims_dynamic(piece.__code__, locals_) == []
    locals_ = {"hidden": torch.randn(16, 8), "window_index": torch.arange(4)}
    assert dynamo_settings._mark_leading_dims_dynamic(window_permutation.__code__, locals_) == []
    assert all(_marks(t) == {} for t in (*locals_.values(), grid))


def test_a_frame_whose_code_cannot_be_hashed_is_passed_over_on_the_stack(monkeypatch):
    """Code that dynamo generates can hold unhashable constants (a program-fuzz case, seed 61, had a
    dict among its forward's): walking the stack past such a frame must not raise (it was a crash where
    eager runs), and such code was never recorded, so it is simply not an eager run."""
    import sys
    import weakref

    def unrelated():
        return None

    records = weakref.WeakKeyDictionary()
    records[unrelated.__code__] = (sys._getframe(), threading.get_ident())  # a live record of this thread
    monkeypatch.setattr(dynamo_settings, "_eager_runs", records)

    def caller():
        return dynamo_settings.inside_a_frame_traced_again()

    caller.__code__ = caller.__code__.replace(co_consts=caller.__code__.co_consts + ({},))
    with pytest.raises(TypeError):
        hash(caller.__code__)
    assert caller() is False
