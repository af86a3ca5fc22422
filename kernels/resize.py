"""Bicubic resize in one kernel launch (the CUDA path of ``torch.ops.kimi_cg.bicubic_resize``).

    x:     [N, C, H, W]  float32 / bfloat16 / float16, any strides (a position table stored as
                         [H, W, C] and viewed as [1, C, H, W] is read in place)
    out:   [N, C, h, w]  x.dtype, contiguous, as ATen's bicubic returns it
           (``bicubic_resize_rows``: [h * w, C] for N = 1, the rows a tower makes of it)
    equal to ``F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False)`` up to float32
    rounding, cast to x.dtype once.

Why: a host program resizes the learned position grid once per new image size, on the critical
path of that request. The two-matrix form (kimi_cg/ops/resize.py) costs five or six launches per
size (a float copy of the table, a broadcast matmul with its expand copy, a GEMM, a cast): on the
H200 host ~0.13 ms of CPU time per new size, paid eight times by an eight-image request of new
sizes. Here each program computes the taps and cubic weights of its output pixels itself, reads
the table in x's dtype and writes x.dtype: one launch, no host-made tables, no copies.

The arithmetic follows ATen's upsample_bicubic2d (align_corners=False): scale = H / h rounded to
float32 (passed from the host), source = scale * (i + 0.5) - 0.5, t = source - floor(source), the
cubic convolution weights with A = -0.75, taps floor(source) - 1 .. floor(source) + 2 clamped to
the border, interpolated along W in each of the four rows and then along H, in float32.
"""

from __future__ import annotations

import numpy
import torch
import triton
import triton.language as tl

from kimi_cg.kernels import FLOAT_DTYPES, on_device_of

_BLOCK_PIXELS = 16
_BLOCK_CHANNELS = 128


@triton.jit
def _cubic_weights(t):
    # Cubic convolution (A = -0.75) at distances 1 + t, t, 1 - t, 2 - t from the four taps.
    a = -0.75
    s = t + 1.0
    w0 = ((a * s - 5.0 * a) * s + 8.0 * a) * s - 4.0 * a
    w1 = ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0
    u = 1.0 - t
    w2 = ((a + 2.0) * u - (a + 3.0)) * u * u + 1.0
    v = 2.0 - t
    w3 = ((a * v - 5.0 * a) * v + 8.0 * a) * v - 4.0 * a
    return w0, w1, w2, w3


@triton.jit
def _row(base, y, x0, stride_h, stride_w, in_w, wx0, wx1, wx2, wx3, mask):
    # One source row's four clamped taps along W, weighted: x0 * w0 + x1 * w1 + x2 * w2 + x3 * w3.
    row_ptr = base + y[:, None] * stride_h
    c0 = tl.minimum(tl.maximum(x0, 0), in_w - 1).to(tl.int64)
    c1 = tl.minimum(tl.maximum(x0 + 1, 0), in_w - 1).to(tl.int64)
    c2 = tl.minimum(tl.maximum(x0 + 2, 0), in_w - 1).to(tl.int64)
    c3 = tl.minimum(tl.maximum(x0 + 3, 0), in_w - 1).to(tl.int64)
    v0 = tl.load(row_ptr + c0[:, None] * stride_w, mask=mask, other=0.0).to(tl.float32)
    v1 = tl.load(row_ptr + c1[:, None] * stride_w, mask=mask, other=0.0).to(tl.float32)
    v2 = tl.load(row_ptr + c2[:, None] * stride_w, mask=mask, other=0.0).to(tl.float32)
    v3 = tl.load(row_ptr + c3[:, None] * stride_w, mask=mask, other=0.0).to(tl.float32)
    return v0 * wx0[:, None] + v1 * wx1[:, None] + v2 * wx2[:, None] + v3 * wx3[:, None]


