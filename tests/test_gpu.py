"""GPU proof (skipped without CUDA): CUDA-graph replays vs eager in bf16 on fuzzed grid batches.

The fuzzing is kimi_cg.testing's (its grids and its bf16 rule, flash-attention's: the compiled error
against an fp32 reference with the same weights is at most 2x eager bf16's error against it, plus a
rounding floor). The graph pool is poisoned with NaN before capture, so a read of unwritten memory
shows up as NaN.
Writes a JSON summary to $KIMI_CG_GPU_SUMMARY when set (scripts/gpu_check.sh does).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import kimi_cg
import kimi_cg.testing
from kimi_cg.config import KimiCGConfig
from kimi_cg.models import MoonViT3dConfig, MoonViT3dPretrainedModel, MoonVitConfig, MoonVitPretrainedModel
from kimi_cg.testing.targets import pixel_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SUMMARY: dict = {}


def _relative_error(got, want) -> float:
    num = sum(float((g.float() - w.float()).norm() ** 2) for g, w in zip(got, want)) ** 0.5
    den = sum(float(w.float().norm() ** 2) for w in want) ** 0.5
    return num / den


CASES = [
    ("moonvit", "tiny", 300),
    ("moonvit3d", "tiny", 300),
    ("moonvit", "real", 48),
    ("moonvit3d", "real", 48),
    ("moonvit", "real-host-tables", 48),  # NOTE [table gathers] off: the host computes the tables' values
    # NOTE [host block] on: host-made inputs packed in one copy, padded by the unpack kernel inside the graphs
    ("moonvit", "tiny-host-block", 300),
    ("moonvit3d", "tiny-host-block", 150),
    ("moonvit", "real-host-block", 48),
]


def _record(name: str, report, counters: dict, **extra) -> None:
    worst = report.worst
    SUMMARY[name] = {
        "batches": report.examples,
        "distinct_grids": report.distinct_grids,
        "distinct_item_counts": len(report.item_counts),
        "max_patches_in_a_batch": max(kimi_cg.testing.patches(g) for g in report.grids),
        "worst_relative_error_vs_fp32": worst.get("error", 0.0),
        "worst_error_ratio_vs_eager_bf16": worst.get("error", 0.0) / max(worst.get("eager_error", 0.0), 1e-12),
        "worst": worst.get("where"),
        "counters": counters,
        **extra,
    }
    path = os.environ.get("KIMI_CG_GPU_SUMMARY")
    if path:
        cases = {}
        if os.path.exists(path):  # scripts/gpu_check.sh runs its parts as separate pytest processes
            with open(path) as f:
                cases = json.load(f).get("cases", {})
        cases.update(SUMMARY)
        with open(path, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "cases": cases}, f, indent=2)


@pytest.mark.parametrize("tower, size, count", CASES, ids=[f"{t}-{s}" for t, s, _ in CASES])
def test_graph_replays_match_eager_bf16(tower, size, count):
    torch.manual_seed(0)
    video = tower == "moonvit3d"
    config_class, model_class = (MoonViT3dConfig, MoonViT3dPretrainedModel) if video else (MoonVitConfig, MoonVitPretrainedModel)
    tiny = size.startswith("tiny")
    config = config_class.tiny() if tiny else config_class()
    reference = model_class(config).cuda().eval()  # fp32
    model = copy.deepcopy(reference).to(torch.bfloat16)
    options = {"poison_graph_pool": True, "table_gathers": not size.endswith("host-tables"),
               "host_block": size.endswith("host-block")}
    if tiny:
        options["token_budgets"] = [512, 1024, 2048, 4096, 8192]
    compiled = torch.compile(model, backend="kimi_cg", options=options)  # one compiled model for all examples
    make_inputs = pixel_inputs("cuda", torch.bfloat16)
    first = [[1, 4, 6]] if video else [[4, 6]]
    with torch.no_grad():
        kimi_cg.warm_up(compiled, *make_inputs(first), max_items=8)
    warm = dict(kimi_cg.counters)
    # Up to 8 items, even sides up to 64 (strips, the position table's edge, realistic aspect ratios,
    # batches exactly at, one merged row under and over each bucket), video chunks t in 2..4 for a
    # quarter of the 3D items; batches over the largest bucket split or run the non-graphed program.
    buckets = KimiCGConfig.from_options(options).buckets()
    strategy = kimi_cg.testing.grids(dims=3 if video else 2, max_items=8, max_side=64, max_patches=2 * max(buckets),
                                     video_fraction=0.25, table_size=config.init_pos_emb_height, buckets=buckets)
    report = kimi_cg.testing.assert_matches_eager(model, compiled, make_inputs, strategy, reference=reference,
                                                  max_examples=count, no_graph_breaks=True, no_fallbacks=True)
    counters = dict(kimi_cg.counters)
    assert report.examples >= 0.9 * count  # hypothesis may stop a little early
    # The fuzzing fuzzes (hypothesis repeats its simplest grids often).
    # (48 real-size examples drew 5 of the 8 item counts on 2026-11-30; 300 tiny ones all 8)
    assert report.distinct_grids >= report.examples // 5 and len(report.item_counts) >= (6 if count >= 100 else 4)
    assert counters["dynamo_graphs"] == warm["dynamo_graphs"]  # warm_up traced every count 1..8: no retrace
    assert counters["device_programs_compiled"] == warm["device_programs_compiled"]  # none after warm-up
    assert counters.get("graph_replays", 0) > 0
    if options["table_gathers"] and not video:  # the position grid's resize gathered as 4 row by 4 column taps
        assert counters.get("table_gather_pairs", 0) > 0 and counters.get("table_gathers", 0) >= 2, counters
    elif options["table_gathers"]:  # MoonViT3d: its RoPE table (its position term is not a table read)
        assert counters.get("table_gathers", 0) >= 1, counters
    else:
        assert counters.get("table_gathers", 0) == 0, counters
    if options["host_block"]:  # the replays took their host-made inputs through the bucket's packed copy
        assert counters.get("host_block_copies", 0) > 0, counters
    # NOTE [segment-length classes]: bounded graphs were made and replayed, in the poisoned pool.
    assert counters.get("length_class_replays", 0) > 0 and counters.get("length_class_failures", 0) == 0, counters
    _record(f"{tower}-{size}", report, counters,
            captures_after_warm_up=counters.get("captures", 0) - warm.get("captures", 0))


def test_blocks_marked_as_regions_replay_graphs_bf16(monkeypatch):
    """NOTE [compile regions inlined]: a tiny MoonViT whose blocks are nested compile regions (marked by hand:
    kimi_cg.warmup.mark_repeated_blocks marks nothing before torch 2.13) is lifted and replays bucket graphs
    in a NaN-poisoned pool, within the bf16 rule against an fp32 reference."""
    from kimi_cg.models.moonvit import MoonVitEncoderLayer

    monkeypatch.setattr(MoonVitEncoderLayer, "forward", torch.compiler.nested_compile_region(MoonVitEncoderLayer.forward))
    torch.manual_seed(0)
    reference = MoonVitPretrainedModel(MoonVitConfig.tiny(num_hidden_layers=4)).cuda().eval()  # fp32
    model = copy.deepcopy(reference).to(torch.bfloat16)
    options = {"poison_graph_pool": True, "token_budgets": [512, 1024, 2048]}
    compiled = torch.compile(model, backend="kimi_cg", options=options)
    buckets = KimiCGConfig.from_options(options).buckets()
    strategy = kimi_cg.testing.grids(dims=2, max_items=4, max_side=32, max_patches=max(buckets), table_size=8,
                                     buckets=buckets)
    report = kimi_cg.testing.assert_matches_eager(model, compiled, pixel_inputs("cuda", torch.bfloat16), strategy,
                                                  reference=reference, max_examples=40, no_graph_breaks=True,
                                                  no_fallbacks=True)
    counters = dict(kimi_cg.counters)
    _record("moonvit-tiny-regions", report, counters)
    assert counters.get("compile_region_calls_inlined", 0) >= 4, counters
    assert counters.get("lift_fallbacks", 0) == 0 and counters.get("graph_replays", 0) > 0, counters


@pytest.mark.parametrize("host_block", [False, True], ids=["moved-batches", "host-block"])
def test_repeated_single_images_replay_exact_size_graphs_bf16(host_block):
    """NOTE [exact-size graphs]: real-size MoonViT, single images repeated; from a size's third call
    it replays a graph of its exact rows with cuDNN attention, in a NaN-poisoned pool, within the
    bf16 rule against an fp32 reference. Multi-image calls in between keep replaying buckets."""
    torch.manual_seed(0)
    reference = MoonVitPretrainedModel(MoonVitConfig()).cuda().eval()  # fp32
    model = copy.deepcopy(reference).to(torch.bfloat16)
    compiled = torch.compile(model, backend="kimi_cg", options={"poison_graph_pool": True, "host_block": host_block})
    sizes = [[32, 32], [16, 16], [30, 46], [64, 64], [128, 128]]
    grids = [[size] for size in sizes for _ in range(4)] + [[[32, 32], [16, 16]], [[30, 46], [64, 64]]]
    report = kimi_cg.testing.assert_matches_eager(model, compiled, pixel_inputs("cuda", torch.bfloat16), grids,
                                                  reference=reference, no_fallbacks=True)
    counters = dict(kimi_cg.counters)
    _record("moonvit-real-exact-size" + ("-host-block" if host_block else ""), report, counters)
    assert counters.get("exact_size_captures", 0) == len(sizes), counters
    assert counters.get("exact_size_replays", 0) == 2 * len(sizes), counters  # the third and fourth call of each
    assert counters.get("exact_size_graph_failures", 0) == 0, counters
    assert counters.get("fills_skipped", 0) > 0, counters
    if host_block:  # NOTE [host block]: a size's second call on a graph finds its values in the packed copy
        # (one copy for the size's bucket graph, one for its exact-size graph; each of the two pairs one)
        assert 0 < counters.get("host_block_copies", 0) <= len(grids) - 2 * len(sizes), counters
    else:  # NOTE [moved batches]: a repeated image's plans stay on the GPU, its exact-size replays find them
        assert counters.get("moved_batch_hits", 0) >= 2 * len(sizes), counters


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tower_on_a_device_that_is_not_current_replays_its_own_graphs_bf16():
    """NOTE [the activations' device is current]: a tiny MoonViT on cuda:1, called with cuda:0 current,
    captures and replays its buckets on cuda:1 (NaN-poisoned pool) within the bf16 rule."""
    torch.manual_seed(0)
    reference = MoonVitPretrainedModel(MoonVitConfig.tiny()).to("cuda:1").eval()  # fp32
    model = copy.deepcopy(reference).to(torch.bfloat16)
    compiled = torch.compile(model, backend="kimi_cg", options={"poison_graph_pool": True,
                                                                "token_budgets": [512, 1024, 2048]})
    grids = [[[4, 6]], [[6, 10], [2, 4]], [[10, 6], [8, 8]], [[12, 12]], [[6, 10], [2, 4]], [[16, 14], [4, 4]]]
    with torch.cuda.device(0):
        report = kimi_cg.testing.assert_matches_eager(model, compiled, pixel_inputs("cuda:1", torch.bfloat16), grids,
                                                      reference=reference, no_fallbacks=True)
    counters = dict(kimi_cg.counters)
    _record("moonvit-tiny-on-cuda1", report, counters)
    assert counters.get("captures", 0) >= 1 and counters.get("graph_replays", 0) >= 3, counters
    assert torch.cuda.memory_allocated(0) < torch.cuda.memory_allocated(1), "graphs or buffers landed on cuda:0"


def test_exact_size_graphs_made_and_dropped_do_not_grow_memory():
    """Each capture ran its warm-up on a new stream, and cuBLAS keeps a workspace per stream for the
    life of the process: exact-size graphs made and dropped (the LRU of ``exact_size_graphs``) grew
    GPU memory with every capture. Captures now share one side stream per device."""
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).cuda().to(torch.bfloat16).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"exact_size_graphs": 2,
                                                                  "token_budgets": [512, 1024, 2048]})
    make_inputs = pixel_inputs("cuda", torch.bfloat16)

    def churn(sizes):
        with torch.no_grad():
            for size in sizes:
                for _ in range(3):  # a size's third call makes its graph, dropping the oldest
                    compiled(*make_inputs([size]))
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    before = churn([[8, 8], [10, 10], [12, 12]])
    captures = kimi_cg.counters["exact_size_captures"]
    after = churn([[14, 14], [16, 16], [18, 18], [20, 20], [22, 22], [24, 24]])
    assert kimi_cg.counters["exact_size_captures"] == captures + 6 and kimi_cg.counters["exact_size_graphs_dropped"] >= 6
    # Two graphs are kept; the larger sizes' buffers and outputs are a few MB in the tiny config, a
    # cuBLAS workspace per capture tens of MB.
    assert after - before < 16 * 2**20, (before, after)


# Frame counts per item in the fuzz: transformers 5.17's Kimi-K2.5 temporal merger needs one t per batch
# (images only); GLM-4V takes one [1, h, w] row per frame; the Qwen towers take 2-temporal-patch
# videos. Qwen2.5-VL's first calls run eagerly while its forward is traced (NOTE [settings ladder]), the
# graphs traced inside them as dynamo captured them (NOTE [calls inside a frame traced again]). PaddleOCR-VL and HunYuan-VL
# (images) keep their rows on dim 1 (NOTE [rows on dim 1] in kimi_cg/capture.py); HunYuan-VL's embeddings
# run eagerly (README), its layers replay.
FOREIGN_GPU_TOWERS = {"kimi_k25": 0.0, "qwen2_vl": 0.3, "qwen2_5_vl": 0.3, "glm4v": 0.0, "qwen3_vl": 0.3,
                      "paddleocr_vl": 0.0, "hunyuan_vl": 0.0}


@pytest.mark.parametrize("tower_name", sorted(FOREIGN_GPU_TOWERS))
def test_transformers_tower_matches_eager_bf16(tower_name):
    """transformers' vision towers (tiny, random weights) on CUDA in bf16 with Inductor programs and a
    NaN-poisoned graph pool, through kimi_cg.testing: correct outputs, every graph lifted and its device
    calls replayed as CUDA graphs (as on CPU, where tests/test_foreign_towers.py checks the same on the
    padded path)."""
    from towers import TowerUnavailable
    from towers.transformers_towers import FACTORIES

    try:
        tower = FACTORIES[tower_name]("sdpa", seed=0)
    except TowerUnavailable as reason:
        pytest.skip(str(reason))
    reference = tower.model.cuda()
    model = copy.deepcopy(reference).to(torch.bfloat16)

    def make_inputs(grid):
        pixels, grid_thw = tower.make_inputs(grid)
        return pixels.cuda().bfloat16(), grid_thw.cuda()  # these towers build their indices on grid_thw's device

    compiled = torch.compile(model, backend="kimi_cg", options={"poison_graph_pool": True})
    video = FOREIGN_GPU_TOWERS[tower_name]
    strategy = kimi_cg.testing.grids(dims=3, max_items=4, max_side=16, max_patches=1024, video_fraction=video,
                                     max_frames=2 if video else 1)
    report = kimi_cg.testing.assert_matches_eager(model, compiled, make_inputs, strategy, reference=reference,
                                                  outputs=tower.extract_outputs, max_examples=24)
    counters = dict(kimi_cg.counters)
    _record(f"transformers-{tower_name}-tiny", report, counters)
    assert counters.get("lift_fallbacks", 0) == 0 and counters.get("call_fallbacks", 0) == 0, counters
    # Qwen2.5-VL: a call of one window group (4 to 7 patch rows) gives dynamo's resumed piece a window
    # index of length 1, which dynamo specialises; that graph's index cannot grow with the padded rows,
    # so its calls run the plain program (one padding hazard, found 2026-12-03 on the H200, reproduced
    # on CPU in bf16). Any other hazard fails.
    allowed_hazards = 1 if tower_name == "qwen2_5_vl" else 0
    assert counters.get("graph_replays", 0) > 0 and counters.get("padding_hazards", 0) <= allowed_hazards, counters
    # Every call fits the default buckets (<= 1024 patches), so none runs the plain program once traced:
    # for Kimi-K2.5 on transformers 5.17 (gather-and-mean temporal merge) that needs GatherReducePass;
    # 2026-12-01 on the H200, before it, 24 of 48 device calls ran unpadded.
    if tower_name != "qwen2_5_vl":
        assert counters.get("eager_fallbacks", 0) == 0, counters


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa", "flash_attention_2"])
def test_upstream_moonvit_replays_graphs_bf16(attn_implementation, monkeypatch):
    """Kimi-VL's remote-code MoonViT (plain asserts; its three attention paths, the flash one through the
    test corpus's stand-in for flash-attn's op, torch's varlen kernel on CUDA) in bf16 with a NaN-poisoned
    graph pool: correct, its pieces captured and replayed. Found 2026-12-05 on an H100: the stand-in read
    its segment bounds on the host (`.tolist()`), which no CUDA graph can capture, so every flash-path
    call ran padded without graphs (`capture_failures`); flash-attn's kernel makes no such read."""
    from kimi_cg import varlen_registry
    from towers.upstream_moonvit import FLASH_STAND_IN, build_upstream_moonvit

    monkeypatch.setattr(varlen_registry, "_REGISTRY", dict(varlen_registry._REGISTRY))  # restored after the test
    kimi_cg.register_varlen_attention(FLASH_STAND_IN, {"max_seqlen_q": "q", "max_seqlen_k": "k"},
                                      segments=("cu_seqlens_q", "cu_seqlens_k"))
    tower = build_upstream_moonvit(attn_implementation, seed=0)
    reference = tower.model.cuda()
    model = copy.deepcopy(reference).to(torch.bfloat16)

    def make_inputs(grid):
        pixels, grid_hws = tower.make_inputs(grid)
        return pixels.cuda().bfloat16(), grid_hws.cuda()

    compiled = torch.compile(model, backend="kimi_cg", options={"poison_graph_pool": True})
    strategy = kimi_cg.testing.grids(dims=2, max_items=4, max_side=16, max_patches=1024)
    report = kimi_cg.testing.assert_matches_eager(model, compiled, make_inputs, strategy, reference=reference,
                                                  outputs=tower.extract_outputs, max_examples=16)
    counters = dict(kimi_cg.counters)
    _record(f"upstream-moonvit-{attn_implementation}-tiny", report, counters)
    assert counters.get("capture_failures", 0) == 0 and counters.get("graph_replays", 0) > 0, counters
    assert counters.get("lift_fallbacks", 0) == 0 and counters.get("call_fallbacks", 0) == 0, counters
    assert counters.get("padding_hazards", 0) == 0, counters


@pytest.mark.parametrize("tower", ["moonvit", "moonvit3d"])
def test_concurrent_replays_from_threads_and_a_side_stream_match_eager(tower):
    """NOTE [concurrent calls] with capture: two threads, one on its own CUDA stream, replaying one
    compiled tower with different grids (the 3D tower returned another thread's rows before)."""
    import concurrent.futures
    import random
    import threading

    torch.manual_seed(0)
    video = tower == "moonvit3d"
    config_class, model_class = (MoonViT3dConfig, MoonViT3dPretrainedModel) if video else (MoonVitConfig, MoonVitPretrainedModel)
    model = model_class(config_class.tiny()).cuda().to(torch.bfloat16).eval()  # bf16, as served
    compiled = torch.compile(model, backend="kimi_cg", options={"token_budgets": [256, 512, 1024, 2048], "max_items": 6})
    first = [[1, 4, 6]] if video else [[4, 6]]
    with torch.inference_mode():
        kimi_cg.warm_up(compiled, torch.randn(24, 3, 14, 14, device="cuda", dtype=torch.bfloat16), torch.tensor(first), max_items=6)
    chooser = random.Random(0)
    requests = []
    for index in range(120):
        grid = []
        for _ in range(chooser.randint(1, 6)):
            h, w = 2 * chooser.randint(1, 8), 2 * chooser.randint(1, 8)
            grid.append([chooser.randint(1, 4), h, w] if video else [h, w])
        requests.append((grid, index))

    def pixels(grid, seed):
        rows = int(torch.tensor(grid).prod(-1).sum())
        return torch.randn(rows, 3, 14, 14, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).bfloat16()

    with torch.inference_mode():
        want = [model(pixels(grid, seed), torch.tensor(grid)) for grid, seed in requests]
    side = torch.cuda.Stream()
    start = threading.Barrier(2)

    def serve(worker):
        results = {}
        stream = side if worker == 1 else torch.cuda.current_stream()
        start.wait()
        with torch.inference_mode(), torch.cuda.stream(stream):
            for index in range(worker, len(requests), 2):
                grid, seed = requests[index]
                results[index] = compiled(pixels(grid, seed), torch.tensor(grid))
        stream.synchronize()
        return results

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outputs = {}
        for part in pool.map(serve, range(2)):
            outputs.update(part)
    for index, (grid, _) in enumerate(requests):
        got = outputs[index]
        assert not any(torch.isnan(g).any() for g in got), grid
        # Against eager bf16 (another thread's rows give ~1.0; bf16 rounding stays below 2e-2).
        assert _relative_error(got, want[index]) <= 2e-2, (grid, _relative_error(got, want[index]))
    assert kimi_cg.counters["graph_replays"] > 0
    assert kimi_cg.counters["call_fallbacks"] == 0


# NOTE [program cache]: a second process loads the first one's Inductor compile of the device program
# (its Triton kernels' sources and configs) and replays CUDA graphs of it. Each process checks the bf16
# rule against fp32 eager itself. Across processes the outputs are checked close, not bitwise equal: on
# the H200 (2026-12-05) they were not bitwise equal. The likely cause, not confirmed: Inductor times a
# reduction kernel's candidate configs at its first launch in each process and keeps the fastest, and
# configs differ in summation order.
PROGRAM_CACHE_SCRIPT = """
import json, sys, torch, kimi_cg, kimi_cg.testing
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel
torch.manual_seed(0)
model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval().cuda().bfloat16()
compiled = torch.compile(model, backend="kimi_cg", options={"cuda_graphs": True, "device_compiler": "inductor"})
grids = [[[8, 8]], [[4, 6], [10, 4]], [[6, 6], [2, 2], [4, 8]], [[16, 12], [2, 6]]]

def make_inputs(grid):
    grid = torch.tensor(grid)
    rows = int(grid.prod(-1).sum())
    pixels = torch.randn(rows, 3, 14, 14, generator=torch.Generator().manual_seed(rows))
    return pixels.cuda().bfloat16(), grid

kimi_cg.testing.assert_matches_eager(model, compiled, make_inputs, grids)  # bf16 rule against fp32
with torch.no_grad():
    outputs = [t.float().cpu() for grid in grids for t in compiled(*make_inputs(grid))]
torch.save(outputs, sys.argv[1] + ".pt")
with open(sys.argv[1] + ".json", "w") as f:
    json.dump(dict(kimi_cg.counters), f)
"""


def test_a_second_process_replays_the_program_the_first_stored(tmp_path):
    import subprocess
    import sys

    environment = dict(os.environ, KIMI_CG_PROGRAM_CACHE=str(tmp_path / "programs"))
    reports, outputs = [], []
    for name in ("first", "second"):
        out = str(tmp_path / name)
        result = subprocess.run([sys.executable, "-P", "-c", PROGRAM_CACHE_SCRIPT, out], capture_output=True, text=True,
                                timeout=600, env=environment)
        assert result.returncode == 0, result.stderr[-3000:]
        with open(out + ".json") as f:
            reports.append(json.load(f))
        outputs.append(torch.load(out + ".pt"))
    first, second = reports
    assert first.get("program_cache_stores") == 1 and second.get("program_cache_hits") == 1, reports
    assert all(r.get("program_cache_errors", 0) == 0 and r.get("call_fallbacks", 0) == 0 for r in reports), reports
    assert second.get("graph_replays", 0) >= 4, second
    for a, b in zip(*outputs):
        assert not torch.isnan(a).any() and not torch.isnan(b).any()
        assert (a - b).norm() <= 1e-2 * a.norm(), (a - b).norm() / a.norm()  # a few bf16 units at most
