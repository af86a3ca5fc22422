"""MoonViT's fc0 + tanh GELU: eager, Inductor, and cuBLASLt's GELU-bias epilogue, at bucket-sized rows (GPU).

    python scripts/linear_gelu_bench.py --out linear_gelu.json

x [rows, 1152] @ W [4304, 1152]^T + b, then gelu(approximate="tanh"), in bf16, at 1,024-16,384 rows:
- ``linear``: F.linear alone (the GEMM with its bias epilogue: what the GELU adds to);
- ``eager``: F.linear then F.gelu, two kernels;
- ``inductor``: torch.compile of the pair (static shapes), as a device program runs it: cuBLAS's GEMM
  and a Triton kernel for bias + GELU;
- ``epilogue``: ``torch.ops.kimi_cg.linear_gelu_tanh`` (``torch._addmm_activation(..., use_gelu=True)``).
Each is captured 20 times into one CUDA graph (no launch gaps) and the graph replayed 10 times; the
figure is the mean kernel time of one call. Errors are against a float64 reference of the same bf16
inputs. NOTE [linear + GELU epilogue] in kimi_cg/canonicalize/linear_gelu.py is what uses it.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import kimi_cg.ops  # noqa: F401  (registers torch.ops.kimi_cg.*)

ROWS = (1024, 4096, 8192, 16384)
IN_FEATURES, OUT_FEATURES = 1152, 4304


def graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    for _ in range(3):  # compiles, plans, allocator warm-up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("linear_gelu_bench.py times CUDA kernels: no GPU here")
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    weight = (torch.randn(OUT_FEATURES, IN_FEATURES, device="cuda") / IN_FEATURES ** 0.5).bfloat16()
    bias = torch.randn(OUT_FEATURES, device="cuda").bfloat16()

    def pair(x):
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")

    compiled = torch.compile(pair, dynamic=False)
    for rows in ROWS:
        x = torch.randn(rows, IN_FEATURES, device="cuda").bfloat16()
        want = F.gelu(F.linear(x.double(), weight.double(), bias.double()), approximate="tanh")
        systems = {"linear": lambda: F.linear(x, weight, bias), "eager": lambda: pair(x),
                   "inductor": lambda: compiled(x),
                   "epilogue": lambda: torch.ops.kimi_cg.linear_gelu_tanh(x, weight, bias)}
        row = {"rows": rows}
        for name, fn in systems.items():
            row[f"{name}_ms"] = graph_ms(fn)
            if name != "linear":
                row[f"{name}_error"] = relative(fn(), want)
        report["rows"].append(row)
        print(row, flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
