"""The pass wrapper: timing, logging and, when dumping, the graph after every pass that changed it;
helpers the passes share (a call's arguments by name, replacing a node)."""

from __future__ import annotations

import logging
import operator
import time

import torch
import torch.fx

from kimi_cg.capture import example_value

logger = logging.getLogger(__name__)


class GraphPass:
    """Subclasses implement ``run(gm) -> dict`` (a small report); call the pass as ``pass_(gm)``."""

    name = "pass"

    def __init__(self, dump=None):
        self.dump = dump  # kimi_cg.debug.dump.GraphDump or None
        self.report: dict = {}

    def run(self, gm: torch.fx.GraphModule) -> dict:
        raise NotImplementedError

    def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        before = gm.code if self.dump is not None and self.dump.enabled else None
        existing = set(gm.graph.nodes)
        fingerprint = graph_fingerprint(gm.graph)
        start = time.perf_counter()
        self.report = self.run(gm) or {}
        _inherit_stack_traces(gm.graph, existing)
        gm.graph.lint()
        if not _same(graph_fingerprint(gm.graph), fingerprint):
            gm.recompile()  # ~0.1 s for a real tower's graph: only when the pass changed it
        elapsed_ms = (time.perf_counter() - start) * 1e3
        logger.debug("%s: %.1f ms, %s", self.name, elapsed_ms, self.report)
        if before is not None and gm.code != before:  # a pass that changed nothing writes nothing
            self.dump.stage(self.name, lambda: readable_with_shapes(gm))
        return gm


def replay_before(graph: torch.fx.Graph, nodes, replaced: dict, function_of, marks: tuple[str, ...] = ()):
    """Before each of ``nodes``, a call of ``function_of(node)`` on the node's arguments with the nodes
    already in ``replaced`` swapped for their replacements (a region replayed on a host stand-in);
    ``replaced`` gains each node's call, which keeps the node's stack trace and the meta ``marks``.
    Returns the argument mapping, for the region's other users."""

    def swap(arg):
        return replaced.get(arg, arg) if isinstance(arg, torch.fx.Node) else arg

    for node in nodes:
        with graph.inserting_before(node):
            args = torch.fx.node.map_arg(node.args, swap)
            kwargs = torch.fx.node.map_arg(node.kwargs, swap)
            replaced[node] = graph.call_function(function_of(node), args, kwargs)
        replaced[node].meta["stack_trace"] = node.meta.get("stack_trace")
        for mark in marks:
            replaced[node].meta[mark] = True
    return swap


def call_arguments(node: torch.fx.Node, names: tuple[str, ...], defaults: dict) -> dict | None:
    """A call's arguments by name (positional ones matched to ``names``, defaults filled in); None when it
    passes more positional arguments than ``names`` or a keyword not among them."""
    values = dict(defaults)
    values.update(zip(names, node.args))
    values.update(node.kwargs)
    return values if len(node.args) <= len(names) and set(values) <= set(names) else None


def replace_node(graph: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node, *dead: torch.fx.Node) -> None:
    """``new`` takes ``old``'s place (its meta, so its example value and source, and its uses); ``old`` is
    erased, then ``dead``: nodes that only ``old`` used, in an order where each has no users left."""
    new.meta = dict(old.meta)
    old.replace_all_uses_with(new)
    for node in (old, *dead):
        graph.erase_node(node)


def readable_with_shapes(gm: torch.fx.GraphModule) -> str:
    """``gm.print_readable()`` with shapes also on the nodes passes created (they have no example value):
    each is run on the fake values of its inputs, only for the printout (the values are removed again,
    so nothing a later stage reads changes). Nodes that need real values (host plans) stay unannotated."""
    added = []
    try:
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method") or "val" in node.meta or "example_value" in node.meta:
                continue
            value = fake_value(node)
            if value is not None:
                node.meta["val"] = value
                added.append(node)
        return gm.print_readable(print_output=False)
    finally:
        for node in added:
            del node.meta["val"]


