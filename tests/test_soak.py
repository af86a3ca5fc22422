"""scripts/soak.py in a tiny configuration on the CPU: a mixed stream (fresh, repeated and invalid
requests) served from two threads through the bucketed runtime, checked against eager.

The soak itself says what it checks (its module docstring); these tests assert what it reports.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest
import torch

from kimi_cg.models import KimiVLVisionEncoder, MoonVitConfig

SOAK_PATH = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


soak = load_soak()

TARGET_NAMES = {"0 wrong outputs", "0 NaN/inf outputs", "0 mishandled invalid requests", "0 failures",
                "0 device-program compiles after warm-up", "0 captures after warm-up", "0 lift fallbacks (whole run)"}


@pytest.fixture(scope="module")
def two_thread_soak(tmp_path_factory):
    """150 requests of the Kimi-VL tower, fp32, two threads, every fresh request checked against eager.

    The invalid kinds leave out no_pixels: test_a_request_without_pixels_... below runs it alone."""
    out = tmp_path_factory.mktemp("soak") / "summary.json"
    summary = soak.main(["--tower", "kimi_vl", "--config", "tiny", "--device", "cpu", "--dtype", "fp32",
                         "--requests", "150", "--threads", "2", "--invalid-fraction", "0.05",
                         "--invalid-kinds", "odd_side,pixel_rows,zero_side", "--seed", "0", "--out", str(out)])
    return summary, out


def test_soak_from_two_threads_gets_every_request_right(two_thread_soak):
    summary, _ = two_thread_soak
    assert summary["wrong"] == 0, summary["wrong_examples"]
    assert summary["nan"] == 0
    assert summary["invalid"]["mishandled"] == 0, summary["failures"]
    assert summary["failure_count"] == 0, summary["failures"]
    assert summary["worst_error"] <= summary["tolerance"] == soak.EAGER_TOLERANCE["fp32"]
    assert summary["worst_repeat_drift"] <= summary["digest_tolerance"]


def test_soak_summary_counts_what_it_served(two_thread_soak):
    summary, out = two_thread_soak
    kinds = summary["kinds"]
    assert sum(kinds.values()) == summary["requests"] == 150
    assert kinds["fresh"] > 0 and kinds["repeat"] > 0
    invalid = {kind: count for kind, count in kinds.items() if kind.startswith("invalid_")}
    assert set(invalid) <= {"invalid_odd_side", "invalid_pixel_rows", "invalid_zero_side"} and invalid
    assert summary["invalid"]["handled"] + summary["invalid"]["mishandled"] == sum(invalid.values())
    assert set(summary["invalid"]["eager_raises"]) == set(invalid)  # eager rejects each kind too
    # --eager-check-fraction defaults to 1.0 on tiny: every fresh request was compared with eager,
    # every repeat with the digest of its pair's first result
    assert summary["checked"]["against_eager"] == kinds["fresh"]
    assert summary["checked"]["against_digest"] == kinds["repeat"]
    assert 0 < summary["checked"]["after_invalid"] <= sum(invalid.values())

    memory = summary["memory"]
    assert memory["memory_growth"] is None  # no CUDA allocator on the CPU
    assert memory["host_rss_bytes"]["at_50_percent"] > 0 and isinstance(memory["rss_growth"], float)
    labels = [sample["label"] for sample in memory["samples"]]
    assert labels.count("periodic") >= 20 and labels.count("50%") == 1 and labels[-1] == "end"  # every ~N/20
    assert all(set(sample["kimi_cg"]) >= {"metadata", "graphs", "programs"} for sample in memory["samples"])
    assert set(summary["after_warm_up"]) >= {"dynamo_graphs", "device_programs_compiled", "captures", "graph_replays",
                                             "eager_fallbacks", "split_calls", "call_fallbacks", "lift_fallbacks"}
    assert summary["throughput"]["requests_per_s"] > 0 and summary["throughput"]["call_ms"]["p50"] > 0

    targets = {target["name"]: target for target in summary["targets"]}
    assert set(targets) >= TARGET_NAMES
    assert next(t for name, t in targets.items() if name.startswith("memory growth"))["passed"] is None  # skipped
    assert summary["passed"] == all(t["passed"] is not False for t in targets.values())
    assert json.loads(out.read_text())["requests"] == 150


class MixedUpTower:
    """A broken stand-in for a compiled tower: every 4th call answers with the rows of other pixels
    (right shapes, wrong data), every 7th puts a NaN in, and invalid inputs raise an error of
    another class than eager's."""

    def __init__(self, model):
        self.model = model
        self.calls = 0

    def __call__(self, pixels, grid):
        self.calls += 1
        if self.calls % 4 == 0:
            pixels = torch.randn(pixels.shape, generator=torch.Generator().manual_seed(self.calls)).to(pixels.dtype)
        try:
            outputs = self.model(pixels, grid)
        except RuntimeError as error:
            raise KeyError(str(error)) from error
        if self.calls % 7 == 0:
            outputs[0][0, 0] = float("nan")
        return outputs


def test_the_soak_catches_wrong_rows_nan_and_eager_errors_on_invalid_requests():
    """The checks can fail: run the soak's serving loop (no compile) on a tower that mixes requests up."""
    args = soak.parse_args(["--tower", "kimi_vl", "--config", "tiny", "--device", "cpu", "--requests", "40",
                            "--threads", "1", "--invalid-fraction", "0.1", "--invalid-kinds", "odd_side,pixel_rows"])
    model, _ = soak.build_tower("kimi_vl", "tiny", seed=0)
    model.eval()
    requests = soak.request_stream(40, 0, soak.TINY_SIZES, None, 4, 0.1, args.invalid_kinds, 0.5, 1.0)
    served = soak.Soak(args, model, MixedUpTower(model), requests, soak.counter_snapshot())
    middle, end, seconds = served.run()
    summary = soak.summarize(args, served, {"seconds": 0.0, "calls": 0, "dynamo_graphs": 0}, {}, middle, end, seconds)
    invalid = sum(count for kind, count in summary["kinds"].items() if kind.startswith("invalid_"))
    assert invalid > 0 and summary["invalid"]["mishandled"] == invalid  # neither InvalidInputError nor eager's error
    assert summary["wrong"] >= 4 and not summary["worst_error"] <= 0.1  # other rows: near 1 (or NaN), not rounding
    assert summary["nan"] >= 2
    failed = {target["name"] for target in summary["targets"] if target["passed"] is False}
    assert failed >= {"0 wrong outputs", "0 NaN/inf outputs", "0 mishandled invalid requests", "0 failures"}
    assert summary["passed"] is False


def test_a_request_without_pixels_is_an_invalid_input_and_changes_nothing_after_it():
    summary = soak.main(["--tower", "kimi_vl", "--config", "tiny", "--device", "cpu", "--requests", "12",
                         "--max-items", "2", "--threads", "1", "--invalid-fraction", "0.25",
                         "--invalid-kinds", "no_pixels", "--seed", "0"])
    assert summary["kinds"].get("invalid_no_pixels", 0) > 0
    assert summary["wrong"] == 0 and summary["nan"] == 0
    assert summary["invalid"]["mishandled"] == 0, summary["failures"]
    assert summary["after_warm_up"]["device_programs_compiled"] == 0
