"""Towers other people wrote, at real sizes: fuzzed against eager, then timed (one process per run).

    python scripts/family_bench.py --out docs/bench/<date>_families.json          # H200, bf16
    python scripts/family_bench.py --families kimi_k25 --skip-fuzz
    python scripts/family_bench.py --smoke-test-on-cpu                             # tiny, fp32, CPU

Families (transformers' towers as shipped, default ``sdpa`` attention, random weights, bf16), and the
reference the issue's target is relative to:
  moonvit     kimi_cg's reference MoonViT (Kimi-VL's tower, 27 x 1152, its config's attention), images
  moonvit_upstream_sdpa, moonvit_upstream_flash
              MoonViT as Kimi-VL's remote code ships it (tests/towers/upstream_moonvit.py: plain asserts on
              grid values; sdpa under a block-diagonal mask set by a slice loop, or flash-attn's varlen op
              with max_seqlen from .item() per layer), 27 x 1152, images. flash-attn is not installed on
              the benchmark host, so the flash family's op is the test corpus's stand-in (flash-attn's
              signature; on CUDA torch's varlen flash kernel, which like flash-attn's never reads the
              segment bounds on the host), registered with kimi_cg.register_varlen_attention as a user would
  kimi_k25    Kimi_K25VisionModel, 27 layers x 1152 (MoonViT3d; images and 4-frame video chunks)
  qwen2_5_vl  Qwen2.5-VL-7B's tower, 32 x 1280, window attention (window 112 px, full attention in
              layers 7, 15, 23, 31)
  qwen2_vl    Qwen2-VL-7B's tower, 32 x 1280
  glm4v       GLM-4.1V's tower, 24 x 1536
  qwen3_vl    Qwen3-VL-8B's tower, 27 x 1152, patches of 16 pixels, deepstack mergers after layers 8, 16, 24
  paddleocr_vl  PaddleOCR-VL's tower, 27 x 1152 (its config's defaults), patches [1, L, 3, 14, 14] (rows on
              dim 1), images; no merger in the tower (its projector merges)
For each family:
1. fuzz: ``kimi_cg.testing.assert_matches_eager`` on --fuzz-examples random batches (2x-eager-bf16 rule
   against an fp32 copy, NaN-poisoned CUDA-graph pool), then the counters of those calls;
2. time: W1 (one 32x32-patch image) and a W4-like fresh stream (bench.py's: --requests requests of 1-8
   images, sides 8..64 patches; Kimi-K2.5 also with 20% video chunks) after bench.py's 10-request
   warm-up, for eager, torch.compile (Inductor, stock settings, dynamic shapes) and kimi_cg, all in this
   process. Speed-ups are ratios to eager in the same process; a pass stops at --stream-budget-s, a
   warm-up at --warmup-budget-s (when given).
Writes --out after every step (fuzz, each system), so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also under python -P / PYTHONSAFEPATH
import bench  # noqa: E402  scripts/bench.py: the same request streams and timing helpers
import kimi_cg
import kimi_cg.testing

PATCH, MERGE = 14, 2


UPSTREAM = {"moonvit_upstream_sdpa": "sdpa", "moonvit_upstream_flash": "flash_attention_2"}
IMAGES_AS_HW = ("moonvit", *UPSTREAM)  # grids of [h, w] rows, pixels [L, 3, 14, 14]


def _upstream_moonvit():
    """tests/towers/upstream_moonvit.py (the remote code's form), its flash stand-in registered with kimi_cg."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from towers import upstream_moonvit

    kimi_cg.register_varlen_attention(upstream_moonvit.FLASH_STAND_IN, {"max_seqlen_q": "q", "max_seqlen_k": "k"},
                                      segments=("cu_seqlens_q", "cu_seqlens_k"))
    return upstream_moonvit


def _config(family: str, tiny: bool):
    if family in UPSTREAM:
        from kimi_cg.models.moonvit import MoonVitConfig

        upstream = _upstream_moonvit()
        sizes = dataclasses.asdict(MoonVitConfig.tiny() if tiny else MoonVitConfig())
        sizes.pop("attn_implementation", None)
        return upstream.UpstreamMoonVitPretrainedModel, upstream.UpstreamMoonVitConfig(
            **sizes, attn_implementation=UPSTREAM[family])
    if family == "moonvit":
        from kimi_cg.models.moonvit import MoonVitConfig, MoonVitPretrainedModel

        return MoonVitPretrainedModel, MoonVitConfig.tiny() if tiny else MoonVitConfig()
    if family == "kimi_k25":
        from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

        size = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4) if tiny else dict(
            num_hidden_layers=27, hidden_size=1152, intermediate_size=4304, num_attention_heads=16)
        return Kimi_K25VisionModel, Kimi_K25VisionConfig(patch_size=PATCH, pos_emb_height=64, pos_emb_width=64,
                                                         pos_emb_time=4, merge_kernel_size=[MERGE, MERGE], **size)
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        size = dict(depth=2, hidden_size=64, intermediate_size=96, out_hidden_size=48, num_heads=4,
                    fullatt_block_indexes=[1]) if tiny else dict(
            depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=3584, num_heads=16,
            fullatt_block_indexes=[7, 15, 23, 31])
        return Qwen2_5_VisionTransformerPretrainedModel, Qwen2_5_VLVisionConfig(
            in_channels=3, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=112, **size)
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        size = dict(depth=2, embed_dim=64, hidden_size=48, num_heads=4) if tiny else dict(
            depth=32, embed_dim=1280, hidden_size=3584, num_heads=16)
        return Qwen2VisionTransformerPretrainedModel, Qwen2VLVisionConfig(
            in_channels=3, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, mlp_ratio=4, **size)
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        size = dict(depth=2, hidden_size=64, intermediate_size=96, out_hidden_size=48, num_heads=4, num_position_embeddings=64,
                    deepstack_visual_indexes=[0]) if tiny else dict(
            depth=27, hidden_size=1152, intermediate_size=4304, out_hidden_size=4096, num_heads=16,
            num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
        return Qwen3VLVisionModel, Qwen3VLVisionConfig(in_channels=3, patch_size=16, spatial_merge_size=MERGE,
                                                       temporal_patch_size=2, **size)
    if family == "glm4v":
        from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
        from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

        size = dict(depth=2, hidden_size=64, intermediate_size=96, out_hidden_size=48, num_heads=4) if tiny else dict(
            depth=24, hidden_size=1536, intermediate_size=13696, out_hidden_size=4096, num_heads=12)
        return Glm4vVisionModel, Glm4vVisionConfig(in_channels=3, patch_size=PATCH, spatial_merge_size=MERGE,
                                                   temporal_patch_size=2, image_size=336, **size)
    if family == "paddleocr_vl":
        from transformers.models.paddleocr_vl.configuration_paddleocr_vl import PaddleOCRVisionConfig
        from transformers.models.paddleocr_vl.modeling_paddleocr_vl import PaddleOCRVisionModel

        size = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4) if tiny else dict(
            num_hidden_layers=27, hidden_size=1152, intermediate_size=4304, num_attention_heads=16)
        return PaddleOCRVisionModel, PaddleOCRVisionConfig(num_channels=3, image_size=384, patch_size=PATCH,
                                                           spatial_merge_size=MERGE, **size)
    raise ValueError(f"unknown family {family!r}")


