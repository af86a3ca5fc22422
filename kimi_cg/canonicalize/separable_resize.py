"""SeparableResizePass: bicubic ``F.interpolate`` becomes ``kimi_cg.bicubic_resize`` (two GEMMs).

The towers resize the learned position grid per item::

    interpolate: "f32[1, 1152, u0, u1]" = torch.nn.functional.interpolate(grid, size=[u0, u1], mode='bicubic')

becomes::

    interpolate: "f32[1, 1152, u0, u1]" = torch.ops.kimi_cg.bicubic_resize(grid, u0, u1)

Same numbers up to float rounding (fp32 relative error ~1e-7; see kimi_cg/ops/resize.py), about
a hundred times less GPU time per new image size: this value is computed in the host pass (it
depends on grid integers) for every size not in the per-item cache, so in serving, where most
sizes are new, it is on the critical path. Only the exact form is rewritten: mode "bicubic",
``size`` given as two integers, no scale_factor, align_corners False/None, no antialias, a 4-D
input; anything else is left to ATen.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from kimi_cg.canonicalize.base import GraphPass
from kimi_cg.ops import resize  # noqa: F401 - registers torch.ops.kimi_cg.bicubic_resize

_SIGNATURE = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
_DEFAULTS = {"size": None, "scale_factor": None, "mode": "nearest", "align_corners": None,
             "recompute_scale_factor": None, "antialias": False}


def _bound_arguments(node: torch.fx.Node) -> dict | None:
    if len(node.args) > len(_SIGNATURE) or any(key not in _SIGNATURE for key in node.kwargs):
        return None
    bound = dict(_DEFAULTS)
    bound.update(zip(_SIGNATURE, node.args))
    bound.update(node.kwargs)
    return bound


def _rewritable(node: torch.fx.Node) -> dict | None:
    if node.op != "call_function" or node.target is not F.interpolate:
        return None
    bound = _bound_arguments(node)
    if bound is None or "input" not in bound:
        return None
    size = bound["size"]
    if bound["mode"] != "bicubic" or bound["scale_factor"] is not None or bound["align_corners"]:
        return None
    if bound["antialias"] or bound["recompute_scale_factor"]:
        return None
    if not isinstance(size, (list, tuple)) or len(size) != 2:
        return None
    value = bound["input"].meta.get("example_value") if isinstance(bound["input"], torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        return None
    return bound


class SeparableResizePass(GraphPass):
    name = "separable_resize"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        rewritten = 0
        for node in list(gm.graph.nodes):
            bound = _rewritable(node)
            if bound is None:
                continue
            height, width = bound["size"]
            with gm.graph.inserting_before(node):
                resized = gm.graph.call_function(torch.ops.kimi_cg.bicubic_resize.default, (bound["input"], height, width))
            resized.meta = dict(node.meta)
            node.replace_all_uses_with(resized)
            gm.graph.erase_node(node)
            rewritten += 1
        return {"rewritten": rewritten}
