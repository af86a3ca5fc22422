"""The bucketed runtime on CPU: padding rules, slicing, fallbacks, no aliasing (the capture itself
needs CUDA: tests/test_gpu.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

import kimi_cg
import kimi_cg.testing
from kimi_cg.config import KimiCGConfig
from kimi_cg.testing.targets import pixel_inputs
from kimi_cg.models import KimiK25VisionEncoder, KimiVLVisionEncoder, MoonViT3dConfig, MoonVitConfig, MoonVitPretrainedModel

OPTIONS = {"cuda_graphs": True, "token_budgets": [256, 1024, 2048], "max_items": 4}


def assert_matches_eager(compiled, model, grid, seed):
    """One grid through kimi_cg.testing's check (fp32 rule, eager's structure, no new NaN)."""
    kimi_cg.testing.assert_matches_eager(model, compiled, pixel_inputs("cpu", torch.float32), grids=[grid], seed=seed)


def inputs(grid, seed):
    grid_tensor = torch.tensor(grid)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid_tensor.prod(-1).sum()), 3, 14, 14, generator=generator), grid_tensor


@pytest.mark.parametrize(
    "build, grids",
    [
        (lambda: KimiVLVisionEncoder(MoonVitConfig.tiny(attn_implementation="sdpa")),
         [[[4, 6], [2, 8]], [[6, 4], [8, 2]], [[2, 2], [4, 4], [6, 6]], [[64, 64]], [[8, 8]] * 5, [[2, 64], [16, 2]]]),
        (lambda: KimiK25VisionEncoder(MoonViT3dConfig.tiny()),
         [[[1, 4, 6], [2, 2, 8]], [[3, 6, 4], [1, 8, 2]], [[4, 4, 4], [1, 2, 2]], [[1, 64, 64]], [[2, 8, 8]] * 5, [[4, 2, 64]]]),
    ],
    ids=["kimi_vl", "kimi_k25"],
)
@pytest.mark.parametrize("host_block", [False, True], ids=["", "host_block"])
def test_bucketed_path_matches_eager_splits_and_falls_back(build, grids, host_block):
    torch.manual_seed(0)
    model = build().eval()
    compiled = torch.compile(model, backend="kimi_cg", options={**OPTIONS, "host_block": host_block})
    with torch.no_grad():
        for seed, grid in enumerate(grids):
            assert_matches_eager(compiled, model, grid, seed)
    # [[64, 64]] (4096 patches, one item) exceeds the largest bucket: the non-graphed program runs.
    # Five items exceed max_items=4: the call is split into replays of 4 and 1 whole items.
    assert kimi_cg.counters["eager_fallbacks"] == 1
    assert kimi_cg.counters["split_calls"] == 1
    # NOTE [host block]: with the option, the replays took their host-made plans and boundaries through the
    # buckets' host copies
    if host_block:
        assert kimi_cg.counters["host_block_copies"] >= kimi_cg.counters["padded_runs"] > 0
    else:
        assert kimi_cg.counters["host_block_copies"] == 0 and kimi_cg.counters["padded_runs"] > 0


def test_results_do_not_alias_static_buffers():
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    with torch.no_grad():
        compiled(*inputs([[2, 2]], 0))  # static first trace
        first = compiled(*inputs([[4, 6], [2, 8]], 1))
        kept = [t.clone() for t in first]
        compiled(*inputs([[6, 4], [8, 2]], 2))  # same bucket, same shapes: would overwrite aliases
    for a, b in zip(first, kept):
        assert torch.equal(a, b)


class _Recorder:
    """A stand-in device program for BucketedGraphs: keeps the padded arguments it was called with."""

    def __call__(self, *args):
        self.args = args
        return (args[0] * 1.0,)

    def output_shapes(self, args):
        return [tuple(args[0].shape)]


def test_padded_rows_are_zero_and_cu_seqlens_gets_a_trailing_segment():
    from kimi_cg.runtime.graphs import BucketedGraphs, InputRule

    recorder = _Recorder()
    rules = [InputRule("rows"), InputRule("size"), InputRule("cu_seqlens"), InputRule("plan_index"), InputRule("plan_weight")]
    runtime = BucketedGraphs(recorder, rules, buckets=(8, 16), max_items=3, max_frames=2, capture=False)
    x = torch.randn(5, 3)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    index = torch.tensor([[0], [1], [4]])
    weight = torch.ones(3, 1)
    args = [x, 5, cu, index, weight]
    capacity = runtime.choose(args)
    assert capacity == 8
    (out,) = runtime.run(args, capacity)
    static_x, size, static_cu, static_index, static_weight = recorder.args
    assert size == 8 and static_x.shape == (8, 3) and torch.equal(static_x[:5], x) and not static_x[5:].any()
    assert static_cu.tolist() == [0, 2, 5, 8, 8]  # real bounds, trailing [5, 8), then empty segments
    assert static_index.shape == (8, 2) and static_index[:3, 0].tolist() == [0, 1, 4]
    assert (static_index[:, 1] == -1).all() and (static_index[3:] == -1).all()
    assert not static_weight[3:].any() and not static_weight[:, 1].any()
    assert torch.equal(out, x)
    assert runtime.choose([torch.randn(17, 3), 17, cu, index, weight]) is None  # larger than every bucket
    assert runtime.choose([x, 5, torch.zeros(6, dtype=torch.int32), index, weight]) is None  # too many items
    assert runtime.choose([x, 5, cu, torch.zeros(3, 3, dtype=torch.long), torch.ones(3, 3)]) is None  # frames


def test_many_segments_get_a_dense_table_and_padding_in_short_segments():
    """NOTE [segment tables] in kimi_cg/runtime/graphs.py: window attention's boundaries (more segments
    than max_items) make the input's table dense instead of running the plain program; padding rows
    get segments of their own, PADDING_SEGMENT_ROWS long while the table has room."""
    from kimi_cg.runtime.graphs import PADDING_SEGMENT_ROWS, ROWS_PER_DENSE_SEGMENT, BucketedGraphs, InputRule

    recorder = _Recorder()
    runtime = BucketedGraphs(recorder, [InputRule("rows"), InputRule("cu_seqlens")], buckets=(64, 256, 512), max_items=3,
                             max_frames=2, capture=False)
    windows = torch.tensor([0, 4, 20, 36, 40, 56, 60, 64, 80, 84, 90, 94, 100], dtype=torch.int32)  # 12 windows
    x = torch.randn(100, 3)
    assert runtime.choose([x, windows]) is None  # 12 segments: more than max_items
    assert runtime.make_tables_dense([x, windows]) and not runtime.make_tables_dense([x, windows])
    assert runtime.segment_slots(1, 256) == 4 + 256 // ROWS_PER_DENSE_SEGMENT
    capacity = runtime.choose([x, windows])
    assert capacity == 256
    (out,) = runtime.run([x, windows], capacity)
    static_x, static_cu = recorder.args
    bounds = static_cu.tolist()
    assert len(bounds) == runtime.segment_slots(1, 256) + 1 and bounds[:13] == windows.tolist() and bounds[-1] == 256
    assert bounds[13:16] == [100 + PADDING_SEGMENT_ROWS, 100 + 2 * PADDING_SEGMENT_ROWS, 256]  # padding: linear pieces
    assert all(b >= a for a, b in zip(bounds, bounds[1:])) and torch.equal(out, x)
    # Few rows in many short windows: the smallest bucket's table is too small, a larger bucket holds them.
    tiny_windows = torch.arange(0, 64, 4, dtype=torch.int32).tolist() + [62]
    small = torch.tensor(sorted(set(tiny_windows)), dtype=torch.int32)
    rows = torch.randn(62, 3)
    assert small.numel() - 1 > runtime.segment_slots(1, 64) - 1
    assert runtime.choose([rows, small]) == 256
    (out,) = runtime.run([rows, small], 256)
    assert torch.equal(out, rows) and recorder.args[1].tolist()[:small.numel()] == small.tolist()


def test_a_static_first_trace_is_never_split_and_takes_a_dense_table():
    """dynamo's static first trace (exact_rows: one bucket, its row count) has literal sizes: splitting
    its call into parts of fewer rows ran its program at sizes it cannot take (Qwen2.5-VL's static block
    graph on the H200: its 40-odd windows read as items, every call fell back)."""
    from kimi_cg.runtime.graphs import BucketedGraphs, InputRule

    recorder = _Recorder()
    runtime = BucketedGraphs(recorder, [InputRule("rows"), InputRule("cu_seqlens")], buckets=(100,), max_items=3,
                             max_frames=2, capture=False, exact_rows=True)
    windows = torch.tensor([0, 4, 20, 36, 40, 56, 60, 64, 80, 84, 90, 94, 100], dtype=torch.int32)
    x = torch.randn(100, 3)
    assert runtime.split([x, windows]) is None
    assert runtime.choose([x, windows]) is None and runtime.make_tables_dense([x, windows])
    assert runtime.choose([x, windows]) == 100
    (out,) = runtime.run([x, windows], 100)
    assert torch.equal(out, x) and recorder.args[1].tolist()[:13] == windows.tolist()


def test_bucket_ladder_and_option_validation():
    assert KimiCGConfig().buckets() == (1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 5888, 6912,
                                        8192, 9984, 11776, 13824, 16384)
    assert KimiCGConfig(buckets_per_doubling=1).buckets() == (1024, 2048, 4096, 8192, 16384)
    assert KimiCGConfig(min_tokens=100, max_tokens=300, buckets_per_doubling=1).buckets() == (100, 256, 300)
    ladder = KimiCGConfig().buckets()
    assert all(b / a <= 1.25 for a, b in zip(ladder, ladder[1:]))
    assert KimiCGConfig(token_budgets=(300, 100, 300)).buckets() == (100, 300)
    with pytest.raises(ValueError):
        KimiCGConfig(token_budgets=(0,))
    with pytest.raises(ValueError):
        KimiCGConfig(min_tokens=4096, max_tokens=1024)
    with pytest.raises(ValueError):
        KimiCGConfig(buckets_per_doubling=0)
    with pytest.raises(ValueError):
        KimiCGConfig(device_compiler="tvm")
    assert KimiCGConfig().compute_hash() != KimiCGConfig(max_items=3).compute_hash()


def test_two_models_with_one_structure_do_not_share_captured_weights():
    torch.manual_seed(0)
    first = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    second = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()  # same structure, other weights
    compiled = [torch.compile(m, backend="kimi_cg", options=OPTIONS) for m in (first, second)]
    with torch.no_grad():
        for seed, grid in enumerate([[[2, 2]], [[4, 6], [2, 8]], [[6, 4], [8, 2]]]):
            pixel_values, grid_tensor = inputs(grid, seed)
            for model, fast in zip((first, second), compiled):
                for got, want in zip(fast(pixel_values, grid_tensor), model(pixel_values, grid_tensor)):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_inductor_device_program_compiles_once_for_all_buckets():
    """The default on CUDA: Inductor with symbolic sizes, run here through the padded bucket path."""
    torch.manual_seed(0)
    model = KimiK25VisionEncoder(MoonViT3dConfig.tiny()).eval()
    options = dict(OPTIONS, device_compiler="inductor")
    compiled = torch.compile(model, backend="kimi_cg", options=options)
    with torch.no_grad():
        for seed, grid in enumerate([[[1, 2, 2]], [[1, 4, 6], [2, 2, 8]], [[3, 6, 4], [1, 8, 2]], [[1, 16, 16], [4, 4, 2]], [[1, 2, 2], [1, 2, 2], [2, 4, 4]]]):
            assert_matches_eager(compiled, model, grid, seed)
    assert kimi_cg.counters["device_programs_compiled"] == 1  # one Inductor program, from the first call on
    assert kimi_cg.counters["eager_fallbacks"] == 0


def test_split_keeps_item_order_and_runs_an_oversized_item_unsplit():
    torch.manual_seed(0)
    model = KimiVLVisionEncoder(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    with torch.no_grad():
        for seed, grid in enumerate([[[2, 2]], [[4, 4], [2, 2]], [[40, 40], [2, 6], [30, 30], [4, 4]], [[4, 2], [64, 64], [2, 2]]]):
            assert_matches_eager(compiled, model, grid, seed)
    assert kimi_cg.counters["split_calls"] == 2
    assert kimi_cg.counters["eager_fallbacks"] == 1  # the 64x64 item alone


@pytest.mark.parametrize("build, grid", [
    (lambda: KimiVLVisionEncoder(MoonVitConfig.tiny()), [[20, 30], [30, 50], [10, 50], [28, 50]]),
    (lambda: KimiK25VisionEncoder(MoonViT3dConfig.tiny()), [[1, 20, 30], [3, 10, 50], [1, 10, 50], [2, 14, 50]]),
], ids=["kimi_vl", "kimi_k25_video"])
def test_split_packs_sorted_items_and_restores_call_order(build, grid, monkeypatch):
    """Patches 600, 1500, 500, 1400 with a largest bucket of 2048: call order needs 3 parts
    ([600], [1500, 500], [1400]); first-fit decreasing needs 2 ([1500, 500], [1400, 600]), the
    second out of call order, so the outputs must be put back item by item."""
    from kimi_cg.runtime.graphs import BucketedGraphs

    torch.manual_seed(0)
    model = build().eval()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    runs = []
    original = BucketedGraphs.run
    monkeypatch.setattr(BucketedGraphs, "run", lambda self, inputs, capacity, **kwargs: runs.append(capacity) or original(self, inputs, capacity, **kwargs))
    with torch.no_grad():
        for seed, g in enumerate([[row[:-2] + [2, 2] for row in grid[:1]], grid]):
            runs.clear()
            assert_matches_eager(compiled, model, g, seed)
    assert kimi_cg.counters["split_calls"] == 1
    assert runs == [2048, 2048]


class GridIntoVarlenOp(torch.nn.Module):
    """A call's cu_seqlens (an integer input, per call) handed as is to a varlen attention op."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, cu_seqlens):
        q = self.proj(x).view(-1, 1, 16)
        return torch.ops.kimi_cg_test.flash_attn_varlen_fwd(q, q, q, cu_seqlens, cu_seqlens, x.shape[0], x.shape[0]).flatten(1)


