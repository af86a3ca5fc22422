"""How ``F.grid_sample`` traces in kimi_cg frames.

NOTE [grid sampler]
Towers that interpolate a learned position table with ``F.grid_sample`` at per-image sizes (GLM-4V:
bicubic, border padding, ``align_corners=False``) sample at a grid whose length is a grid value, an
unbacked SymInt in a kimi_cg trace. ``aten::grid_sampler`` is a composite op: before it picks its
kernel it asks whether cuDNN could run the call (``cond_cudnn_grid_sampler``), and on a CUDA float32 /
float16 / float64 input that asks whether the grid's element count fits 32-bit indexing, which starts
with ``numel == 0``. Dynamo cannot decide that for an unbacked count, so on a GPU the frame broke
there (GLM-4V at real size on an H100, 2026-12-05: the forward ran as pieces with the interpolation in
dynamo's glue); on a CPU the check stops at the device and nothing breaks.

The composite only returns cuDNN's kernel for bilinear mode, zeros padding and ``align_corners=True``;
every other call ends in ``grid_sampler_2d`` (a 4-D input) or ``grid_sampler_3d`` (5-D) whatever
cuDNN's answer. So while dynamo traces a kimi_cg frame, a call that is not of that one kind is traced
as the kernel the composite would have chosen, without the question: the same op, the same result
bit for bit. The cuDNN kind, every call outside kimi_cg traces, and eager execution go through the
composite as before.

This is a Python kernel of ``aten::grid_sampler`` for its CompositeImplicitAutograd key, used only
under the Python dispatcher (dynamo's and AOT's tracing). It is installed process-wide (once, by
``kimi_cg.dynamo_settings.install()``) and leaves every compile other than kimi_cg's unchanged: there
it runs the composite itself. Counted: ``grid_samplers_traced_direct``.
"""

from __future__ import annotations

import logging

import torch

from kimi_cg.counters import counters

logger = logging.getLogger(__name__)

_BILINEAR, _ZEROS = 0, 0  # GridSamplerInterpolation::Bilinear, GridSamplerPadding::Zeros
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_installed = False


def grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners):
    """``aten::grid_sampler`` as its composite resolves it (NOTE [grid sampler])."""
    from kimi_cg import dynamo_settings

    cudnn_kind = interpolation_mode == _BILINEAR and padding_mode == _ZEROS and align_corners
    if cudnn_kind or not dynamo_settings.active() or input.dim() not in (4, 5):
        # The C++ composite itself (``decompose`` would call this kernel again).
        return torch.ops.aten.grid_sampler.default._op_dk(_COMPOSITE, input, grid, interpolation_mode, padding_mode,
                                                           align_corners)
    counters["grid_samplers_traced_direct"] += 1
    kernel = torch.ops.aten.grid_sampler_2d if input.dim() == 4 else torch.ops.aten.grid_sampler_3d
    return kernel(input, grid, interpolation_mode, padding_mode, align_corners)


def install() -> None:
    """Register ``grid_sampler`` (NOTE [grid sampler]) once; leaves a kernel someone else registered."""
    global _installed
    if _installed:
        return
    _installed = True
    op = torch.ops.aten.grid_sampler.default
    if _COMPOSITE in op.py_kernels:
        logger.info("kimi_cg: aten::grid_sampler already has a Python kernel; F.grid_sample is traced as written")
        return
    op.py_impl(_COMPOSITE)(grid_sampler)
