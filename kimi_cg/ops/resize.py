"""Bicubic resize of position grids: ``torch.ops.kimi_cg.bicubic_resize`` (two GEMMs, or a kernel on CUDA).

    x:        [N, C, H, W]  float32 / bfloat16 / float16
    returns   [N, C, h, w]  x.dtype, equal to ``F.interpolate(x, size=(h, w), mode="bicubic")``
              (align_corners=False, no antialias) up to float rounding

Why: the towers resize the learned 64x64 position grid to every image's (h, w). ATen's bicubic
kernel parallelises over output pixels and loops over the 1152 channels, 5-10 ms per image on the
H200 (design brief, section 4). Bicubic resizing is separable: out[c] = A_h @ x[c] @ A_w^T, with
A_h [h, H] and A_w [w, W] holding each output position's four cubic-convolution taps (A = -0.75,
half-pixel centres, taps clamped to the border, so a clamped tap adds its weight to the border
column). Both matrices depend only on (H, h) and (W, w): they are built once in float64 on the host
and cached; the products run in float32 on x's device (microseconds) and round once to x.dtype.

On CUDA the op runs the Triton kernel of ``kimi_cg.kernels.resize`` instead: the same taps and
weights computed per output pixel in float32, one launch per call (a host program pays this once
per new image size, on that request's critical path; the matrices cost five or six launches). On
CPU the matrices run, or the kernel with ``KIMI_CG_TRITON_ON_CPU=1`` (through Triton's interpreter
when ``TRITON_INTERPRET=1``: how CI tests it), as for the merge gather.
"""

from __future__ import annotations

import torch

from kimi_cg.kernels import FLOAT_DTYPES
from kimi_cg.ops.merge_gather import use_triton

_CUBIC_A = -0.75


def resize_taps_float64(in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output position's four input taps [out_size, 4] (int64, clamped to the border, so a clamped
    tap may repeat) and their bicubic weights [out_size, 4] (float64)."""
    if in_size <= 0 or out_size <= 0:
        raise ValueError(f"bicubic resize needs positive sizes, got {in_size} -> {out_size}")
    # Source positions in float32, as ATen computes them (its scale is a float: with float64
    # positions the weights differ by up to ~1e-5 after a large upsampling), weights in float64.
    scale = torch.tensor(in_size / out_size, dtype=torch.float32)
    out = torch.arange(out_size, dtype=torch.float32)
    source = (out + 0.5) * scale - 0.5  # half-pixel centres; not clamped for cubic
    base = torch.floor(source)
    t = (source - base).double()
    base = base.double()
    a = _CUBIC_A
    # Cubic convolution weights of the taps at base-1, base, base+1, base+2.
    weights = torch.stack([
        ((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1,
        ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a,
    ], dim=1)
    taps = (base.long().unsqueeze(1) + torch.arange(-1, 3).unsqueeze(0)).clamp(0, in_size - 1)
    return taps, weights


def _resize_matrix_float64(in_size: int, out_size: int) -> torch.Tensor:
    """[out_size, in_size] float64: row o holds the bicubic weights of output position o."""
    taps, weights = resize_taps_float64(in_size, out_size)
    matrix = torch.zeros(out_size, in_size, dtype=torch.float64)
    matrix.scatter_add_(1, taps, weights)
    return matrix


_DEVICE_MATRICES: dict = {}  # (in, out, device) -> float32 matrix; bounded, dropped by kimi_cg.reset()


def clear_matrix_cache() -> None:
    _DEVICE_MATRICES.clear()


def matrix_cache_report() -> dict:
    """Entries and bytes of the resize matrices kept per (sizes, device) (``kimi_cg.memory_report()``)."""
    matrices = list(_DEVICE_MATRICES.values())
    return {"entries": len(matrices), "bytes": sum(m.numel() * m.element_size() for m in matrices)}


def resize_matrix(in_size: int, out_size: int, device: torch.device) -> torch.Tensor:
    """The float32 resize matrix on `device` (cached per sizes and device)."""
    key = (in_size, out_size, str(device))
    matrix = _DEVICE_MATRICES.get(key)
    if matrix is None:
        matrix = _resize_matrix_float64(in_size, out_size).to(device=device, dtype=torch.float32)
        if len(_DEVICE_MATRICES) > 1024:
            _DEVICE_MATRICES.clear()
        _DEVICE_MATRICES[key] = matrix
    return matrix


@torch.library.custom_op("kimi_cg::bicubic_resize", mutates_args=())
def bicubic_resize(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    return bicubic_resize_on_host(x, height, width)


def _kernel_takes(x: torch.Tensor) -> bool:
    """Whether the Triton kernel runs x (CUDA or asked for, in a dtype it reads); the matrices take the
    rest (float64 included), as before the kernel existed."""
    return x.dtype in FLOAT_DTYPES and use_triton(x)


def bicubic_resize_on_host(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The op's computation as a plain function: host programs call this one (NOTE [host calls skip
    the dispatcher] in host_program.py); the op is what traced programs see."""
    if _kernel_takes(x):
        from kimi_cg.kernels.resize import bicubic_resize as bicubic_resize_triton

        return bicubic_resize_triton(x, height, width)
    if x.dim() != 4:
        raise ValueError(f"bicubic_resize expects [N, C, H, W], got shape {tuple(x.shape)}")
    rows = resize_matrix(x.shape[2], height, x.device)
    cols = resize_matrix(x.shape[3], width, x.device)
    # [N, C, H, W] -> [N, C, h, W] -> [N, C, h, w], both products in float32.
    resized = torch.matmul(torch.matmul(rows, x.float()), cols.t())
    return resized.to(x.dtype)


@bicubic_resize.register_fake
def _(x, height, width):
    return x.new_empty((x.shape[0], x.shape[1], height, width))


def bicubic_resize_rows_on_host(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``bicubic_resize_on_host(x, h, w).squeeze(0).permute(1, 2, 0).flatten(0, 1)``: the [h * w, C]
    rows towers make of a resized position grid. On CUDA the kernel writes the rows directly (no
    copy after it); anywhere else, or for N != 1, it is that expression itself (same errors)."""
    if _kernel_takes(x) and x.dim() == 4 and x.shape[0] == 1:
        from kimi_cg.kernels.resize import bicubic_resize_rows

        return bicubic_resize_rows(x, height, width)
    return bicubic_resize_on_host(x, height, width).squeeze(0).permute(1, 2, 0).flatten(0, 1)