@pytest.mark.parametrize("registered", [False, True], ids=["unknown_op", "registered_op"])
def test_a_grid_handed_to_a_device_op_is_never_a_static_input(registered, tmp_path, monkeypatch):
    """A captured graph reads a static input at its capture-time address: a per-call grid given that
    rule would replay with another call's values. It is padded as segment boundaries when it is a
    registered varlen attention's, else those calls run the plain program; outputs always match eager."""
    import json

    from kimi_cg import varlen_registry
    from kimi_cg.debug.dump import read_index
    from towers.upstream_moonvit import FLASH_STAND_IN

    monkeypatch.setattr(varlen_registry, "_REGISTRY", dict(varlen_registry._REGISTRY))
    if registered:
        kimi_cg.register_varlen_attention(FLASH_STAND_IN, {"max_seqlen_q": "q", "max_seqlen_k": "k"},
                                          segments=("cu_seqlens_q", "cu_seqlens_k"))
    torch.manual_seed(0)
    model = GridIntoVarlenOp().eval()
    compiled = torch.compile(model, backend="kimi_cg", dynamic=True,
                             options={"cuda_graphs": True, "token_budgets": [64], "debug_dir": str(tmp_path)})
    for lengths in ([5, 7], [3, 9, 4], [10, 2]):
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.randn(sum(lengths), 16)
        torch.testing.assert_close(compiled(x, cu_seqlens), model(x, cu_seqlens), rtol=1e-5, atol=1e-5)
    graph = next(g for g in read_index(str(tmp_path)) if g["status"] == "lifted")
    report = json.loads((tmp_path / graph["path"] / "lift_report.json").read_text())
    (grid_input,) = [entry for entry in report["device_inputs"] if entry["kind"] == "grid"]
    assert grid_input["padding_rule"] == ("cu_seqlens" if registered else "unpadded")
    assert kimi_cg.counters["lift_fallbacks"] == kimi_cg.counters["call_fallbacks"] == 0


