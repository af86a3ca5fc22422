"""One-item calls on the H200: buckets only, exact-size graphs with cuDNN, exact-size graphs with flash.

    python -P scripts/exact_size_bench.py --out exact.json

NOTE [exact-size graphs] (kimi_cg/runtime/graphs.py): a one-image size seen three times gets a CUDA
graph of its exact rows whose attention runs cuDNN's dense kernel. This script measures what that
buys per image size, in one process, against eager and against the bucket replay it replaces:

  eager          the model as written (bf16)
  buckets        kimi_cg with ``exact_size_graphs=0``: the bucket replay (item table on flash)
  exact_cudnn    kimi_cg's default: the exact-size graph, attention on cuDNN
  exact_flash    the exact-size graph with cuDNN switched off (flash on the table [0, L])

Real Kimi-VL config (27 layers, hidden 1152, bf16, random weights). Per size: the median of
``--calls`` end-to-end calls (CUDA synchronised before and after) after the three calls that make
the exact-size graph; ``first_exact_call_ms`` is the call that made it (cuDNN plan, two runs, the
capture); the relative error of each system against an fp32 eager reference of the same weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

import kimi_cg
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel

SIZES = [[16, 16], [32, 32], [30, 46], [48, 48], [64, 64], [100, 60], [128, 128]]


def timed(fn, *args) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def relative_error(got, want) -> float:
    got, want = got[0] if isinstance(got, (tuple, list)) else got, want[0] if isinstance(want, (tuple, list)) else want
    got, want = (torch.cat(t) if isinstance(t, (tuple, list)) else t for t in (got, want))
    return float((got.float() - want.float()).norm() / want.float().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--sizes", default=None, help="h x w list, e.g. 32x32,64x64")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = [[int(v) for v in s.split("x")] for s in args.sizes.split(",")] if args.sizes else SIZES

    torch.manual_seed(0)
    reference = MoonVitPretrainedModel(MoonVitConfig()).cuda().eval()  # fp32
    model = copy.deepcopy(reference).to(torch.bfloat16)
    systems = {"eager": model}
    for name, limit in (("buckets", 0), ("exact_flash", 8), ("exact_cudnn", 8)):
        systems[name] = torch.compile(copy.deepcopy(model), backend="kimi_cg", options={"exact_size_graphs": limit})
    varlen = sys.modules["kimi_cg.ops.varlen_attention"]  # (the package's name for the op shadows the module)
    cudnn = varlen._dense_cudnn
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "calls": args.calls, "sizes": []}
    with torch.no_grad():
        for name in ("buckets", "exact_flash", "exact_cudnn"):  # the first call compiles (and captures the buckets)
            pixels = torch.randn(64, 3, 14, 14, device="cuda", dtype=torch.bfloat16)
            start = time.perf_counter()
            systems[name](pixels, torch.tensor([[8, 8]]))
            torch.cuda.synchronize()
            report[f"{name}_first_call_s"] = time.perf_counter() - start
        for h, w in sizes:
            grid = torch.tensor([[h, w]])
            pixels = torch.randn(h * w, 3, 14, 14, device="cuda")
            want = reference(pixels, grid)
            row = {"grid": [h, w], "rows": h * w}
            for name, system in systems.items():
                if name == "exact_flash":
                    varlen._dense_cudnn = lambda *a: None  # captured now, so its graph keeps flash
                try:
                    setup = [timed(system, pixels.bfloat16(), grid) for _ in range(3)]
                finally:
                    varlen._dense_cudnn = cudnn
                times = [timed(system, pixels.bfloat16(), grid) for _ in range(args.calls)]
                row[f"{name}_ms"] = statistics.median(times)
                row[f"{name}_first_exact_call_ms"] = setup[2]
                row[f"{name}_error"] = relative_error(system(pixels.bfloat16(), grid), want)
            for name in ("buckets", "exact_flash", "exact_cudnn"):
                row[f"{name}_speedup"] = row["eager_ms"] / row[f"{name}_ms"]
            print(json.dumps(row), flush=True)
            report["sizes"].append(row)
    report["counters"] = dict(kimi_cg.counters)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