def build(family: str, tiny: bool, device: str, dtype: torch.dtype):
    model_class, config = _config(family, tiny)
    torch.manual_seed(0)
    if family in IMAGES_AS_HW:
        model = model_class(config).eval()
    else:
        model = model_class._from_config(config, attn_implementation="sdpa").eval()
    return model.to(device=device, dtype=dtype), config


def row_width(family: str, config) -> int:
    if family in ("kimi_k25", "paddleocr_vl", *IMAGES_AS_HW):
        return 3 * PATCH * PATCH
    return config.in_channels * config.temporal_patch_size * config.patch_size * config.patch_size


def inputs_for(family: str, config, device: str, dtype: torch.dtype):
    width = row_width(family, config)

    def make_inputs(grid):
        if family in IMAGES_AS_HW:  # [h, w] rows, images only
            grid_hw = torch.tensor([row[-2:] for row in grid], dtype=torch.int64)
            rows = int(grid_hw.prod(-1).sum())
            pixels = torch.randn(rows, 3, PATCH, PATCH, generator=torch.Generator().manual_seed(rows))
            return pixels.to(device=device, dtype=dtype), grid_hw.to(device)
        grid_thw = torch.tensor([row if len(row) == 3 else [1, *row] for row in grid], dtype=torch.int64)
        rows = int(grid_thw.prod(-1).sum())
        generator = torch.Generator().manual_seed(rows)
        pixels = torch.randn(rows, width, generator=generator)
        if family == "kimi_k25":
            pixels = pixels.view(rows, 3, PATCH, PATCH)
        if family == "paddleocr_vl":  # one batch of packed patches: rows on dim 1
            pixels = pixels.view(1, rows, 3, PATCH, PATCH)
        return pixels.to(device=device, dtype=dtype), grid_thw.to(device)

    return make_inputs


