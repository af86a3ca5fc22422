"""RealRopePass: the complex-number rotary embedding becomes real arithmetic that Inductor can fuse.

MoonViT applies RoPE as a complex product (Inductor has no code generation for complex ops, so it
falls back to one aten kernel per op and splits the fusion around it)::

    xq_complex: "c64[s0, 16, 36]" = torch.view_as_complex(view_2)          # view_2: f32[s0, 16, 36, 2]
    freqs_cis: "c64[s0, 1, 36]" = rope_freqs_cis.unsqueeze(-2)            # rope_freqs_cis: host, c64[s0, 36]
    mul_1 = xq_complex * freqs_cis
    view_as_real: "f32[s0, 16, 36, 2]" = torch.view_as_real(mul_1)

becomes, with the table handed over as real pairs by the host::

    rope_real: "f32[s0, 36, 2]" = torch.view_as_real(rope_freqs_cis)       # host
    f = rope_real.unsqueeze(-3)                                            # f32[s0, 1, 36, 2]
    real = view_2[..., 0] * f[..., 0] - view_2[..., 1] * f[..., 1]
    imag = view_2[..., 0] * f[..., 1] + view_2[..., 1] * f[..., 0]
    view_as_real = torch.stack([real, imag], dim=-1)

The same products in fp32 (complex multiplication is defined by exactly these four products).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from kimi_cg.capture import example_value
from kimi_cg.canonicalize.base import GraphPass


def _real_view_of(graph: torch.fx.Graph, factor: torch.fx.Node, real_bases: dict) -> torch.fx.Node:
    """view_as_real of a complex factor, taken below any unsqueeze chain so that the base tensor
    (a host value) is what becomes real, once per base (every layer shares the table)."""
    chain = []
    base = factor
    while base.op == "call_method" and base.target == "unsqueeze" and len(base.all_input_nodes) == 1:
        chain.append(base.args[1] if len(base.args) > 1 else base.kwargs["dim"])
        base = base.args[0]
    real = real_bases.get(base)
    if real is None:
        with graph.inserting_after(base):
            real = graph.call_function(torch.view_as_real, (base,))
        try:  # metadata for later passes (lift sinks views of host tensors by their example values)
            real.meta["example_value"] = torch.view_as_real(example_value(base))
        except Exception:  # noqa: BLE001 - metadata only
            pass
        real_bases[base] = real
    cursor = real
    for dim in reversed(chain):
        with graph.inserting_after(cursor):
            cursor = graph.call_method("unsqueeze", (cursor, dim - 1 if dim < 0 else dim))
    return cursor


class RealRopePass(GraphPass):
    name = "real_rope"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        rewritten = 0
        real_bases: dict = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.view_as_real:
                continue
            product = node.args[0]
            if product.op != "call_function" or product.target is not operator.mul or len(product.users) != 1:
                continue
            left, right = product.args
            if isinstance(left, torch.fx.Node) and left.target is torch.view_as_complex:
                packed, factor = left, right
            elif isinstance(right, torch.fx.Node) and right.target is torch.view_as_complex:
                packed, factor = right, left
            else:
                continue
            factor_value = example_value(factor) if isinstance(factor, torch.fx.Node) else None
            if not (isinstance(factor_value, torch.Tensor) and factor_value.dtype == torch.complex64):
                continue
            pairs = packed.args[0]
            factor_real = _real_view_of(graph, factor, real_bases)
            with graph.inserting_before(node):
                a0 = graph.call_method("select", (pairs, -1, 0))
                a1 = graph.call_method("select", (pairs, -1, 1))
                f0 = graph.call_method("select", (factor_real, -1, 0))
                f1 = graph.call_method("select", (factor_real, -1, 1))
                real = graph.call_function(operator.sub, (graph.call_function(operator.mul, (a0, f0)), graph.call_function(operator.mul, (a1, f1))))
                imag = graph.call_function(operator.add, (graph.call_function(operator.mul, (a0, f1)), graph.call_function(operator.mul, (a1, f0))))
                stacked = graph.call_function(torch.stack, ([real, imag],), {"dim": -1})
            stacked.meta = dict(node.meta)
            node.replace_all_uses_with(stacked)
            graph.erase_node(node)
            graph.erase_node(product)
            if not packed.users:
                graph.erase_node(packed)
            if isinstance(factor, torch.fx.Node) and not factor.users:
                graph.erase_node(factor)
            rewritten += 1
        return {"rewritten": rewritten}
