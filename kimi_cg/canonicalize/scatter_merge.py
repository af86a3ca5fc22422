"""ScatterMergePass: a scatter-add into a zeros buffer sized by grid values becomes a gather.

Kimi-K2.5's temporal merge (transformers) averages the frames of each video chunk like this::

    pooled = hidden.new_zeros(num_merged * 4, D, dtype=torch.float32)      # num_merged: a grid value
    pooled.index_add_(0, destination_index, hidden.float() * frame_weight[:, None])
    return pooled.view(num_merged, 4, -1).to(hidden.dtype)

The buffer's size and the index are grid-dependent, so the device program cannot allocate it with a
shape that only depends on its input sizes. Each destination row is a sum of source rows, which is
what kimi_cg's gather op computes from a host-made plan; so::

    plan_index, plan_weight = scatter_plan(destination_index, num_merged * 4)   # host
    pooled = kimi_cg.merge_gather(hidden.float() * frame_weight[:, None], plan_index, plan_weight)

``scatter_plan`` inverts the index (destination row -> the source rows added into it, in source
order, -1 padded) and checks every index is in range (eager's index_add_ would raise: the call then
runs the captured graph, which raises the same error). The bucket runtime pads the plan like the
merge plans it already knows (NOTE [padding rules] in runtime/graphs.py): padded rows gather nothing.

Views of the result whose sizes name a grid value (``view(num_merged, 4, -1)``) are rewritten to
infer that size instead (``view(-1, 4, 64)``), when the other sizes make it the same by construction.
"""

from __future__ import annotations

import logging
import operator

import sympy
import torch
import torch.fx

from kimi_cg.aliasing import Aliasing
from kimi_cg.capture import example_value
from kimi_cg.canonicalize.base import GraphPass
from kimi_cg.errors import UnsupportedGraphError
from kimi_cg.lift import activation_dependent_nodes

logger = logging.getLogger(__name__)

_MERGE_GATHER = torch.ops.kimi_cg.merge_gather.default


