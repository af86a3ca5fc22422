"""Benchmarks: kimi_cg against eager (and optionally torch.compile) in one process, on the H200.

    python scripts/bench.py --out docs/bench/latest.json      # eager, seed_style, kimi_cg; all workloads
    python scripts/bench.py --systems eager,inductor,inductor_reduce_overhead,seed_style,kimi_cg --workloads W1

Real Kimi-VL config (27 layers, hidden 1152, bf16, random weights); W4_3d uses MoonViT3d.
Workloads (fixed seeds):
  W1  one 448x448 image (32x32 patches)        W2  eight mixed images (7896 patches)
  W3  one 128x128-patch image                  W4  100 requests of 1-8 images, h, w even in [8, 64]:
  every system first gets the same 10 other requests (warm-up; between them they use each item
  count 1..8 once, as a serving start-up pass would; their sizes are drawn from another seed), then
  W4 is timed in one pass, compile stalls included; W4_repeat is a second pass (sizes seen); W4_3d
  is W4 on MoonViT3d with 20% video chunks (t in 2..4); W5 is a fresh stream of 1-2 small images
  (h, w even in [4, 24]: below the smallest default bucket) after its own 3-request warm-up. A pass
  stops once --stream-budget-s is spent (torch.compile recompiles for minutes) and its result says
  "truncated". With --pipelined, W4_pipelined calls another stream of mostly new sizes back to back,
  then again, synchronised only around each pass (a serving loop's throughput, not a latency). Stream
  summaries list the pauses of Python's full garbage collections during the pass (gc_full_collections_ms).
Times are wall-clock per call with CUDA synchronisation before and after (end to end, host pass
included). For kimi_cg, W1 also reports replay-only time (CUDA events around graph.replay()) and
host overhead (end to end minus replay) and a cProfile of its host side. The torch.compile systems
run under dynamo's stock settings (class StockDynamo). Results are written to --out after each one.
Systems: eager, inductor, inductor_reduce_overhead, seed_style, kimi_cg, and kimi_cg variants with one
lever off or on for same-process comparisons (KIMI_CG_VARIANTS: kimi_cg_one_length_class, kimi_cg_max_autotune,
kimi_cg_small_buckets, kimi_cg_large_buckets).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import random
import statistics
import time

import torch

import kimi_cg
from kimi_cg.models import MoonViT3dConfig, MoonViT3dPretrainedModel, MoonVitConfig, MoonVitPretrainedModel

DEVICE = "cuda"  # --smoke-test-on-cpu switches it (a quick check of this script without a GPU)
W2 = [[32, 32], [32, 40], [40, 24], [24, 32], [36, 28], [20, 44], [32, 28], [30, 36]]


def request_stream(seed: int, count: int, video_fraction: float = 0.0):
    rng = random.Random(seed)
    stream = []
    for _ in range(count):
        items = []
        for _ in range(rng.randint(1, 8)):
            h, w = 2 * rng.randint(4, 32), 2 * rng.randint(4, 32)
            if video_fraction:
                t = rng.randint(2, 4) if rng.random() < video_fraction else 1
                items.append([t, h, w])
            else:
                items.append([h, w])
        stream.append(items)
    return stream


def small_request_stream(seed: int, count: int):
    """W5: requests of one or two small images (thumbnails, OCR crops), h, w even in [4, 24] patches:
    16-576 patches each, all below the default ladder's smallest bucket (1024)."""
    rng = random.Random(seed)
    return [[[2 * rng.randint(2, 12), 2 * rng.randint(2, 12)] for _ in range(rng.randint(1, 2))] for _ in range(count)]


