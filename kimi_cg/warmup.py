"""``kimi_cg.warm_up``: trace every item count once before serving, so that no request compiles.

Dynamo unrolls a tower's per-item loop, so each number of items N in a call is one dynamo trace
(4-7 s of host time for the real Kimi-VL tower on the H200 machine; NOTE [dynamo graph count] in
docs/design.md). Everything else is shared between the traces: one device program, one set of
bucket graphs. A serving engine calls ``warm_up`` once at start-up with one example item; it runs
batches of 1..max_items copies of that item (tiny compute), in the order 1, 2, 1, 3, 4, ...: the
first trace of a tower's entry frame is dynamic in the patch count (NOTE [dynamic first trace] in
kimi_cg/dynamo_settings.py), but a piece after a graph break or a nested frame is traced statically
first, so count 1 runs again with an item twice as tall (the same item would pass a static graph's
guards and trace nothing); where every trace is already dynamic that call traces nothing. Before
them the item runs once eagerly (``torch.compiler.set_stance("force_eager")``), so that state the
tower builds in its first call exists when dynamo first traces it. The first batch that fits a
bucket also captures every bucket.
"""

from __future__ import annotations

import logging
import time

import torch

from kimi_cg.capture import input_rows_dim
from kimi_cg.counters import counters, timings
from kimi_cg.dynamo_settings import TORCH_2_13

logger = logging.getLogger(__name__)


def warm_up(model, pixel_values: torch.Tensor, grid: torch.Tensor, max_items: int = 8) -> dict:
    """Run ``model`` (compiled with backend="kimi_cg") on 1..max_items copies of the first item of
    (pixel_values, grid); returns what it cost: {"seconds", "calls", "dynamo_graphs", "breakdown_s",
    "buckets_ready_s", "per_call", "programs_loaded", "programs_stored"} (the last two: device programs
    taken from / written to the program cache, NOTE [program cache] in kimi_cg/program_cache.py). breakdown_s splits the seconds into kimi_cg's backend, device
    compile, capture and the rest (dynamo's tracing and the runs themselves; see ``kimi_cg.timings``);
    buckets_ready_s is the time from the first call until every bucket graph was captured (the
    later calls only trace further item counts); per_call lists {"items", "seconds" (since the
    start), "captures" (the process-wide counter)} after each call.

    ``grid`` is the tower's grid tensor ([N, 2] (h, w) or [N, 3] (t, h, w)); the item's pixel rows
    are the first prod(grid[0]) rows of ``pixel_values``: along dim 0, or along dim 1 for a tower that
    keeps a batch of one in front of its rows (``[1, L, ...]``, PaddleOCR-VL: NOTE [rows on dim 1] in
    kimi_cg/capture.py).
    """
    if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[0] < 1:
        raise ValueError(f"warm_up needs a grid tensor of shape [N >= 1, 2 or 3]; got {getattr(grid, 'shape', grid)!r}")
    if not isinstance(max_items, int) or max_items < 1:
        raise ValueError(f"max_items must be a positive int; got {max_items!r}")
    rows = int(grid[0].prod())
    dim = input_rows_dim(pixel_values, rows)
    if pixel_values.shape[dim] < rows:
        raise ValueError(f"pixel_values has {pixel_values.shape[dim]} rows; the first item needs {rows}")
    item_pixels, item_grid = pixel_values.narrow(dim, 0, rows), grid[:1]
    taller_grid = item_grid.clone()
    taller_grid[0, -2] *= 2  # (h, w) -> (2h, w): twice the rows, still even for the patch merger
    # (items, one item's grid row, copies of the item's pixel rows)
    batches = [(1, item_grid, 1), (2, item_grid, 2), (1, taller_grid, 2), *((n, item_grid, n) for n in range(3, max_items + 1))]
    if max_items == 1:
        batches = batches[:1]
    def copies_of_item(copies: int) -> torch.Tensor:
        repeat = [1] * item_pixels.dim()
        repeat[dim] = copies
        return item_pixels.repeat(*repeat)

    before, start, timed = counters["dynamo_graphs"], time.perf_counter(), dict(timings)
    loaded, stored = counters["program_cache_hits"], counters["program_cache_stores"]
    per_call = []
    with torch.no_grad():
        # State a tower builds lazily in its first call (MoonViT's RoPE table) is part of what
        # dynamo's first trace guards on: traced before it exists, count 1 is traced again at its
        # next call. One eager call of the item first builds it, so that trace is not wasted: one
        # trace fewer (the reference MoonViT: 9 -> 8 for 8 item counts, ~4 s of an H100 host's time).
        with torch.compiler.set_stance("force_eager"):
            model(item_pixels, item_grid)
        for count, one_grid, copies in batches:
            model(copies_of_item(copies), one_grid.repeat(count, 1))
            if item_pixels.is_cuda:
                torch.cuda.synchronize(item_pixels.device)
            per_call.append({"items": count, "seconds": time.perf_counter() - start, "captures": counters["captures"]})
    seconds = time.perf_counter() - start
    # The first call after which no bucket was captured any more: serving can replay every bucket.
    final_captures = per_call[-1]["captures"]
    buckets_ready = next(call["seconds"] for call in per_call if call["captures"] == final_captures)
    breakdown = {key: timings[key] - timed.get(key, 0.0) for key in ("backend", "device_compile", "capture")}
    breakdown["dynamo_and_runs"] = seconds - sum(breakdown.values())
    return {"seconds": seconds, "calls": len(batches), "dynamo_graphs": counters["dynamo_graphs"] - before,
            "breakdown_s": breakdown, "buckets_ready_s": buckets_ready, "per_call": per_call,
            "programs_loaded": counters["program_cache_hits"] - loaded,
            "programs_stored": counters["program_cache_stores"] - stored}