# The sizes change with every image: specialising on them (Triton compiles a variant per value
# class, e.g. divisible by 16) would put a compile on the first request of a new class.
@triton.jit(do_not_specialize=["in_h", "in_w", "out_h", "out_w"])
def _bicubic_resize_kernel(
    x_ptr,
    out_ptr,
    stride_n,
    stride_c,
    stride_h,
    stride_w,
    in_h,
    in_w,
    out_h,
    out_w,
    scale_h,
    scale_w,
    n_channels,
    ROWS: tl.constexpr,
    BLOCK_PIXELS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
):
    # Program (pixel block, channel block, n): a [BLOCK_PIXELS, BLOCK_CHANNELS] tile of the output.
    pixels = tl.program_id(0) * BLOCK_PIXELS + tl.arange(0, BLOCK_PIXELS)
    channels = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    n = tl.program_id(2).to(tl.int64)
    n_pixels = out_h * out_w
    mask = (pixels < n_pixels)[:, None] & (channels < n_channels)[None, :]
    i = pixels // out_w
    j = pixels % out_w

    source_y = scale_h * (i.to(tl.float32) + 0.5) - 0.5
    source_x = scale_w * (j.to(tl.float32) + 0.5) - 0.5
    floor_y = tl.floor(source_y)
    floor_x = tl.floor(source_x)
    wy0, wy1, wy2, wy3 = _cubic_weights(source_y - floor_y)
    wx0, wx1, wx2, wx3 = _cubic_weights(source_x - floor_x)
    y0 = floor_y.to(tl.int32) - 1
    x0 = floor_x.to(tl.int32) - 1

    base = x_ptr + n * stride_n + channels[None, :].to(tl.int64) * stride_c
    r0 = _row(base, tl.minimum(tl.maximum(y0, 0), in_h - 1).to(tl.int64), x0, stride_h, stride_w, in_w,
              wx0, wx1, wx2, wx3, mask)
    r1 = _row(base, tl.minimum(tl.maximum(y0 + 1, 0), in_h - 1).to(tl.int64), x0, stride_h, stride_w, in_w,
              wx0, wx1, wx2, wx3, mask)
    r2 = _row(base, tl.minimum(tl.maximum(y0 + 2, 0), in_h - 1).to(tl.int64), x0, stride_h, stride_w, in_w,
              wx0, wx1, wx2, wx3, mask)
    r3 = _row(base, tl.minimum(tl.maximum(y0 + 3, 0), in_h - 1).to(tl.int64), x0, stride_h, stride_w, in_w,
              wx0, wx1, wx2, wx3, mask)
    value = r0 * wy0[:, None] + r1 * wy1[:, None] + r2 * wy2[:, None] + r3 * wy3[:, None]

    # Pixel p = i * w + j. ROWS: out is [h * w, C] (N = 1), else [N, C, h, w]; both contiguous. The
    # layout is a constexpr, not strides passed in: [N, C, h, w]'s strides change with every size.
    if ROWS:
        out_offsets = pixels[:, None].to(tl.int64) * n_channels + channels[None, :]
    else:
        out_offsets = (n * n_channels + channels[None, :].to(tl.int64)) * n_pixels + pixels[:, None]
    tl.store(out_ptr + out_offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


_SCALES: dict[tuple[int, int], float] = {}


def _float32_scale(in_size: int, out_size: int) -> float:
    # ATen divides in float32; a Python float holding that value reaches the kernel exactly.
    scale = _SCALES.get((in_size, out_size))
    if scale is None:
        if len(_SCALES) > 4096:
            _SCALES.clear()
        scale = _SCALES[(in_size, out_size)] = float(numpy.float32(in_size) / numpy.float32(out_size))
    return scale


def _check(x: torch.Tensor, height: int, width: int) -> None:
    if x.dim() != 4:
        raise ValueError(f"bicubic_resize expects [N, C, H, W], got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"bicubic_resize expects float32, bfloat16 or float16; got {x.dtype}")
    if height <= 0 or width <= 0 or x.shape[2] <= 0 or x.shape[3] <= 0:
        raise ValueError(f"bicubic resize needs positive sizes, got {tuple(x.shape[2:])} -> {(height, width)}")


def _launch(x: torch.Tensor, out: torch.Tensor, height: int, width: int, rows: bool) -> None:
    n, channels, in_h, in_w = x.shape
    if out.numel() == 0:
        return
    grid = (triton.cdiv(height * width, _BLOCK_PIXELS), triton.cdiv(channels, _BLOCK_CHANNELS), n)
    with on_device_of(x):
        _bicubic_resize_kernel[grid](
            x, out, *x.stride(), in_h, in_w, height, width,
            _float32_scale(in_h, height), _float32_scale(in_w, width), channels,
            ROWS=rows, BLOCK_PIXELS=_BLOCK_PIXELS, BLOCK_CHANNELS=_BLOCK_CHANNELS, num_warps=4,
        )


def bicubic_resize(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Triton bicubic resize: [N, C, H, W] -> [N, C, height, width] in x.dtype (contiguous)."""
    _check(x, height, width)
    n, channels = x.shape[:2]
    out = torch.empty((n, channels, height, width), dtype=x.dtype, device=x.device)
    _launch(x, out, height, width, rows=False)
    return out


def bicubic_resize_rows(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[1, C, H, W] -> [height * width, C]: ``bicubic_resize(x).squeeze(0).permute(1, 2, 0).flatten(0, 1)``
    written in place of the copy that flatten makes (row i * width + j holds pixel (i, j))."""
    _check(x, height, width)
    if x.shape[0] != 1:
        raise ValueError(f"bicubic_resize_rows expects one image [1, C, H, W], got shape {tuple(x.shape)}")
    channels = x.shape[1]
    out = torch.empty((height * width, channels), dtype=x.dtype, device=x.device)
    _launch(x, out, height, width, rows=True)
    return out
