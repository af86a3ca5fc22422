"""Attention kernel time on a bucket: what kimi_cg replays today against the work-list kernel
(kernels/varlen_attention.py) and against exact segments (issue 14's reference), on the H200.

    python scripts/attention_bench.py --out attention.json           # H200, bf16
    python scripts/attention_bench.py --smoke-test-on-cpu            # tiny, Triton's interpreter

Cases (bf16, fixed seeds; each a packed call of L rows in a bucket of C rows):
  images   W4-like requests: 1-8 images of h x w patches (h, w even in [8, 64]), one segment each;
           MoonViT's heads (16 x 72)
  windows  the same images cut into Qwen2.5-VL windows (8 x 8 patches, partial at the edges);
           Qwen2.5-VL-7B's heads (16 x 80)
Systems, per case:
  flash_bucket   torch's varlen flash kernel on the bucket: the real segments, one trailing segment
                 [L, C), max_seqlen = C (what a replayed graph runs today)
  flash_exact    the same kernel on the real segments only, max_seqlen = the longest (no padding)
  work_list      the work-list kernel on the bucket (padding rows in linear blocks), per block size
Times: CUDA events around 20 calls after 5 warm-up calls, median per call; each case also checks the
work-list output against flash_exact on the real rows (max abs difference).
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

from kimi_cg.kernels.varlen_attention import plan_work_list, work_list_attention, work_list_capacity  # noqa: E402

BUCKETS = (1024, 2048, 4096, 8192, 16384)
BLOCKS = ((64, 64), (128, 64), (128, 128))


def image_requests(seed: int, count: int):
    rng = random.Random(seed)
    return [[(2 * rng.randint(4, 32), 2 * rng.randint(4, 32)) for _ in range(rng.randint(1, 8))] for _ in range(count)]


def window_lengths(h: int, w: int, window: int = 8) -> list[int]:
    return [min(window, h - r) * min(window, w - c) for r in range(0, h, window) for c in range(0, w, window)]


def segments_of(request, case: str) -> list[int]:
    if case == "images":
        return [h * w for h, w in request]
    return [length for h, w in request for length in window_lengths(h, w)]


def timed(fn, repeats: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        return float("nan")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def flash(q, k, v, bounds, max_seqlen):
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    return lambda: varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen)


def run_case(case: str, request, heads: int, head_dim: int, device: str, dtype, smoke: bool) -> dict | None:
    lengths = segments_of(request, case)
    rows = sum(lengths)
    capacity = next((c for c in BUCKETS if c >= rows), None)
    if capacity is None:
        return None
    generator = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(capacity, heads, head_dim, generator=generator).to(device=device, dtype=dtype) for _ in range(3))
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    result = {"case": case, "items": len(request), "segments": len(lengths), "rows": rows, "bucket": capacity}
    exact = None
    if not smoke:
        longest = max(lengths)
        exact_q, exact_k, exact_v = q[:rows], k[:rows], v[:rows]
        result["flash_exact_ms"] = timed(flash(exact_q, exact_k, exact_v, bounds, longest))
        bucket_bounds = bounds + [capacity] if rows < capacity else bounds  # one trailing segment [L, C)
        result["flash_bucket_ms"] = timed(flash(q, k, v, bucket_bounds, capacity))
        exact = flash(exact_q, exact_k, exact_v, bounds, longest)()
    padded = bounds[:-1] + [capacity]  # the last segment reaches over the padding rows
    for block_m, block_n in BLOCKS[:1] if smoke else BLOCKS:
        work = plan_work_list(padded, block_m=block_m, padding_from=rows,
                              entries=work_list_capacity(capacity, len(lengths) + 1, block_m)).to(device)
        call = lambda: work_list_attention(q, k, v, work, block_m=block_m, block_n=block_n)  # noqa: E731
        name = f"work_list_{block_m}x{block_n}"
        result[f"{name}_ms"] = timed(call, repeats=1 if smoke else 20, warmup=0 if smoke else 5)
        if exact is not None:
            result[f"{name}_max_abs_diff"] = (call()[:rows].float() - exact.float()).abs().max().item()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--smoke-test-on-cpu", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = "cpu" if args.smoke_test_on_cpu else "cuda"
    dtype = torch.float32 if args.smoke_test_on_cpu else torch.bfloat16
    requests = [[(8, 12), (4, 6)]] if args.smoke_test_on_cpu else image_requests(seed=0, count=args.requests)
    shapes = {"images": (16, 72), "windows": (16, 80)} if not args.smoke_test_on_cpu else {"images": (1, 16), "windows": (1, 16)}
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "cases": []}
    for case, (heads, head_dim) in shapes.items():
        for request in requests:
            result = run_case(case, request, heads, head_dim, device, dtype, args.smoke_test_on_cpu)
            if result is not None:
                report["cases"].append(result)
                print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
