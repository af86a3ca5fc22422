"""The patch embedding as a convolution (cuDNN) and as one matmul, at bucket-sized row counts (GPU).

    python scripts/patch_conv_bench.py --out conv.json

MoonViT / Kimi-K2.5's Conv2d (3 x 14 x 14 patches, 1152 filters, bias) and Qwen2-VL's Conv3d
(3 x 2 x 14 x 14, 1280 filters, no bias) over 1,024-16,384 patches in bf16: the mean of 50 calls each
(CUDA events, after 5 warm-up calls), and the largest difference between the two results.
NOTE [patch convolution as a matmul] in kimi_cg/canonicalize/patch_conv.py is what uses it.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

CASES = (("conv2d", (3, 14, 14), 1152, True), ("conv3d", (3, 2, 14, 14), 1280, False))
ROWS = (1024, 4096, 8192, 16384)


def mean_ms(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("patch_conv_bench.py times CUDA kernels: no GPU here")
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for kind, patch, filters, with_bias in CASES:
        convolution = F.conv2d if kind == "conv2d" else F.conv3d
        for rows in ROWS:
            x = torch.randn(rows, *patch, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(filters, *patch, device="cuda", dtype=torch.bfloat16) * 0.02
            bias = torch.randn(filters, device="cuda", dtype=torch.bfloat16) if with_bias else None

            def conv(x=x, weight=weight, bias=bias):
                return convolution(x, weight, bias, stride=patch[1:])

            def matmul(x=x, weight=weight, bias=bias):
                return F.linear(x.flatten(1), weight.flatten(1), bias)

            difference = (conv().flatten(1).float() - matmul().float()).abs().max().item()
            row = {"kind": kind, "rows": rows, "conv_ms": mean_ms(conv), "matmul_ms": mean_ms(matmul),
                   "max_abs_difference": difference}
            report["rows"].append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
