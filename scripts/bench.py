"""Benchmarks: kimi_cg against eager (and optionally torch.compile) in one process, on the H200.

    python scripts/bench.py --out docs/bench/latest.json                 # eager + kimi_cg, all workloads
    python scripts/bench.py --systems eager,inductor,inductor_reduce_overhead,seed_style,kimi_cg --workloads W1

Real Kimi-VL config (27 layers, hidden 1152, bf16, random weights); W4_3d uses MoonViT3d.
Workloads (fixed seeds):
  W1  one 448x448 image (32x32 patches)        W2  eight mixed images (7896 patches)
  W3  one 128x128-patch image                  W4  100 requests of 1-8 images, h, w even in [8, 64]:
  every system first gets the same 10 other requests (warm-up), then W4 is timed in one pass,
  compile stalls included; W4_repeat is a second pass (sizes seen); W4_3d is W4 on MoonViT3d with
  20% video chunks (t in 2..4).
Times are wall-clock per call with CUDA synchronisation before and after (end to end, host pass
included). For kimi_cg, W1 also reports replay-only time (CUDA events around graph.replay()) and
host overhead (end to end minus replay).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import time

import torch

import kimi_cg
from kimi_cg.models import MoonViT3dConfig, MoonViT3dPretrainedModel, MoonVitConfig, MoonVitPretrainedModel

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


def make_inputs(grid, seed: int, dtype=torch.bfloat16):
    grid_tensor = torch.tensor(grid)
    rows = int(grid_tensor.prod(-1).sum())
    generator = torch.Generator("cuda").manual_seed(seed)
    return torch.randn(rows, 3, 14, 14, device="cuda", generator=generator).to(dtype), grid_tensor


def timed_call(fn, *args) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


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


def build_system(name: str, model, device_compiler: str = "auto"):
    if name == "eager":
        return model
    if name == "kimi_cg":
        return torch.compile(model, backend="kimi_cg", options={"device_compiler": device_compiler})
    if name == "inductor":
        return torch.compile(model)
    if name == "inductor_reduce_overhead":
        return torch.compile(model, mode="reduce-overhead")
    if name == "seed_style":
        from kimi_cg.baselines.seed_style import SeedStyleMoonVit

        return SeedStyleMoonVit(model, max_output_tokens=4096)
    raise ValueError(name)


def compile_count(name: str, system=None) -> int:
    if name == "seed_style":
        return len(system.graphs) if system is not None else 0
    if name == "kimi_cg":
        return kimi_cg.counters["dynamo_graphs"] + kimi_cg.counters["device_programs_compiled"] + kimi_cg.counters["captures"]
    from torch._dynamo.utils import counters

    return int(sum(counters["stats"].get(k, 0) for k in ("unique_graphs",)))


def replay_only_ms(capacity_hint: int) -> float | None:
    """Median replay time of the captured bucket that serves `capacity_hint` patches."""
    from kimi_cg.runtime.runner import live_runners

    for runner in live_runners():
        graphs = runner.graphs
        if graphs is None:
            continue
        capacity = next((c for c in graphs.capacities if c >= capacity_hint), None)
        bucket = graphs.buckets.get(capacity)
        if bucket is None or bucket.graph is None:
            continue
        times = []
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            bucket.graph.replay()
            end.record()
            torch.cuda.synchronize()
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
        torch.cuda.synchronize()
        warmup = time.perf_counter() - start
        times = [timed_call(system, pixels, grid_tensor) for _ in range(repeats)]
    return times, warmup


def run_stream(system, warmup_stream, stream, seed: int) -> tuple[list[float], list[float], float]:
    with torch.no_grad():
        start = time.perf_counter()
        for i, grid in enumerate(warmup_stream):
            system(*make_inputs(grid, seed + i))
        torch.cuda.synchronize()
        warmup = time.perf_counter() - start
        prepared = [make_inputs(grid, seed + 1000 + i) for i, grid in enumerate(stream)]
        first = [timed_call(system, *args) for args in prepared]
        second = [timed_call(system, *args) for args in prepared]
    return first, second, warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="eager,kimi_cg")
    parser.add_argument("--workloads", default="W1,W2,W3,W4,W4_3d")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device-compiler", default="auto", choices=["auto", "eager", "inductor"])
    args = parser.parse_args()
    systems = args.systems.split(",")
    workloads = args.workloads.split(",")
    results: dict = {}
    extras: dict = {}
    torch.manual_seed(0)
    vit = MoonVitPretrainedModel(MoonVitConfig()).cuda().to(torch.bfloat16).eval()
    stream = request_stream(seed=4, count=args.requests)
    warm_stream = request_stream(seed=40, count=10)
    for name in systems:
        torch._dynamo.reset()
        kimi_cg.reset()
        system = build_system(name, vit, args.device_compiler)
        for workload, grid in (("W1", [[32, 32]]), ("W2", W2), ("W3", [[128, 128]])):
            if workload not in workloads:
                continue
            before = compile_count(name, system)
            times, warmup = run_fixed(system, grid, args.repeats, seed=1)
            results.setdefault(workload, {})[name] = summarize(times, warmup, compile_count(name, system) - before)
            if name != "eager":
                with torch.no_grad():
                    pixels, grid_tensor = make_inputs(grid, 1)
                    got, want = system(pixels, grid_tensor), vit(pixels, grid_tensor)
                    num = sum(float((g.float() - w.float()).norm() ** 2) for g, w in zip(got, want)) ** 0.5
                    den = sum(float(w.float().norm() ** 2) for w in want) ** 0.5
                    extras[f"{workload}_{name}_rel_err_vs_eager"] = num / den
                    print(f"{workload} {name} vs eager relative error {num / den:.2e}", flush=True)
            if name == "kimi_cg" and workload == "W1":
                replay = replay_only_ms(1024)
                extras["W1_replay_only_ms"] = replay
                extras["W1_host_overhead_ms"] = statistics.median(times) - replay if replay else None
            print(f"{workload:<10} {name:<26} {json.dumps(results[workload][name])}", flush=True)
        if "W4" in workloads:
            before = compile_count(name, system)
            first, second, warmup = run_stream(system, warm_stream, stream, seed=100)
            after_first = compile_count(name, system)
            results.setdefault("W4", {})[name] = summarize(first, warmup, after_first - before)
            results.setdefault("W4_repeat", {})[name] = summarize(second, 0.0, compile_count(name, system) - after_first)
            for key in ("W4", "W4_repeat"):
                print(f"{key:<10} {name:<26} {json.dumps(results[key][name])}", flush=True)
        if name == "kimi_cg":
            extras["graph_memory_bytes"] = graph_memory_bytes()
            extras["kimi_cg_counters"] = dict(kimi_cg.counters)
        del system
    if "W4_3d" in workloads:
        del vit
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        vit3d = MoonViT3dPretrainedModel(MoonViT3dConfig()).cuda().to(torch.bfloat16).eval()
        stream3d = request_stream(seed=5, count=args.requests, video_fraction=0.2)
        warm3d = request_stream(seed=50, count=10, video_fraction=0.2)
        for name in systems:
            torch._dynamo.reset()
            kimi_cg.reset()
            if name == "seed_style":
                continue  # the seeds run video chunks eagerly (a sentinel size); no graph-safe 3D path
            system = build_system(name, vit3d, args.device_compiler)
            before = compile_count(name, system)
            first, _, warmup = run_stream(system, warm3d, stream3d, seed=200)
            results.setdefault("W4_3d", {})[name] = summarize(first, warmup, compile_count(name, system) - before)
            print(f"{'W4_3d':<10} {name:<26} {json.dumps(results['W4_3d'][name])}", flush=True)
            if name == "kimi_cg":
                extras["W4_3d_kimi_cg_counters"] = dict(kimi_cg.counters)
    report = {
        "machine": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "command": "python scripts/bench.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None),
        "results": results,
        "extras": extras,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