class PieceAfterABreak(torch.nn.Module):
    """What a frame resumed after a graph break receives (Kimi-K2.5's piece after get_vision_frame_index):
    a small float table the caller computed (fixed shape, not one row per patch), a per-patch index made
    from the grid, and the packed patches. The index only reads the table; an index_add would write."""

    def __init__(self, write: bool = False):
        super().__init__()
        self.write = write
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, table, frame_index, x):
        if self.write:  # a scatter: padded index rows would add padding into real rows
            return self.proj(x).index_add(0, frame_index, x)
        return self.proj(x + table[frame_index])


@pytest.mark.parametrize("write", [False, True])
def test_a_resumed_piece_with_a_fixed_table_and_a_row_index_replays(write, tmp_path):
    """A float input of fixed shape is copied in as is each call ("fixed"); a grid-made index with one
    entry per patch row that only gathers is padded like rows (padding rows read table row 0). An index
    a device op writes through stays unpadded (plain program). Outputs always match eager."""
    import json

    from kimi_cg.debug.dump import read_index

    torch.manual_seed(0)
    model = PieceAfterABreak(write).eval()
    # Automatic dynamic shapes (as for a tower): the table keeps its static shape, the rows become s0.
    compiled = torch.compile(model, backend="kimi_cg",
                             options={"cuda_graphs": True, "token_budgets": [32, 64], "debug_dir": str(tmp_path)})
    for rows in (7, 20, 41, 13):
        table = torch.randn(5, 16)
        frame_index = torch.randint(0, 5 if not write else rows, (rows,))
        x = torch.randn(rows, 16)
        with torch.no_grad():
            torch.testing.assert_close(compiled(table, frame_index, x), model(table, frame_index, x), rtol=1e-5, atol=1e-5)
    graph = [g for g in read_index(str(tmp_path)) if g["status"] == "lifted"][-1]  # the dynamic trace
    report = json.loads((tmp_path / graph["path"] / "lift_report.json").read_text())
    rules = {entry["placeholder"]: entry["padding_rule"] for entry in report["device_inputs"]}
    index_rule = next(rule for name, rule in rules.items() if "frame_index" in name)
    assert index_rule == ("unpadded" if write else "rows"), rules
    if not write:
        assert next(rule for name, rule in rules.items() if "table" in name) == "fixed", rules
        assert kimi_cg.counters["eager_fallbacks"] == 0, dict(kimi_cg.counters)
    assert kimi_cg.counters["lift_fallbacks"] == kimi_cg.counters["call_fallbacks"] == 0


