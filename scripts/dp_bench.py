"""Data-parallel encoding on several GPUs: one GPU (rank 0 alone) vs every GPU (kimi_cg.data_parallel).

    torchrun --nproc-per-node 2 scripts/dp_bench.py --out docs/bench/dp_latest.json

Real Kimi-VL config (W4) and MoonViT3d (W4_3d, 20% video chunks), bf16, random weights (the same on
every rank), compiled with backend="kimi_cg" on every rank. Each rank warms its tower with
kimi_cg.warm_up (item counts 1..16) and both modes get bench.py's warm-up stream. Then, per workload:
  single  rank 0 runs the stream on its own GPU, the tower called directly (the other ranks wait);
  dp      every rank runs the same stream through kimi_cg.data_parallel (NCCL for the outputs).
Each mode runs a fresh stream (sizes its towers have not seen, as bench.py's W4 first pass) and then
repeats it. Fresh streams differ between the modes (a stream is fresh only once) but are drawn from
the same distribution: 100 requests of 1-8 items. Then, on the data-parallel stream again (sizes
seen): the floor (each rank runs its share alone, then a barrier: no agreement, no gather), plans
balanced by kimi_cg.distributed.attention_aware_cost, and throughput with two requests per encoder
call (both modes, second pass). Times are per request (or pair) on rank 0, end to end:
synchronised before (after a barrier, so every rank starts together) and after the call returns
every item's features. Throughput is requests (or pairs) per second, one call at a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also under python -P / PYTHONSAFEPATH
import bench  # noqa: E402  scripts/bench.py: the request streams and inputs
import kimi_cg
import kimi_cg.distributed
from kimi_cg.models import MoonViT3dConfig, MoonViT3dPretrainedModel, MoonVitConfig, MoonVitPretrainedModel


def summarize(times_ms: list[float]) -> dict:
    ordered = sorted(times_ms)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    mean = statistics.fmean(times_ms)
    return {"mean_ms": mean, "p50_ms": statistics.median(times_ms), "p99_ms": p99,
            "requests_per_s": 1e3 / mean, "requests": len(times_ms)}


def synchronize() -> None:
    if bench.DEVICE == "cuda":
        torch.cuda.synchronize()


def run_stream(encode, stream, seed: int, barrier_group=None) -> list[float]:
    """Per request: synchronise (after a barrier of every rank, when barrier_group is given), call,
    synchronise; milliseconds."""
    times = []
    for index, grid in enumerate(stream):
        pixels, grid_tensor = bench.make_inputs(grid, seed + index)
        if barrier_group is not None:
            dist.barrier(group=barrier_group)
        synchronize()
        start = time.perf_counter()
        encode(pixels, grid_tensor)
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run_local_shares(tower, stream, seed: int, barrier_group) -> list[float]:
    """The floor of a data-parallel call: each rank runs its own share (inputs cut before timing),
    then a barrier; no agreement, no output gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    times = []
    for index, grid in enumerate(stream):
        pixels, grid_tensor = bench.make_inputs(grid, seed + index)
        plan = kimi_cg.distributed.plan_items([math.prod(item) for item in grid], world)
        starts = [0]
        for item in grid:
            starts.append(starts[-1] + math.prod(item))
        share = plan.shares[rank]
        if share:
            share_pixels = torch.cat([pixels[starts[i]:starts[i + 1]] for i in share])
            share_grid = grid_tensor[list(share)]
        dist.barrier(group=barrier_group)
        synchronize()
        start = time.perf_counter()
        if share:
            tower(share_pixels, share_grid)
        synchronize()
        dist.barrier(group=barrier_group)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def pairs(stream):
    """Two consecutive requests in one encoder call (a serving engine batching its encoder inputs)."""
    return [stream[i] + stream[i + 1] for i in range(0, len(stream) - 1, 2)]


