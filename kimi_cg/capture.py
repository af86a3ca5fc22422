"""Capture: the dynamo settings kimi_cg needs, and the roles of a captured graph's inputs.

NOTE [dynamo settings]
The only global state kimi_cg touches. ``configure_dynamo()`` runs once, when the backend module is
imported; torch.compile imports it through the ``torch_dynamo_backends`` entry point inside the
``torch.compile(...)`` call, i.e. before the first trace. It sets:

- ``capture_scalar_outputs = True``: ``grid.tolist()`` / ``.item()`` become unbacked SymInts inside
  one graph instead of graph breaks that specialise (and recompile) on every image size;
- ``capture_dynamic_output_shape_ops = True``: ops whose output size depends on data stay in the
  graph too;
- ``recompile_limit >= 64``: dynamo keeps one graph per number of items N; with the default 8, a
  serving mix of 1..8+ images exhausts it and later calls silently run eager (seen on the H200).
Plus, on torch < 2.13 only, the compatibility shim of NOTE [list vs torch.Size].

A backend cannot scope these to its own frames (torch.compile drops ``backend_ctx_ctor``, and
config is read at trace time and is not part of guards), so they apply to every torch.compile in
the process once kimi_cg is loaded. Both only keep more code inside graphs.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import logging
import operator
import re
import sys

import torch
import torch.fx

logger = logging.getLogger(__name__)

DYNAMO_SETTINGS = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}
# Dynamo keeps one graph per number of items N (plus the static first trace and the RoPE table's
# retrace): the default limit of 8 graphs per frame sends calls with new N to eager once reached.
MIN_RECOMPILE_LIMIT = 64


def configure_dynamo() -> None:
    """Apply NOTE [dynamo settings]; idempotent."""
    for name, value in DYNAMO_SETTINGS.items():
        if getattr(torch._dynamo.config, name) != value:
            logger.info("kimi_cg sets torch._dynamo.config.%s = %s", name, value)
            setattr(torch._dynamo.config, name, value)
    if torch._dynamo.config.recompile_limit < MIN_RECOMPILE_LIMIT:
        logger.info("kimi_cg raises torch._dynamo.config.recompile_limit to %d", MIN_RECOMPILE_LIMIT)
        torch._dynamo.config.recompile_limit = MIN_RECOMPILE_LIMIT
    _patch_list_compare()


def _list_vs_tuple_aware(original):
    def list_cmp(op, left, right):
        # Python: a list never equals a tuple (or torch.Size); compare element-wise only when both
        # sides are lists or both are tuples.
        if op in (operator.eq, operator.ne) and isinstance(left, list) != isinstance(right, list):
            return op is operator.ne
        if op is operator.eq and len(left) == len(right):
            # Element-wise equality as one symbolic condition (no guard per element), so that
            # torch._check(x.shape[:-2] == y.shape[:-1]) traces with unbacked sizes.
            result = True
            for a, b in zip(left, right):
                result = torch.sym_and(result, a == b) if result is not True else a == b
            return result
        return original(op, left, right)

    list_cmp.__kimi_cg_original__ = original
    return list_cmp


def _patch_list_compare() -> None:
    """NOTE [list vs torch.Size]: dynamo before torch 2.13 compares ``[h, w] == weight.shape[:-1]``
    (upstream MoonViT's position-embedding check, always False in Python) element by element, so
    with unbacked h, w it guards on ``h != 64`` and graph-breaks. Its polyfill ``list_cmp`` is made
    type-aware, as Python and torch >= 2.13 are. A compatibility shim for that one bug; a no-op on
    torch >= 2.13."""
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
        return
    polyfills = importlib.import_module("torch._dynamo.polyfills")
    original = getattr(polyfills, "list_cmp", None)
    if original is None or hasattr(original, "__kimi_cg_original__"):
        return
    patched = _list_vs_tuple_aware(original)
    for name, module in list(sys.modules.items()):
        if name.startswith("torch._dynamo") and getattr(module, "list_cmp", None) is original:
            setattr(module, "list_cmp", patched)
    logger.info("kimi_cg: made dynamo's list_cmp polyfill list/tuple aware (torch %s)", torch.__version__)


class InputRole(enum.Enum):
    MODULE_STATE = "module_state"  # parameters, buffers, tensor attributes: same every call
    GRID = "grid"  # integer user inputs (grid_hws, grid_thws): drive the host metadata pass
    ACTIVATION = "activation"  # floating user inputs (pixel values): only the device touches them
    SIZE = "size"  # SymInt inputs dynamo adds for dynamic dimensions


# Dynamo names lifted module state after its source: L_self_modules_..._parameters_weight_,
# L_self_modules_encoder_modules_rope_2d_freqs_cis, L_model_modules_..._buffers_... .
_MODULE_STATE_NAME = re.compile(r"^(L_self_|L_self$)|_modules_|_parameters_|_buffers_")


@dataclasses.dataclass(frozen=True)
class GraphInput:
    index: int
    node: torch.fx.Node
    role: InputRole


def example_value(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def classify_inputs(gm: torch.fx.GraphModule) -> list[GraphInput]:
    """Give each placeholder of a dynamo graph a role (see InputRole)."""
    roles = []
    for index, node in enumerate(node for node in gm.graph.nodes if node.op == "placeholder"):
        value = example_value(node)
        if isinstance(value, (torch.SymInt, int)):
            role = InputRole.SIZE
        elif isinstance(value, torch.nn.Parameter) or _MODULE_STATE_NAME.search(node.target):
            role = InputRole.MODULE_STATE
        elif isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
            role = InputRole.GRID
        elif isinstance(value, torch.Tensor):
            role = InputRole.ACTIVATION
        else:
            role = InputRole.MODULE_STATE
        roles.append(GraphInput(index, node, role))
    return roles