def test_device_programs_equal_but_for_input_names_share_one_hash():
    """Dynamo names a resumed piece's inputs after its own counters (getitem_116 in one trace,
    getitem_179 in the next): the names must not key the device program, or every retrace of a piece
    compiles the same program again (found on transformers 5.17's Kimi-K2.5: three Inductor compiles
    of the 27-layer piece)."""
    from kimi_cg.device_program import structural_hash

    def first(getitem_116, weight):
        return torch.relu(getitem_116 @ weight) + 1

    def second(getitem_179, weight):
        return torch.relu(getitem_179 @ weight) + 1

    def other(getitem_179, weight):
        return torch.relu(getitem_179 @ weight) + 2

    hashes = [structural_hash(torch.fx.symbolic_trace(fn)) for fn in (first, second, other)]
    assert hashes[0] == hashes[1]
    assert hashes[1] != hashes[2]


def test_device_programs_on_two_devices_do_not_share_one_hash():
    """The same tower on two devices in one process (a replica per GPU) traces two graphs equal but for
    their inputs' device; one device program would reuse the first device's compile (Inductor's code
    allocates on, and launches for, the device it was compiled for) for the second device's tensors."""
    from kimi_cg.device_program import structural_hash

    def program(x, weight):
        return torch.relu(x @ weight) + 1

    def traced_on(device):
        gm = torch.fx.symbolic_trace(program)
        for node, shape in zip((n for n in gm.graph.nodes if n.op == "placeholder"), ((4, 8), (8, 8))):
            node.meta["example_value"] = torch.empty(shape, device=device)
        return gm

    assert structural_hash(traced_on("cpu")) == structural_hash(traced_on("cpu"))
    assert structural_hash(traced_on("cpu")) != structural_hash(traced_on("meta"))


INDUCTOR_PROGRAM_WITH_A_SIZE_INPUT = """
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from kimi_cg.device_program import compile_with_inductor

def program(rows, count):  # a size input tied to a tensor's size (transformers' seq_len)
    return rows.reshape(count, 1) * 2

gm = torch.fx.symbolic_trace(program)
shape_env = ShapeEnv()
symbol = shape_env.create_symbol(32, ConstantSource("count"), dynamic_dim=DimDynamic.DYNAMIC)
count = [node for node in gm.graph.nodes if node.op == "placeholder"][1]
count.meta["example_value"] = shape_env.create_symintnode(symbol, hint=32, source=ConstantSource("count"))
rows = torch.randn(8, 4)
out = compile_with_inductor(gm, [rows, 32])(rows, 32)
assert torch.equal(out[0] if isinstance(out, (list, tuple)) else out, program(rows, 32))
"""


def test_an_inductor_device_program_compiles_again_in_a_process_with_a_warm_inductor_cache(tmp_path):
    """Inductor's FX graph cache stores guards over the graph's SymInt inputs only, assuming every
    symbolic tensor size has one (true of dynamo's graphs, not of device programs, whose fakes hold
    symbols of their own): the guard of the second process named an unknown tensor, raised NameError,
    and every call of that program ran the captured graph (transformers' Qwen2.5-VL, second run on a
    machine)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for run in ("cold cache", "warm cache"):
        result = subprocess.run([sys.executable, "-P", "-c", INDUCTOR_PROGRAM_WITH_A_SIZE_INPUT], capture_output=True,
                                text=True, timeout=300, env=env)
        assert result.returncode == 0, f"{run}: {result.stderr[-2000:]}"


def test_an_inductor_device_program_traced_with_a_symbolic_width_takes_every_width():
    """A frame called with tensors of two widths (Qwen2.5-VL's permute_input_for_window_attn takes the
    hidden states and the rotary table) is traced with a symbolic trailing size, and its device program
    serves both widths: compiled for the first call's width, the second raised Inductor's size assert
    and ran the captured graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from kimi_cg.device_program import get_device_program

    def program(rows):
        return (rows * 2 + 1).softmax(-1)

    gm = torch.fx.symbolic_trace(program)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
    rows = next(node for node in gm.graph.nodes if node.op == "placeholder")
    rows.meta["example_value"] = fake_mode.from_tensor(torch.randn(6, 10), symbolic_context=context)
    device = get_device_program(gm, "inductor")
    for shape in ((7, 64), (5, 16), (9, 64)):
        x = torch.randn(shape)
        out = device(x)
        out = out[0] if isinstance(out, (list, tuple)) else out
        torch.testing.assert_close(out, program(x), rtol=1e-6, atol=1e-6)