def warmup_stream(seed: int, count: int = 10, video_fraction: float = 0.0):
    """The warm-up every system gets: `count` requests that between them use each item count 1..8
    (as a serving engine's start-up pass would), sizes drawn like W4's but from another seed."""
    rng = random.Random(seed)
    counts = list(range(1, 9))
    rng.shuffle(counts)
    # The first count comes again: dynamo's first trace is static in the patch count, so the first
    # item count needs a second (dynamic) trace (NOTE [dynamo graph count] in docs/design.md).
    counts += [counts[0]] + [rng.randint(1, 8) for _ in range(count - 9)]
    stream = []
    for n in counts:
        items = []
        for _ in range(n):
            h, w = 2 * rng.randint(4, 32), 2 * rng.randint(4, 32)
            if video_fraction:
                items.append([rng.randint(2, 4) if rng.random() < video_fraction else 1, h, w])
            else:
                items.append([h, w])
        stream.append(items)
    return stream


def make_inputs(grid, seed: int, dtype=torch.bfloat16):
    grid_tensor = torch.tensor(grid)
    rows = int(grid_tensor.prod(-1).sum())
    generator = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randn(rows, 3, 14, 14, device=DEVICE, generator=generator).to(dtype), grid_tensor


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed_call(fn, *args) -> float:
    synchronize()
    start = time.perf_counter()
    fn(*args)
    synchronize()
    return (time.perf_counter() - start) * 1e3


class GcPauses:
    """Python's full collections (generation 2: the whole heap, dynamo's, FX's and Inductor's objects
    included) and how long each paused the process; `take()` returns those since the last take. Counted once
    main() adds `callback` to gc.callbacks (importing this module changes nothing)."""

    def __init__(self):
        self.pauses: list[float] = []
        self._start = None

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None and info.get("generation") == 2:
            self.pauses.append((time.perf_counter() - self._start) * 1e3)

    def take(self) -> list[float]:
        pauses, self.pauses = self.pauses, []
        return [round(p, 2) for p in pauses]


GC_PAUSES = GcPauses()


def summarize(times_ms: list[float], warmup_s: float, compiles: int) -> dict:
    ordered = sorted(times_ms)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        "mean_ms": statistics.fmean(times_ms),
        "p50_ms": statistics.median(times_ms),
        "p99_ms": p99,
        "warmup_s": warmup_s,
        "compiles": compiles,
        "calls": len(times_ms),
    }


def host_profile(system, grid, calls: int = 200, top: int = 18) -> list[str]:
    """cProfile of `calls` warm calls (the host side of an end-to-end call), top functions by own time."""
    import cProfile
    import io
    import pstats

    pixels, grid_tensor = make_inputs(grid, 1)
    profiler = cProfile.Profile()
    with torch.no_grad():
        system(pixels, grid_tensor)
        synchronize()
        profiler.enable()
        for _ in range(calls):
            system(pixels, grid_tensor)
        synchronize()
        profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()]


class StockDynamo:
    """Runs a torch.compile'd model under dynamo's stock settings: kimi_cg's backend module changes
    three of them process-wide when it is loaded (NOTE [dynamo settings] in kimi_cg/capture.py), and
    the torch.compile baselines must get what users get without kimi_cg."""

    SETTINGS = {"capture_scalar_outputs": False, "capture_dynamic_output_shape_ops": False, "recompile_limit": 8}

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, *args):
        with torch._dynamo.config.patch(**self.SETTINGS):
            return self.compiled(*args)


# kimi_cg under its defaults and under options that turn one lever off (same process, same streams).
KIMI_CG_VARIANTS = {
    "kimi_cg": {},
    "kimi_cg_one_length_class": {"attention_length_classes": 1},  # NOTE [segment-length classes] off
    "kimi_cg_no_linear_gelu": {"linear_gelu_epilogue": False},  # NOTE [linear + GELU epilogue] off
    "kimi_cg_no_table_gathers": {"table_gathers": False},  # NOTE [table gathers] off
    "kimi_cg_table_gathers": {"table_gathers": True},  # NOTE [table gathers] on
    # Inductor's GEMM autotuning for the device program, in force only while kimi_cg compiles it
    "kimi_cg_max_autotune": {"inductor_config": {"max_autotune": True, "max_autotune_gemm": True}},
    "kimi_cg_small_buckets": {"min_tokens": 256},  # the ladder from 256 patches: W5's requests pad less
    "kimi_cg_large_buckets": {"max_tokens": 32768},  # W4_3d's requests over 16,384 rows replay unsplit
    "kimi_cg_host_block": {"host_block": True},  # NOTE [host block] on (the default since 2026-12-07)
    "kimi_cg_no_host_block": {"host_block": False},  # NOTE [host block] off: a copy and padding per host-made input
}


