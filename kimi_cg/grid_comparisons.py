"""``int()`` of a comparison on grid values, traced as an integer expression instead of a graph break.

NOTE [int of a grid comparison]
Code that turns a comparison on a grid value into a number, e.g. transformers' Kimi-K2.5
``frames = torch.arange(t) + int(t > 1)`` per item of ``grid_thw.tolist()`` (images get frame index 0,
video frames 1..t), makes dynamo run ``sym_int`` on a symbolic bool. With ``t`` unbacked (a value read
from the grid) that asks whether ``t > 1`` holds, which dynamo cannot decide: a graph break, and the
frame around it (Kimi-K2.5's ``get_vision_frame_index``) ran eagerly at every call, between two lifted
pieces.

The number such an ``int()`` stands for is known without deciding the comparison: 1 where it holds,
0 where it does not, i.e. ``torch.sym_ite(cond, 1, 0)``, an integer expression the host program
evaluates per call. ``install()`` puts a wrapper in place of ``sym_int`` where dynamo emits it for
``int()`` (its graphs call the wrapper): while a kimi_cg frame traces, a symbolic bool with unbacked
symbols becomes that expression; everything else (backed bools, which dynamo guards on as before,
other compiles, real values at run time) goes to ``torch.sym_int`` unchanged. A size that later has to
be decided on the expression still fails to trace, as the ``int()`` itself did before: dynamo's own
handling (a graph break, or the settings ladder) takes it from there.
"""

from __future__ import annotations

import importlib

import torch

# dynamo's modules that emit ``sym_int`` for ``int()`` of a symbolic value (torch 2.11 and 2.13)
_EMITTERS = ("torch._dynamo.variables.builtin", "torch._dynamo.variables.tensor")


def sym_int(value):
    """``torch.sym_int``, except on an undecidable symbolic bool while a kimi_cg frame traces."""
    if isinstance(value, torch.SymBool) and _undecidable(value):
        return torch.sym_ite(value, 1, 0)
    return torch.sym_int(value)


def _undecidable(value) -> bool:
    from kimi_cg import dynamo_settings

    if not dynamo_settings.active():
        return False
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(value))


def install() -> None:
    """Put ``sym_int`` above in the modules where dynamo emits ``torch.sym_int`` (idempotent)."""
    for name in _EMITTERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "sym_int", None) is torch.sym_int:
            module.sym_int = sym_int