def pooled(output):
    """The merged features transformers' towers return (pooler_output), their last hidden states where
    they merge outside the tower (PaddleOCR-VL), or the tensor itself."""
    merged = getattr(output, "pooler_output", None)
    return merged if merged is not None else getattr(output, "last_hidden_state", output)


def takes_mixed_frame_counts(model, make_inputs) -> bool:
    """Whether eager accepts an image and a 2-frame chunk in one batch."""
    try:
        with torch.no_grad():
            model(*make_inputs([[1, 2, 2], [2, 2, 2]]))
    except RuntimeError:
        return False
    return True


def time_stream(fn, make_inputs, grids, budget_s: float) -> dict:
    times, start = [], time.perf_counter()
    for grid in grids:
        times.append(bench.timed_call(fn, *make_inputs(grid)))
        if time.perf_counter() - start > budget_s:
            break
    result = bench.summarize(times, 0.0, 0)
    result["truncated"] = len(times) < len(grids)
    return result


def run_family(family: str, args, device: str, dtype: torch.dtype, report: dict, save) -> None:
    """Fills ``report`` step by step and calls ``save()`` after each step, so a run cut short by a time
    limit keeps what it measured."""
    model, config = build(family, args.smoke_test_on_cpu, device, dtype)
    make_inputs = inputs_for(family, config, device, dtype)
    video = 0.2 if family == "kimi_k25" else 0.0
    report.update(family=family, attn_implementation=getattr(config, "attn_implementation", "sdpa") if family in IMAGES_AS_HW else "sdpa")
    if video and not takes_mixed_frame_counts(model, make_inputs):
        video = 0.0  # transformers 5.17's Kimi-K2.5 merger concatenates [h*w/4, t, 4] rows: one t per batch
        report["note"] = "images only: this transformers rejects a batch mixing frame counts"
    if not args.skip_fuzz:
        torch._dynamo.reset()
        kimi_cg.reset()  # after dynamo's reset, which drops kimi_cg's compile callbacks
        max_side = 16 if args.smoke_test_on_cpu else 64
        grids = kimi_cg.testing.grids(dims=2 if family in IMAGES_AS_HW else 3, max_items=4, max_side=max_side, max_patches=4 * max_side * max_side,
                                      max_frames=4 if family == "kimi_k25" else 1, video_fraction=video,
                                      patch_size=PATCH)
        started = time.perf_counter()
        try:
            fuzz = kimi_cg.testing.assert_matches_eager(model, None, make_inputs, grids, outputs=pooled,
                                                        max_examples=args.fuzz_examples,
                                                        poison_graph_pool=device == "cuda")
            worst = fuzz.worst
            report["fuzz"] = {"examples": fuzz.examples, "rule": fuzz.rule, "seconds": time.perf_counter() - started,
                              "distinct_grids": fuzz.distinct_grids,
                              "max_patches": max(kimi_cg.testing.patches(grid) for grid in fuzz.grids),
                              "worst_error": worst.get("error"), "worst_eager_error": worst.get("eager_error"),
                              "counters": dict(kimi_cg.counters)}
        except kimi_cg.testing.MismatchError as failure:
            report["fuzz"] = {"mismatch": str(failure)[:4000], "counters": dict(kimi_cg.counters)}
        fuzzed = report["fuzz"]
        counters = fuzzed["counters"]
        print(f"{family}: fuzz {fuzzed.get('examples', 'FAILED')} examples, worst error {fuzzed.get('worst_error')} "
              f"(eager's {fuzzed.get('worst_eager_error')}), replays {counters.get('graph_replays', 0)}, eager fallbacks "
              f"{counters.get('eager_fallbacks', 0)}, call fallbacks {counters.get('call_fallbacks', 0)}", flush=True)
        save()
    count = 4 if args.smoke_test_on_cpu else args.requests
    warmup = bench.warmup_stream(seed=1, count=10, video_fraction=video)
    stream = bench.request_stream(seed=0, count=count, video_fraction=video)
    if args.smoke_test_on_cpu:  # small sides: the same shapes of streams, CPU-sized
        warmup = [[[row[0], 8, 8] if len(row) == 3 else [8, 8] for row in items][:2] for items in warmup][:3]
        stream = [[[row[0], 4, 6] if len(row) == 3 else [4, 6] for row in items][:2] for items in stream]
    w1 = [[32, 32]] if not args.smoke_test_on_cpu else [[4, 4]]
    for system in [name for name in args.systems.split(",") if name not in ("", "none")]:  # none: fuzz only
        torch._dynamo.reset()
        kimi_cg.reset()  # after dynamo's reset, which drops kimi_cg's compile callbacks
        if system == "eager":
            fn = model
        elif system == "inductor":
            fn = torch.compile(model, dynamic=True)
        elif system == "kimi_cg":
            fn = torch.compile(model, backend="kimi_cg")
        else:
            raise ValueError(f"unknown system {system!r}")
        started = time.perf_counter()
        warmed = 0
        with torch.no_grad():
            for grid in warmup:
                fn(*make_inputs(grid))
                warmed += 1
                budget = args.warmup_budget_s.get(system, args.warmup_budget_s.get(""))
                if budget is not None and time.perf_counter() - started > budget:
                    break
            warm_s = time.perf_counter() - started
            w1_times = [bench.timed_call(fn, *make_inputs(w1)) for _ in range(args.repeats)]
            fresh = time_stream(fn, make_inputs, stream, args.stream_budget_s)
        report[system] = {"warmup_s": warm_s, "W1_ms": statistics.median(w1_times), "W4_fresh": fresh,
                          "counters": dict(kimi_cg.counters) if system == "kimi_cg" else None}
        if warmed < len(warmup):  # --warmup-budget-s: the stream's first requests may still compile
            report[system]["warmup_truncated"] = f"{warmed} of {len(warmup)} warm-up requests"
        print(f"{family} {system}: warm-up {warm_s:.1f} s, W1 {report[system]['W1_ms']:.2f} ms, "
              f"W4 fresh {fresh['mean_ms']:.2f} ms/request", flush=True)
        save()
    if "eager" in report:
        for system in ("inductor", "kimi_cg"):
            if system in report:
                report[system]["W1_speedup"] = report["eager"]["W1_ms"] / report[system]["W1_ms"]
                report[system]["W4_fresh_speedup"] = report["eager"]["W4_fresh"]["mean_ms"] / report[system]["W4_fresh"]["mean_ms"]


