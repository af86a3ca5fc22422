"""The compiler core on CPU: compiled == eager on fuzzed grids, counters, errors, lift structure."""

from __future__ import annotations

import logging
import os
import operator
import subprocess
import sys
import textwrap

import pytest
import torch

import kimi_cg
from dumps import last_device_program, last_lifted_graph
import kimi_cg.testing
from kimi_cg.errors import InvalidInputError
from kimi_cg.models import moonvit
from kimi_cg.models.moonvit import KimiVLVisionEncoder, MoonVitConfig, MoonVitPretrainedModel
from kimi_cg.models.moonvit3d import KimiK25VisionEncoder, MoonViT3dConfig, MoonViT3dPretrainedModel
from kimi_cg.testing.targets import pixel_inputs

# fp32: compiled vs eager within 1e-5 relative (design brief); outputs are O(1) after LayerNorm.
RTOL, ATOL = 1e-5, 1e-5


def make_inputs(grid: list[list[int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    grid_tensor = torch.tensor(grid, dtype=torch.int64)
    rows = int(grid_tensor.prod(dim=-1).sum())
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, 14, 14, generator=generator), grid_tensor


def assert_same_outputs(compiled, eager):
    assert isinstance(compiled, list) and len(compiled) == len(eager)
    for got, want in zip(compiled, eager):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


TOWERS = [
    # N in 1..8 items, even sides up to 64 (2 x 64 strips, the 8 x 8 position table's edge, realistic
    # aspect ratios included); MoonViT3d also video chunks, t in 2..4 for a third of the items.
    pytest.param(lambda impl: MoonVitPretrainedModel(MoonVitConfig.tiny(attn_implementation=impl)), 2, id="moonvit"),
    pytest.param(lambda impl: MoonViT3dPretrainedModel(MoonViT3dConfig.tiny(attn_implementation=impl)), 3, id="moonvit3d"),
]


@pytest.mark.parametrize("build, dims", TOWERS)
@pytest.mark.parametrize("impl, max_patches", [("flash_attention_2", 4096), ("sdpa", 2048)])
def test_fuzzed_batches_match_eager_with_one_device_program(build, dims, impl, max_patches):
    torch.manual_seed(0)
    model = build(impl).eval()
    compiled = torch.compile(model, backend="kimi_cg")  # one compiled model for every example
    strategy = kimi_cg.testing.grids(dims=dims, max_items=8, max_side=64, max_patches=max_patches, table_size=8,
                                     video_fraction=0.33)
    item = [[2, 2]] if dims == 2 else [[1, 2, 2]]
    taller = [[4, 2]] if dims == 2 else [[1, 4, 2]]
    # The warm-up traces one item twice (static first trace, then dynamic in the patch count): after
    # it no device program compiles, whatever the item count.
    report = kimi_cg.testing.assert_matches_eager(model, compiled, pixel_inputs("cpu", torch.float32), strategy,
                                                  max_examples=30, warm_up=[item, taller], no_compiles_after_warm_up=True,
                                                  no_graph_breaks=True, no_fallbacks=True)
    # The fuzzing must fuzz: many distinct grids and item counts.
    assert report.examples >= 32 and report.distinct_grids >= report.examples // 5 and len(report.item_counts) >= 4
    # One graph per distinct N, plus two: dynamo's first trace has static shapes and the lazily built
    # RoPE table forces one more trace. NOTE [dynamo graph count] in docs/design.md.
    assert report.counters["dynamo_graphs"] <= len(set(report.item_counts) | {1}) + 2
    # One device program, dynamic in the patch count from the first trace (NOTE [dynamic first trace]).
    assert report.counters["device_programs_compiled"] == 1
    assert report.counters["host_programs_built"] == report.counters["dynamo_graphs"]


@pytest.mark.parametrize(
    "wrapper, grids",
    [
        (lambda: KimiVLVisionEncoder(MoonVitConfig.tiny(attn_implementation="sdpa")), [[[4, 6], [2, 8]], [[8, 4], [2, 2]], [[6, 6], [2, 4]]]),
        (lambda: KimiK25VisionEncoder(MoonViT3dConfig.tiny()), [[[1, 4, 6], [3, 2, 8]], [[2, 8, 4], [1, 2, 2]], [[4, 6, 6], [1, 2, 4]]]),
    ],
    ids=["kimi_vl_with_projector", "kimi_k25_with_projector"],
)
def test_tower_with_projector_matches_eager(wrapper, grids):
    torch.manual_seed(0)
    model = wrapper().eval()
    compiled = torch.compile(model, backend="kimi_cg")
    with torch.no_grad():
        for seed, grid in enumerate(grids):
            pixel_values, grid_tensor = make_inputs(grid, seed)
            assert_same_outputs(compiled(pixel_values, grid_tensor), model(pixel_values, grid_tensor))
    assert kimi_cg.counters["graph_breaks"] == 0
    assert kimi_cg.counters["device_programs_compiled"] <= 2


def test_metadata_cache_hits_repeats_and_invalidates_on_weight_update():
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    # The host computes the tables' per-item values here (NOTE [table gathers] off: with it on, the
    # device reads the tables and the cached plans hold no weights: tests/test_table_gather.py).
    compiled = torch.compile(model, backend="kimi_cg", options={"table_gathers": False})
    # The first call builds the RoPE table inside its graph (a fresh tensor, so its slices are keyed on
    # a tensor that is gone afterwards); the last batch repeats the sizes of the second.
    grids = [[[2, 2]], [[4, 6], [2, 8]], [[8, 8], [2, 2]], [[2, 8], [4, 6]]]
    with torch.no_grad():
        for seed, grid in enumerate(grids[:3]):
            pixel_values, grid_tensor = make_inputs(grid, seed)
            compiled(pixel_values, grid_tensor)
        misses = kimi_cg.counters["metadata_cache_misses"]
        hits = kimi_cg.counters["metadata_cache_hits"]
        pixel_values, grid_tensor = make_inputs(grids[3], 7)
        assert_same_outputs(compiled(pixel_values, grid_tensor), model(pixel_values, grid_tensor))
        # Two item values per image (interpolated position grid, RoPE slice), both seen before.
        assert kimi_cg.counters["metadata_cache_misses"] == misses
        assert kimi_cg.counters["metadata_cache_hits"] == hits + 4
        model.patch_embed.pos_emb.weight.mul_(1.5)  # in-place weight update: cached embeddings are stale
        assert_same_outputs(compiled(pixel_values, grid_tensor), model(pixel_values, grid_tensor))
        assert kimi_cg.counters["metadata_cache_misses"] == misses + 2


@pytest.mark.parametrize(
    "tower, grid, rows, expected",
    [
        ("2d", [[4, 4], [2, 2]], 21, "grid[0][0]*grid[0][1]"),  # pixel rows do not match the grid
        ("2d", [[4, 4], [3, 2]], None, "item 1 [3, 2]"),  # h not divisible by the merge kernel
        ("2d", [[4, 4], [2, 130]], None, "item 1 [2, 130]"),  # beyond the RoPE table (128)
        ("2d", [[4, 4], [0, 2]], None, "item 1 [0, 2]"),
        ("3d", [[1, 4, 4], [5, 2, 2]], None, "item 1 [5, 2, 2]"),  # t beyond the time table (4)
        ("3d", [[1, 2, 2], [0, 4, 4]], None, "item 1 [0, 4, 4]"),
    ],
)
def test_invalid_grids_raise_clear_errors(tower, grid, rows, expected):
    torch.manual_seed(0)
    model = (MoonVitPretrainedModel(MoonVitConfig.tiny()) if tower == "2d" else MoonViT3dPretrainedModel(MoonViT3dConfig.tiny())).eval()
    compiled = torch.compile(model, backend="kimi_cg")
    good = [[4, 4], [2, 2]] if tower == "2d" else [[1, 4, 4], [2, 2, 2]]
    with torch.no_grad():
        compiled(*make_inputs(good, 0))  # a valid call first: the error must come from the compiled path
        grid_tensor = torch.tensor(grid)
        total = int(grid_tensor.prod(dim=-1).sum()) if rows is None else rows
        pixel_values = torch.randn(total, 3, 14, 14)
        with pytest.raises(Exception):
            model(pixel_values, grid_tensor)
        with pytest.raises(InvalidInputError, match=expected.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
            compiled(pixel_values, grid_tensor)


def test_empty_batch_raises():
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg")
    empty = torch.zeros(0, 2, dtype=torch.int64)
    with torch.no_grad(), pytest.raises(Exception):
        model(torch.randn(0, 3, 14, 14), empty)
    with torch.no_grad(), pytest.raises(Exception):
        compiled(torch.randn(0, 3, 14, 14), empty)


class _UpstreamAssertRope(moonvit.Rope2DPosEmb):
    """The RoPE lookup with upstream's untraceable assert (a generator over grid values)."""

    def get_freqs_cis_by_seqlens(self, grid_hws, device=None):
        if self.freqs_cis is None:
            self.freqs_cis = self._precompute_freqs_cis(device if device is not None else grid_hws.device)
        shapes = grid_hws.tolist()
        assert all(1 <= h <= self.max_height and 1 <= w <= self.max_width for h, w in shapes), shapes
        return torch.cat([self.freqs_cis[:h, :w].reshape(-1, self.dim // 2) for h, w in shapes], dim=0)


def test_graph_break_is_reported_counted_and_results_stay_correct(caplog):
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    rope = model.encoder.rope_2d
    model.encoder.rope_2d = _UpstreamAssertRope(rope.dim, rope.max_height, rope.max_width, rope.theta_base)
    compiled = torch.compile(model, backend="kimi_cg")
    with caplog.at_level(logging.WARNING, logger="kimi_cg"), torch.no_grad():
        for seed, grid in enumerate([[[4, 6], [2, 8]], [[8, 4], [2, 2]]]):
            pixel_values, grid_tensor = make_inputs(grid, seed)
            assert_same_outputs(compiled(pixel_values, grid_tensor), model(pixel_values, grid_tensor))
    assert kimi_cg.counters["graph_breaks"] >= 1
    messages = [r.getMessage() for r in caplog.records if "graph break" in r.getMessage()]
    assert messages and __file__ in messages[0] and "torch._check" in messages[0]


def test_lift_moves_grid_work_to_host_and_removes_dense_mask(tmp_path):
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny(attn_implementation="sdpa")).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"debug_dir": str(tmp_path)})
    with torch.no_grad():
        for seed, grid in enumerate([[[4, 6], [2, 8]], [[8, 4], [2, 2]]]):
            compiled(*make_inputs(grid, seed))
    last = last_lifted_graph(tmp_path)
    def code(name):  # the dumps hold the user's source lines as comments: look at code only
        lines = (last / name).read_text().splitlines()
        return "\n".join(line for line in lines if not line.strip().startswith("#"))

    device, host = code(last_device_program(tmp_path)), code("host_program.py")
    assert "merge_gather" in device and "varlen_attention" in device
    for host_only in ("interpolate", ".item()", "scaled_dot_product_attention", "torch.zeros", "contiguous", "view_as_complex"):
        assert host_only not in device, host_only
    assert "item_value" in host and "segments_to_cu_seqlens" in host and "row_view" in host
    assert (last / "lift_report.json").exists()
    stages = sorted(p.name for p in last.glob("[0-9][0-9]_*"))  # the graph as received, then each changing pass
    assert stages[0] == "00_dynamo_graph.py" and any(n.endswith("_merge_gather.diff") for n in stages), stages
    assert any(n.endswith("_segment_attention.diff") for n in stages), stages


def test_backend_resolves_in_a_fresh_interpreter():
    code = textwrap.dedent(
        """
        import sys, torch
        assert "kimi_cg" not in sys.modules
        f = torch.compile(lambda x: x * 2, backend="kimi_cg")
        assert f(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
        assert "kimi_cg.backend" in sys.modules
        assert not torch._dynamo.config.capture_scalar_outputs  # scoped to kimi_cg's own traces
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_dynamic_true_matches_eager_without_a_static_first_graph():
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg", dynamic=True)
    with torch.no_grad():
        for seed, grid in enumerate([[[4, 6], [2, 8]], [[8, 4], [2, 2]], [[6, 6]], [[2, 64]]]):
            pixel_values, grid_tensor = make_inputs(grid, seed)
            assert_same_outputs(compiled(pixel_values, grid_tensor), model(pixel_values, grid_tensor))
    # N = 2 twice (the lazily built RoPE table forces the second trace), then N = 1 once.
    assert kimi_cg.counters["dynamo_graphs"] == 3
    assert kimi_cg.counters["device_programs_compiled"] == 1  # no static first-shape program
    assert kimi_cg.counters["graph_breaks"] == 0


@pytest.mark.parametrize("build, item", [
    (lambda: MoonVitPretrainedModel(MoonVitConfig.tiny()), [2, 2]),
    (lambda: MoonViT3dPretrainedModel(MoonViT3dConfig.tiny()), [1, 2, 2]),
], ids=["moonvit", "moonvit3d"])
@pytest.mark.parametrize("eager_first", [False, True], ids=["fresh", "eager_first"])
def test_warm_up_traces_every_item_count_so_serving_never_compiles(build, item, eager_first):
    torch.manual_seed(0)
    model = build().eval()
    pixel_values, grid_tensor = make_inputs([item], seed=0)
    if eager_first:  # the RoPE table exists before warm_up (which also makes it first, eagerly)
        with torch.no_grad():
            model(pixel_values, grid_tensor)
    compiled = torch.compile(model, backend="kimi_cg")
    report = kimi_cg.warm_up(compiled, pixel_values, grid_tensor, max_items=4)
    # One trace per item count: warm_up's eager first call built the lazy RoPE table before dynamo's
    # first trace, so no count is traced twice (5 traces, fresh, before it did).
    assert report["calls"] == 5 and report["dynamo_graphs"] == kimi_cg.counters["dynamo_graphs"] == 4
    parts = report["breakdown_s"]
    assert set(parts) == {"backend", "device_compile", "capture", "dynamo_and_runs"}
    assert parts["backend"] > 0 and min(parts.values()) >= 0
    assert sum(parts.values()) == pytest.approx(report["seconds"])
    assert parts["backend"] == pytest.approx(kimi_cg.timings["backend"])  # the counters started at zero
    assert [call["items"] for call in report["per_call"]] == [1, 2, 1, 3, 4]
    seconds = [call["seconds"] for call in report["per_call"]]
    assert seconds == sorted(seconds) and report["buckets_ready_s"] in seconds and seconds[-1] <= report["seconds"]
    traced = kimi_cg.counters["dynamo_graphs"]
    grids = [[[4, 6], [2, 8]], [[8, 4]], [[6, 6], [2, 10], [4, 4], [2, 2]], [[10, 2], [2, 4], [6, 2]]]
    with torch.no_grad():
        for seed, grid in enumerate(grids):
            grid = [[1 + seed % 3, h, w] for h, w in grid] if len(item) == 3 else grid
            pixel_values, grid_tensor = make_inputs(grid, seed)
            assert_same_outputs(compiled(pixel_values, grid_tensor), model(pixel_values, grid_tensor))
    assert kimi_cg.counters["dynamo_graphs"] == traced  # no request compiled


def test_warm_up_rejects_bad_arguments():
    with pytest.raises(ValueError, match="grid tensor"):
        kimi_cg.warm_up(lambda *a: None, torch.zeros(4, 3, 14, 14), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="first item needs 16"):
        kimi_cg.warm_up(lambda *a: None, torch.zeros(4, 3, 14, 14), torch.tensor([[4, 4]]))
    with pytest.raises(ValueError, match="max_items"):
        kimi_cg.warm_up(lambda *a: None, torch.zeros(4, 3, 14, 14), torch.tensor([[2, 2]]), max_items=0)


def test_unknown_option_is_rejected():
    compiled = torch.compile(MoonVitPretrainedModel(MoonVitConfig.tiny()), backend="kimi_cg", options={"no_such_option": 1})
    with pytest.raises(Exception, match="unknown kimi_cg options"):
        compiled(*make_inputs([[2, 2]], 0))


def test_projector_pre_norm_is_fused_into_the_gather(tmp_path):
    torch.manual_seed(0)
    model = KimiK25VisionEncoder(MoonViT3dConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"debug_dir": str(tmp_path)})
    with torch.no_grad():
        for seed, grid in enumerate([[[1, 4, 6], [3, 2, 8]], [[2, 8, 4], [1, 2, 2]]]):
            pixel_values, grid_tensor = make_inputs(grid, seed)
            assert_same_outputs(compiled(pixel_values, grid_tensor), model(pixel_values, grid_tensor))
    last = last_lifted_graph(tmp_path)
    code = "\n".join(l for l in last_device_program(tmp_path).read_text().splitlines() if not l.strip().startswith("#"))
    assert "merge_gather_layernorm" in code
    assert code.count("layer_norm(") == 2 * MoonViT3dConfig.tiny().num_hidden_layers + 1  # blocks + final, not pre_norm


class _MergerIntoLayerNorm(torch.nn.Module):
    """A per-item 2x2 window merger whose output goes through a LayerNorm (the projector's pre-norm)."""

    def __init__(self):
        super().__init__()
        self.pre_norm = torch.nn.LayerNorm(4)
        self.proj = torch.nn.Linear(16, 6)

    def forward(self, x, grid):
        outs = []
        start = 0
        for h, w in grid.tolist():
            seq = x[start:start + h * w]
            start = start + h * w
            outs.append(seq.view(h // 2, 2, w // 2, 2, 4).permute(0, 2, 1, 3, 4).contiguous().view(h * w // 4, 4, 4))
        return self.proj(self.pre_norm(torch.cat(outs)).view(-1, 16))


def test_a_layer_norm_whose_eps_is_traced_as_a_graph_input_is_left_unfused():
    """torch.compile(dynamic=True) traces a module's float attributes (LayerNorm's eps) as graph inputs:
    the fusion of a gather into the LayerNorm needs a number, so that norm stays as it is (it raised
    TypeError inside kimi_cg and the graph ran unlifted; found by the program fuzzer, seed 1205 case 34)."""
    torch.manual_seed(0)
    model = _MergerIntoLayerNorm().eval()
    compiled = torch.compile(model, backend="kimi_cg", dynamic=True, options={"strict": True})
    with torch.no_grad():
        for grid in ([[8, 6]], [[2, 4], [4, 6], [2, 8]]):
            grid = torch.tensor(grid)
            x = torch.randn(int(grid.prod(-1).sum()), 4)
            torch._dynamo.mark_static(x, 1)  # the feature width (dynamic=True would make it symbolic too)
            torch.testing.assert_close(compiled(x, grid), model(x, grid), rtol=1e-5, atol=1e-6)
    assert kimi_cg.counters["lift_fallbacks"] == 0 and kimi_cg.counters["host_programs_built"] >= 1, dict(kimi_cg.counters)


class _ReturnsAFreshMask(torch.nn.Module):
    """Varlen attention over the grid's items, and a [1, L, L] mask the graph returns (dynamo ends a
    piece there when the frame goes on to fill the mask in a loop it cannot trace)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x, grid):
        rows = x.shape[0]
        lengths = grid[:, 0] * grid[:, 1]
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        q, k, v = self.qkv(x).view(rows, 3, 2, 4).unbind(1)
        out = torch.ops.kimi_cg.varlen_attention(q, k, v, cu_seqlens, int(lengths.max().item()))
        return out.reshape(rows, 8), torch.zeros(1, rows, rows, dtype=torch.bool)


def test_a_graph_returning_a_tensor_made_from_constants_alone_is_lifted():
    """Under a static trace ``torch.zeros(1, L, L)`` depends on nothing: no program owned it, and the
    split raised KeyError inside kimi_cg, so the graph ran unlifted (found by the program fuzzer, seed
    1206 case 11). The host serves it now, a fresh tensor per call (a caller may fill it in place)."""
    torch.manual_seed(0)
    model = _ReturnsAFreshMask().eval()
    compiled = torch.compile(model, backend="kimi_cg", dynamic=False, options={"strict": True})
    masks = []
    with torch.no_grad():
        for grid in ([[2, 3], [1, 4]], [[2, 2], [3, 1]], [[4, 4]], [[2, 2], [3, 1]]):
            grid = torch.tensor(grid)
            x = torch.randn(int(grid.prod(-1).sum()), 8)
            got, want = compiled(x, grid), model(x, grid)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            got[1].fill_(True)  # the caller owns what it got back
            masks.append(got[1])
    assert len({mask.data_ptr() for mask in masks}) == len(masks)
    assert kimi_cg.counters["lift_fallbacks"] == 0 and kimi_cg.counters["host_programs_built"] >= 1, dict(kimi_cg.counters)


class _CentredItemsThenMaskedAttention(torch.nn.Module):
    """Per-item centring (a split by grid sizes: the rows become a sum of unbacked sizes), SDPA under a
    block-diagonal mask filled by a loop, then a per-item flip."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x, grid):
        cu = torch.nn.functional.pad((grid[:, 0] * grid[:, 1]).cumsum(0), (1, 0))
        x = torch.cat([p - p.mean(0, keepdim=True) for p in torch.split(x, (cu[1:] - cu[:-1]).tolist())])
        rows = x.shape[0]
        q, k, v = (t.transpose(0, 1) for t in self.qkv(x).view(rows, 3, 1, 8).unbind(1))
        mask = torch.zeros([1, rows, rows], dtype=torch.bool)
        for i in range(1, len(cu)):
            a, b = cu[i - 1].item(), cu[i].item()
            mask[:, a:b, a:b] = True
        x = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask).transpose(0, 1).reshape(rows, 8)
        return torch.cat([p.flip(0) for p in x.split([h * w for h, w in grid.tolist()])])


def test_nodes_the_segment_attention_rewrite_inserts_carry_example_values():
    """The masked SDPA becomes kimi_cg's varlen op through inserted transposes; without example values
    on them the merge-gather pass took them for a region's root and raised AttributeError inside
    kimi_cg (the graph ran unlifted; program fuzzer, seed 1207 case 248). Whatever kimi_cg cannot lift
    here must be a named limit, never an internal error."""
    torch.manual_seed(0)
    model = _CentredItemsThenMaskedAttention().eval()
    compiled = torch.compile(model, backend="kimi_cg")
    with torch.no_grad():
        for grid in ([[7, 5], [8, 2]], [[3, 1], [7, 1], [4, 4]], [[1, 8], [8, 4], [8, 7]]):
            grid = torch.tensor(grid)
            x = torch.randn(int(grid.prod(-1).sum()), 8)
            torch.testing.assert_close(compiled(x, grid), model(x, grid), rtol=1e-5, atol=1e-6)
    assert not any(reason.startswith("internal error") for reason in kimi_cg.fallbacks), dict(kimi_cg.fallbacks)


class _MergerWithReshape(torch.nn.Module):
    """A per-item 2x2 window merger written with ``reshape`` after the permute (a copy, where ``view``
    would fail)."""

    def forward(self, x, grid):
        outs = []
        start = 0
        for h, w in grid.tolist():
            seq = x[start:start + h * w]
            start += h * w
            outs.append(seq.view(h // 2, 2, w // 2, 2, 4).permute(0, 2, 1, 3, 4).reshape(-1, 4, 4))
        return outs


def test_a_merger_reshaping_after_a_permute_is_a_gather():
    """The host replay of ``reshape`` copies where a view cannot follow (as the real op does): it replayed it
    as ``view`` and rejected every valid input, so each call ran unlifted (program fuzzer, seed 1205)."""
    model = _MergerWithReshape().eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"strict": True, "cuda_graphs": True, "token_budgets": [32, 128]})
    with torch.no_grad():
        for grid in ([[6, 4], [2, 2]], [[2, 2], [6, 4]], [[4, 4]]):
            grid = torch.tensor(grid, dtype=torch.int32)
            x = torch.randn(int(grid.prod(-1).sum()), 4)
            for got, want in zip(compiled(x, grid), model(x, grid), strict=True):
                assert torch.equal(got, want)  # a pure gather: exact
    assert kimi_cg.counters["call_fallbacks"] == 0 and kimi_cg.counters["host_programs_built"] >= 1, dict(kimi_cg.counters)


def test_grid_integers_are_read_once_as_a_list():
    """NOTE [grid read once]: grid[i][j].item() chains become indexing of one grid.tolist(); an
    indexing another node uses as a tensor stays; reads of other tensors are left alone."""
    from kimi_cg.host_program import read_grids_once

    graph = torch.fx.Graph()
    grid, other = graph.placeholder("grid"), graph.placeholder("other")
    row0, row1 = graph.call_function(operator.getitem, (grid, 0)), graph.call_function(operator.getitem, (grid, 1))
    h0 = graph.call_method("item", (graph.call_function(operator.getitem, (row0, 0)),))
    w0 = graph.call_function(torch.ops.aten._local_scalar_dense.default, (graph.call_function(operator.getitem, (row0, 1)),))
    h1 = graph.call_method("item", (graph.call_function(operator.getitem, (row1, 0)),))
    row1_sum = graph.call_method("sum", (row1,))  # a tensor use of grid[1]: kept
    t = graph.call_method("item", (graph.call_function(operator.getitem, (other, 0)),))  # not a grid
    graph.output((graph.call_function(operator.mul, (h0, w0)), h1, row1_sum, t))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    args = (torch.tensor([[6, 4], [2, 8]]), torch.tensor([7, 9]))
    want = gm(*args)
    assert read_grids_once(gm, {grid}) == 3
    code = gm.code
    assert code.count("tolist()") == 1 and code.count(".item()") == 1  # the other tensor's read only
    assert [n.target for n in gm.graph.nodes].count("sum") == 1
    got = gm(*args)
    assert got[0] == want[0] == 24 and got[1] == want[1] == 2 and got[3] == want[3] == 7
    assert torch.equal(got[2], want[2]) and all(type(v) is int for v in (got[0], got[1]))
    with pytest.raises(IndexError):
        gm(torch.tensor([[6, 4]]), args[1])  # too few items: IndexError, as grid[1] raised before


def test_repeated_host_reads_merge_and_their_checks_run_once():
    """NOTE [repeated host reads]: per-layer re-reads of the boundaries become one read and one check;
    a tensor some user writes in place, and allocations, are never merged; values are unchanged."""
    from kimi_cg.host_program import check_scalar, inline_scalar_asserts, merge_repeated_reads

    graph = torch.fx.Graph()
    cu, rows = graph.placeholder("cu"), graph.placeholder("rows")
    longest = []
    for layer in range(3):  # each "layer" checks cu[-1] == rows and takes the longest segment
        last = graph.call_method("item", (graph.call_function(operator.getitem, (cu, -1)),))
        graph.call_function(torch.ops.aten._assert_scalar.default, (graph.call_function(operator.eq, (last, rows)), f"layer {layer}"))
        diff = graph.call_function(operator.sub, (graph.call_function(operator.getitem, (cu, slice(1, None))),
                                                  graph.call_function(operator.getitem, (cu, slice(None, -1)))))
        longest.append(graph.call_method("item", (graph.call_method("max", (diff,)),)))
    written = [graph.call_function(operator.getitem, (cu, slice(0, 2))) for _ in range(2)]
    graph.call_method("add_", (written[0], 1))  # cu[0:2] written in place: neither copy may be merged
    zeros = [graph.call_function(torch.zeros, (2,)) for _ in range(2)]  # allocations: never merged
    graph.output((longest, written, zeros))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    before = len(gm.graph.nodes)
    merged = merge_repeated_reads(gm)
    assert merged == 2 * (1 + 1 + 1 + 1 + 1 + 1 + 1 + 1)  # per extra layer: 2 indexings x 2 + sub, max, 2 items, eq
    assert len(gm.graph.nodes) == before - merged
    assert inline_scalar_asserts(gm) == 1  # the three layers' checks now share one condition
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count("item") == 2 and targets.count("max") == 1 and targets.count(check_scalar) == 1
    assert targets.count(torch.zeros) == 2 and targets.count(operator.getitem) == 3 + 2
    got_longest, got_written, got_zeros = gm(torch.tensor([0, 3, 7, 8]), 8)
    assert got_longest == [4, 4, 4] and got_zeros[0] is not got_zeros[1]
    assert got_written[0].tolist() == [1, 4] and got_written[1].tolist() == [1, 4]  # one storage, written once
    with pytest.raises(RuntimeError, match="layer 0"):
        gm(torch.tensor([0, 3, 7, 9]), 8)


def test_moonvit_host_program_reads_its_grid_once(tmp_path):
    """NOTE [grid read once] and NOTE [repeated host reads] on a real tower: the dumped host program
    reads grid_hws with one tolist(), and of the boundary reads each layer's flash path makes
    (cu_seqlens[-1].item(), the longest segment's .item()) one of each remains; outputs equal eager."""
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"debug_dir": str(tmp_path)})
    with torch.no_grad():
        pixel_values, grid = make_inputs([[8, 8], [6, 4], [2, 10]], 0)
        assert_same_outputs(compiled(pixel_values, grid), model(pixel_values, grid))
    code = [line for line in (last_lifted_graph(tmp_path) / "host_program.py").read_text().splitlines()
            if not line.strip().startswith("#")]
    assert sum(".tolist()" in line for line in code) == 1 and sum(".item()" in line for line in code) == 2


def test_host_asserts_run_as_python_checks_once_per_condition():
    from kimi_cg.host_program import check_scalar, inline_scalar_asserts

    graph = torch.fx.Graph()
    h, w = graph.placeholder("h"), graph.placeholder("w")
    positive = graph.call_function(operator.ge, (h, 1))
    fits = graph.call_function(operator.le, (w, 128))
    for condition, message in ((positive, "h >= 1"), (positive, "h >= 1 again"), (fits, "w <= 128")):
        graph.call_function(torch.ops.aten._assert_scalar.default, (condition, message))
    graph.output(graph.call_function(operator.mul, (h, w)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert inline_scalar_asserts(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(check_scalar) == 2 and torch.ops.aten._assert_scalar.default not in targets
    assert gm(4, 6) == 24
    with pytest.raises(RuntimeError, match="h >= 1"):
        gm(0, 6)
    with pytest.raises(RuntimeError, match="w <= 128"):
        gm(2, 130)
