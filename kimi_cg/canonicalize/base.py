"""The pass wrapper: timing, logging and optional before/after dumps for every pass."""

from __future__ import annotations

import logging
import operator
import os
import time

import torch
import torch.fx

logger = logging.getLogger(__name__)


class GraphPass:
    """Subclasses implement ``run(gm) -> dict`` (a small report); call the pass as ``pass_(gm)``."""

    name = "pass"

    def __init__(self, debug_dir: str | None = None):
        self.debug_dir = debug_dir
        self.report: dict = {}

    def run(self, gm: torch.fx.GraphModule) -> dict:
        raise NotImplementedError

    def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        self._dump(gm, "before")
        start = time.perf_counter()
        self.report = self.run(gm) or {}
        gm.graph.lint()
        gm.recompile()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        logger.debug("%s: %.1f ms, %s", self.name, elapsed_ms, self.report)
        self._dump(gm, "after")
        return gm

    def _dump(self, gm: torch.fx.GraphModule, when: str) -> None:
        if not self.debug_dir:
            return
        os.makedirs(self.debug_dir, exist_ok=True)
        with open(os.path.join(self.debug_dir, f"{self.name}.{when}.py"), "w") as f:
            f.write(gm.print_readable(print_output=False))


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
