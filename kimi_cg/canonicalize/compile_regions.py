"""InlineRegionsPass: calls of nested compile regions become the region's ops again.

NOTE [compile regions inlined]
A block marked with ``torch.compiler.nested_compile_region`` reaches the backend as an ``invoke_subgraph``
call of a subgraph that dynamo traced once and reused for every block with the same inputs' metadata::

    subgraph_0 = self.subgraph_0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(subgraph_0, 'subgraph_0', x_1, w0, b0, ...)
    x_2 = invoke_subgraph[0]
    subgraph_1 = self.subgraph_0
    invoke_subgraph_1 = torch.ops.higher_order.invoke_subgraph(subgraph_1, 'subgraph_0', x_2, w1, b1, ...)

On torch 2.13 that halves a real MoonViT's trace of each item count (docs/benchmarks.md, 2026-12-06;
torch 2.11 reuses nothing). The passes and the lift read ops, not regions (a region call taking grid
values is a device op reading the grid: the graph would run unlifted), so this pass puts a copy of the
subgraph's nodes in place of each call, on the call's own operands, as dynamo would have inlined the block.

The copies hold the subgraph's traced values: the same fake tensors, hence the same fake storages, in
every copy. The aliasing analysis (aliasing.py) groups nodes by storage, so each copied node gets the key
``ALIAS_KEY`` to use instead: a tensor made inside the region is (copy, storage); a view of an operand
takes the operand's key, a value the call returns its result's key in the graph. Copies stay apart, and
a write through a view of a block's input still joins that input.

A region may bind unbacked symbols: MoonViT's blocks read ``max_seqlen`` and ``cu_seqlens[-1]`` with
``.item()``. One symbol in every copy is right only for a value that is the same in every call, so such
a node, and what it reads inside the region, must depend only on inputs that every call passes the same
graph value that nothing writes; those nodes are made once, in the first copy, and later copies read them
(dynamo's own inlining would have read the same values again). Refused, so the graph runs unlifted
(correct, not graphed): a binding from values that differ between calls, a region that binds and also
writes in place, attributes or regions of its own, inputs that share storage, a returned input or value
made once, and a call whose operands do not match the subgraph's inputs.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from kimi_cg.aliasing import ALIAS_KEY, Aliasing, storage_key, value_storage, written_arguments
from kimi_cg.canonicalize.base import GraphPass
from kimi_cg.capture import example_value
from kimi_cg.counters import counters
from kimi_cg.errors import UnsupportedGraphError

_REASON = "nested compile region kimi_cg cannot inline"


def _invoke_subgraph():
    ops = getattr(torch.ops, "higher_order", None)
    return getattr(ops, "invoke_subgraph", None) if ops is not None else None


def has_regions(gm: torch.fx.GraphModule) -> bool:
    target = _invoke_subgraph()
    return target is not None and any(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


def _refuse(message: str, node: torch.fx.Node):
    raise UnsupportedGraphError(f"nested compile region {node.name}: {message}", _REASON)


class InlineRegionsPass(GraphPass):
    name = "inline_compile_regions"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        target = _invoke_subgraph()
        calls = [n for n in gm.graph.nodes if target is not None and n.op == "call_function" and n.target is target]
        if not calls:
            return {"calls": 0}
        written = {member for group in Aliasing(gm.graph).groups for member in group.members}
        operands_by_subgraph: dict[str, list] = {}  # every call's operands, taken before any call is inlined
        for call in calls:
            operands_by_subgraph.setdefault(getattr(call.args[0], "target", None), []).append(tuple(call.args[2:]))
        invariant: dict[str, set] = {}  # subgraph -> its nodes that compute the same value in every call
        shared: dict[str, dict] = {}  # subgraph -> its first copy of each of those nodes
        for copy_index, call in enumerate(calls):
            self._inline(gm, call, copy_index, operands_by_subgraph, written, invariant, shared)
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and not node.users and isinstance(getattr(gm, node.target, None),
                                                                       torch.fx.GraphModule):
                gm.graph.erase_node(node)
        counters["compile_region_calls_inlined"] += len(calls)
        return {"calls": len(calls)}

    def _inline(self, gm: torch.fx.GraphModule, call: torch.fx.Node, copy_index: int, operands_by_subgraph,
                written, invariant_by_subgraph: dict, shared: dict) -> None:
        holder, _identifier, *operands = call.args
        if call.kwargs or not isinstance(holder, torch.fx.Node) or holder.op != "get_attr":
            _refuse("the call's form", call)
        subgraph = getattr(gm, holder.target)
        placeholders = [n for n in subgraph.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(operands):
            _refuse(f"{len(operands)} operands for {len(placeholders)} inputs", call)
        body = [n for n in subgraph.graph.nodes if n.op not in ("placeholder", "output")]
        for node in body:
            if node.op not in ("call_function", "call_method"):
                _refuse(f"a {node.op} node ({node.name}) in its subgraph", call)
        if holder.target not in invariant_by_subgraph:
            invariant_by_subgraph[holder.target] = _invariant_nodes(
                subgraph, placeholders, operands_by_subgraph[holder.target], written, call)
        invariant = invariant_by_subgraph[holder.target]
        (output,) = [n for n in subgraph.graph.nodes if n.op == "output"]
        results = output.args[0]
        if not isinstance(results, (tuple, list)) or not all(isinstance(r, torch.fx.Node) for r in results):
            _refuse("an output that is not a tuple of values", call)
        if any(r.op == "placeholder" for r in results):
            _refuse("an input returned as it is", call)
        if any(r in invariant for r in results):  # one node for every call: views after the calls would not join it
            _refuse("a result that is the same in every call", call)
        users = {}
        for user in call.users:
            if user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int):
                _refuse(f"its result used by {user.name}, not by an index", call)
            users[user] = user.args[1]
        # The subgraph's storages -> the keys they have in this copy: an operand's for views of it, the
        # graph's result node's for the values returned (views of them after the call already use it).
        keys: dict[StorageWeakRef, object] = {}
        for placeholder, operand in zip(placeholders, operands):
            storage = value_storage(example_value(placeholder))
            if storage is not None and storage in keys:  # another call may pass tensors that do not alias
                _refuse("two inputs that share storage", call)
            if storage is not None and isinstance(operand, torch.fx.Node):
                keys[storage] = storage_key(operand)
        for user, index in users.items():
            storage, key = value_storage(example_value(results[index])), storage_key(user)
            if storage is not None and key is not None and keys.setdefault(storage, key) != key:
                _refuse(f"result {index} shares storage with another input or result", call)
        env: dict[torch.fx.Node, object] = dict(zip(placeholders, operands))
        first = shared.setdefault(holder.target, {})
        with gm.graph.inserting_before(call):
            for node in body:
                if node in invariant and node in first:
                    env[node] = first[node]  # the first copy's node: the same value, its symbols bound once
                    continue
                copied = gm.graph.node_copy(node, lambda n: env[n])
                if node in invariant:
                    first[node] = copied
                storage = value_storage(example_value(node))
                if storage is not None:
                    copied.meta[ALIAS_KEY] = keys.get(storage, (copy_index, storage))
                env[node] = copied
        for user, index in users.items():
            user.replace_all_uses_with(env[results[index]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(call)


def _invariant_nodes(subgraph: torch.fx.GraphModule, placeholders, calls_operands, written, call) -> set:
    """The subgraph's nodes that compute the same value in every call of it, when it binds unbacked
    symbols (then every copy must read that symbol's one binding; empty otherwise): nodes reading only
    such nodes and inputs that every call passes the same unwritten graph value. A region that binds a
    symbol from anything else, or that writes in place, is refused."""
    body = [n for n in subgraph.graph.nodes if n.op not in ("placeholder", "output")]
    binders = [n for n in body if n.meta.get("unbacked_bindings")]
    if not binders:
        return set()
    if any(written_arguments(n) for n in body):
        _refuse("it binds unbacked symbols and writes in place", call)
    same = set()
    for position, placeholder in enumerate(placeholders):
        values = [operands[position] for operands in calls_operands]
        first = values[0]
        if isinstance(first, torch.fx.Node):
            if first not in written and all(v is first for v in values):
                same.add(placeholder)
        elif all(not isinstance(v, torch.fx.Node) and type(v) is type(first) and v == first for v in values):
            same.add(placeholder)
    invariant = set(same)
    for node in body:  # a node without inputs (a constructor, maybe random) is made again in every copy
        if node.all_input_nodes and all(arg in invariant for arg in node.all_input_nodes):
            invariant.add(node)
    for node in binders:
        if node not in invariant:
            _refuse(f"{node.name} binds unbacked symbols from values that differ between calls", call)
    return invariant - set(placeholders)
