"""Warm-up cost of a tower compiled with kimi_cg, cold and warm, each in a fresh process.

A serving process calls ``kimi_cg.warm_up(max_items=8)`` at start-up: dynamo traces every item count,
Inductor compiles the device program, every bucket graph is captured. This runs that in new processes
one after another with one program cache directory (NOTE [program cache] in kimi_cg/program_cache.py):
the first starts cold (empty directory), the later ones load the device program the first stored, as
a restarted server or a second data-parallel rank would. Caches outside kimi_cg's (Triton's kernel
cache) are as the host has them. One JSON report: per process, the warm-up's seconds, when every bucket
was ready, the split (kimi_cg's backend, device compile, capture, the rest: dynamo and the runs) and the
program cache counters.

    python -P scripts/warmup_bench.py --family moonvit --processes 2 --out warmup.json        # H200, real size
    python -P scripts/warmup_bench.py --family moonvit --cpu --max-items 2 --out w.json      # CPU, real size, fp32
    python -P scripts/warmup_bench.py --family moonvit --smoke-test-on-cpu --out w.json      # CPU, tiny tower

Families are family_bench.py's (moonvit, kimi_k25, qwen2_5_vl, qwen2_vl, glm4v, qwen3_vl, paddleocr_vl).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also under python -P / PYTHONSAFEPATH

ITEM = [1, 16, 16]  # the example item warm_up copies: 16 x 16 patches (one frame)


def child(args) -> dict:
    """One process's warm-up (run with --child)."""
    import torch

    import family_bench
    import kimi_cg

    on_cpu = args.smoke_test_on_cpu or args.cpu
    device = "cpu" if on_cpu else "cuda"
    dtype = torch.float32 if on_cpu else torch.bfloat16
    started = time.perf_counter()
    model, config = family_bench.build(args.family, args.smoke_test_on_cpu, device, dtype)
    make_inputs = family_bench.inputs_for(args.family, config, device, dtype)
    built_s = time.perf_counter() - started
    options = {"device_compiler": "inductor"} if on_cpu else {}  # on CPU "auto" would run the FX graph
    compiled = torch.compile(model, backend="kimi_cg", options=options)
    pixels, grid = make_inputs([ITEM])
    result = kimi_cg.warm_up(compiled, pixels, grid, max_items=args.max_items)
    return {"build_s": built_s, "warm_up": result, "counters": dict(kimi_cg.counters),
            "timings": dict(kimi_cg.timings), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="moonvit")
    parser.add_argument("--processes", type=int, default=2, help="fresh processes in a row (the first cold)")
    parser.add_argument("--max-items", type=int, default=8)
    parser.add_argument("--cache-dir", default=None, help="program cache directory (default: a new temporary one)")
    parser.add_argument("--smoke-test-on-cpu", action="store_true", help="tiny tower on CPU, Inductor device programs")
    parser.add_argument("--cpu", action="store_true", help="real-size tower on CPU (fp32), Inductor device programs")
    parser.add_argument("--commit", default=None, help="recorded in the report")
    parser.add_argument("--out", required=True)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        json.dump(child(args), sys.stdout)
        return
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kimi_cg_programs_")
    report = {"family": args.family, "max_items": args.max_items, "item": ITEM, "program_cache": cache_dir,
              "commit": args.commit, "processes": []}
    command = [sys.executable, "-P", os.path.abspath(__file__), "--child", "--family", args.family,
               "--max-items", str(args.max_items), "--out", args.out]
    command += ["--smoke-test-on-cpu"] * args.smoke_test_on_cpu + ["--cpu"] * args.cpu
    environment = dict(os.environ, KIMI_CG_PROGRAM_CACHE=cache_dir)
    for index in range(args.processes):
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=environment)
        if result.returncode != 0:
            report["processes"].append({"error": result.stderr[-4000:]})
            break
        run = json.loads(result.stdout)
        run["process_s"] = time.perf_counter() - started
        report["processes"].append(run)
        warm = run["warm_up"]
        counters = run["counters"]
        print(f"process {index + 1}: warm-up {warm['seconds']:.1f} s (buckets ready {warm['buckets_ready_s']:.1f} s; "
              f"device compile {warm['breakdown_s']['device_compile']:.1f} s, capture {warm['breakdown_s']['capture']:.1f} s, "
              f"dynamo and runs {warm['breakdown_s']['dynamo_and_runs']:.1f} s); program cache: "
              f"{counters.get('program_cache_hits', 0)} loaded, {counters.get('program_cache_stores', 0)} stored, "
              f"{counters.get('program_cache_errors', 0)} errors", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    if any("error" in run for run in report["processes"]):
        sys.exit(report["processes"][-1]["error"][-2000:])


if __name__ == "__main__":
    main()
