"""MergeGatherPass: per-item data movement on activations becomes one gather with a host-made index.

The patch merger slices the packed activations per image and regroups each 2x2 window::

    seq: "f32[u14, 64]" = x_4[0:mul_3]
    view_4: "f32[(u10//2), 2, (u11//2), 2, 64]" = seq.view(floordiv_8, 2, floordiv_9, 2, 64)
    windows = view_4.permute(0, 2, 1, 3, 4)
    contiguous = windows.contiguous()                   # one copy kernel per image, per call
    ... (the same for the next image)
    return (contiguous, contiguous_1)

Every output row is a row of ``x_4`` (or, for video chunks, the mean of t rows). The pass replays
that chain on the host on a stand-in (``RowCombination``: for each output row, which anchor rows
and with which weights), then the device only runs one fused gather::

    rows = row_source(s0, 64)                           # host
    seq' = row_getitem(rows, slice(0, mul_3)) ...       # host, same ops on the stand-in
    plan = pack_rows([contiguous', contiguous_1'])      # host: index [R, K], weight [R, K]
    gathered: "f32[R, 64]" = kimi_cg.merge_gather(x_4, plan_index(plan), plan_weight(plan))
    return (take_rows(gathered, plan, 0), take_rows(gathered, plan, 1))   # views, after the device

The device program's shapes then depend on L and R only. A region exit consumed by further
device work (the projector after ``torch.cat``) must have the form [R', c1, ..., D] with constants
c_i; it becomes ``gathered.view(-1, c1, ..., D)``.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import kimi_cg.ops  # noqa: F401  (registers torch.ops.kimi_cg.*)
from kimi_cg.aliasing import Aliasing
from kimi_cg.capture import example_value
from kimi_cg.canonicalize.base import GraphPass, replay_before, stable_topological_sort
from kimi_cg.errors import UnsupportedGraphError
from kimi_cg.lift import activation_dependent_nodes, output_view_nodes, source_location
from kimi_cg.runtime.gather_plan import (
    row_source,
    row_getitem,
    row_view,
    row_reshape,
    row_permute,
    row_transpose,
    row_identity,
    row_flatten,
    row_unsqueeze,
    row_squeeze,
    row_mean,
    row_cat,
    row_size,
    row_numel,
    row_storage_offset,
    pack_rows,
    plan_index,
    plan_weight,
    take_rows,
)

logger = logging.getLogger(__name__)


_ROW_METHODS = {
    "view": row_view,
    "reshape": row_reshape,
    "permute": row_permute,
    "transpose": row_transpose,
    "contiguous": row_identity,
    "clone": row_identity,
    "flatten": row_flatten,
    "unsqueeze": row_unsqueeze,
    "squeeze": row_squeeze,
    "mean": row_mean,
}
_ROW_FUNCTIONS = {
    operator.getitem: row_getitem,
    torch.cat: row_cat,
    torch.concat: row_cat,
    torch.mean: row_mean,
    torch.permute: row_permute,
    torch.reshape: row_reshape,
    torch.flatten: row_flatten,
    torch.transpose: row_transpose,
}
_ROW_SYMBOLS = {
    torch.ops.aten.sym_size.int: row_size,
    torch.ops.aten.sym_numel.default: row_numel,
    torch.ops.aten.sym_storage_offset.default: row_storage_offset,
}


def _row_function(node: torch.fx.Node):
    if node.op == "call_method":
        return _ROW_METHODS.get(node.target)
    if node.op == "call_function":
        if node.target is operator.getitem and not isinstance(example_value(node.args[0]), torch.Tensor):
            return None  # indexing a tuple (unbind, split), not a tensor
        return _ROW_FUNCTIONS.get(node.target)
    return None


def _has_unbacked_shape(node: torch.fx.Node) -> bool:
    value = example_value(node)
    return isinstance(value, torch.Tensor) and bool(free_unbacked_symbols(value.shape))


class MergeGatherPass(GraphPass):
    name = "merge_gather"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        activation = activation_dependent_nodes(graph)
        post = output_view_nodes(graph, activation)
        # A view of storage written in place reads whatever the write left, when it is read; a
        # gather would copy it at another time (NOTE [mutation and lifting]): left as it is.
        mutated = Aliasing(graph).mutated
        region: list[torch.fx.Node] = []
        in_region: set[torch.fx.Node] = set()
        for node in graph.nodes:
            if node not in activation or node in post or node in mutated or _row_function(node) is None:
                continue
            # A root slices a tensor of known (backed) shape into grid-dependent pieces; the region
            # then grows through movement ops on region values only.
            tensor_args = [arg for arg in node.all_input_nodes if isinstance(example_value(arg), torch.Tensor)]
            is_root = _has_unbacked_shape(node) and not any(_has_unbacked_shape(arg) for arg in tensor_args)
            if is_root or any(arg in in_region for arg in node.all_input_nodes):
                region.append(node)
                in_region.add(node)
        if not region:
            return {"regions": 0}
        anchors = {arg for node in region for arg in node.all_input_nodes if arg in activation and arg not in in_region}
        if len(anchors) != 1:
            raise UnsupportedGraphError(
                "per-item data movement reads from several activations "
                f"({sorted(a.name for a in anchors)}); kimi_cg gathers from one packed tensor",
                "per-item data movement from several activations",
            )
        (anchor,) = anchors
        self._rewrite(graph, anchor, region, in_region, post)
        return {"regions": 1, "anchor": anchor.name, "nodes_lifted": len(region)}

    def _rewrite(self, graph, anchor, region, in_region, post) -> None:
        anchor_value = example_value(anchor)
        dim = anchor_value.shape[-1]
        if not isinstance(dim, int):
            raise UnsupportedGraphError(f"the feature dimension of {anchor.name} must be static; got {dim}", "dynamic feature dimension")
        with graph.inserting_after(anchor):
            sizes = []
            for d in range(anchor_value.dim() - 1):
                size = graph.call_function(torch.ops.aten.sym_size.int, (anchor, d))
                size.meta["example_value"] = anchor_value.shape[d]
                sizes.append(size)
        with graph.inserting_after(sizes[-1]):
            source = graph.call_function(row_source, (tuple(sizes), dim))
        host: dict[torch.fx.Node, torch.fx.Node] = {anchor: source}
        to_host = replay_before(graph, region, host, _row_function)
        for node in list(graph.nodes):  # sizes of per-item activations are host values now
            if node.op == "call_function" and node.target in _ROW_SYMBOLS and node.args[0] in in_region:
                with graph.inserting_before(node):
                    replacement = graph.call_function(_ROW_SYMBOLS[node.target], tuple(map(to_host, node.args)))
                node.replace_all_uses_with(replacement)
                graph.erase_node(node)

        exits = [node for node in region if any(user not in in_region for user in node.users)]
        order = {node: i for i, node in enumerate(graph.nodes)}
        last = max(region, key=order.__getitem__)
        with graph.inserting_after(last):
            plan = graph.call_function(pack_rows, ([host[e] for e in exits],))
        with graph.inserting_after(plan):
            index = graph.call_function(plan_index, (plan,))
        with graph.inserting_after(index):
            weight = graph.call_function(plan_weight, (plan,))
        with graph.inserting_after(weight):
            flat_anchor = graph.call_method("reshape", (anchor, -1, dim)) if anchor_value.dim() != 2 else anchor
        with graph.inserting_after(flat_anchor):
            gathered = graph.call_function(torch.ops.kimi_cg.merge_gather.default, (flat_anchor, index, weight))

        device_exits = [e for e in exits if any(u not in in_region and u not in post and u.op != "output" for u in e.users)]
        if len(device_exits) > 1:
            raise UnsupportedGraphError(
                f"several per-item activations ({[e.name for e in device_exits]}) feed further device work; "
                f"kimi_cg supports one (e.g. torch.cat of the merger outputs); at {source_location(device_exits[0])}",
                "several per-item results feed device work",
            )
        cursor = gathered
        for exit_number, node in enumerate(exits):
            if node in device_exits:
                shape = example_value(node).shape
                if any(not isinstance(s, int) for s in shape[1:]):
                    raise UnsupportedGraphError(
                        f"{node.name} {tuple(shape)} feeds device work but has grid-dependent inner dims; "
                        f"at {source_location(node)}",
                        "grid-dependent inner dims feed device work",
                    )
                with graph.inserting_after(cursor):
                    cursor = graph.call_method("view", (gathered, -1, *shape[1:]))
                replacement = cursor
            else:
                with graph.inserting_after(cursor):
                    cursor = graph.call_function(take_rows, (gathered, plan, exit_number))
                replacement = cursor
            for user in list(node.users):
                if user not in in_region:
                    user.replace_input_with(node, replacement)
        for node in reversed(region):
            graph.erase_node(node)
        stable_topological_sort(graph)