def scatter_plan(index: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host: the gather plan of ``zeros(rows, ...).index_add_(0, index, source)``: plan_index [rows, T]
    (source rows per destination row, in source order, -1 padded) and plan_weight [rows, T] (1 / 0)."""
    index = index.to(device="cpu", dtype=torch.int64)
    if index.dim() != 1:
        raise UnsupportedGraphError(f"index_add_ index of shape {tuple(index.shape)}", "index_add_ index not 1-D")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows):
        raise UnsupportedGraphError(f"index_add_ index out of range for {rows} rows", "index_add_ index out of range")
    counts = torch.bincount(index, minlength=rows)
    terms = max(int(counts.max()) if rows else 0, 1)
    order = torch.argsort(index, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(index.numel()) - starts[index[order]]
    plan_index = torch.full((rows, terms), -1, dtype=torch.int64)
    plan_index[index[order], slot] = order
    return plan_index, (plan_index >= 0).to(torch.float32)


def _zeros_buffer(node: torch.fx.Node) -> bool:
    if node.op == "call_method" and node.target == "new_zeros":
        return True
    return node.op == "call_function" and node.target is torch.zeros


def _has_unbacked(value) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(value)) if isinstance(value, (torch.SymInt, torch.Tensor)) else False


class ScatterMergePass(GraphPass):
    name = "scatter_merge"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        report = {"scatters_rewritten": 0, "views_inferred": 0, "scatters_left": []}
        candidates = [n for n in graph.nodes if _zeros_buffer(n) and _has_unbacked(example_value(n))]
        if not candidates:
            return report
        activation = activation_dependent_nodes(graph)
        order = {node: i for i, node in enumerate(graph.nodes)}
        aliasing = Aliasing(graph)
        for buffer in candidates:
            reason = self._problem(buffer, activation, order, aliasing)
            if reason:
                report["scatters_left"].append(f"{buffer.name}: {reason}")
                continue
            gathered = self._rewrite(graph, buffer, order)
            report["scatters_rewritten"] += 1
            report["views_inferred"] += infer_view_sizes(graph, gathered)
        return report

    @staticmethod
    def _problem(buffer, activation, order, aliasing) -> str | None:
        writes = [u for u in buffer.users if u.op == "call_method" and u.target == "index_add_" and u.args[0] is buffer]
        if len(writes) != 1:
            return "not written by exactly one index_add_"
        write = writes[0]
        dim = write.args[1] if len(write.args) > 1 else write.kwargs.get("dim")
        if dim != 0 or len(write.args) != 4 or set(write.kwargs) - {"alpha"} or write.kwargs.get("alpha", 1) != 1:
            return "index_add_ with a dim other than 0 or an alpha"
        index, source = write.args[2], write.args[3]
        if index in activation or source not in activation:
            return "the index depends on activations, or the source does not"
        shape = buffer.args[1:] if buffer.op == "call_method" else buffer.args
        if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
            shape = tuple(shape[0])
        values = [example_value(buffer), example_value(source)]
        if not all(isinstance(v, torch.Tensor) for v in values) or values[0].dim() != 2 or values[1].dim() != 2:
            return "buffer or source is not 2-D"
        if values[0].dtype != values[1].dtype or isinstance(shape[-1], torch.fx.Node) and _has_unbacked(example_value(shape[-1])):
            return "buffer and source differ in dtype, or the row width is grid-dependent"
        for user in buffer.users:
            if user is not write and order[user] < order[write]:
                return f"{user.name} reads the buffer before the index_add_"
        if write.users:
            return "the index_add_ result is used"
        group = next((group for group in aliasing.groups if buffer in group.members), None)
        if group is not None and list(group.writes) != [write]:
            return "the buffer has other writers"
        if group is not None and any(order[m] < order[write] for m in group.members if m is not buffer):
            return "a view of the buffer is taken before the index_add_"
        return None

    @staticmethod
    def _rewrite(graph: torch.fx.Graph, buffer: torch.fx.Node, order) -> torch.fx.Node:
        write = next(u for u in buffer.users if u.op == "call_method" and u.target == "index_add_")
        index, source = write.args[2], write.args[3]
        rows_arg = buffer.args[1] if buffer.op == "call_method" else buffer.args[0]
        if isinstance(rows_arg, (list, tuple)):
            rows_arg = rows_arg[0]
        value = example_value(buffer)
        with graph.inserting_before(write):
            plan = graph.call_function(scatter_plan, (index, rows_arg))
            plan.meta["stack_trace"] = write.meta.get("stack_trace")
            plan_index = graph.call_function(operator.getitem, (plan, 0))
            plan_weight = graph.call_function(operator.getitem, (plan, 1))
            with value.fake_mode:
                plan_index.meta["example_value"] = torch.empty((value.shape[0], 1), dtype=torch.int64)
                plan_weight.meta["example_value"] = torch.empty((value.shape[0], 1), dtype=torch.float32)
            gathered = graph.call_function(_MERGE_GATHER, (source, plan_index, plan_weight))
            gathered.meta = {**write.meta, "example_value": value}
        buffer.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not write)
        graph.erase_node(write)
        graph.erase_node(buffer)
        return gathered


def infer_view_sizes(graph: torch.fx.Graph, node: torch.fx.Node) -> int:
    """``node.view(n, 4, -1)`` with n a grid value -> ``view(-1, 4, D)`` when the sizes multiply to
    node's element count by construction (same symbolic expression), so the device op takes no grid
    value. Returns how many views it rewrote."""
    shape = example_value(node).shape
    done = 0
    for view in list(node.users):
        if not (view.op == "call_method" and view.target in ("view", "reshape")):
            continue
        sizes = list(view.args[1:]) if not (len(view.args) == 2 and isinstance(view.args[1], (list, tuple))) else list(view.args[1])
        grid_sized = [i for i, s in enumerate(sizes) if isinstance(s, torch.fx.Node) and _has_unbacked(example_value(s))]
        if len(grid_sized) != 1:
            continue
        position = grid_sized[0]
        known = [example_value(s) if isinstance(s, torch.fx.Node) else s for s in sizes]
        inferred = [i for i, s in enumerate(known) if isinstance(s, int) and s == -1]
        if len(inferred) > 1 or any(isinstance(s, torch.fx.Node) and i != position for i, s in enumerate(sizes)):
            continue
        symbolic = [sympy.sympify(s.node.expr if isinstance(s, torch.SymInt) else s) for s in known]
        total = sympy.Mul(*[sympy.sympify(d.node.expr if isinstance(d, torch.SymInt) else d) for d in shape])
        if inferred:  # two unknowns: the -1 must be a constant once the grid value cancels
            others = sympy.Mul(*[v for i, v in enumerate(symbolic) if i != inferred[0]])
            value = sympy.simplify(total / others)
            if not value.is_Integer:
                continue
            sizes[inferred[0]] = int(value)
        elif sympy.simplify(sympy.Mul(*symbolic) - total) != 0:
            continue
        sizes[position] = -1
        view.args = (view.args[0], *sizes)
        done += 1
    return done