def gemm_peak_tflops(size: int = 8192, calls: int = 20) -> float:
    """The bf16 [size]^3 matmul's rate on this GPU, best of three timings of ``calls`` matmuls."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return 2 * size ** 3 / best / 1e9


def build_system(name: str, model, device_compiler: str = "auto"):
    if name == "eager":
        return model
    if name in KIMI_CG_VARIANTS:
        options = {"device_compiler": device_compiler, **KIMI_CG_VARIANTS[name]}
        return torch.compile(model, backend="kimi_cg", options=options)
    if name == "inductor":
        return StockDynamo(torch.compile(model))
    if name == "inductor_reduce_overhead":
        return StockDynamo(torch.compile(model, mode="reduce-overhead"))
    if name == "seed_style":
        from kimi_cg.baselines.seed_style import SeedStyleMoonVit

        return SeedStyleMoonVit(model, max_output_tokens=4096)
    raise ValueError(name)


def compile_count(name: str, system=None) -> int:
    if name == "seed_style":
        return len(system.graphs) if system is not None else 0
    if name in KIMI_CG_VARIANTS:
        return kimi_cg.counters["dynamo_graphs"] + kimi_cg.counters["device_programs_compiled"] + kimi_cg.counters["captures"]
    from torch._dynamo.utils import counters

    return int(sum(counters["stats"].get(k, 0) for k in ("unique_graphs",)))


def replay_only_ms(capacity_hint: int) -> float | None:
    """Median replay time of the graph that serves a one-image call of `capacity_hint` patches: its
    exact-size graph once made (NOTE [exact-size graphs]), else its bucket's."""
    from kimi_cg.runtime.runner import live_runners

    for runner in live_runners():
        graphs = runner.graphs
        if graphs is None:
            continue
        capacity = next((c for c in graphs.capacities if c >= capacity_hint), None)
        bucket = getattr(graphs, "exact", {}).get(capacity_hint) or graphs.buckets.get(capacity)
        if bucket is None or bucket.graph is None:
            continue
        times = []
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            bucket.graph.replay()
            end.record()
            synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    return None


def graph_memory_bytes() -> int:
    from kimi_cg.runtime.runner import live_runners

    shared = {id(r.graphs): r.graphs for r in live_runners() if r.graphs is not None}
    return sum(graphs.graph_bytes for graphs in shared.values())


def run_fixed(system, grid, repeats: int, seed: int) -> tuple[list[float], float]:
    pixels, grid_tensor = make_inputs(grid, seed)
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(3):
            system(pixels, grid_tensor)
        synchronize()
        warmup = time.perf_counter() - start
        times = [timed_call(system, pixels, grid_tensor) for _ in range(repeats)]
    return times, warmup


def _counter_snapshot() -> dict:
    from torch._dynamo.utils import counters as dynamo_counters

    snapshot = {f"kimi_cg.{k}": v for k, v in kimi_cg.counters.items()}
    snapshot.update({f"dynamo.{k}": v for k, v in dynamo_counters["stats"].items()})
    return snapshot


class ReplayTimer:
    """--replay-breakdown: CUDA events around every ``torch.cuda.CUDAGraph.replay`` in the process
    (kimi_cg's and seed_style's graphs), so a stream's end-to-end time splits into replay and the
    rest (host pass, copies, non-graphed work)."""

    active: "ReplayTimer | None" = None

    def __init__(self):
        self.events = []
        self.original = None

    def __enter__(self):
        self.original = original = torch.cuda.CUDAGraph.replay
        events = self.events

        def replay(graph):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            original(graph)
            end.record()
            events.append((start, end))

        torch.cuda.CUDAGraph.replay = replay
        ReplayTimer.active = self
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.replay = self.original
        ReplayTimer.active = None

    def take_ms(self) -> float:
        """Replay time since the last take (the caller has synchronised)."""
        total = sum(start.elapsed_time(end) for start, end in self.events)
        self.events.clear()
        return total


