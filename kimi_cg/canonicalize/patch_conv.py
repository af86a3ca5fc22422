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
1, one group, floating dtypes. Anything else (a whole image under a strided convolution, padding,
groups, symbolic sizes) keeps its convolution.
"""

from __future__ import annotations

import torch
import torch.fx

from kimi_cg.capture import example_value
from kimi_cg.canonicalize.base import GraphPass
from kimi_cg.counters import counters

_CONVOLUTIONS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _arguments(node: torch.fx.Node) -> dict | None:
    values = dict(_DEFAULTS)
    values.update(zip(_NAMES, node.args))
    values.update(node.kwargs)
    return values if set(values) <= set(_NAMES) and "input" in values and "weight" in values else None


def _all_equal(value, expected: int, spatial: int) -> bool:
    """An int or a sequence of ints, every one ``expected`` (a conv's padding / dilation argument)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value == expected
    return isinstance(value, (tuple, list)) and len(value) in (1, spatial) and all(
        isinstance(v, int) and not isinstance(v, bool) and v == expected for v in value)


def _valid_stride(value, spatial: int) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 1
    return isinstance(value, (tuple, list)) and len(value) in (1, spatial) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)


def _is_patch_convolution(node: torch.fx.Node) -> bool:
    spatial = _CONVOLUTIONS.get(node.target) if node.op == "call_function" else None
    values = _arguments(node) if spatial else None
    if values is None:
        return False
    x, weight, bias = values["input"], values["weight"], values["bias"]
    if not isinstance(x, torch.fx.Node) or not isinstance(weight, torch.fx.Node):
        return False
    if bias is not None and not isinstance(bias, torch.fx.Node):
        return False
    x_value, w_value = example_value(x), example_value(weight)
    b_value = example_value(bias) if bias is not None else None
    tensors = [v for v in (x_value, w_value, b_value) if v is not None]
    if not all(isinstance(v, torch.Tensor) for v in tensors) or (bias is not None and b_value is None):
        return False
    if not all(v.dtype.is_floating_point and v.dtype == x_value.dtype for v in tensors):
        return False
    if x_value.dim() != spatial + 2 or w_value.dim() != spatial + 2:
        return False  # an unbatched input, or a malformed call: eager's own error stays
    patch = tuple(x_value.shape[1:])
    kernel = tuple(w_value.shape[1:])
    if not all(isinstance(s, int) for s in (*patch, *kernel, w_value.shape[0])) or patch != kernel:
        return False
    if b_value is not None and tuple(b_value.shape) != (w_value.shape[0],):
        return False
    padding = values["padding"]
    if not (padding == "valid" or _all_equal(padding, 0, spatial)):
        return False
    return _all_equal(values["dilation"], 1, spatial) and _valid_stride(values["stride"], spatial) and (
        isinstance(values["groups"], int) and not isinstance(values["groups"], bool) and values["groups"] == 1)


class PatchConvPass(GraphPass):
    name = "patch_conv"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        rewritten = 0
        for node in list(graph.nodes):
            if not _is_patch_convolution(node):
                continue
            values = _arguments(node)
            with graph.inserting_before(node):
                patches = graph.call_function(torch.flatten, (values["input"], 1))
                filters = graph.call_function(torch.flatten, (values["weight"], 1))
                out = graph.call_function(torch.nn.functional.linear, (patches, filters, values["bias"]))
                for _ in range(_CONVOLUTIONS[node.target]):
                    out = graph.call_method("unsqueeze", (out, -1))
            out.meta = dict(node.meta)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            rewritten += 1
        counters["patch_convolutions_as_matmuls"] += rewritten
        return {"rewritten": rewritten}