def test_device_programs_with_other_constant_tensors_do_not_share_a_hash():
    """A graph's constant tensors (get_attr) are part of its program: two graphs equal but for a
    constant's values must not share the first one's compiled program (a wrong number)."""
    from kimi_cg.device_program import structural_hash

    class AddsAConstant(torch.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.offset = torch.full((4,), float(value))

        def forward(self, x):
            return x + self.offset

    hashes = [structural_hash(torch.fx.symbolic_trace(AddsAConstant(value))) for value in (1, 1, 2)]
    assert hashes[0] == hashes[1]
    assert hashes[0] != hashes[2]


def _new_graph_sets(earlier):
    """The graph sets made since ``earlier`` (those of earlier tests may still be alive)."""
    from kimi_cg.runtime.graphs import graph_sets

    return [graphs for graphs in graph_sets() if not any(graphs is old for old in earlier)]


def test_a_repeated_one_item_size_gets_an_exact_size_graph():
    """NOTE [exact-size graphs]: the third call of a one-item size runs a graph of exactly its rows
    (a two-entry table [0, L], nothing padded), equal to eager; multi-item calls never do; the least
    recently used size is dropped beyond the limit."""
    from kimi_cg.runtime.graphs import graph_sets

    earlier = list(graph_sets())
    torch.manual_seed(0)
    model = KimiVLVisionEncoder(MoonVitConfig.tiny(attn_implementation="sdpa")).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={**OPTIONS, "exact_size_graphs": 2})
    with torch.no_grad():
        compiled(*inputs([[2, 2]], 0))  # dynamo's first trace
        for seed, grid in enumerate([[[4, 6]], [[4, 6]], [[4, 6], [2, 2]], [[4, 6], [2, 2]], [[6, 4]], [[6, 4]]]):
            assert_matches_eager(compiled, model, grid, seed)
        (graphs,) = [graphs for graphs in _new_graph_sets(earlier) if graphs.exact]
        assert list(graphs.exact) == [24]  # [[6, 4]] is 24 rows too: the same graph
        bucket = graphs.exact[24]
        table = next(value for value, rule in zip(bucket.inputs, graphs.rules) if rule.kind == "cu_seqlens")
        assert table.tolist() == [0, 24] and bucket.capacity == 24
        assert_matches_eager(compiled, model, [[8, 8]], 7)  # seen once: its bucket, no exact graph
        assert list(graphs.exact) == [24]
        assert_matches_eager(compiled, model, [[6, 4]], 8)  # 24 rows again: its graph is the most recent
        for seed, grid in enumerate([[[8, 8]], [[2, 6]], [[2, 6]], [[8, 8]], [[2, 6]]]):
            assert_matches_eager(compiled, model, grid, 10 + seed)
        assert list(graphs.exact) == [64, 12]  # 24 was the least recently used of three
    assert kimi_cg.counters["exact_size_graphs_dropped"] == 1
    assert kimi_cg.counters["eager_fallbacks"] == 0


def test_exact_size_graphs_off():
    from kimi_cg.runtime.graphs import graph_sets

    earlier = list(graph_sets())
    torch.manual_seed(0)
    model = KimiVLVisionEncoder(MoonVitConfig.tiny(attn_implementation="sdpa")).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={**OPTIONS, "exact_size_graphs": 0})
    with torch.no_grad():
        for seed in range(4):
            assert_matches_eager(compiled, model, [[4, 6]], seed)
    new = _new_graph_sets(earlier)
    assert new and all(not graphs.exact and not graphs.sightings for graphs in new)


def test_class_bounds_halve_the_capacity_in_flash_blocks():
    from kimi_cg.runtime.graphs import class_bounds

    assert class_bounds(7168, 3) == [3584, 1792]
    assert class_bounds(7168, 1) == []
    assert class_bounds(1000, 4) == [512, 256, 128]  # rounded up to 128-row query blocks
    assert class_bounds(256, 4) == [128]  # 64 rounds up to 128: one bound, once
    assert class_bounds(100, 3) == []  # no bound below the capacity
    with pytest.raises(ValueError, match="attention_length_classes"):
        KimiCGConfig(attention_length_classes=0)


def test_a_broken_segment_bound_raises_on_cpu():
    """NOTE [segment-length classes]: the op checks the runtime's promise on CPU tables; a broken one
    is an error, never a silently partial attention."""
    from kimi_cg.ops.varlen_attention import longest_segment_bound

    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    expected = torch.ops.kimi_cg.varlen_attention(q, q, q, cu, 10)
    with longest_segment_bound(10, 6):
        assert torch.equal(torch.ops.kimi_cg.varlen_attention(q, q, q, cu, 10), expected)
    with longest_segment_bound(12, 4):  # a promise about other rows: not this attention's
        assert torch.equal(torch.ops.kimi_cg.varlen_attention(q, q, q, cu, 10), expected)
    with longest_segment_bound(10, 5), pytest.raises(RuntimeError, match="segment-length classes"):
        torch.ops.kimi_cg.varlen_attention(q, q, q, cu, 10)


