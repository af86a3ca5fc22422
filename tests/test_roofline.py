"""scripts/roofline.py's FLOP counts against torch's own FLOP counter, and its bucket arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench  # noqa: E402
import roofline  # noqa: E402

from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel  # noqa: E402


def test_tower_flops_equal_torchs_flop_counter_on_one_image():
    """One image: the sdpa tower's block mask is the whole call, so torch counts exactly the
    convolution, the GEMMs and the two attention products that the formula counts."""
    config = MoonVitConfig.tiny(attn_implementation="sdpa")
    model = MoonVitPretrainedModel(config).eval()
    grid = [[6, 8]]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randn(48, 3, 14, 14), torch.tensor(grid))
    counted = roofline.tower_flops(config, grid)
    assert counter.get_total_flops() == counted["embed"] + counted["gemm"] + counted["attention"]
    by_op = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    assert by_op["aten.convolution"] == counted["embed"]
    assert by_op["aten.bmm"] == counted["attention"]


def test_attention_flops_are_per_segment():
    config = MoonVitConfig.tiny()
    one, two = roofline.tower_flops(config, [[4, 4]]), roofline.tower_flops(config, [[4, 4], [4, 4]])
    assert two["attention"] == 2 * one["attention"] and two["gemm"] == 2 * one["gemm"]


def test_executed_rows_follow_the_buckets():
    buckets = (1024, 1280, 1536, 2048)
    assert roofline.executed_rows(1024, buckets) == 1024
    assert roofline.executed_rows(1025, buckets) == 1280
    assert roofline.executed_rows(2048, buckets) == 2048
    assert roofline.executed_rows(2049, buckets) == 2048 + 1024  # a piece of the largest bucket, then the rest
    assert roofline.executed_rows(5000, buckets) == 2 * 2048 + 1024


def test_roofline_rows_from_a_report():
    report = {"results": {"W1": {"kimi_cg": {"mean_ms": 5.0, "replay_only_ms": 4.0}},
                          "W3": {"kimi_cg": {"mean_ms": 170.0}}}}
    rows = {row["workload"]: row for row in roofline.roofline(report)}
    assert set(rows) == {"W1", "W3"}
    assert rows["W1"]["kernel_ms"] == 4.0 and not rows["W1"]["kernel_ms_is_end_to_end"]
    assert rows["W3"]["kernel_ms_is_end_to_end"] and rows["W3"]["rows"] == 128 * 128
    assert "| W1 | 1024 |" in roofline.markdown(list(rows.values()))
    assert rows["W1"]["gemm_peak_tflops"] == roofline.GEMM_PEAK_TFLOPS  # a report without its own: the H200's


def test_a_report_with_its_own_gemm_peak_is_measured_against_it():
    report = {"results": {"W1": {"kimi_cg": {"mean_ms": 5.0, "replay_only_ms": 4.0}}}}
    base = roofline.roofline(report)[0]
    report["extras"] = {"gemm_peak_tflops": roofline.GEMM_PEAK_TFLOPS / 2}
    half = roofline.roofline(report)[0]
    assert half["gemm_peak_tflops"] == roofline.GEMM_PEAK_TFLOPS / 2
    assert half["fraction_of_gemm_peak"] == pytest.approx(2 * base["fraction_of_gemm_peak"])
    assert half["floor_ms_at_gemm_peak"] == pytest.approx(2 * base["floor_ms_at_gemm_peak"])


def test_bench_runs_its_variants_and_small_image_stream_on_cpu(tmp_path):
    """scripts/bench.py's smoke mode (tiny towers on the CPU) through the variants and the W5 stream, so
    a run on the GPU host does not find a broken script."""
    import json
    import subprocess

    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-P", "scripts/bench.py", "--smoke-test-on-cpu", "--systems",
                             "eager,kimi_cg_small_buckets,kimi_cg_max_autotune", "--workloads", "W1,W5", "--requests", "3",
                             "--repeats", "2", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results["W5"]) == {"eager", "kimi_cg_small_buckets", "kimi_cg_max_autotune"}, results
    assert results["W5"]["kimi_cg_small_buckets"]["calls"] == 3
    assert results["W1"]["kimi_cg_max_autotune"]["rel_err_vs_eager"] < 1e-2


def test_tail_recovers_a_fixed_cost_and_rate_and_the_streams_own_ratio():
    """--tail on a report whose times are an exact affine function of the executed FLOPs: the fit finds it,
    and a system with no fixed cost has the work's own P99 / mean."""
    import statistics

    from kimi_cg.config import KimiCGConfig
    from kimi_cg.models import MoonVitConfig

    config, buckets = MoonVitConfig(), KimiCGConfig().buckets()
    executed = []
    for grid in bench.request_stream(seed=4, count=30):
        c = roofline.tower_flops(config, grid)
        executed.append((c["gemm_per_row"] * roofline.executed_rows(c["rows"], buckets) + c["embed"] + c["attention"]) / 1e9)
    report = {"extras": {"W4_fixed_times_ms": [4.0 + f / 300.0 for f in executed],
                         "W4_proportional_times_ms": [f / 500.0 for f in executed],
                         "W4_3d_fixed_times_ms": [1.0] * 30}}  # another workload: not read
    result = roofline.tail(report, config, buckets)
    assert set(result["systems"]) == {"fixed", "proportional"}
    fixed, proportional = result["systems"]["fixed"], result["systems"]["proportional"]
    assert abs(fixed["fixed_ms"] - 4.0) < 1e-6 and abs(fixed["executed_tflops"] - 300.0) < 1e-6
    assert abs(fixed["correlation_with_executed_flops"] - 1.0) < 1e-9
    work = result["work_p99_over_mean"]["executed_flops"]
    assert abs(proportional["p99_over_mean"] - work) < 1e-9 and fixed["p99_over_mean"] < work
    assert abs(proportional["mean_ms"] - statistics.fmean(executed) / 500.0) < 1e-9
    with pytest.raises(ValueError, match="per-request times"):
        roofline.tail({"extras": {}})
