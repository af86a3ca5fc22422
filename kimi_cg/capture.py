"""Capture: the roles of a captured graph's inputs, and the working copy the passes rewrite.

The dynamo settings kimi_cg traces with are scoped to its own frames: NOTE [dynamo settings] in
dynamo_settings.py.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

logger = logging.getLogger(__name__)


class InputRole(enum.Enum):
    MODULE_STATE = "module_state"  # parameters, buffers, tensor attributes: same every call
    GRID = "grid"  # integer user inputs (grid_hws, grid_thws): drive the host metadata pass
    ACTIVATION = "activation"  # floating user inputs (pixel values): only the device touches them
    SIZE = "size"  # SymInt inputs dynamo adds for dynamic dimensions


# Fallback when a placeholder has no source (graphs not made by dynamo): dynamo's names for
# lifted module state, e.g. L_self_modules_..._parameters_weight_.
_MODULE_STATE_NAME = re.compile(r"^(L_self_|L_self$)|_modules_|_parameters_|_buffers_")


def source_name(node: torch.fx.Node) -> str | None:
    """Dynamo's name of where a graph input came from (``L['grid_hws']``, ``L['x'].size()[0]``), or None."""
    name = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
    return name() if callable(name) else name  # a method in torch 2.11, a property later


def _is_module_state_source(source) -> bool | None:
    """From dynamo's source of a graph input: True for state that is the same every call (reached
    through an nn.Module, a global or a closure cell), False for the call's own arguments (a local
    of the frame, or something reached from one), None when there is no source."""
    if source is None:
        return None
    while source is not None:
        kind = type(source).__name__
        if "NNModule" in kind or "ParamBuffer" in kind or kind in ("GlobalSource", "GlobalWeakRefSource", "ClosureSource",
                                                                    "CellContentsSource", "ConstantSource"):
            return True
        source = getattr(source, "base", None)
    return False


@dataclasses.dataclass(frozen=True)
class GraphInput:
    index: int
    node: torch.fx.Node
    role: InputRole


def example_value(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def row_dim(value) -> int:
    """NOTE [rows on dim 1]
    The dim of a traced activation that holds its packed rows. Most towers pack rows on dim 0
    ([L, ...]); some keep a batch dim of one through every layer ([1, L, ...]: transformers'
    PaddleOCR-VL patches, HunYuan-VL's layers). Dynamo traces such a batch dim as the literal 1 (it
    guards it: a call with another batch gets another graph) and the rows as a symbol, so the rows
    are the first symbolic dim when every dim before it is a literal 1; else dim 0 (also in dynamo's
    static first trace, whose sizes are all literals: its one bucket is its call's exact size)."""
    if not isinstance(value, torch.Tensor):
        return 0
    for dim, size in enumerate(value.shape):
        if not isinstance(size, int):
            return dim
        if size != 1:
            return 0
    return 0


def input_rows_dim(pixel_values: torch.Tensor, rows: int) -> int:
    """Where a call's pixel tensor holds ``rows`` packed rows (NOTE [rows on dim 1]): dim 0 when it is
    that long, else dim 1 of a [1, L, ...] tensor of three dims or more (PaddleOCR-VL's patches). The
    caller checks the size it needs there."""
    if pixel_values.shape[0] < rows and pixel_values.dim() >= 3 and pixel_values.shape[0] == 1:
        return 1
    return 0


def working_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (node metadata copied, attributes shared), for
    passes to rewrite while ``gm`` stays as dynamo captured it."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    # Lazy: its code is generated only if something reads or runs it (a debug dump does; the passes and
    # the split read the graph), not at every pass that changes the graph (~0.1 s each for a real tower).
    copy = _LazyGraphModule(gm, graph, class_name=type(gm).__name__)
    copy.meta.update(gm.meta)
    return copy


def classify_inputs(gm: torch.fx.GraphModule) -> list[GraphInput]:
    """Give each placeholder of a dynamo graph a role (see InputRole)."""
    roles = []
    for index, node in enumerate(node for node in gm.graph.nodes if node.op == "placeholder"):
        value = example_value(node)
        grapharg = node.meta.get("grapharg")
        module_state = _is_module_state_source(getattr(grapharg, "source", None))
        if module_state is None:
            module_state = bool(_MODULE_STATE_NAME.search(node.target))
        if isinstance(value, (torch.SymInt, int)):
            role = InputRole.SIZE
        elif isinstance(value, torch.nn.Parameter) or module_state:
            role = InputRole.MODULE_STATE
        elif isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
            role = InputRole.GRID
        elif isinstance(value, torch.Tensor):
            role = InputRole.ACTIVATION
        else:
            role = InputRole.MODULE_STATE
        roles.append(GraphInput(index, node, role))
    return roles