def test_calls_run_at_the_smallest_segment_length_class_that_holds_them(monkeypatch):
    """NOTE [segment-length classes]: a bucket runs bounded by the longest segment its table gets,
    padding segments included; the op checks each bound on CPU, and results equal eager."""
    from kimi_cg.runtime import graphs as graphs_module

    bounds = []
    real = graphs_module.longest_segment_bound

    def recording(rows, bound):
        bounds.append((rows, bound))
        return real(rows, bound)

    monkeypatch.setattr(graphs_module, "longest_segment_bound", recording)
    torch.manual_seed(0)
    model = KimiVLVisionEncoder(MoonVitConfig.tiny(attn_implementation="sdpa")).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={**OPTIONS, "exact_size_graphs": 0})
    with torch.no_grad():
        compiled(*inputs([[2, 2]], 0))  # builds the RoPE table: the plain program (NOTE [a graph that builds
        assert bounds == []            # module state])
        bounds.clear()
        # 40 rows in the 256 bucket: segments 24, 16, then padding 64, 64, 88: the 128 bound holds them.
        assert_matches_eager(compiled, model, [[4, 6], [2, 8]], 1)
        # 160 rows: a 128-row item, padding 64, 32 and an empty segment: exactly the 128 bound.
        assert_matches_eager(compiled, model, [[2, 64], [16, 2]], 2)
        # 320 rows in the 1024 bucket: padding 64, 64, then 576 rows, over the 512 bound: capacity.
        assert_matches_eager(compiled, model, [[16, 16], [8, 8]], 3)
        # 700 rows, one item of 480: padding pieces end short of the 512 bound.
        assert_matches_eager(compiled, model, [[16, 30], [10, 22]], 4)
    assert bounds == [(256, 128), (256, 128), (1024, 512)]
    assert kimi_cg.counters["length_class_runs"] == 3
    assert kimi_cg.counters["eager_fallbacks"] == 0 and kimi_cg.counters["call_fallbacks"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_the_longest_segment_read_on_the_host_is_the_filled_tables(seed):
    """NOTE [segment-length classes]: the bound a call replays is chosen from the longest segment
    computed on the host; it must be exactly the longest of the tables ``_fill`` writes (real
    segments, padding pieces, the rest), for item tables and dense ones, at every bucket that fits."""
    import random

    from kimi_cg.runtime.graphs import BucketedGraphs, InputRule

    rng = random.Random(seed)
    for dense in (False, True):  # item tables (a long last padding piece), then dense ones (many short pieces)
        items = rng.choice([2, 4, 8])
        runtime = BucketedGraphs(_Recorder(), [InputRule("rows"), InputRule("cu_seqlens")],
                                 buckets=(128, 512, 1024, 4096), max_items=items, max_frames=2, capture=False)
        checked, last_piece_longest = 0, 0
        for _ in range(60):
            lengths = [rng.choice([1, 7, 16, 64, 100, 300, 900]) for _ in range(rng.randint(1, 12 if dense else items))]
            table = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
            x = torch.randn(int(table[-1]), 3)
            if dense:
                runtime.make_tables_dense([x, table])
            if runtime.choose([x, table]) is None:
                continue
            for capacity in [c for c in runtime.capacities if c >= x.shape[0]]:
                if len(lengths) + 1 > runtime.segment_slots(1, capacity):
                    continue
                runtime.run([x, table], capacity)  # prepares the buckets and fills this one
                filled = runtime.buckets[capacity].inputs[1].tolist()
                longest = max(b - a for a, b in zip(filled, filled[1:]))
                assert runtime.longest_segment(runtime.buckets[capacity], [x, table]) == longest, (filled, capacity)
                checked += 1
                last_piece_longest += filled[-1] - filled[-2] == longest > max(lengths)
        assert checked >= 30 and (dense or last_piece_longest >= 5)


def test_one_model_compiled_with_and_without_length_classes_keeps_each_option():
    """Graph sets are shared by equal device programs of one model's weights; the graph options are
    part of that key, so a second compile with other options does not inherit the first one's graphs."""
    torch.manual_seed(0)
    model = KimiVLVisionEncoder(MoonVitConfig.tiny(attn_implementation="sdpa")).eval()
    with_classes = torch.compile(model, backend="kimi_cg", options={**OPTIONS, "exact_size_graphs": 0})
    without = torch.compile(model, backend="kimi_cg", options={**OPTIONS, "exact_size_graphs": 0, "attention_length_classes": 1})
    with torch.no_grad():
        assert_matches_eager(with_classes, model, [[4, 6], [2, 8]], 1)
        runs = kimi_cg.counters["length_class_runs"]
        assert runs > 0
        assert_matches_eager(without, model, [[4, 6], [2, 8]], 1)
        assert kimi_cg.counters["length_class_runs"] == runs


@pytest.mark.parametrize("make", [
    lambda: torch.randint(-5, 2**40, (37, 4)), lambda: torch.randn(3, 5, 7).to(torch.bfloat16), lambda: torch.rand(9) > 0.5,
    lambda: torch.tensor(7, dtype=torch.int32), lambda: torch.empty(0, 4, dtype=torch.int64), lambda: torch.randn(6, 4).t(),
    lambda: torch.randn(5, dtype=torch.complex64).conj(), lambda: torch.randn(5, dtype=torch.complex64)._neg_view(),
    lambda: torch.randn(4, 3, requires_grad=True), lambda: torch.randn(2, 3, dtype=torch.float16)],
    ids=["int64", "bf16", "bool", "scalar", "empty", "strided", "conj", "neg", "requires_grad", "fp16"])
def test_staged_bytes_read_back_as_the_value(make):
    """NOTE [pinned staging]: a value written into a staging buffer (numpy's copy for dense ones, torch's
    for the rest) reads back bit for bit, at an offset, with its dtype and shape."""
    from kimi_cg.runtime.staging import write_bytes

    value = make()
    buffer = torch.full((1 << 12,), 0xA5, dtype=torch.uint8)
    stage = write_bytes(buffer, buffer.numpy(), 128, value)
    want = value.detach().resolve_conj().resolve_neg()
    assert stage.dtype == want.dtype and stage.shape == want.shape
    assert torch.equal(stage.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))
    assert stage.data_ptr() == buffer.data_ptr() + 128 or want.numel() == 0
    assert (buffer[:128] == 0xA5).all() and (buffer[128 + want.numel() * want.element_size():] == 0xA5).all()