def timed_pass(system, prepared, grids, budget_s: float, stalls: list, replays: list | None = None) -> list[float]:
    """Per-call times over the stream; stops early (the result says so) once `budget_s` is spent.
    A call over 1 s is a stall: its grid and the counters it moved are kept for the report."""
    times, start = [], time.perf_counter()
    for args, grid in zip(prepared, grids):
        before = _counter_snapshot()
        if ReplayTimer.active is not None:
            ReplayTimer.active.take_ms()  # drop replays from outside this call
        times.append(timed_call(system, *args))
        if ReplayTimer.active is not None and replays is not None:
            replays.append(ReplayTimer.active.take_ms())
        if times[-1] > 1000.0:
            after = _counter_snapshot()
            moved = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
            stalls.append({"request": len(times) - 1, "ms": times[-1], "grid": grid, "counters_moved": moved})
        if time.perf_counter() - start > budget_s:
            break
    return times


def pipelined_ms(system, prepared) -> float:
    """Milliseconds per request over `prepared` called back to back, synchronised only before and after
    (a serving loop that hands each output on without waiting for it): a system whose calls never wait
    for the device overlaps one request's host work with the device work of the one before."""
    synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        for args in prepared:
            system(*args)
    synchronize()
    return (time.perf_counter() - start) * 1e3 / len(prepared)


