"""Aliasing and in-place writes in a captured graph: which nodes share storage, which are written.

NOTE [mutation and lifting]
Lifting moves nodes between programs by what their *inputs* are (lift.py). An in-place write breaks
that reasoning: after ::

    mask: "b8[1, 6, 6]" = torch.zeros([1, 6, 6], dtype=torch.bool)      # inputs: literals only
    setitem = operator.setitem(mask, (Ellipsis, slice(u0, u1), ...), True)  # inputs: grid values
    attn = F.scaled_dot_product_attention(q, k, v, mask)

``mask`` looks constant, but what ``attn`` reads depends on the grid. So every node whose value
shares storage with a written tensor (the tensor, its views, the writes themselves) forms one
*mutated group*, and lift gives the whole group one category: the highest category of its members
and of everything the writes read, and never lower than HOST, so that the group is computed in
exactly one program, in graph order, and handed to the programs after it as a finished value.
A group that contains a graph input (module state, pixels, the grid) cannot be moved at all: kimi_cg
refuses to lift that graph (the caller falls back to the captured graph, which is correct).

Storage identity comes from the fake tensors dynamo traced with (``meta["example_value"]``): views
share their base's fake storage, whatever op made them, so no list of view ops is needed. Nodes
without a traced value (made by passes) are assumed to alias their tensor inputs (conservative). A node
whose traced value is shared with other nodes (the copies of a nested compile region, NOTE [compile
regions inlined]) keeps its storage's identity in ``meta[ALIAS_KEY]`` instead.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from kimi_cg.capture import example_value

ALIAS_KEY = "kimi_cg_alias_key"
"""Node meta key: the identity of the node's storage where its traced value does not tell it."""


def storage_key(node: torch.fx.Node, value=None):
    """What identifies the storage of ``node``'s tensor value (its traced value's storage, unless
    ``ALIAS_KEY`` says otherwise); None for values without storage."""
    key = node.meta.get(ALIAS_KEY)
    if key is not None:
        return key
    return value_storage(example_value(node) if value is None else value)


def value_storage(value) -> StorageWeakRef | None:
    """The storage of a traced tensor value; None for anything else."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except (NotImplementedError, RuntimeError):  # sparse or other storage-less tensors
        return None

_IN_PLACE_OPERATORS = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.imatmul,
}


def _is_tensor_node(value) -> bool:
    return isinstance(value, torch.fx.Node) and isinstance(example_value(value), torch.Tensor)


# The in-place dunders as methods (``x.__iadd__(y)``, as some dynamo versions record ``x += y``).
_IN_PLACE_DUNDERS = {f"__{name}__" for name in ("setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod",
                                                 "ipow", "iand", "ior", "ixor", "ilshift", "irshift", "imatmul")}


def _target_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    return getattr(node.target, "__name__", "") or ""


def written_arguments(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes ``node`` writes in place (empty for a functional op)."""
    if node.op not in ("call_function", "call_method"):
        return []
    written = []
    first = node.args[0] if node.args else None
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        # x += y on a tensor writes x; on a Python or symbolic int it makes a new value.
        if node.target is operator.setitem or _is_tensor_node(first):
            written.append(first)
    elif isinstance(node.target, torch._ops.OpOverload):
        schema = node.target._schema
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written.append(value)
        for argument in schema.arguments:
            if argument.alias_info is not None and argument.alias_info.is_write and argument.name in node.kwargs:
                written.append(node.kwargs[argument.name])
    else:
        name = _target_name(node)
        # torch's in-place convention: add_, index_put_, copy_, masked_fill_, nn.init.zeros_, _foreach_mul_.
        if (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS:
            written += list(first) if isinstance(first, (tuple, list)) else [first]
        if node.kwargs.get("inplace") is True:
            written.append(first)
    out = node.kwargs.get("out")
    written += list(out) if isinstance(out, (tuple, list)) else [out]
    return [value for value in written if isinstance(value, torch.fx.Node)]


@dataclasses.dataclass
class MutatedGroup:
    """Nodes sharing one written storage: the values (base and views) and the writes."""

    members: list[torch.fx.Node]
    writes: list[torch.fx.Node]

    def read_inputs(self) -> set[torch.fx.Node]:
        """Everything the writes read besides the group itself (indices, written values)."""
        members = set(self.members)
        return {arg for write in self.writes for arg in write.all_input_nodes if arg not in members}


class Aliasing:
    """Union of nodes by storage, and the groups that some node writes in place."""

    def __init__(self, graph: torch.fx.Graph):
        self._parent: dict[torch.fx.Node, torch.fx.Node] = {}
        by_storage: dict[object, torch.fx.Node] = {}
        writes: list[tuple[torch.fx.Node, list[torch.fx.Node]]] = []
        for node in graph.nodes:
            if node.op == "output":
                continue
            value = example_value(node)
            if isinstance(value, torch.Tensor):
                key = storage_key(node, value)
                if key is not None:
                    if key in by_storage:
                        self._union(node, by_storage[key])
                    else:
                        by_storage[key] = node
            written = written_arguments(node)
            if written:  # a write joins the group of what it writes (not of the values it reads)
                writes.append((node, written))
                for target in written:
                    self._union(node, target)
            elif value is None and node.op in ("call_function", "call_method"):
                # Made by a pass (no traced value): may alias its tensor inputs.
                for arg in node.all_input_nodes:
                    if _is_tensor_node(arg) or example_value(arg) is None:
                        self._union(node, arg)
        groups: dict[torch.fx.Node, MutatedGroup] = {}
        for write, _ in writes:
            root = self._find(write)
            groups.setdefault(root, MutatedGroup([], []))
        for node in graph.nodes:
            if node in self._parent and self._find(node) in groups:
                groups[self._find(node)].members.append(node)
        for write, _ in writes:
            groups[self._find(write)].writes.append(write)
        self.groups = list(groups.values())
        self.mutated = {node for group in self.groups for node in group.members}

    def _find(self, node: torch.fx.Node) -> torch.fx.Node:
        self._parent.setdefault(node, node)
        root = node
        while self._parent[root] is not root:
            root = self._parent[root]
        while self._parent[node] is not root:
            self._parent[node], node = root, self._parent[node]
        return root

    def _union(self, a: torch.fx.Node, b: torch.fx.Node) -> None:
        root_a, root_b = self._find(a), self._find(b)
        if root_a is not root_b:
            self._parent[root_a] = root_b

    def reads_mutated(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` is, or reads, a value whose storage is written somewhere in the graph."""
        return node in self.mutated or any(arg in self.mutated for arg in node.all_input_nodes)