def workload(name: str, model_class, config, video_fraction: float, requests: int, barrier_group) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = model_class(config).to(bench.DEVICE, torch.bfloat16).eval()
    tower = torch.compile(model, backend="kimi_cg")
    encode = kimi_cg.data_parallel(tower)
    encode_attention_aware = kimi_cg.data_parallel(tower, cost=kimi_cg.distributed.attention_aware_cost())
    started = time.perf_counter()
    first = bench.request_stream(7, 1, video_fraction)[0]
    kimi_cg.warm_up(tower, *bench.make_inputs(first, 0), max_items=16)  # up to 16: pairs of requests
    for index, grid in enumerate(bench.warmup_stream(99, video_fraction=video_fraction)):
        tower(*bench.make_inputs(grid, index))
        encode(*bench.make_inputs(grid, index))
    synchronize()
    warm_up_s = time.perf_counter() - started
    dist.barrier(group=barrier_group)

    single_stream = bench.request_stream(1000, requests, video_fraction)
    dp_stream = bench.request_stream(2000, requests, video_fraction)
    result = {"warm_up_s_rank0": warm_up_s}
    alone = lambda stream, seed: summarize(run_stream(tower, stream, seed)) if rank == 0 else None  # noqa: E731
    together = lambda fn, stream, seed: summarize(run_stream(fn, stream, seed, barrier_group))  # noqa: E731
    # Fresh: sizes the towers have not seen (a different stream per mode, the same distribution).
    result["single"] = alone(single_stream, 1000)
    dist.barrier(group=barrier_group)
    before = dict(kimi_cg.counters)
    result["dp"] = together(encode, dp_stream, 2000)
    changes = {key: kimi_cg.counters[key] - before.get(key, 0) for key in kimi_cg.counters}
    result["dp_counter_changes_rank0"] = {key: value for key, value in changes.items() if value}
    # Repeat: the same streams again (sizes seen), then the variants on the data-parallel stream.
    result["single_repeat"] = alone(single_stream, 1000)
    dist.barrier(group=barrier_group)
    result["dp_repeat"] = together(encode, dp_stream, 2000)
    result["dp_local_shares_only"] = summarize(run_local_shares(tower, dp_stream, 2000, barrier_group))
    together(encode_attention_aware, dp_stream, 2000)  # its plans put sizes on other ranks: see them once
    result["dp_attention_aware_repeat"] = together(encode_attention_aware, dp_stream, 2000)
    # Throughput with two requests per encoder call, both modes on the same stream, second pass.
    alone(pairs(dp_stream), 2000)
    result["pairs_single_repeat"] = alone(pairs(dp_stream), 2000)
    dist.barrier(group=barrier_group)
    together(encode, pairs(dp_stream), 2000)
    result["pairs_dp_repeat"] = together(encode, pairs(dp_stream), 2000)
    # How even the plans were: the busiest rank's tokens over the mean per rank, averaged over requests.
    imbalance = [max(plan.loads) * world / sum(plan.loads)
                 for plan in (kimi_cg.distributed.plan_items([math.prod(item) for item in grid], world)
                              for grid in dp_stream)]
    result["dp_mean_load_imbalance"] = statistics.fmean(imbalance)
    if rank == 0:
        ratio = lambda a, b: result[a]["mean_ms"] / result[b]["mean_ms"]  # noqa: E731
        result["speedups"] = {
            "fresh": ratio("single", "dp"), "repeat": ratio("single_repeat", "dp_repeat"),
            "repeat_attention_aware": ratio("single_repeat", "dp_attention_aware_repeat"),
            "local_shares_floor": ratio("single_repeat", "dp_local_shares_only"),
            "pairs_throughput": ratio("pairs_single_repeat", "pairs_dp_repeat"),
            "p99_fresh_dp_over_single": result["dp"]["p99_ms"] / result["single"]["p99_ms"],
        }
        print(f"{name}: single {result['single']['mean_ms']:.2f} ms (p99 {result['single']['p99_ms']:.2f}), "
              f"dp {result['dp']['mean_ms']:.2f} ms (p99 {result['dp']['p99_ms']:.2f}); speed-ups "
              + ", ".join(f"{key} {value:.2f}" for key, value in result["speedups"].items()), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--workloads", default="W4,W4_3d")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--smoke-test-on-cpu", action="store_true",
                        help="tiny configs on the CPU over gloo, to check this script without GPUs (times mean nothing)")
    args = parser.parse_args()
    configs = {"W4": MoonVitConfig(), "W4_3d": MoonViT3dConfig()}
    if args.smoke_test_on_cpu:
        bench.DEVICE = "cpu"
        configs = {"W4": MoonVitConfig.tiny(), "W4_3d": MoonViT3dConfig.tiny()}
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    barrier_group = dist.new_group(backend="gloo")  # barriers off the GPU streams
    torch.set_grad_enabled(False)
    results = {
        "date": datetime.date.today().isoformat(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
        "gpus": dist.get_world_size(),
        "device": torch.cuda.get_device_name() if bench.DEVICE == "cuda" else "cpu (smoke test)",
        "torch": torch.__version__,
    }
    for name in args.workloads.split(","):
        model_class, fraction = {"W4": (MoonVitPretrainedModel, 0.0), "W4_3d": (MoonViT3dPretrainedModel, 0.2)}[name]
        results[name] = workload(name, model_class, configs[name], fraction, args.requests, barrier_group)
        if dist.get_rank() == 0 and args.out:  # after each workload: a run cut short keeps what it measured
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as handle:
                json.dump(results, handle, indent=1)
    dist.barrier(group=barrier_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