def fake_value(node: torch.fx.Node):
    """``node`` run on the fake values of its inputs (a node a pass created); None where that fails."""
    def value_of(arg):
        return example_value(arg) if isinstance(arg, torch.fx.Node) else arg

    args = torch.fx.node.map_aggregate(node.args, value_of)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value_of)
    mode = None
    for arg in node.all_input_nodes:
        value = value_of(arg)
        if isinstance(value, torch.Tensor) and hasattr(value, "fake_mode"):
            mode = value.fake_mode
            break
    if mode is None or any(value_of(arg) is None for arg in node.all_input_nodes):
        return None
    try:
        with mode:
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a printout annotation only: host plans need real values
        return None


def graph_fingerprint(graph: torch.fx.Graph) -> list:
    """What a graph's generated code is made of: every node, in order, with its name, op, target and
    arguments. Fingerprints that ``_same`` finds equal give the same code."""
    return [(node, node.name, node.op, node.target, node.args, node.kwargs) for node in graph.nodes]


_PLAIN = (int, float, str, bytes, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _same(a, b) -> bool:
    """Structural equality that never asks an object what ``==`` means (a SymInt would answer with a guard, a
    tensor with a tensor): containers by their items, plain values by value, anything else by identity. Unsure
    means different, which only costs a recompile."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, slice):
        return _same((a.start, a.stop, a.step), (b.start, b.stop, b.step))
    return isinstance(a, _PLAIN) and a == b


def _inherit_stack_traces(graph: torch.fx.Graph, existing: set) -> None:
    """Nodes a pass created without a stack trace take the user's line of what they replace: the
    nearest input that has one, else a user that has one (errors, dumps and reports name a source
    line instead of "node view_as_real_54")."""
    for node in graph.nodes:
        if node in existing or node.op in ("placeholder", "output") or node.meta.get("stack_trace"):
            continue
        origin = next((arg for arg in node.all_input_nodes if arg.op != "placeholder" and arg.meta.get("stack_trace")), None)
        if origin is None:
            origin = next((user for user in node.users if user.meta.get("stack_trace")), None)
        if origin is not None:
            node.meta["stack_trace"] = origin.meta["stack_trace"]


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, moving as little as possible.

    Rewrites insert a value (e.g. the gather) after the last node it depends on, while users of it
    may come earlier; this pulls each node's missing inputs in just before it.
    """
    placed: set[torch.fx.Node] = set()
    order: list[torch.fx.Node] = []
    for root in list(graph.nodes):
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in placed:
                continue
            if expanded:
                placed.add(node)
                order.append(node)
                continue
            stack.append((node, True))
            for arg in reversed(node.all_input_nodes):
                if arg not in placed:
                    stack.append((arg, False))
    cursor = None
    for node in order:
        if cursor is None:
            if node is not next(iter(graph.nodes)):
                next(iter(graph.nodes)).prepend(node)
        elif cursor.next is not node:
            cursor.append(node)
        cursor = node


_PURE_FUNCTIONS = {operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod,
                   operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, torch.sym_sum,
                   torch.ops.aten.sym_size.int}


def eliminate_common_scalar_subexpressions(graph: torch.fx.Graph, extra_pure=()) -> int:
    """Merge repeated pure scalar/index computations (each layer re-reading ``cu_seqlens[i].item()``)
    so that equal host values are computed, and handed to the device, once."""
    from kimi_cg.aliasing import Aliasing

    pure = _PURE_FUNCTIONS | set(extra_pure)
    aliasing = Aliasing(graph)  # a read of written storage gives different values before and after the write
    seen: dict = {}
    merged = 0
    for node in list(graph.nodes):
        is_pure = (node.op == "call_function" and node.target in pure) or (node.op == "call_method" and node.target == "item")
        if not is_pure or aliasing.reads_mutated(node):
            continue
        try:
            key = (node.op, node.target, node.args, tuple(sorted(node.kwargs.items())))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    return merged