def mark_repeated_blocks(model: torch.nn.Module) -> list[type]:
    """Mark the class of every repeated block of ``model`` (an ``nn.ModuleList`` of two or more modules
    of one class) with ``torch.compiler.nested_compile_region``, so that dynamo traces one block per
    item count and reuses it for the others; kimi_cg inlines the calls back before lifting (NOTE
    [compile regions inlined]). On torch 2.13 this cut a real Kimi-VL tower's trace per item count by
    about half (docs/benchmarks.md, 2026-12-06).

    The mark is on the class, so it holds for every instance in the process (in eager mode it only
    calls through). Marking each instance's bound ``forward`` instead made torch 2.13 reuse the first
    block's weights for every block: kimi_cg never does that. Returns the classes marked; a class
    already marked is left as it is. Call it before the first compiled call (dynamo keeps the traces
    it has). On torch older than 2.13 it marks nothing (measured on 2.11: each count traced ~7% slower with
    the marks) and says so in the log.

    Not public yet (``scripts/trace_bench.py --blocks-as-regions`` measures it): checked on kimi_cg's
    MoonViT only. A block dynamo cannot trace whole becomes a graph break (NOTE [regions fall back]); a
    block that binds a symbol from a value that differs between calls makes its graph run unlifted (NOTE
    [compile regions inlined]), slower than without the marks: on the foreign towers of
    tests/test_foreign_towers.py every output stayed equal to eager's, but 7 of 16 lost lifting
    (docs/benchmarks.md, 2026-12-06). Also unmeasured: the warm-up on a GPU host with torch >= 2.13.
    """
    if not TORCH_2_13:
        logger.info("kimi_cg.mark_repeated_blocks: torch %s reuses no traced block (2.11 measured); nothing marked",
                    torch.__version__)
        return []
    marked = []
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2 or len({type(m) for m in module}) != 1:
            continue
        cls = type(module[0])
        if cls in marked or cls.forward is torch.nn.Module.forward or "forward" in vars(module[0]):
            continue  # no forward of its own, or an instance's own forward (hooks such as accelerate's)
        if not hasattr(cls.forward, "__marked_compile_region_fn__"):
            cls.forward = torch.compiler.nested_compile_region(cls.forward)
        marked.append(cls)
    return marked
