"""EmbeddingReadsPass: rows of a module-state table picked by a host-made index become a device gather.

NOTE [embedding reads]
transformers' Kimi-K2.5 tower builds its position term from grid-made indices, not from slices of its
tables (which TableGatherPass follows)::

    indices, weights = ...                           # host: [R, 16] bicubic taps of each patch row
    pos = F.embedding_bag(indices, table, per_sample_weights=weights, mode="sum")
    pos = pos + time_table[frame_index]              # host: frame_index [R]
    hidden = hidden + pos.to(hidden.dtype)

Left alone, every input of these reads but the tables is a grid value, so the host computed the whole
[R, D] term each call and checked both tables' contents (NOTE [state tokens]: one host sync each).
Each read is the table gather kimi_cg already runs on the device (``kimi_cg.table_gather``: out[r] =
sum_k weight[r, k] * table[index[r, k]], in float32, cast to the table's dtype) with a plan the host
makes from the index it already computes::

    plan = embedding_plan(indices, weights, 64, "sum")          # host: (index [R, K], weight [R, K])
    pos = kimi_cg.table_gather(table, plan[0], plan[1])         # device: reads the table where it lives

``embedding_plan`` checks the index as eager does (an entry outside [-rows, rows) for ``table[index]``,
outside [0, rows) for the embedding functions, raises: the call then runs the captured graph, which
raises eager's error) and turns negative ``table[index]`` entries into rows from the end. The gather
is marked for the device, so the sum and the cast after it follow it there.

Matched: ``table[index]`` (one integer index tensor of 1 dim), ``F.embedding(index, table)`` (1 dim;
padding_idx changes gradients only) and ``F.embedding_bag(index, table, ...)`` (2 dims, no offsets, no
max_norm, no padding_idx, mode "sum" or "mean"; per_sample_weights only with "sum"), where the table is a
2-dim floating tensor of constant shape made from module state alone, on the activations' device, never
written, and the index depends on the grid or sizes and not on activations; the read's row count is not a
constant, and its value reaches activation work only through tensor ops that keep its rows (nothing the host
must read back).
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx
import torch.nn.functional as F

import kimi_cg.ops  # noqa: F401  (registers torch.ops.kimi_cg.*)
from kimi_cg import capture
from kimi_cg.aliasing import Aliasing
from kimi_cg.capture import example_value
from kimi_cg.canonicalize.base import GraphPass
from kimi_cg.canonicalize.table_gather import activation_devices
from kimi_cg.counters import counters
from kimi_cg.errors import UnsupportedGraphError
from kimi_cg.lift import activation_dependent_nodes
from kimi_cg.runtime.table_rows import DEVICE_PLACEMENT

_TABLE_GATHER = torch.ops.kimi_cg.table_gather.default
_EMBEDDING_BAG = inspect.signature(F.embedding_bag)
_EMBEDDING = inspect.signature(F.embedding)


def embedding_plan(index: torch.Tensor, weight: torch.Tensor | None, rows: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Host: the table-gather plan (index [R, K] int64, weight [R, K] float32) of a read of a table of
    ``rows`` rows: ``kind`` "getitem" (``table[index]``, K = 1), "sum" or "mean" (embedding_bag over
    index [R, K], ``weight`` its per_sample_weights or None; ``F.embedding`` is "sum" over index[:, None])."""
    index = index.to(device="cpu", dtype=torch.int64)
    low = -rows if kind == "getitem" else 0
    if index.numel() and (int(index.min()) < low or int(index.max()) >= rows):
        raise UnsupportedGraphError(f"index out of range for a table of {rows} rows", "embedding index out of range")
    if kind == "getitem":
        index = torch.where(index < 0, index + rows, index)
    if index.dim() == 1:
        index = index[:, None]
    if weight is not None:
        plan_weight = weight.to(device="cpu", dtype=torch.float32).reshape(index.shape)
    else:
        terms = index.shape[1]
        plan_weight = torch.full(index.shape, 1.0 / terms if kind == "mean" and terms else 1.0, dtype=torch.float32)
    return index.contiguous(), plan_weight.contiguous()


