"""Attention kernel time on a bucket: what kimi_cg replays against exact segments (issue 14's
reference), per kernel and launch configuration, on the H200.

    python scripts/attention_bench.py --out attention.json           # H200, bf16
    python scripts/attention_bench.py --smoke-test-on-cpu            # tiny, Triton's interpreter

Cases (bf16, fixed seeds; each a packed call of L rows in a bucket of C rows):
  images   W4-like requests: 1-8 images of h x w patches (h, w even in [8, 64]), one segment each;
           MoonViT's heads (16 x 72)
  windows  the same images cut into Qwen2.5-VL windows (8 x 8 patches, partial at the edges);
           Qwen2.5-VL-7B's heads (16 x 80)
  single   one image of 1024 (W1), 4096 and 16384 (W3) patches, exactly a bucket; 16 x 72
Systems, per case:
  flash_bucket   torch's varlen flash kernel on the bucket's segment table as a replay holds it (the
                 real segments, the padding rows in 64-row segments while the table has room, empty
                 segments after; NOTE [segment tables]), max_seqlen = C
  flash_exact    the same kernel on the real segments only, max_seqlen = the longest (no padding)
  flash_bucket_class   flash on the bucket's table with max_seqlen = the smallest segment-length class
                 bound (C / 2, C / 4) that holds its longest segment, padding included, as kimi_cg's
                 default replays it (NOTE [segment-length classes]); C when none does
  cudnn_dense    (single only) SDPA's cuDNN backend on [1, H, L, D]
  cudnn_exact, cudnn_bucket   (--with-cudnn-ragged; timed call by call, it cannot be captured)
                 cuDNN's attention on packed segments (cumulative lengths) on the exact segments / on
                 the bucket's table with max_seqlen = C
  work_list_<m>x<n>_w<warps>_s<stages>
                 the work-list kernel on the same table, planned on the device as a replay plans it
Times: each call captured in a CUDA graph, 20 replays back to back between CUDA events, the median of 5
such samples per call (kernel time; launching from Python costs more than the kernels of small cases).
Each case also checks the work-list and cuDNN outputs against flash_exact on the real rows (max abs
difference).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

import torch

SMOKE = "--smoke-test-on-cpu" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported

from kimi_cg.config import KimiCGConfig  # noqa: E402
from kimi_cg.kernels.varlen_attention import plan_work_list_on_device, work_list_attention, work_list_capacity  # noqa: E402
from kimi_cg.runtime.graphs import class_bounds  # noqa: E402

BUCKETS = KimiCGConfig().buckets()  # kimi_cg's default ladder (4 per doubling, 1024 .. 16384)
TABLE_SEGMENTS = 33  # a bucket's item table: max_items (32) + 1
PADDING_SEGMENT_ROWS = 64
# (block_m, block_n, num_warps, num_stages)
CONFIGS = ((64, 64, 4, 2), (128, 32, 4, 3), (128, 64, 8, 2))
SINGLE = ((32, 32), (64, 64), (128, 128))
SKIP_FLASH = False
WITH_CUDNN_RAGGED = False  # --with-cudnn-ragged: ~80 ms a call on torch 2.11 (docs/benchmarks.md)
KERNEL_OPTIONS: dict = {}  # --kernel-options: work_list_attention's keyword arguments (head-dim split)


def image_requests(seed: int, count: int):
    rng = random.Random(seed)
    return [[(2 * rng.randint(4, 32), 2 * rng.randint(4, 32)) for _ in range(rng.randint(1, 8))] for _ in range(count)]


def window_lengths(h: int, w: int, window: int = 8) -> list[int]:
    return [min(window, h - r) * min(window, w - c) for r in range(0, h, window) for c in range(0, w, window)]


def segments_of(request, case: str) -> list[int]:
    if case == "images":
        return [h * w for h, w in request]
    return [length for h, w in request for length in window_lengths(h, w)]


def timed(fn, repeats: int = 20, warmup: int = 5, capture: bool = True) -> float:
    """Median GPU time of one call in ms. The call is captured in a CUDA graph and ``repeats`` replays
    run back to back between two events (kernel time, not Python's launch cost, which exceeds the
    kernels of small cases); with ``capture=False``, or when the capture fails, it is timed eagerly,
    one call per event pair."""
    if not torch.cuda.is_available():
        return float("nan")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = None
    if capture:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError:
            graph = None
            torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats if graph is not None else 1):
            graph.replay() if graph is not None else fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / (repeats if graph is not None else 1))
    return statistics.median(samples)


def flash(q, k, v, bounds, max_seqlen):
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    return lambda: varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen)


def cudnn_dense(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)
    return call


def cudnn_ragged(q, k, v, bounds, max_seqlen):
    """cuDNN's attention over packed segments (torch's ``_cudnn_attention_forward`` with cumulative
    lengths, as nested-tensor SDPA calls it)."""
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    return lambda: torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_seqlen, max_seqlen, False)[0]


def bucket_table(bounds: list[int], capacity: int, segments: int = TABLE_SEGMENTS) -> list[int]:
    """The boundary table a replay holds (NOTE [segment tables] in kimi_cg/runtime/graphs.py)."""
    table = list(bounds)
    while len(table) < segments and table[-1] < capacity:
        table.append(min(table[-1] + PADDING_SEGMENT_ROWS, capacity))
    table[-1] = capacity
    return table + [capacity] * (segments + 1 - len(table))


def run_case(case: str, lengths: list[int], items: int, heads: int, head_dim: int, device: str, dtype,
             smoke: bool) -> dict | None:
    rows = sum(lengths)
    capacity = next((c for c in BUCKETS if c >= rows), None)
    if capacity is None:
        return None
    generator = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(capacity, heads, head_dim, generator=generator).to(device=device, dtype=dtype) for _ in range(3))
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    # Windows need the dense table (a segment per 16 rows on top of the item table).
    table = bucket_table(bounds, capacity, TABLE_SEGMENTS + (capacity // 16 if case == "windows" else 0))
    result = {"case": case, "items": items, "segments": len(lengths), "rows": rows, "bucket": capacity,
              "table_segments": len(table) - 1}
    if smoke or SKIP_FLASH:  # no flash kernel on the CPU: the per-segment reference instead
        from kimi_cg.ops.varlen_attention import varlen_attention_reference

        exact = varlen_attention_reference(*(t[:rows].float() for t in (q, k, v)), torch.tensor(bounds).to(q.device))
    else:
        longest = max(lengths)
        exact_q, exact_k, exact_v = q[:rows], k[:rows], v[:rows]
        result["flash_exact_ms"] = timed(flash(exact_q, exact_k, exact_v, bounds, longest))
        result["flash_bucket_ms"] = timed(flash(q, k, v, table, capacity))
        table_longest = max(b - a for a, b in zip(table, table[1:]))
        bound = next((b for b in reversed(class_bounds(capacity, KimiCGConfig().attention_length_classes))
                      if b >= table_longest), capacity)
        result["class_bound"] = bound
        result["flash_bucket_class_ms"] = timed(flash(q, k, v, table, bound))
        class_out = flash(q, k, v, table, bound)()[:rows]
        exact = flash(exact_q, exact_k, exact_v, bounds, longest)()
        result["flash_bucket_class_max_abs_diff"] = (class_out.float() - exact.float()).abs().max().item()
        if WITH_CUDNN_RAGGED:  # timed call by call: its capture fails (docs/benchmarks.md, 2026-12-04)
            for name, call in (("cudnn_exact", cudnn_ragged(exact_q, exact_k, exact_v, bounds, longest)),
                               ("cudnn_bucket", cudnn_ragged(q, k, v, table, capacity))):
                try:
                    result[f"{name}_max_abs_diff"] = (call()[:rows].float() - exact.float()).abs().max().item()
                    result[f"{name}_ms"] = timed(call, capture=False)
                except RuntimeError as error:  # no ragged cuDNN attention in this build or for this shape
                    result[f"{name}_error"] = str(error)[:300]
        if case == "single":
            try:
                result["cudnn_dense_ms"] = timed(cudnn_dense(exact_q, exact_k, exact_v))
            except RuntimeError as error:  # no cuDNN attention for this shape or build
                result["cudnn_dense_error"] = str(error)[:200]
    cu_table = torch.tensor(table, dtype=torch.int32, device=device)
    for block_m, block_n, warps, stages in CONFIGS[:1] if smoke else CONFIGS:
        work = plan_work_list_on_device(cu_table, work_list_capacity(capacity, len(table) - 1, block_m), block_m)
        call = lambda: work_list_attention(q, k, v, work, block_m=block_m, block_n=block_n,  # noqa: E731
                                           num_warps=warps, num_stages=stages, **KERNEL_OPTIONS)
        name = f"work_list_{block_m}x{block_n}_w{warps}_s{stages}"
        result[f"{name}_ms"] = timed(call, repeats=1 if smoke else 20, warmup=0 if smoke else 5)
        result[f"{name}_max_abs_diff"] = (call()[:rows].float() - exact.float()).abs().max().item()
    return result


def summarise(cases: list[dict]) -> dict:
    """Per case kind: each system's summed time and its ratio to flash on exact segments."""
    summary = {}
    for kind in sorted({case["case"] for case in cases}):
        chosen = [case for case in cases if case["case"] == kind]
        systems = sorted({key[:-3] for case in chosen for key in case if key.endswith("_ms")})
        totals = {name: sum(case.get(f"{name}_ms", float("nan")) for case in chosen) for name in systems}
        exact = totals.get("flash_exact")
        summary[kind] = {name: {"ms": round(total, 3), "vs_flash_exact": round(total / exact, 3) if exact else None}
                         for name, total in totals.items()}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--smoke-test-on-cpu", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--kernel-options", default="{}",
                        help='JSON keyword arguments for the work-list kernel, e.g. {"split_scores": false}')
    parser.add_argument("--cases", default="images,windows,single")
    parser.add_argument("--skip-flash", action="store_true", help="time the work-list kernel only")
    parser.add_argument("--with-cudnn-ragged", action="store_true", help="also time cudnn_exact and cudnn_bucket")
    args = parser.parse_args()
    KERNEL_OPTIONS.update(json.loads(args.kernel_options))
    global SKIP_FLASH, WITH_CUDNN_RAGGED
    SKIP_FLASH, WITH_CUDNN_RAGGED = args.skip_flash, args.with_cudnn_ragged
    device = "cpu" if args.smoke_test_on_cpu else "cuda"
    dtype = torch.float32 if args.smoke_test_on_cpu else torch.bfloat16
    requests = [[(8, 12), (4, 6)]] if args.smoke_test_on_cpu else image_requests(seed=0, count=args.requests)
    shapes = ({"images": (16, 72), "windows": (16, 80), "single": (16, 72)} if not args.smoke_test_on_cpu
              else {"images": (1, 16), "windows": (1, 16), "single": (1, 24)})
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "cases": []}
    calls = [(case, segments_of(request, case), len(request)) for case in ("images", "windows")
             for request in requests]
    calls += [("single", [h * w], 1) for h, w in ([(8, 8)] if args.smoke_test_on_cpu else SINGLE)]
    wanted = set(args.cases.split(","))
    for case, lengths, items in [call for call in calls if call[0] in wanted]:
        heads, head_dim = shapes[case]
        result = run_case(case, lengths, items, heads, head_dim, device, dtype, args.smoke_test_on_cpu)
        if result is not None:
            report["cases"].append(result)
            print(json.dumps(result), flush=True)
    report["summary"] = summarise(report["cases"])
    print(json.dumps(report["summary"], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
