"""Roofline of the MoonViT workloads: FLOPs per call, kernel time, achieved TFLOP/s (issue 14).

    python scripts/roofline.py docs/bench/<run>.json              # a bench.py report from the H200
    python scripts/roofline.py docs/bench/<run>.json --markdown   # the table for docs/benchmarks.md

FLOPs are counted from the real Kimi-VL config and each workload's grids (bench.py's W1, W2, W3 and
its W4 stream, the same seeds), as multiply-adds x 2:
  patch embedding   2 * rows * (3 * p * p) * D                       (a convolution of stride p)
  GEMMs per layer   2 * rows * D * (3D + D + 2F)                      (qkv, output, MLP in and out)
  attention         4 * sum(segment_rows ** 2) * D per layer          (q k^T and p v, every head)
``useful`` counts the call's own rows; ``executed`` counts the GEMMs at the bucket's capacity, as a
replay runs them (padding rows included; a request over the largest bucket runs in pieces of at
most that bucket, counted at the largest bucket per piece, an upper bound). Kernel time is the
report's replay time (CUDA events around graph replays: W1's replay-only figure, W4's replay mean)
or, where the report has none (W2, W3), the end-to-end time, an upper bound. The GEMM peak is the
bf16 8192^3 matmul bench.py measures on the report's GPU (``extras["gemm_peak_tflops"]``); reports from
before it did are from the H200, where it was 805 TFLOP/s.

--tail reads the W4 pass's per-request times instead (a report's ``extras["W4_<system>_times_ms"]``,
in stream order) and sets each system's P99 / mean beside the stream's own: the P99 / mean of the
work each request holds (rows, useful FLOPs, FLOPs executed at bucket sizes). A system whose time is
proportional to the work it runs has the work's ratio; only a fixed cost per request (host time)
brings it lower. The fit ``time = fixed + executed GFLOP / rate`` (least squares) says how much of
kimi_cg's time is fixed.

    python scripts/roofline.py docs/bench/<run>.json --tail
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the workloads' grids)

from kimi_cg.config import KimiCGConfig  # noqa: E402
from kimi_cg.models import MoonVitConfig  # noqa: E402

GEMM_PEAK_TFLOPS = 805.0  # the H200's, for reports without their own measurement


def tower_flops(config: MoonVitConfig, grid: list[list[int]]) -> dict:
    """FLOPs of one call of the tower on ``grid`` ([[h, w], ...] patches), by kind."""
    d, f, layers, p = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.patch_size
    rows = sum(h * w for h, w in grid)
    embed = 2 * rows * 3 * p * p * d
    gemm_per_row = 2 * d * (3 * d + d + 2 * f) * layers
    attention = 4 * d * layers * sum((h * w) ** 2 for h, w in grid)
    return {"rows": rows, "embed": embed, "gemm": gemm_per_row * rows, "attention": attention,
            "gemm_per_row": gemm_per_row}


def executed_rows(rows: int, buckets: tuple[int, ...]) -> int:
    """Rows a bucketed replay runs for a call of ``rows`` (see the module docstring)."""
    largest = buckets[-1]
    pieces, rest = divmod(rows, largest)
    fit = next((b for b in buckets if b >= rest), largest) if rest else 0
    return pieces * largest + fit


def workload_grids(requests: int) -> dict[str, list[list[list[int]]]]:
    return {"W1": [[[32, 32]]], "W2": [bench.W2], "W3": [[[128, 128]]],
            "W4": bench.request_stream(seed=4, count=requests)}


def roofline(report: dict, config: MoonVitConfig | None = None, buckets: tuple[int, ...] | None = None) -> list[dict]:
    config = config or MoonVitConfig()
    buckets = buckets or KimiCGConfig().buckets()
    results = report["results"]
    requests = results.get("W4", {}).get("kimi_cg", {}).get("calls") or 40
    peak = report.get("extras", {}).get("gemm_peak_tflops") or GEMM_PEAK_TFLOPS
    rows = []
    for workload, grids in workload_grids(requests).items():
        measured = results.get(workload, {}).get("kimi_cg")
        if not measured:
            continue
        counts = [tower_flops(config, grid) for grid in grids]
        mean = {key: sum(c[key] for c in counts) / len(counts) for key in ("rows", "embed", "gemm", "attention")}
        executed_gemm = sum(c["gemm_per_row"] * executed_rows(c["rows"], buckets) for c in counts) / len(counts)
        kernel_ms = measured.get("replay_only_ms") or measured.get("replay_mean_ms")
        bound = kernel_ms is None
        kernel_ms = kernel_ms or measured["mean_ms"]
        useful = mean["embed"] + mean["gemm"] + mean["attention"]
        rows.append({
            "workload": workload, "rows": round(mean["rows"]), "gemm_gflop": mean["gemm"] / 1e9,
            "attention_gflop": mean["attention"] / 1e9, "useful_gflop": useful / 1e9,
            "executed_gemm_gflop": executed_gemm / 1e9, "kernel_ms": kernel_ms, "kernel_ms_is_end_to_end": bound,
            "useful_tflops": useful / kernel_ms / 1e9, "fraction_of_gemm_peak": useful / kernel_ms / 1e9 / peak,
            "floor_ms_at_gemm_peak": useful / peak / 1e9, "gemm_peak_tflops": peak,
        })
    return rows


def p99(values: list[float]) -> float:
    """bench.py's P99 (the nearest rank of sorted values)."""
    return bench.summarize(values, 0.0, 0)["p99_ms"]


