"""FuseGatherLayerNormPass: the merger gather followed by the projector's pre-LayerNorm, as one kernel.

Kimi-VL's projector normalises every merged patch before concatenating the window::

    gathered: "bf16[R, 1152]" = kimi_cg.merge_gather(x, index, weight)
    view: "bf16[R//4, 4, 1152]" = gathered.view(-1, 4, 1152)
    pre_norm: "bf16[R//4, 4, 1152]" = layer_norm(view, (1152,), w, b, 1e-05)

LayerNorm over the last dim is row-wise, so it commutes with the view::

    fused: "bf16[R, 1152]" = kimi_cg.merge_gather_layernorm(x, index, weight, w, b, 1e-05)
    pre_norm = fused.view(-1, 4, 1152)

One pass over the gathered rows instead of a write and a re-read. The fused kernel normalises the
fp32 gather result before its single cast (for a pure gather that is exactly eager's input; for a
temporal mean it skips one bf16 rounding). Applied only when the gather's sole use is that view and
the view's sole use is that LayerNorm with affine weights.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

import kimi_cg.ops  # noqa: F401  (registers torch.ops.kimi_cg.*)
from kimi_cg.canonicalize.base import GraphPass, replace_node

_LAYER_NORMS = {F.layer_norm, torch.layer_norm, torch.ops.aten.layer_norm.default}


def _layer_norm_args(node: torch.fx.Node):
    """(normalized_shape, weight, bias, eps) of a layer_norm call, or None."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    values = dict(zip(names, node.args))
    values.update(node.kwargs)
    if values.get("weight") is None or values.get("bias") is None:
        return None
    eps = values.get("eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None  # e.g. a graph input: torch.compile(dynamic=True) traces a module's float attributes
    return tuple(values["normalized_shape"]), values["weight"], values["bias"], float(eps)


class FuseGatherLayerNormPass(GraphPass):
    name = "fuse_gather_layernorm"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        fused = 0
        for gather in list(graph.nodes):
            if gather.op != "call_function" or gather.target is not torch.ops.kimi_cg.merge_gather.default:
                continue
            if len(gather.users) != 1:
                continue
            (view,) = gather.users
            if view.op != "call_method" or view.target != "view" or len(view.users) != 1:
                continue
            (norm,) = view.users
            if norm.op != "call_function" or norm.target not in _LAYER_NORMS or norm.args[0] is not view:
                continue
            parsed = _layer_norm_args(norm)
            if parsed is None or len(parsed[0]) != 1 or view.args[-1] != parsed[0][0]:
                continue
            _, ln_weight, ln_bias, eps = parsed
            with graph.inserting_before(norm):
                fused_node = graph.call_function(
                    torch.ops.kimi_cg.merge_gather_layernorm.default, (*gather.args, ln_weight, ln_bias, eps)
                )
                new_view = graph.call_method("view", (fused_node, *view.args[1:]))
            replace_node(graph, norm, new_view, view, gather)
            fused += 1
        return {"fused": fused}