def test_repeated_batches_reuse_their_filled_inputs_and_their_moved_copies(monkeypatch):
    """NOTE [moved batches] in kimi_cg/runtime/runner.py, through a tower: batches repeated, interleaved
    and as single images equal eager while their replays skip the fills of inputs still in place; a
    batch's kept device copies come back only for its key, on the device and stream that made them
    (default streams of two devices share a handle), at positions they cover, and go with the batch when
    it leaves the cache."""
    from kimi_cg.host_program import HostProgram
    from kimi_cg.runtime.memory import metadata_store
    from kimi_cg.runtime.staging import read_only

    runs = []
    run = HostProgram.run
    monkeypatch.setattr(HostProgram, "run", lambda self, *args: runs.append((self, run(self, *args))) or runs[-1][1])
    torch.manual_seed(0)
    model = KimiVLVisionEncoder(MoonVitConfig.tiny(attn_implementation="sdpa")).eval()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    a, b, c = [[4, 6], [2, 8]], [[6, 4], [8, 2]], [[10, 12]]
    with torch.no_grad():
        for seed, grid in enumerate([a, a, b, a, a, c, c, c, b, a]):
            assert_matches_eager(compiled, model, grid, seed)
    assert kimi_cg.counters["batch_cache_hits"] >= 6 and kimi_cg.counters["fills_skipped"] > 0, dict(kimi_cg.counters)

    host, (outputs, key) = runs[-1]  # batch a's
    assert key is not None and all(value in read_only for value in outputs if isinstance(value, torch.Tensor))
    copies = {3: torch.zeros(4), 5: torch.ones(2)}
    made = (torch.device("cuda", 0), 7)
    host.keep_moved(key, copies, made)
    assert host.moved(key, {3: None}.keys(), made) == copies and all(value in read_only for value in copies.values())
    assert host.moved(key, {3: None, 5: None}.keys(), made) == copies
    assert host.moved(key, {3: None, 4: None}.keys(), made) is None  # a position it does not cover
    assert host.moved(key, {3: None}.keys(), (torch.device("cuda", 0), 8)) is None  # another stream
    assert host.moved(key, {3: None}.keys(), (torch.device("cuda", 1), 7)) is None  # another device, same handle
    assert host.moved(None, {3: None}.keys(), made) is None
    with torch.no_grad():  # other batches of two items push batch a out of its program's cache
        for width in range(2, 2 + 2 * host.batch_cache_size, 2):
            compiled(*inputs([[2, width], [2, 2]], 0))
    assert metadata_store.get(("batch", host.serial, key)) is None and host.moved(key, {3: None}.keys(), made) is None