def tail(report: dict, config: MoonVitConfig | None = None, buckets: tuple[int, ...] | None = None) -> dict:
    """P99 / mean of each system's W4 request times against that of the work the requests hold."""
    config = config or MoonVitConfig()
    buckets = buckets or KimiCGConfig().buckets()
    times = {key[len("W4_"):-len("_times_ms")]: values for key, values in report.get("extras", {}).items()
             if key.startswith("W4_") and key.endswith("_times_ms") and not key.startswith("W4_3d_")}
    if not times:
        raise ValueError("the report has no W4 per-request times (extras['W4_<system>_times_ms'])")
    count = max(len(values) for values in times.values())
    counts = [tower_flops(config, grid) for grid in bench.request_stream(seed=4, count=count)]
    executed = [c["gemm_per_row"] * executed_rows(c["rows"], buckets) + c["embed"] + c["attention"] for c in counts]
    work = {"rows": [c["rows"] for c in counts], "useful_flops": [c["embed"] + c["gemm"] + c["attention"] for c in counts],
            "executed_flops": executed}
    result = {"requests": count, "work_p99_over_mean": {k: p99(v) / statistics.fmean(v) for k, v in work.items()},
              "systems": {}}
    for system, values in times.items():
        flops = [f / 1e9 for f in executed[:len(values)]]  # a pass cut by its time budget timed a prefix
        mean_t = statistics.fmean(values)
        slope, fixed = statistics.linear_regression(flops, values)
        result["systems"][system] = {
            "requests": len(values), "mean_ms": mean_t, "p99_ms": p99(values), "p99_over_mean": p99(values) / mean_t,
            "correlation_with_executed_flops": statistics.correlation(flops, values),
            "fixed_ms": fixed, "executed_tflops": 1.0 / slope if slope > 0 else None}
    return result


def markdown(rows: list[dict]) -> str:
    lines = ["| workload | rows | GEMM GFLOP (useful / executed) | attention GFLOP | kernel ms | useful TFLOP/s | "
             "of the GEMM peak | floor at the peak, ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kernel = f"{r['kernel_ms']:.2f}" + (" (end to end)" if r["kernel_ms_is_end_to_end"] else "")
        lines.append(f"| {r['workload']} | {r['rows']} | {r['gemm_gflop']:.0f} / {r['executed_gemm_gflop']:.0f} | "
                     f"{r['attention_gflop']:.0f} | {kernel} | {r['useful_tflops']:.0f} | "
                     f"{100 * r['fraction_of_gemm_peak']:.0f}% | {r['floor_ms_at_gemm_peak']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="a bench.py JSON report")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--tail", action="store_true", help="W4's P99 / mean against the work's (see above)")
    args = parser.parse_args()
    with open(args.report) as f:
        report = json.load(f)
    if args.tail:
        print(json.dumps(tail(report), indent=1))
        return
    rows = roofline(report)
    print(markdown(rows) if args.markdown else json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
