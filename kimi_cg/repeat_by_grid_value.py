"""How ``tensor.repeat_interleave(n)`` traces in kimi_cg frames when ``n`` is a grid value.

NOTE [repeat by a grid value]
transformers' Kimi-K2.5 tower builds its per-patch frame index item by item:
``torch.arange(t) + int(t > 1)`` then ``.repeat_interleave(h * w)``, with ``t, h, w`` from
``grid_thw.tolist()``: unbacked SymInts in a kimi_cg trace. ``aten::repeat_interleave.self_int`` is a
composite whose C++ kernel checks ``repeats >= 0`` before it unsqueezes, expands and flattens. Up to
torch 2.12 that check is a plain comparison, so dynamo has to decide ``u1 * u2 >= 0`` for unbacked
``u1, u2``, which it cannot (h and w could have opposite signs as far as it knows): on torch 2.11 (the
GPU hosts') the tower's ``get_vision_frame_index`` frame broke out and ran eagerly between two lifted
pieces at every call. torch 2.13 no longer asks dynamo to decide it.

So while dynamo traces a kimi_cg frame, a call with a symbolic count is traced as the composite's own
steps with the check as ``torch._check`` (a runtime assertion on the count, as torch 2.13 does):
flatten when no dim is given, unsqueeze after the dim, expand that new dim to the count, a contiguous
copy, flatten the two dims. The same ops the composite runs, so the same values bit for bit; a negative
count fails the assertion when the host program runs it, as eager fails. Calls with an int or backed count,
an ``output_size``, a 0-d input with a dim, every call outside kimi_cg traces, and eager execution go to the
composite as before.

A Python kernel of ``aten::repeat_interleave.self_int`` for its CompositeImplicitAutograd key, used only
under the Python dispatcher (dynamo's and AOT's tracing), installed once by
``kimi_cg.dynamo_settings.install()``. Counted: ``repeats_by_grid_value``.
"""

from __future__ import annotations

import logging

import torch

from kimi_cg.counters import counters

logger = logging.getLogger(__name__)

_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_OP = torch.ops.aten.repeat_interleave.self_int
_installed = False


def repeat_interleave(self, repeats, dim=None, *, output_size=None):
    """``aten::repeat_interleave.self_int`` (NOTE [repeat by a grid value])."""
    from kimi_cg import dynamo_settings

    if (output_size is not None or (dim is not None and self.dim() == 0) or not dynamo_settings.active()
            or not _unbacked(repeats)):
        return _OP._op_dk(_COMPOSITE, self, repeats, dim, output_size=output_size)
    counters["repeats_by_grid_value"] += 1
    torch._check(repeats >= 0, lambda: f"repeats must be non-negative, got {repeats}")
    if dim is None:
        input, dim = self.flatten(), 0
    else:
        input, dim = self, dim % self.dim()
    input = input.unsqueeze(dim + 1)
    shape = list(input.shape)
    shape[dim + 1] = repeats
    return input.expand(shape).clone(memory_format=torch.contiguous_format).flatten(dim, dim + 1)


def _unbacked(value) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return isinstance(value, torch.SymInt) and bool(free_unbacked_symbols(value))


def install() -> None:
    """Register ``repeat_interleave`` (NOTE [repeat by a grid value]) once; leaves a kernel someone else
    registered."""
    global _installed
    if _installed:
        return
    _installed = True
    if _COMPOSITE in _OP.py_kernels:
        logger.info("kimi_cg: aten::repeat_interleave.self_int already has a Python kernel; traced as written")
        return
    _OP.py_impl(_COMPOSITE)(repeat_interleave)
