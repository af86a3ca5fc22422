"""PatchConvPass: a convolution over pre-cut patches becomes one matmul.

NOTE [patch convolution as a matmul]
Vision towers embed patches the host has already cut out: MoonViT and Kimi-K2.5 run a Conv2d with
kernel 14 x 14 over ``x: [L, 3, 14, 14]``; Qwen2-VL, Qwen2.5-VL and GLM-4V a Conv3d with kernel
2 x 14 x 14 over ``[L, 3, 2, 14, 14]``. Each output element is then the dot product of one whole input
patch with one filter, so the convolution is a matmul::

    conv2d(x, w, b, stride, padding=0, dilation=1, groups=1): [L, O, 1, 1]
    == linear(x.flatten(1), w.flatten(1), b).unsqueeze(-1).unsqueeze(-1)

whenever the input's spatial size equals the kernel's (then the output's is 1 for any stride). cuDNN
runs these shapes as a convolution, slowly: on an H100 (bf16, torch 2.11, 2026-12-06,
docs/benchmarks.md) the Conv2d took 0.105 / 0.465 / 0.849 ms at 1,024 / 8,192 / 16,384 patches against
0.021 / 0.087 / 0.140 ms as a matmul, the Conv3d 0.248 / 0.984 / 1.991 ms against 0.018 / 0.040 /
0.078 ms. The sums are the same products in another order (fp32 accumulation either way; in bf16 the
outputs differed by at most one bf16 rounding step).

Rewritten only when everything the equivalence needs is known while tracing: a batched input whose
channel and spatial sizes are literals equal to the weight's, zero padding (or ``"valid"``), dilation
1, one group, floating dtypes, but not float32 on CUDA: there cuDNN runs convolutions in TF32 by
default (``torch.backends.cudnn.allow_tf32``) while matmuls stay float32, so the rewrite would move the
result away from eager's by TF32's rounding (7e-4 absolute on a tiny fp32 MoonViT on an H100,
2026-12-06, against the 1e-5 its test allows). Anything else (a whole image under a strided convolution, padding,
groups, symbolic sizes) keeps its convolution.
"""

from __future__ import annotations

import torch
import torch.fx

from kimi_cg.capture import example_value
from kimi_cg.canonicalize.base import GraphPass, call_arguments, replace_node
from kimi_cg.counters import counters

_CONVOLUTIONS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _ints(value, spatial: int) -> tuple[int, ...] | None:
    """A conv's int-or-sequence argument (stride, padding, dilation) as ints, None if it is not literal ints."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    if len(values) not in (1, spatial) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    return tuple(values)


def _patch_convolution(node: torch.fx.Node) -> dict | None:
    """The call's arguments by name when it is a convolution over whole patches, else None."""
    spatial = _CONVOLUTIONS.get(node.target) if node.op == "call_function" else None
    if spatial is None:
        return None
    values = call_arguments(node, _NAMES, _DEFAULTS)
    if values is None or "input" not in values or "weight" not in values:
        return None
    x, weight, bias = values["input"], values["weight"], values["bias"]
    if not all(isinstance(n, torch.fx.Node) for n in (x, weight) + (() if bias is None else (bias,))):
        return None
    tensors = [example_value(n) for n in (x, weight, bias) if n is not None]
    if not all(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in tensors) or (
            len({v.dtype for v in tensors}) != 1):
        return None
    x_value, w_value = tensors[:2]
    if x_value.dtype == torch.float32 and x_value.device.type == "cuda":
        return None  # cuDNN may run it in TF32 (its default) where a matmul would not: eager's numbers stay
    if x_value.dim() != spatial + 2 or w_value.dim() != spatial + 2:
        return None  # an unbatched input, or a malformed call: eager's own error stays
    patch, kernel = tuple(x_value.shape[1:]), tuple(w_value.shape[1:])
    if not all(isinstance(s, int) for s in (*patch, *kernel, w_value.shape[0])) or patch != kernel:
        return None
    if bias is not None and tuple(tensors[2].shape) != (w_value.shape[0],):
        return None
    padding = values["padding"] if values["padding"] == "valid" else _ints(values["padding"], spatial)
    stride, dilation = _ints(values["stride"], spatial), _ints(values["dilation"], spatial)
    groups = _ints(values["groups"], 1)
    if padding != "valid" and (padding is None or any(padding)):
        return None
    if stride is None or min(stride) < 1 or dilation is None or set(dilation) != {1} or groups != (1,):
        return None
    return values


class PatchConvPass(GraphPass):
    name = "patch_conv"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        rewritten = 0
        for node in list(graph.nodes):
            values = _patch_convolution(node)
            if values is None:
                continue
            with graph.inserting_before(node):
                patches = graph.call_function(torch.flatten, (values["input"], 1))
                filters = graph.call_function(torch.flatten, (values["weight"], 1))
                out = graph.call_function(torch.nn.functional.linear, (patches, filters, values["bias"]))
                for _ in range(_CONVOLUTIONS[node.target]):
                    out = graph.call_method("unsqueeze", (out, -1))
            replace_node(graph, node, out)
            rewritten += 1
        counters["patch_convolutions_as_matmuls"] += rewritten
        return {"rewritten": rewritten}
