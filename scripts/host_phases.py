"""Where a kimi_cg call's time goes, phase by phase, for image sizes seen before and new ones (GPU).

    python scripts/host_phases.py --out phases.json

Real Kimi-VL tower (bf16, random weights), ``kimi_cg.warm_up`` first (its cost and breakdown are
reported: a clean warm-up figure when nothing else runs on the machine), then W4-like requests:
a pass over one stream, a second pass over the same stream (every size seen), and a pass over
another stream (mostly new sizes). Each phase below is timed with the device synchronised before
and after it, so phases add up but the total is a little slower than an unsynchronised call:

  call          the whole compiled call (dynamo's guards and frame entry included)
  runner        kimi_cg's runner (call minus dynamo)
  host          the host metadata pass (per-item cache lookups included)
  item_values   per-item metadata (cache hits and misses), part of host
  move          host-made values to the GPU (none for a batch whose copies are kept: NOTE [moved batches])
  fill          copies into the bucket's static inputs
  replay        CUDA-graph replays
  output_rows   the output sizes for this call (symbolic, cached per shape)

With --cpu-time nothing is synchronised inside a call: each phase is the host CPU time it takes to
issue its work (what delays the replay's launch), "call_cpu" the time until the call returns, and
"state_tokens" (the module-state check) and "graph_launch" are timed too; "misses" counts per-item
metadata misses per request. --warm-up-stream warms with bench.py's W4 warm-up requests instead of
``kimi_cg.warm_up`` (the W4 benchmark's start).

    python scripts/host_phases.py --cpu-time --warm-up-stream --compare-resize --out resize_ab.json

--tower moonvit3d runs MoonViT3d (Kimi-K2.5's tower, the W4_3d benchmark's) on bench.py's W4_3d streams (20% video
chunks; a request over the largest bucket is split into several replays, ``split_calls`` in the counters) instead
of the Kimi-VL tower on W4's, with the warm-up item [1, 16, 16]. "state_tokens" (the module-state check: a content
comparison, one host sync, for a table the host reads) is then timed in both modes, within "host".

    python scripts/host_phases.py --tower moonvit3d --warm-up-stream --out phases_3d.json

--compare-resize instead runs six fresh 30-request streams (new image sizes) in one process,
alternating the position-grid resize of host programs between the CUDA kernel
(kimi_cg/kernels/resize.py) and the two-matrix form it replaced (kimi_cg/ops/resize.py's CPU path,
switched on here by patching the module): the host CPU time a new size costs, either way.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the same streams and inputs as the benchmarks)

import kimi_cg  # noqa: E402
from kimi_cg.device_program import DeviceProgram  # noqa: E402
from kimi_cg.host_program import HostProgram, ItemValue  # noqa: E402
from kimi_cg.models import (  # noqa: E402
    MoonViT3dConfig, MoonViT3dPretrainedModel, MoonVitConfig, MoonVitPretrainedModel,
)
from kimi_cg.runtime.graphs import BucketedGraphs  # noqa: E402
from kimi_cg.runtime import runner as runner_module  # noqa: E402
from kimi_cg.runtime.runner import LiftedRunner  # noqa: E402
from kimi_cg.runtime.state_tokens import StateTokens  # noqa: E402

PHASES = collections.Counter()
SYNCHRONISE = True  # False with --cpu-time
THREE_D = False  # --tower moonvit3d: the W4_3d streams, and the module-state check timed when synchronised


def video_fraction() -> float:
    """The streams' share of video chunks: bench.py's W4_3d's for MoonViT3d, none for the 2D tower."""
    return 0.2 if THREE_D else 0.0


def timed(name: str, function):
    def wrapper(*args, **kwargs):
        if SYNCHRONISE:
            bench.synchronize()
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            if SYNCHRONISE:
                bench.synchronize()
            PHASES[name] += time.perf_counter() - start
    return wrapper


def instrument() -> None:
    LiftedRunner.__call__ = timed("runner", LiftedRunner.__call__)
    HostProgram.run = timed("host", HostProgram.run)
    ItemValue.forward = timed("item_values", ItemValue.forward)
    BucketedGraphs._fill = timed("fill", BucketedGraphs._fill)
    runner_module._move = timed("move", runner_module._move)
    DeviceProgram.output_rows = timed("output_rows", DeviceProgram.output_rows)
    if SYNCHRONISE:
        torch.cuda.CUDAGraph.replay = timed("replay", torch.cuda.CUDAGraph.replay)
        if THREE_D:
            StateTokens.validate = timed("state_tokens", StateTokens.validate)
    else:
        torch.cuda.CUDAGraph.replay = timed("graph_launch", torch.cuda.CUDAGraph.replay)
        StateTokens.validate = timed("state_tokens", StateTokens.validate)


def measure(system, requests) -> dict:
    names = ("call", "runner", "host", "item_values", "move", "fill", "replay", "output_rows",
             *(("state_tokens",) if THREE_D else ())) if SYNCHRONISE else (
        "call", "call_cpu", "runner", "host", "item_values", "state_tokens", "move", "fill", "output_rows", "graph_launch",
        "misses")
    per_request = collections.defaultdict(list)
    with torch.no_grad():
        for args in requests:
            PHASES.clear()
            misses = kimi_cg.counters["metadata_cache_misses"]
            bench.synchronize()
            start = time.perf_counter()
            system(*args)
            PHASES["call_cpu"] = time.perf_counter() - start
            bench.synchronize()
            PHASES["call"] = time.perf_counter() - start
            for name in names:
                per_request[name].append(PHASES[name] * 1e3 if name != "misses" else
                                         kimi_cg.counters["metadata_cache_misses"] - misses)  # a count
    return {name: {"mean_ms": statistics.fmean(v), "p50_ms": statistics.median(v)} for name, v in per_request.items()}