def _read(node: torch.fx.Node):
    """(table, index, weight, kind) of a matched read form, else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        if len(node.args) != 2 or not isinstance(node.args[1], torch.fx.Node):
            return None
        return node.args[0], node.args[1], None, "getitem"
    signature = {F.embedding: _EMBEDDING, F.embedding_bag: _EMBEDDING_BAG}.get(node.target)
    if signature is None:
        return None
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    arguments = bound.arguments
    if arguments.get("max_norm") is not None:  # renormalises the table in place
        return None
    if node.target is F.embedding:
        return arguments["weight"], arguments["input"], None, "sum"
    mode, weight = arguments["mode"], arguments["per_sample_weights"]
    if (arguments["offsets"] is not None or arguments["padding_idx"] is not None or arguments["include_last_offset"]
            or mode not in ("sum", "mean") or (weight is not None and mode != "sum")):
        return None
    if weight is not None and not isinstance(weight, torch.fx.Node):
        return None
    return arguments["weight"], arguments["input"], weight, mode


def _host_made(graph: torch.fx.Graph, inputs) -> set:
    """Nodes whose value depends on the grid or on a size (what the host program computes, or sizes)."""
    dependent = {item.node for item in inputs if item.role in (capture.InputRole.GRID, capture.InputRole.SIZE)}
    for node in graph.nodes:
        if node.op not in ("placeholder", "output") and any(arg in dependent for arg in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _reaches_activations_as_tensors(node: torch.fx.Node, activation: set) -> bool:
    """Every use of node, through ops that are not activation work, is a tensor op taking no number made
    from the grid and keeping the rows of an input, whose value reaches activation work in the end (nothing
    the host must read back, no graph output of its own)."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if not current.users:
            return False
        for user in current.users:
            if user in activation or user in seen:
                continue
            if user.op not in ("call_function", "call_method") or not isinstance(example_value(user), torch.Tensor):
                return False
            # A number from the grid in a device op would fail the lift (NOTE [device symbols] in lift.py)
            if any(isinstance(example_value(arg), (torch.SymInt, torch.SymFloat, torch.SymBool)) and arg.op != "placeholder"
                   for arg in user.all_input_nodes):
                return False
            # Rows kept (an op of tensors of one row count keeps it; dynamo asserted two symbols of an
            # elementwise op equal): the host-made value the device took before, where the host's work
            # ended, had the read's rows, so the plan is padded by the same rule. Reads of h rows broadcast
            # to [h, w] and flattened stay host reads: their plans are not patch rows.
            if not any(_same_rows(example_value(arg), example_value(user)) for arg in user.all_input_nodes):
                return False
            seen.add(user)
            stack.append(user)
    return True


def _same_rows(a, b) -> bool:
    """Both tensors of one leading size (the same symbol expression or number)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() and b.dim()):
        return False
    x, y = a.shape[0], b.shape[0]
    if isinstance(x, torch.SymInt) and isinstance(y, torch.SymInt):
        return x.node.expr == y.node.expr
    return type(x) is type(y) and x == y


class EmbeddingReadsPass(GraphPass):
    name = "embedding_reads"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        inputs = capture.classify_inputs(gm)
        activation = activation_dependent_nodes(graph, inputs)
        host_made = _host_made(graph, inputs)
        mutated = Aliasing(graph).mutated
        devices = activation_devices(inputs)  # a table elsewhere stays a host read
        rewritten, left = [], []
        for node in list(graph.nodes):
            found = _read(node)
            if found is None or node in activation or node not in host_made:
                continue
            why = self._unmatched(node, *found, activation, host_made, mutated, devices)
            if why:
                left.append(f"{node.name}: {why}")
                continue
            self._rewrite(graph, node, *found)
            rewritten.append(node.name)
        counters["embedding_reads_gathered"] += len(rewritten)
        return {"gathered": rewritten, "left": left}

    @staticmethod
    def _unmatched(node, table, index, weight, kind, activation, host_made, mutated, devices) -> str:
        """Why the read stays with the host ("" when it moves to the device)."""
        table_value, index_value = example_value(table), example_value(index)
        if not (isinstance(table, torch.fx.Node) and isinstance(table_value, torch.Tensor)):
            return "the table is not a tensor"
        if table in activation or table in host_made or table in mutated:
            return "the table is not module state alone, or is written"
        if table_value.dim() != 2 or not table_value.is_floating_point() or not all(isinstance(s, int) for s in table_value.shape):
            return "the table is not a [rows, D] floating tensor of constant shape"
        if {table_value.device} != devices:
            return "the table is not on the activations' device"
        if not isinstance(index_value, torch.Tensor) or index_value.dtype not in (torch.int64, torch.int32):
            return "the index is not an integer tensor"
        if index in activation or index not in host_made:
            return "the index is not made from the grid and sizes alone"
        if index_value.dim() != (2 if node.target is F.embedding_bag else 1):
            return "the index does not have one row per read row"
        if weight is not None:
            weight_value = example_value(weight)
            if weight in activation or not isinstance(weight_value, torch.Tensor) or weight_value.shape != index_value.shape:
                return "per_sample_weights is not a grid value shaped like the index"
        value = example_value(node)
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or isinstance(value.shape[0], int):
            return "the read has a constant row count"
        if not _reaches_activations_as_tensors(node, activation):
            return "the read's value is not only activation work's input"
        return ""

    @staticmethod
    def _rewrite(graph, node, table, index, weight, kind) -> None:
        value, rows = example_value(node), example_value(table).shape[0]
        with graph.inserting_before(node):
            plan = graph.call_function(embedding_plan, (index, weight, rows, kind))
            plan.meta["stack_trace"] = node.meta.get("stack_trace")
            plan_index = graph.call_function(operator.getitem, (plan, 0))
            plan_weight = graph.call_function(operator.getitem, (plan, 1))
            terms = example_value(index).shape[1] if example_value(index).dim() == 2 else 1
            with value.fake_mode:
                plan_index.meta["example_value"] = torch.empty((value.shape[0], terms), dtype=torch.int64)
                plan_weight.meta["example_value"] = torch.empty((value.shape[0], terms), dtype=torch.float32)
            gathered = graph.call_function(_TABLE_GATHER, (table, plan_index, plan_weight))
            gathered.meta = {**node.meta, "example_value": value}
            gathered.meta[DEVICE_PLACEMENT] = True
        node.replace_all_uses_with(gathered)
        graph.erase_node(node)
