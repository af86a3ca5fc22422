"""LinearGeluPass: a linear layer whose only use is a tanh GELU becomes one op with the GELU in its epilogue.

NOTE [linear + GELU epilogue]
MoonViT's and Kimi-K2.5's MLP is ``fc1(gelu(fc0(x), approximate="tanh"))``. Inductor keeps cuBLAS for
``fc0`` (its own GEMM templates were 1.26-1.61x slower at these shapes on an H100, docs/benchmarks.md
2026-12-06) and runs bias + GELU as a separate kernel that writes the [L, 4304] activation, reads it
back and writes it again: ~0.17 ms of W1's 2.94 ms of kernels (27 layers). cuBLASLt can add the bias
and apply the tanh GELU in the GEMM's epilogue (``torch._addmm_activation(..., use_gelu=True)``, an
extern call Inductor leaves alone), so the activation is written once::

    linear: "bf16[L, 4304]" = torch._C._nn.linear(x, w, b)
    gelu: "bf16[L, 4304]" = torch._C._nn.gelu(linear, approximate="tanh")
  becomes
    gelu: "bf16[L, 4304]" = torch.ops.kimi_cg.linear_gelu_tanh(x, w, b)

On an H100 (bf16, torch 2.11, 2026-12-06, docs/benchmarks.md: scripts/linear_gelu_bench.py) the pair
took 0.031 / 0.124 / 0.455 ms as Inductor compiles it at 1,024 / 4,096 / 16,384 rows against 0.019 /
0.071 / 0.262 ms with the epilogue (the GEMM alone: 0.018 / 0.066 / 0.239); in bench.py's same-process
A/B the MoonViT replay fell 3.10 -> 2.95 ms (W1) and 20.57 -> 19.71 ms (W4's mean request).

The op takes the epilogue only on CUDA in bf16 / fp16 (ops/linear_gelu.py); elsewhere it runs the
composition. In bf16 the fused form rounds once (GELU of the float32 accumulator) where eager rounds
the linear's output before the GELU: closer to a float32 reference, not bitwise eager's. cuBLASLt's
float32 GELU is its own: in the far negative tail, where ``1 + tanh`` cancels, it was 7 fp16 rounding
steps (3e-6) from torch's at GELU(-3.5) = -0.0008 (about one step in bf16); against the tensor's scale
that is below one rounding step (tests/test_linear_gelu.py).

Rewritten only for exactly that pattern: the linear's sole use is the GELU, approximate="tanh" (the
exact GELU has no cuBLASLt epilogue), a bias, a 2-D weight, one floating dtype and one device, and the
linear and the GELU computing in that dtype (not under autocast, which would run the linear in a lower
precision the custom op does not take); the ``linear_gelu_epilogue`` option turns the pass off.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

import kimi_cg.ops  # noqa: F401  (registers torch.ops.kimi_cg.*)
from kimi_cg.capture import example_value
from kimi_cg.canonicalize.base import GraphPass, call_arguments, replace_node
from kimi_cg.counters import counters

_LINEARS = {torch._C._nn.linear, F.linear}
_GELUS = {torch._C._nn.gelu, F.gelu}


def _fusable(gelu: torch.fx.Node) -> tuple | None:
    """(x, weight, bias, linear node) when ``gelu`` is a tanh GELU of a biased linear used only there."""
    if gelu.op != "call_function" or gelu.target not in _GELUS:
        return None
    values = call_arguments(gelu, ("input", "approximate"), {"approximate": "none"})
    if values is None or values["approximate"] != "tanh" or not isinstance(values.get("input"), torch.fx.Node):
        return None
    linear = values["input"]
    if linear.op != "call_function" or linear.target not in _LINEARS or len(linear.users) != 1:
        return None
    values = call_arguments(linear, ("input", "weight", "bias"), {"bias": None})
    if values is None or not all(isinstance(values.get(name), torch.fx.Node) for name in ("input", "weight", "bias")):
        return None
    x, weight, bias = (values[name] for name in ("input", "weight", "bias"))
    tensors = [example_value(n) for n in (x, weight, bias)]
    if not all(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in tensors):
        return None
    x_value, w_value, b_value = tensors
    if len({v.dtype for v in tensors}) != 1 or len({v.device for v in tensors}) != 1:
        return None
    if x_value.dim() < 1 or w_value.dim() != 2 or b_value.dim() != 1:
        return None
    if not all(isinstance(s, int) for s in (*w_value.shape, *b_value.shape)) or b_value.shape[0] != w_value.shape[0]:
        return None
    if not isinstance(x_value.shape[-1], int) or x_value.shape[-1] != w_value.shape[1]:
        return None  # a symbolic width, or a malformed call: eager's own error stays
    outputs = [example_value(n) for n in (linear, gelu)]
    if not all(isinstance(v, torch.Tensor) and v.dtype == x_value.dtype for v in outputs):
        return None  # under autocast the linear runs in another dtype; the op would not
    return x, weight, bias, linear


class LinearGeluPass(GraphPass):
    name = "linear_gelu"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        fused = 0
        for node in list(graph.nodes):
            match = _fusable(node)
            if match is None:
                continue
            x, weight, bias, linear = match
            with graph.inserting_before(node):
                out = graph.call_function(torch.ops.kimi_cg.linear_gelu_tanh.default, (x, weight, bias))
            replace_node(graph, node, out, linear)
            fused += 1
        counters["linear_gelu_epilogues"] += fused
        return {"fused": fused}