def compare_resize(compiled, rounds: int = 6, requests: int = 30) -> dict:
    """Fresh streams alternating the resize kernel ("kernel") and the two-matrix form ("matrices")."""
    import kimi_cg.ops.resize as resize

    kernel_rule = resize.use_triton
    instrument()
    rows = collections.defaultdict(list)
    try:
        for index in range(rounds):
            label = "kernel" if index % 2 == 0 else "matrices"
            resize.use_triton = kernel_rule if label == "kernel" else (lambda x: False)
            grids = bench.request_stream(20 + index, requests, video_fraction=video_fraction())
            stream = [bench.make_inputs(grid, 100 * index + i) for i, grid in enumerate(grids)]
            row = {k: round(v["mean_ms"], 3) for k, v in measure(compiled, stream).items()}
            rows[label].append(row)
            print(label, json.dumps(row), flush=True)
    finally:
        resize.use_triton = kernel_rule
    return dict(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--out", default=None)
    parser.add_argument("--cpu-time", action="store_true", help="no synchronisation inside a call (see above)")
    parser.add_argument("--warm-up-stream", action="store_true", help="warm with bench.py's W4 warm-up requests")
    parser.add_argument("--compare-resize", action="store_true",
                        help="alternate the resize kernel and the two-matrix form on fresh streams (see above)")
    parser.add_argument("--no-table-gathers", action="store_true",
                        help="option table_gathers=False: the host computes the tables' per-item values (A/B)")
    parser.add_argument("--table-gathers", action="store_true",
                        help="option table_gathers=True: the device reads the tables with host plans (A/B)")
    block = parser.add_mutually_exclusive_group()
    block.add_argument("--host-block", action="store_true",
                        help="option host_block=True: host-made inputs in one copy per call (NOTE [host block]; the default)")
    block.add_argument("--no-host-block", action="store_true",
                        help="option host_block=False: a copy and padding per host-made input (A/B)")
    parser.add_argument("--tower", choices=("moonvit", "moonvit3d"), default="moonvit",
                        help="moonvit3d: MoonViT3d on the W4_3d streams (see above)")
    parser.add_argument("--smoke-test-on-cpu", action="store_true",
                        help="tiny config on the CPU (bucket path without capture), to check this script")
    args = parser.parse_args()
    global SYNCHRONISE, THREE_D
    THREE_D = three_d = args.tower == "moonvit3d"
    config_class, model_class = ((MoonViT3dConfig, MoonViT3dPretrainedModel) if three_d
                                 else (MoonVitConfig, MoonVitPretrainedModel))
    config, options = config_class(), None
    if args.smoke_test_on_cpu:
        bench.DEVICE, config, options = "cpu", config_class.tiny(), {"cuda_graphs": True}
    elif not torch.cuda.is_available():
        sys.exit("host_phases.py needs a GPU (or --smoke-test-on-cpu)")
    if args.no_table_gathers or args.table_gathers:
        options = {**(options or {}), "table_gathers": bool(args.table_gathers)}
    if args.host_block or args.no_host_block:
        options = {**(options or {}), "host_block": not args.no_host_block}
    torch.manual_seed(0)
    model = model_class(config).to(bench.DEVICE, torch.bfloat16).eval()
    compiled = torch.compile(model, backend="kimi_cg", options=options)
    report = {"machine": torch.cuda.get_device_name() if bench.DEVICE == "cuda" else "cpu (smoke test)", "torch": torch.__version__,
              "command": "python scripts/host_phases.py " + " ".join(sys.argv[1:])}
    SYNCHRONISE = not args.cpu_time
    if args.warm_up_stream:
        start = time.perf_counter()
        with torch.no_grad():
            for i, grid in enumerate(bench.warmup_stream(seed=40, video_fraction=video_fraction())):
                compiled(*bench.make_inputs(grid, 500 + i))
        bench.synchronize()
        report["warm_up"] = {"stream_s": time.perf_counter() - start}
    else:
        item = [[1, 16, 16]] if three_d else [[16, 16]]
        report["warm_up"] = kimi_cg.warm_up(compiled, *bench.make_inputs(item, 0), max_items=8)
    print("warm_up", json.dumps(report["warm_up"]), flush=True)
    if args.compare_resize:
        report["compare_resize"] = compare_resize(compiled)
    else:
        streams = [bench.request_stream(seed, args.requests, video_fraction=video_fraction()) for seed in (4, 9)]
        stream = [bench.make_inputs(grid, 100 + i) for i, grid in enumerate(streams[0])]
        other = [bench.make_inputs(grid, 900 + i) for i, grid in enumerate(streams[1])]
        instrument()
        for label, requests in (("first_pass", stream), ("second_pass_seen_sizes", stream), ("new_stream", other)):
            report[label] = measure(compiled, requests)
            print(label, json.dumps({k: round(v["mean_ms"], 3) for k, v in report[label].items()}), flush=True)
    report["counters"] = dict(kimi_cg.counters)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
