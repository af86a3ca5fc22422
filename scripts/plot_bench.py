"""Plots for docs/benchmarks.md from a scripts/bench.py JSON (run here, not on the GPU machine).

    python scripts/plot_bench.py docs/bench/latest.json docs/bench/
writes latency.png (mean per system per workload, log scale, P50-P99 as error bars) and
w4_cdf.png (the latency CDF of the W4 first pass, one line per system). Needs matplotlib.
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WORKLOADS = ["W1", "W2", "W3", "W4", "W4_repeat", "W4_3d"]
SYSTEMS = ["eager", "inductor", "inductor_reduce_overhead", "seed_style", "kimi_cg"]


def main(path: str, out_dir: str) -> None:
    report = json.load(open(path))
    results = report["results"]
    workloads = [w for w in WORKLOADS if w in results]
    systems = [s for s in SYSTEMS if any(s in results[w] for w in workloads)]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs, means, lows, highs = [], [], [], []
        for j, workload in enumerate(workloads):
            entry = results[workload].get(system)
            if entry is None:
                continue
            xs.append(j + (i - (len(systems) - 1) / 2) * width)
            means.append(entry["mean_ms"])
            lows.append(max(entry["mean_ms"] - entry["p50_ms"], 0))
            highs.append(max(entry["p99_ms"] - entry["mean_ms"], 0))
        ax.bar(xs, means, width, label=system, yerr=[lows, highs], capsize=2)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (mean; bars to P50 and P99)")
    ax.set_title(f"MoonViT (real config, bf16) on {report['machine']}, torch {report['torch']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "latency.png"), dpi=110)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in systems:
        entry = results.get("W4", {}).get(system)
        extras = report.get("extras", {})
        if entry is not None and "source" in entry:  # a merged report: the times are in the source run
            source = report["runs"][entry["source"]]["file"]
            extras = json.load(open(os.path.join(os.path.dirname(path), source))).get("extras", {})
        times = extras.get(f"W4_{system}_times_ms")
        if not times:
            continue
        ordered = sorted(times)
        label = system + (f" ({entry['truncated']})" if entry and entry.get("truncated") else "")
        ax.plot(ordered, [(k + 1) / len(ordered) for k in range(len(ordered))], label=label, drawstyle="steps-post",
                marker="o" if len(ordered) < 5 else None)
    ax.set_xscale("log")
    ax.set_xlabel("ms per request (W4 first pass, compile stalls included)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "w4_cdf.png"), dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(sys.argv[1]))