@pytest.mark.parametrize("host_block", [False, True], ids=["", "host_block"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_fills_skipped_for_read_only_values_leave_what_a_full_fill_writes(device, host_block):
    """NOTE [moved batches] in kimi_cg/runtime/runner.py: a static input still holding the read-only value
    a call brings is not written again. Calls draw their host-made values from three read-only batches
    (one brings a boundary table for more rows than its pixels: the same table, another patch count)
    or make fresh ones, in two buckets, with and without the host block (one batch's weights of another
    dtype take ``_fill``'s path after the block's copy; on CUDA one boundary table is on the device,
    where its padding depends on the call's rows); after every call the static inputs equal,
    element for element, those of a runtime that writes everything from copies of the same values.
    With the host block, a call whose values are the ones the block's packed copy holds copies nothing."""
    from kimi_cg.runtime.graphs import BucketedGraphs
    from kimi_cg.runtime.graphs import InputRule
    from kimi_cg.runtime.staging import read_only

    def runtime(block: bool) -> BucketedGraphs:
        rules = [InputRule("rows"), InputRule("size"), InputRule("cu_seqlens", host=True),
                 InputRule("plan_index", host=True), InputRule("plan_weight", host=True), InputRule("rows", host=True)]
        return BucketedGraphs(_Recorder(), rules, buckets=(16, 64), max_items=4, max_frames=3, capture=False,
                              host_block=block)

    generator = torch.Generator().manual_seed(1)

    def host_values(rows: int, weight_dtype=torch.float32) -> list:
        items = int(torch.randint(1, 5, (), generator=generator))
        cuts = sorted(torch.randint(0, rows + 1, (items - 1,), generator=generator).tolist())
        plan_rows = int(torch.randint(0, rows + 1, (), generator=generator))
        frames = int(torch.randint(1, 4, (), generator=generator))
        return [torch.tensor([0, *cuts, rows], dtype=torch.int32),
                torch.randint(-1, rows, (plan_rows, frames), generator=generator).to(device),
                torch.rand(plan_rows, frames, generator=generator, dtype=weight_dtype).to(device),
                torch.randint(0, 100, (rows, 8), generator=generator, dtype=torch.int32).to(device)]

    batches = [(10, host_values(10)), (12, host_values(12, torch.float64)), (40, host_values(40))]
    if device == "cuda":  # a boundary table on the device is not checked against the rows (a read would sync):
        batches[0][1][0] = batches[0][1][0].to(device)  # batch 0's, with fewer pixel rows, pads for another count
        batches.append((9, [*batches[0][1][:3], torch.zeros(9, 8, dtype=torch.int32, device=device)]))
    for _, values in batches:
        for value in values:
            read_only.add(value)
    skipping, full = runtime(host_block), runtime(False)
    before = kimi_cg.counters["fills_skipped"]
    for call in range(60):
        choice = int(torch.randint(0, len(batches) + 2, (), generator=generator))
        if choice < len(batches):
            rows, values = batches[choice]
        else:
            rows = int(torch.randint(1, 65, (), generator=generator))
            values = host_values(rows)
        pixels = torch.randn(rows, 3, generator=generator).to(device)
        args = [pixels, rows, *values]
        capacity = full.choose(args)
        assert capacity is not None and skipping.choose(args) == capacity
        (out,) = skipping.run(args, capacity)
        assert torch.equal(out, pixels)
        got = skipping.program.args
        full.run([pixels, rows, *(value.clone() for value in values)], capacity)
        for position, (have, want) in enumerate(zip(got, full.program.args)):
            if isinstance(want, torch.Tensor):
                assert torch.equal(have, want), (call, position)
            else:
                assert have == want
    skipped = kimi_cg.counters["fills_skipped"] - before
    # Repeated batches found their values in place: in the static buffers, or (host block) in the
    # block's packed copy, which a call bringing the values it last held does not copy again. (On CUDA
    # with the block, only the boundary tables are host-made and the count depends on the draw.)
    if not host_block or device == "cpu":
        assert skipped > 20, skipped


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_host_block_writes_what_the_plain_fill_writes(device):
    """NOTE [host block] in kimi_cg/runtime/graphs.py: host-made inputs written through a bucket's host
    copies (two, used in turn, padding restored only over the rows a copy last wrote) leave every static
    buffer equal, element for element, to the separate buffers ``_fill`` pads, call after call: more rows
    then fewer, fewer frames, more and fewer segments, two buckets. On CUDA (pinned copies, one copy per
    call, no sync between calls) every fifth call brings one plan already on the device: it takes
    ``_fill``'s path after the block's copy."""
    from kimi_cg.runtime.graphs import BucketedGraphs, InputRule

    def runtime(host: bool) -> BucketedGraphs:
        rules = [InputRule("rows"), InputRule("size"), InputRule("cu_seqlens", host=host),
                 InputRule("plan_index", host=host), InputRule("plan_weight", host=host), InputRule("rows", host=host)]
        return BucketedGraphs(_Recorder(), rules, buckets=(16, 64), max_items=4, max_frames=3, capture=False,
                              host_block=True)

    blocked, plain = runtime(True), runtime(False)
    assert blocked.host_block_positions == [2, 3, 4, 5] and plain.host_block_positions == []
    generator = torch.Generator().manual_seed(0)
    before = kimi_cg.counters["host_block_copies"]
    for call in range(40):
        rows = int(torch.randint(1, 65, (), generator=generator)) if call % 7 else 64
        items = int(torch.randint(1, 5, (), generator=generator))
        cuts = sorted(torch.randint(0, rows + 1, (items - 1,), generator=generator).tolist())
        cu = torch.tensor([0, *cuts, rows], dtype=torch.int32)
        plan_rows = int(torch.randint(0, rows + 1, (), generator=generator))
        frames = int(torch.randint(1, 4, (), generator=generator))
        index = torch.randint(-1, rows, (plan_rows, frames), generator=generator)
        if device == "cuda" and call % 5 == 4:
            index = index.to(device)
        weight = torch.rand(plan_rows, frames, generator=generator)
        table = torch.randint(0, 100, (rows, 8), generator=generator, dtype=torch.int32)
        args = [torch.randn(rows, 3, generator=generator).to(device), rows, cu, index, weight, table]
        capacity = plain.choose(args)
        assert capacity == blocked.choose(args) and capacity is not None
        (out,) = blocked.run(args, capacity)
        assert torch.equal(out, args[0])
        blocked_args = blocked.program.args
        plain.run(args, capacity)
        for position, (got, want) in enumerate(zip(blocked_args, plain.program.args)):
            if isinstance(want, torch.Tensor):
                assert got.device == want.device and torch.equal(got, want), (call, position)
            else:
                assert got == want
    assert kimi_cg.counters["host_block_copies"] - before == 40
    assert all(bucket.host_block is not None and len(bucket.host_block.stages) == 2 for bucket in blocked.buckets.values())
    assert blocked.host_block_bytes() > 0


def test_buckets_live_on_the_activations_device_when_a_host_made_input_comes_first():
    """NOTE [host block]: a host-made rows input stays on the host until the bucket's one copy, so the
    bucket's device is that of an input the host program did not make, whatever the inputs' order (a
    MoonViT3d program lists host-made table plans before its patches: its buckets were allocated on
    the CPU and its device program failed to compile on CUDA). The meta device stands in for CUDA."""
    from kimi_cg.runtime.graphs import BucketedGraphs, InputRule

    rules = [InputRule("rows", host=True), InputRule("rows"), InputRule("size"), InputRule("cu_seqlens", host=True)]
    graphs = BucketedGraphs(_Recorder(), rules, buckets=(16, 64), max_items=4, max_frames=1, capture=False,
                            host_block=True)
    args = [torch.zeros(10, 4, dtype=torch.int64), torch.empty(10, 3, device="meta"), 10,
            torch.tensor([0, 4, 10], dtype=torch.int32)]
    graphs.prepare(args)
    for bucket in graphs.buckets.values():
        assert {value.device.type for value in bucket.inputs if isinstance(value, torch.Tensor)} == {"meta"}
        assert bucket.padding_steps.device.type == "meta"