def device_profile(system, requests: list, top: int = 12) -> dict:
    """torch.profiler over warm calls of `requests` (a list of argument tuples): GPU kernel time per
    request (kernels inside graph replays included), the wall time it took, and the kernels that
    took the most time, grouped by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for args in requests[:2]:
            system(*args)
        synchronize()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for args in requests:
                system(*args)
            synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    by_name: dict = {}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        total, count = by_name.get(event.name, (0.0, 0))
        by_name[event.name] = (total + event.time_range.elapsed_us() / 1e3, count + 1)
    kernel_ms = sum(total for total, _ in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    return {
        "requests": len(requests),
        "kernel_ms_per_request": kernel_ms / len(requests),
        "wall_ms_per_request_under_profiler": wall_ms / len(requests),
        "top_kernels": [{"name": name[:120], "ms_per_request": total / len(requests), "calls": count}
                        for name, (total, count) in ranked],
        "top_host_ops": [{"name": e.key[:120], "self_cpu_ms_per_request": e.self_cpu_time_total / 1e3 / len(requests),
                          "calls": e.count} for e in host[:top + 6]],
    }


def run_stream(system, count, warmup_stream, stream, seed: int, budget_s: float, warmup_budget_s: float,
               repeat: bool = True) -> dict:
    """Warm-up, then one timed pass (and a second when `repeat`); `count()` gives the system's compile
    count, so the compiles of each phase are reported separately."""
    stalls: list = []
    with torch.no_grad():
        start, warmed = time.perf_counter(), 0
        for i, grid in enumerate(warmup_stream):
            system(*make_inputs(grid, seed + i))
            warmed += 1
            if time.perf_counter() - start > warmup_budget_s:
                break
        synchronize()
        warmup = time.perf_counter() - start
        after_warmup = count()
        prepared = [make_inputs(grid, seed + 1000 + i) for i, grid in enumerate(stream)]
        replays = {"first": [], "second": []}
        GC_PAUSES.take()
        first = timed_pass(system, prepared, stream, budget_s, stalls, replays["first"])
        gc_first = GC_PAUSES.take()
        after_first = count()
        second = timed_pass(system, prepared, stream, budget_s, stalls, replays["second"]) if repeat else []
    return {"warmup_s": warmup, "warmup_requests": warmed, "first": first, "second": second, "replays": replays,
            "compiles_first": after_first - after_warmup, "compiles_second": count() - after_first, "stalls": stalls,
            "gc_first": gc_first, "gc_second": GC_PAUSES.take()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="eager,seed_style,kimi_cg")
    parser.add_argument("--workloads", default="W1,W2,W3,W4,W4_3d")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--stream-budget-s", type=float, default=150.0,
                        help="per system and pass: a W4 pass stops (marked truncated) once this is spent")
    parser.add_argument("--warmup-budget-s", type=float, default=300.0,
                        help="torch.compile systems only: the W4 warm-up stops once this is spent (the result says so)")
    parser.add_argument("--kimi-cg-warm-up", action="store_true",
                        help="call kimi_cg.warm_up (item counts 1..8) before anything else; its cost goes to extras")
    parser.add_argument("--replay-breakdown", action="store_true",
                        help="CUDA events around every graph replay: W4 results split into replay and the rest")
    parser.add_argument("--pipelined", action="store_true",
                        help="after W4, W4_pipelined: a stream of new sizes called back to back, then again "
                             "(ms per request, synchronised only around each pass; pipelined_ms)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after W4 (and W4_3d), torch.profiler over N of its requests per system: GPU kernel time and top kernels")
    parser.add_argument("--attn-implementation", default=None, choices=["flash_attention_2", "sdpa"],
                        help="the towers' attention (default: their config's, flash_attention_2); sdpa builds a dense [L, L] mask: W1-W3 only")
    parser.add_argument("--systems-3d", default=None, help="systems for W4_3d (default: --systems)")
    parser.add_argument("--smoke-test-on-cpu", action="store_true",
                        help="tiny configs on the CPU, to check this script without a GPU (times mean nothing)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device-compiler", default="auto", choices=["auto", "eager", "inductor"])
    args = parser.parse_args()
    global DEVICE
    vit_config, vit3d_config = MoonVitConfig(), MoonViT3dConfig()
    if args.smoke_test_on_cpu:
        DEVICE = "cpu"
        vit_config, vit3d_config = MoonVitConfig.tiny(), MoonViT3dConfig.tiny()
    if args.attn_implementation:
        vit_config = dataclasses.replace(vit_config, attn_implementation=args.attn_implementation)
        vit3d_config = dataclasses.replace(vit3d_config, attn_implementation=args.attn_implementation)
    systems = args.systems.split(",")
    workloads = args.workloads.split(",")
    results: dict = {}
    extras: dict = {}
    command = "python scripts/bench.py " + " ".join(
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v}"
        for k, v in vars(args).items() if v not in (None, False) and k != "out")

    def record(workload: str, name: str, summary: dict) -> None:
        results.setdefault(workload, {})[name] = summary
        print(f"{workload:<10} {name:<26} {json.dumps(summary)}", flush=True)
        write_report()

    def write_report() -> None:
        report = {
            "machine": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test)",
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "command": command,
            "results": results,
            "extras": extras,
        }
        if args.out:  # written after every result: a run cut short still leaves what it measured
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)

    def failed(part: str, name: str, error: Exception) -> None:
        import traceback

        text = traceback.format_exception(error)
        print(f"{part:<10} {name:<26} FAILED: {type(error).__name__}: {str(error)[:500]}", flush=True)
        extras.setdefault("errors", {})[f"{part} {name}"] = "".join(text[-4:])[-4000:]
        write_report()

    def with_warm_up(summary: dict, name: str, key: str) -> dict:
        """kimi_cg's stream summary gains the cost of the kimi_cg.warm_up that ran before its
        warm-up stream (--kimi-cg-warm-up; recorded in extras under `key`)."""
        report = extras.get(key)
        if name in KIMI_CG_VARIANTS and report is not None:
            summary.update(warm_up_call_s=report["seconds"], buckets_ready_s=report["buckets_ready_s"])
        return summary

    def warmup_budget(name: str) -> float:  # only torch.compile's warm-up can run for many minutes
        return args.warmup_budget_s if name.startswith("inductor") else float("inf")

    def stream_summary(run, key, total, warmup_total):
        times = run[key]
        summary = summarize(times, run["warmup_s"] if key == "first" else 0.0, run["compiles_" + key])
        if key == "first" and run["warmup_requests"] < warmup_total:
            summary["warmup_truncated"] = f"{run['warmup_requests']} of {warmup_total} warm-up requests in {args.warmup_budget_s:.0f} s"
        summary["gc_full_collections_ms"] = run["gc_" + key]  # pauses of Python's full collections in this pass
        replays = run["replays"][key]
        if replays and any(replays):  # --replay-breakdown
            summary["replay_mean_ms"] = statistics.fmean(replays)
            summary["rest_mean_ms"] = statistics.fmean(t - r for t, r in zip(times, replays))
        if len(times) < total:
            summary["truncated"] = f"{len(times)} of {total} requests within the {args.stream_budget_s:.0f} s budget"
        return summary

    gc.callbacks.append(GC_PAUSES.callback)
    torch.manual_seed(0)
    if DEVICE == "cuda":  # the roofline's GEMM peak, on this GPU (scripts/roofline.py reads it)
        extras["gemm_peak_tflops"] = gemm_peak_tflops()
    if args.replay_breakdown and DEVICE == "cuda":
        ReplayTimer().__enter__()  # for the whole process
    vit = MoonVitPretrainedModel(vit_config).to(DEVICE, torch.bfloat16).eval()
    stream = request_stream(seed=4, count=args.requests)
    warm_stream = warmup_stream(seed=40)
    for name in systems:
        try:
            torch._dynamo.reset()
            kimi_cg.reset()
            system = build_system(name, vit, args.device_compiler)
            if name in KIMI_CG_VARIANTS and args.kimi_cg_warm_up:
                extras[f"{name}_warm_up"] = kimi_cg.warm_up(system, *make_inputs([[16, 16]], 0), max_items=8)
            for workload, grid in (("W1", [[32, 32]]), ("W2", W2), ("W3", [[128, 128]])):
                if workload not in workloads:
                    continue
                before = compile_count(name, system)
                times, warmup = run_fixed(system, grid, args.repeats, seed=1)
                summary = summarize(times, warmup, compile_count(name, system) - before)
                if name != "eager":
                    with torch.no_grad():
                        pixels, grid_tensor = make_inputs(grid, 1)
                        got, want = system(pixels, grid_tensor), vit(pixels, grid_tensor)
                        num = sum(float((g.float() - w.float()).norm() ** 2) for g, w in zip(got, want)) ** 0.5
                        den = sum(float(w.float().norm() ** 2) for w in want) ** 0.5
                        summary["rel_err_vs_eager"] = num / den
                if name in KIMI_CG_VARIANTS and workload == "W1":
                    replay = replay_only_ms(1024) if DEVICE == "cuda" else None
                    summary["replay_only_ms"] = replay
                    summary["host_overhead_ms"] = statistics.median(times) - replay if replay else None
                    extras[f"W1_{name}_host_profile"] = host_profile(system, grid)  # per system: A/B runs keep each
                record(workload, name, summary)
            if "W4" in workloads:
                run = run_stream(system, lambda: compile_count(name, system), warm_stream, stream, seed=100,
                                 budget_s=args.stream_budget_s, warmup_budget_s=warmup_budget(name))
                extras[f"W4_{name}_times_ms"] = run["first"]
                if any(run["replays"]["first"]):
                    extras[f"W4_{name}_replay_ms"] = run["replays"]["first"]
                extras[f"W4_{name}_stalls"] = run["stalls"]
                if args.profile and DEVICE == "cuda":
                    # requests of another seed first: mostly sizes this system has not seen (host pass misses)
                    extras[f"W4_{name}_profile_new_sizes"] = device_profile(
                        system, [make_inputs(grid, 7000 + i) for i, grid in enumerate(request_stream(7, args.profile + 2))])
                    extras[f"W4_{name}_profile"] = device_profile(
                        system, [make_inputs(grid, 100 + 1000 + i) for i, grid in enumerate(stream[:args.profile])])
                summary = stream_summary(run, "first", len(stream), len(warm_stream))
                record("W4", name, with_warm_up(summary, name, f"{name}_warm_up"))
                record("W4_repeat", name, stream_summary(run, "second", len(stream), len(warm_stream)))
                if args.pipelined:
                    # another seed: mostly sizes this system has not seen, then the same requests again
                    fresh = [make_inputs(grid, 8000 + i) for i, grid in enumerate(request_stream(8, args.requests))]
                    before = compile_count(name, system)
                    record("W4_pipelined", name, {"new_sizes_ms_per_request": pipelined_ms(system, fresh),
                                                  "repeat_ms_per_request": pipelined_ms(system, fresh),
                                                  "requests": len(fresh), "compiles": compile_count(name, system) - before})
                    del fresh
            if "W5" in workloads:
                # its own warm-up: one and two items, the first count again (its dynamic trace)
                run = run_stream(system, lambda: compile_count(name, system), [[[8, 8]], [[6, 10], [4, 4]], [[10, 6]]],
                                 small_request_stream(seed=6, count=args.requests), seed=300, budget_s=args.stream_budget_s,
                                 warmup_budget_s=warmup_budget(name), repeat=False)
                extras[f"W5_{name}_times_ms"] = run["first"]
                record("W5", name, stream_summary(run, "first", args.requests, 3))
            if name in KIMI_CG_VARIANTS:
                extras[f"graph_memory_bytes_{name}"] = graph_memory_bytes()
                extras[f"{name}_counters"] = dict(kimi_cg.counters)
                extras[f"{name}_timings_s"] = dict(kimi_cg.timings)
        except Exception as error:  # one system failing (torch.compile crashes) must not end the run
            failed("W1-W4", name, error)
            continue
        del system
    if "W4_3d" in workloads:
        del vit
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        torch.manual_seed(0)
        vit3d = MoonViT3dPretrainedModel(vit3d_config).to(DEVICE, torch.bfloat16).eval()
        stream3d = request_stream(seed=5, count=args.requests, video_fraction=0.2)
        warm3d = warmup_stream(seed=50, video_fraction=0.2)
        for name in (args.systems_3d or args.systems).split(","):
            try:
                torch._dynamo.reset()
                kimi_cg.reset()
                if name == "seed_style":
                    continue  # the seeds run video chunks eagerly (a sentinel size); no graph-safe 3D path
                system = build_system(name, vit3d, args.device_compiler)
                if name in KIMI_CG_VARIANTS and args.kimi_cg_warm_up:
                    extras[f"{name}_warm_up_3d"] = kimi_cg.warm_up(system, *make_inputs([[1, 16, 16]], 0), max_items=8)
                run = run_stream(system, lambda: compile_count(name, system), warm3d, stream3d, seed=200,
                                 budget_s=args.stream_budget_s, warmup_budget_s=warmup_budget(name), repeat=False)
                extras[f"W4_3d_{name}_times_ms"] = run["first"]
                if any(run["replays"]["first"]):  # per request: which requests' non-replay time is large
                    extras[f"W4_3d_{name}_replay_ms"] = run["replays"]["first"]
                extras[f"W4_3d_{name}_stalls"] = run["stalls"]
                if args.profile and DEVICE == "cuda":
                    extras[f"W4_3d_{name}_profile"] = device_profile(
                        system, [make_inputs(grid, 200 + 1000 + i) for i, grid in enumerate(stream3d[:args.profile])])
                if name in KIMI_CG_VARIANTS:
                    extras[f"W4_3d_{name}_counters"] = dict(kimi_cg.counters)
                    extras[f"W4_3d_{name}_timings_s"] = dict(kimi_cg.timings)
                summary = stream_summary(run, "first", len(stream3d), len(warm3d))
                record("W4_3d", name, with_warm_up(summary, name, f"{name}_warm_up_3d"))
            except Exception as error:  # one system failing (torch.compile crashes) must not end the run
                failed("W4_3d", name, error)
                continue
            del system


if __name__ == "__main__":
    main()
