"""GatherReducePass: rows gathered by a host-made index and reduced over one index axis become a gather.

Kimi-K2.5's temporal merge as transformers 5.17 writes it::

    merge_index = ...                                  # host: [merged, t, 4], one source row per slot
    pooled = hidden[merge_index].mean(dim=1)           # [merged, t, 4, D] -> [merged, 4, D]

The gathered tensor has a grid-dependent trailing size (``t``) and the index is grid-made, so no
bucket could hold it. Each output row is a weighted sum of source rows, which is what kimi_cg's
gather op computes from a host-made plan::

    plan_index, plan_weight = reduce_plan(merge_index, 1, rows, mean=True)      # host
    pooled = kimi_cg.merge_gather(hidden, plan_index, plan_weight).view(-1, 4, D)

``reduce_plan`` moves the reduced axis last (plan rows in the output's row-major order, one term per
index along the reduced axis, weight 1/K for a mean, 1 for a sum) and checks the index as eager's
indexing would: negative entries count from the end; an entry outside [-rows, rows) raises (the
call then runs the captured graph, which raises eager's error). The bucket runtime pads the plan
like every merge plan (NOTE [padding rules] in runtime/graphs.py).

Matched: ``x[index]`` with x [L, D] computed from activations, index an integer tensor of >= 2 dims
that does not depend on activations, whose only use is one ``mean`` / ``sum`` over a single index axis
other than the first (no keepdim, no dtype); every output size after the first is a constant.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from kimi_cg.capture import example_value
from kimi_cg.canonicalize.base import GraphPass
from kimi_cg.canonicalize.scatter_merge import infer_view_sizes
from kimi_cg.errors import UnsupportedGraphError
from kimi_cg.lift import activation_dependent_nodes

logger = logging.getLogger(__name__)

_MERGE_GATHER = torch.ops.kimi_cg.merge_gather.default
_REDUCTIONS = {"mean": True, "sum": False}  # name -> is a mean


def reduce_plan(index: torch.Tensor, dim: int, rows: int, mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Host: the gather plan of ``x[index].mean(dim)`` (or ``.sum``) for x with ``rows`` rows:
    plan_index [R, K] (R = the output's rows before the feature axis, K = index.shape[dim]) and
    plan_weight [R, K] (1/K for a mean, else 1)."""
    index = index.to(device="cpu", dtype=torch.int64)
    if index.numel() and (int(index.min()) < -rows or int(index.max()) >= rows):
        raise UnsupportedGraphError(f"index out of range for {rows} rows", "gather index out of range")
    index = torch.where(index < 0, index + rows, index)
    terms = index.shape[dim]
    plan_index = index.movedim(dim, -1).reshape(-1, terms).contiguous()
    weight = 1.0 / terms if mean and terms else 1.0
    return plan_index, torch.full(plan_index.shape, weight, dtype=torch.float32)


def _reduction(node: torch.fx.Node):
    """(is_mean, dim) of ``node`` when it is a plain mean / sum over one axis, else None."""
    if node.op == "call_method" and node.target in _REDUCTIONS:
        name, args = node.target, node.args[1:]
    elif node.op == "call_function" and node.target in (torch.mean, torch.sum):
        name, args = node.target.__name__, node.args[1:]
    else:
        return None
    kwargs = dict(node.kwargs)
    if args:
        if "dim" in kwargs or len(args) > 1:
            return None
        kwargs["dim"] = args[0]
    if set(kwargs) - {"dim", "keepdim"} or kwargs.get("keepdim", False) is not False:
        return None
    dim = kwargs.get("dim")
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return (_REDUCTIONS[name], dim) if isinstance(dim, int) else None


def _size_input(graph: torch.fx.Graph, size):
    """What the host can read ``size`` from: an int, or the graph's placeholder holding that SymInt."""
    if isinstance(size, int):
        return size
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        value = example_value(node)
        if isinstance(value, torch.SymInt) and value.node.expr == size.node.expr:
            return node
    return None


class GatherReducePass(GraphPass):
    name = "gather_reduce"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        report = {"gathers_rewritten": 0, "views_inferred": 0, "gathers_left": []}
        gathers = [n for n in graph.nodes if n.op == "call_function" and n.target is operator.getitem
                   and isinstance(n.args[1], torch.fx.Node)]
        if not gathers:
            return report
        activation = activation_dependent_nodes(graph)
        for gather in gathers:
            plan = self._plan(graph, gather, activation)
            if isinstance(plan, str):
                if plan:
                    report["gathers_left"].append(f"{gather.name}: {plan}")
                continue
            result = self._rewrite(graph, gather, *plan)
            report["gathers_rewritten"] += 1
            report["views_inferred"] += infer_view_sizes(graph, result)
        return report

    @staticmethod
    def _plan(graph, gather, activation):
        """(reduction, is_mean, dim, rows, out sizes) for a rewrite, "" when the node is no candidate,
        or why a candidate stays."""
        source, index = gather.args
        index_value, source_value = example_value(index), example_value(gather.args[0])
        if not (isinstance(index_value, torch.Tensor) and isinstance(source_value, torch.Tensor)):
            return ""
        if index_value.dtype not in (torch.int64, torch.int32) or index_value.dim() < 2:
            return ""
        if source not in activation or index in activation:
            return ""
        if source_value.dim() != 2 or len(gather.users) != 1:
            return "the source is not [rows, D] or the gather has other users"
        reduction = next(iter(gather.users))
        found = _reduction(reduction)
        if found is None:
            return "not reduced by one plain mean / sum"
        is_mean, dim = found
        dims = index_value.dim() + 1
        dim = dim + dims if dim < 0 else dim
        if not 1 <= dim < index_value.dim():
            return "the reduction is over the first or the feature axis"
        out = example_value(reduction)
        if not isinstance(out, torch.Tensor) or not all(isinstance(s, int) for s in out.shape[1:]):
            return "an output size after the first is not a constant"
        if out.dtype != source_value.dtype:
            return "the reduction changes the dtype"
        rows = _size_input(graph, source_value.shape[0])
        if rows is None:
            return "the source's row count is not a graph input"
        return reduction, is_mean, dim, rows, tuple(out.shape[1:])

    @staticmethod
    def _rewrite(graph, gather, reduction, is_mean, dim, rows, trailing):
        source, index = gather.args
        out = example_value(reduction)
        with graph.inserting_before(gather):
            plan = graph.call_function(reduce_plan, (index, dim, rows, is_mean))
            plan.meta["stack_trace"] = gather.meta.get("stack_trace")
            plan_index = graph.call_function(operator.getitem, (plan, 0))
            plan_weight = graph.call_function(operator.getitem, (plan, 1))
            gathered = graph.call_function(_MERGE_GATHER, (source, plan_index, plan_weight))
            gathered.meta["stack_trace"] = gather.meta.get("stack_trace")
            with out.fake_mode:
                plan_rows = out.numel() // out.shape[-1] if out.dim() > 1 else out.shape[0]
                terms = example_value(index).shape[dim]
                plan_index.meta["example_value"] = torch.empty((plan_rows, terms), dtype=torch.int64)
                plan_weight.meta["example_value"] = torch.empty((plan_rows, terms), dtype=torch.float32)
                gathered.meta["example_value"] = torch.empty((plan_rows, out.shape[-1]), dtype=out.dtype, device=out.device)
            result = gathered
            if len(trailing) > 1:
                result = graph.call_method("view", (gathered, -1, *trailing))
                result.meta = {**reduction.meta, "example_value": out}
        reduction.replace_all_uses_with(result)
        graph.erase_node(reduction)
        graph.erase_node(gather)
        return result