def _budgets(text: str) -> dict:
    """--warmup-budget-s: "60" (every system, key "") or "inductor=60,kimi_cg=300"."""
    if "=" not in text:
        return {"": float(text)}
    budgets = {}
    for part in text.split(","):
        system, _, seconds = part.partition("=")
        budgets[system.strip()] = float(seconds)
    return budgets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="moonvit,kimi_k25,qwen2_5_vl,qwen2_vl,glm4v,qwen3_vl")
    parser.add_argument("--systems", default="eager,inductor,kimi_cg", help="comma-separated; none: fuzz only")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--fuzz-examples", type=int, default=20)
    parser.add_argument("--skip-fuzz", action="store_true")
    parser.add_argument("--stream-budget-s", type=float, default=120.0)
    parser.add_argument("--warmup-budget-s", type=_budgets, default={},
                        help="stop a system's warm-up after the request that passes this many seconds (torch.compile "
                             "recompiles for minutes): SECONDS for every system, or SYSTEM=SECONDS,... (e.g. "
                             "inductor=60); the report says how many warm-up requests ran")
    parser.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--smoke-test-on-cpu", action="store_true", help="tiny configs in fp32 on the CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cpu" if args.smoke_test_on_cpu else "cuda"
    bench.DEVICE = device
    dtype = torch.float32 if args.smoke_test_on_cpu else torch.bfloat16
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    import transformers

    results = {"date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
               "transformers": transformers.__version__,
               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "families": {}}
    def save():
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(results, handle, indent=1)

    for family in args.families.split(","):
        report = results["families"][family] = {}
        try:
            run_family(family, args, device, dtype, report, save)
        except Exception as error:  # one family failing must not lose the others' numbers
            report["error"] = f"{type(error).__name__}: {error}"[:3000]
            print(f"{family}: {type(error).__name__}: {error}", flush=True)
        save()
    reference = results["families"].get("moonvit", {}).get("kimi_cg", {}).get("W4_fresh_speedup")
    if reference:  # the target: each family's fresh-stream speed-up within 80% of the reference's
        results["W4_fresh_speedup_vs_moonvit"] = {
            family: r["kimi_cg"]["W4_fresh_speedup"] / reference for family, r in results["families"].items()
            if family != "moonvit" and "W4_fresh_speedup" in r.get("kimi_cg", {})}
        save()
    failed = [f for f, r in results["families"].items() if "error" in r or "mismatch" in r.get("fuzz", {})]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
