"""Lift: classify every node of a dynamo graph and split the graph into three programs.

Categories (NOTE [lift categories]):
  CONST   depends only on module state and literals (weight views, the lazily built RoPE table)
  SIZE    a symbolic integer computable from the call's dynamic sizes (``s0``) alone, e.g. the
          ``sym_size`` of a device tensor whose shape is backed
  HOST    depends on grid values: ``.item()``/``.tolist()`` results, interpolated position
          embeddings, RoPE slices, cu_seqlens, gather plans, and the checks on them
  DEVICE  depends on activations (pixel values)
  POST    a view-only op on device results whose users are all POST or the graph output
          (per-image ``split``/slice views of the packed result), applied after the device program

Programs:
  host    HOST nodes (+ the CONST/SIZE nodes they need): runs first, on the call's grid
  device  DEVICE nodes (+ CONST/SIZE nodes they need); its inputs are activations, module state,
          dynamic sizes and HOST values. After canonicalisation its shapes depend only on the
          dynamic sizes of its inputs, never on a grid value: an unbacked symbol reaching a device
          node is a lift error.
  post    POST nodes: cheap views of device outputs shaped by host values

A SIZE node that queries a device tensor (``sym_size(x, 0)``) is copied as-is into the device
program; in the host and post programs it becomes ``evaluate_size(expr, s0, ...)`` over the
dynamic-size inputs, so those programs never need the device tensor.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import operator
from typing import Any

import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from kimi_cg.aliasing import Aliasing
from kimi_cg.capture import GraphInput, InputRole, example_value
from kimi_cg.errors import UnsupportedGraphError
from kimi_cg.runtime.gather_plan import take_rows
from kimi_cg.runtime.table_rows import DEVICE_PLACEMENT

logger = logging.getLogger(__name__)


class Category(enum.Enum):
    CONST = "const"
    SIZE = "size"
    HOST = "host"
    DEVICE = "device"
    POST = "post"


_SIZE_QUERIES = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
}
_SIZE_METHODS = {"size", "dim", "numel", "stride"}
_VIEW_METHODS = {"view", "split", "split_with_sizes", "unbind", "narrow", "squeeze", "unsqueeze", "transpose", "permute", "chunk", "expand", "__getitem__"}
_VIEW_FUNCTIONS = {operator.getitem, torch.split, torch.unbind, torch.narrow, torch.squeeze, torch.unsqueeze, torch.transpose, torch.permute, torch.chunk}


def source_location(node: torch.fx.Node) -> str:
    """The user's ``File "...", line N, in f: code`` a node came from, for error messages."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").strip().splitlines()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not frames:
        return f"node {node.name}"
    last = frames[-1]
    code = lines[last + 1] if last + 1 < len(lines) else ""
    return f"{lines[last]}: {code}"


def is_size_query(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _SIZE_QUERIES) or (
        node.op == "call_method" and node.target in _SIZE_METHODS
    )


def activation_dependent_nodes(graph: torch.fx.Graph, inputs: list[GraphInput] | None = None) -> set[torch.fx.Node]:
    """Nodes whose value depends on activation data (size queries only depend on shapes: excluded)."""
    if inputs is None:
        from kimi_cg.capture import classify_inputs

        inputs = classify_inputs(graph.owning_module)
    dependent = {item.node for item in inputs if item.role is InputRole.ACTIVATION}
    for node in graph.nodes:
        if node.op in ("placeholder", "output") or is_size_query(node):
            continue
        if any(arg in dependent for arg in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _is_view_op(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and (node.target in _VIEW_FUNCTIONS or node.target is take_rows)


def output_view_nodes(graph: torch.fx.Graph, activation: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """POST nodes: view-only ops on activations whose users are all POST nodes or the output."""
    post: set[torch.fx.Node] = set()
    for node in reversed(list(graph.nodes)):
        if node in activation and _is_view_op(node) and node.users:
            if all(user.op == "output" or user in post for user in node.users):
                post.add(node)
    return post


# Size expressions referenced by evaluate_size nodes (FX code cannot embed sympy objects).
_SIZE_EXPRESSIONS: list[tuple[sympy.Expr, tuple[sympy.Symbol, ...]]] = []


def register_size_expression(expr: sympy.Expr) -> tuple[int, tuple[str, ...]]:
    symbols = tuple(sorted(expr.free_symbols, key=str))
    _SIZE_EXPRESSIONS.append((expr, symbols))
    return len(_SIZE_EXPRESSIONS) - 1, tuple(str(s) for s in symbols)


def evaluate_size(expression_id: int, *values: int) -> int:
    """Host/post stand-in for a size query on a device tensor: the expression over dynamic sizes."""
    # The common case (a tensor's row count) without sympy: it runs every call.
    if _SIZE_EXPRESSIONS[expression_id][0].is_Symbol:
        return int(values[0])
    return _substituted(expression_id, values)


@functools.lru_cache(maxsize=4096)
def _substituted(expression_id: int, values: tuple) -> int:
    expr, symbols = _SIZE_EXPRESSIONS[expression_id]
    return int(expr.xreplace(dict(zip(symbols, values))))


@dataclasses.dataclass(frozen=True)
class ValueRef:
    """Where a program input comes from: the call's args, or another program's outputs."""

    program: str  # "arg", "host", "device", "post", "literal"
    index: Any


@dataclasses.dataclass
class Program:
    name: str
    gm: torch.fx.GraphModule
    inputs: list[ValueRef]
    outputs: list[torch.fx.Node]  # nodes of the original graph, in output order


@dataclasses.dataclass
class LiftedGraph:
    host: Program
    device: Program
    post: Program
    outputs: list[ValueRef]  # the dynamo graph's outputs
    categories: dict[torch.fx.Node, Category]
    report: dict


_ORDER = {Category.CONST: 0, Category.SIZE: 1, Category.HOST: 2, Category.DEVICE: 3, Category.POST: 3}


def classify(gm: torch.fx.GraphModule, inputs: list[GraphInput], aliasing: Aliasing | None = None) -> dict[torch.fx.Node, Category]:
    """Each node's category; a mutated group gets one category for all its members (NOTE [mutation
    and lifting] in aliasing.py), found by iterating until no group's category rises."""
    graph = gm.graph
    aliasing = aliasing or Aliasing(graph)
    for group in aliasing.groups:
        written_inputs = [node for node in group.members if node.op == "placeholder"]
        if written_inputs:
            write = group.writes[0]
            raise UnsupportedGraphError(
                f"the graph writes in place to its input {written_inputs[0].name} at {source_location(write)}; "
                "kimi_cg lifts only graphs whose in-place writes target tensors the graph creates",
                "in-place write to a graph input",
                source_location(write),
            )
    activation = activation_dependent_nodes(graph, inputs)
    post = output_view_nodes(graph, activation) - aliasing.mutated
    forced: dict[torch.fx.Node, Category] = {}
    for _ in range(len(aliasing.groups) + 1):
        categories = _categories(graph, inputs, activation, post, forced)
        raised = False
        for group in aliasing.groups:
            level = max((categories[node] for node in [*group.members, *group.read_inputs()]), key=_ORDER.__getitem__)
            if _ORDER[level] < _ORDER[Category.HOST]:
                level = Category.HOST  # one program computes the group; the others receive it finished
            if level is Category.POST:
                level = Category.DEVICE
            for node in group.members:
                if forced.get(node) is not level:
                    forced[node] = level
                    raised = True
        if not raised:
            break
    _sink_host_views(graph, categories, aliasing.mutated)
    return categories


def _categories(graph, inputs, activation, post, forced) -> dict[torch.fx.Node, Category]:
    roles = {item.node: item.role for item in inputs}
    categories: dict[torch.fx.Node, Category] = {}
    role_category = {
        InputRole.MODULE_STATE: Category.CONST,
        InputRole.GRID: Category.HOST,
        InputRole.ACTIVATION: Category.DEVICE,
        InputRole.SIZE: Category.SIZE,
    }
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            categories[node] = role_category[roles[node]]
            continue
        if node.op == "get_attr":
            category = Category.CONST
        elif node.meta.get(DEVICE_PLACEMENT):
            category = Category.DEVICE  # NOTE [table gathers]: reads module state where it lives
        elif node in post:
            category = Category.POST
        elif node in activation:
            category = Category.DEVICE
        elif is_size_query(node) and any(arg in activation for arg in node.all_input_nodes):
            category = Category.SIZE
        else:
            found = {categories[arg] for arg in node.all_input_nodes}
            if Category.DEVICE in found or Category.POST in found:
                category = Category.DEVICE  # reads a value some write made device-side
            elif Category.HOST in found or node.target is torch.ops.aten._assert_scalar.default:
                category = Category.HOST
            elif Category.SIZE in found:
                value = example_value(node)
                scalar = isinstance(value, (int, bool, torch.SymInt, torch.SymBool)) or value is None
                category = Category.SIZE if scalar and not isinstance(value, torch.Tensor) else Category.HOST
            else:
                category = Category.CONST
        if node in forced and _ORDER[forced[node]] > _ORDER[category]:
            category = forced[node]
        categories[node] = category
    return categories


_SINKABLE_VIEWS = {"unsqueeze", "view", "reshape", "transpose", "permute", "squeeze", "expand", "flatten", "select"}


def _sink_host_views(graph: torch.fx.Graph, categories: dict[torch.fx.Node, Category], mutated: set) -> None:
    """A view of a host tensor used only by device ops (each layer's ``freqs_cis.unsqueeze(-2)``)
    moves into the device program, so the host hands over the base tensor once, not once per layer."""
    for node in reversed(list(graph.nodes)):
        if categories.get(node) is not Category.HOST or node.op != "call_method" or node.target not in _SINKABLE_VIEWS:
            continue
        if node in mutated:  # shares a written storage: stays with its group
            continue
        if len(node.all_input_nodes) != 1:  # a tensor method whose other arguments are literals
            continue
        if node.users and all(categories.get(user) is Category.DEVICE for user in node.users):
            categories[node] = Category.DEVICE


def _check_device_symbols(nodes, categories) -> None:
    """NOTE [device symbols]: device nodes may not see grid-dependent integers."""
    # The device program is a function of its inputs: if no grid-dependent integer reaches a device
    # op as an argument, every device shape follows from the shapes of the program's input tensors.
    # (Shapes in node metadata still show the unbacked symbols dynamo traced with; they are stale.)
    for node in nodes:
        for arg in node.all_input_nodes:
            arg_value = example_value(arg)
            if categories[arg] is Category.HOST and isinstance(arg_value, (torch.SymInt, torch.SymBool, torch.SymFloat)):
                raise UnsupportedGraphError(
                    f"device op {node.name} takes the grid-dependent value {arg.name} ({arg_value}); "
                    f"at {source_location(node)}. Compute it on the host or bound it (see docs/design.md).",
                    "grid-dependent value reaches a device op",
                    source_location(node),
                )


def split(gm: torch.fx.GraphModule, inputs: list[GraphInput]) -> LiftedGraph:
    graph = gm.graph
    categories = classify(gm, inputs)
    order = {node: i for i, node in enumerate(graph.nodes)}
    output_node = next(node for node in graph.nodes if node.op == "output")
    placeholders = {item.node: item.index for item in inputs}
    size_symbols = {}
    for item in inputs:
        value = example_value(item.node)
        if item.role is InputRole.SIZE and isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            size_symbols[str(value.node.expr)] = item.node

    primary = {"host": Category.HOST, "device": Category.DEVICE, "post": Category.POST}
    members: dict[str, list[torch.fx.Node]] = {}
    for name, category in primary.items():
        chosen = {node for node, c in categories.items() if c is category and node.op != "placeholder"}
        if name == "host":  # a CONST / SIZE value the graph returns and no program needs: the host makes it
            chosen |= {arg for arg in output_node.all_input_nodes
                       if arg.op != "placeholder" and categories[arg] in (Category.CONST, Category.SIZE)}
        # CONST and SIZE helpers are recomputed in every program that needs them (they are cheap).
        stack = list(chosen)
        while stack:
            for arg in stack.pop().all_input_nodes:
                if arg not in chosen and arg.op != "placeholder" and categories[arg] in (Category.CONST, Category.SIZE):
                    if name != "device" and categories[arg] is Category.SIZE and is_size_query(arg):
                        chosen.add(arg)  # rewritten to evaluate_size below; its tensor arg is not needed
                        continue
                    chosen.add(arg)
                    stack.append(arg)
        members[name] = sorted(chosen, key=order.__getitem__)
    _check_device_symbols([n for n in members["device"] if categories[n] is Category.DEVICE], categories)

    owner: dict[torch.fx.Node, str] = {}
    for name in ("host", "device", "post"):
        for node in members[name]:
            if categories[node] is primary[name]:
                owner[node] = name
    for node in members["host"]:  # CONST/SIZE values the graph returns are served by the host
        owner.setdefault(node, "host")

    programs: dict[str, Program] = {}
    exported: dict[str, list[torch.fx.Node]] = {name: [] for name in primary}

    def needs(consumer_nodes, consumer_name):
        for node in consumer_nodes:
            for arg in node.all_input_nodes:
                src = owner.get(arg)
                if arg.op != "placeholder" and src and src != consumer_name and arg not in members[consumer_name]:
                    if arg not in exported[src]:
                        exported[src].append(arg)

    needs(members["device"], "device")
    needs(members["post"], "post")
    for arg in output_node.all_input_nodes:
        if arg.op != "placeholder" and arg not in exported[owner[arg]]:
            exported[owner[arg]].append(arg)

    for name in ("host", "device", "post"):
        programs[name] = _extract(name, members[name], exported[name], placeholders, owner, exported, size_symbols, categories)

    outputs = []
    for arg in _flatten_outputs(output_node.args[0]):
        if isinstance(arg, torch.fx.Node):
            if arg.op == "placeholder":
                outputs.append(ValueRef("arg", placeholders[arg]))
            else:
                outputs.append(ValueRef(owner[arg], exported[owner[arg]].index(arg)))
        else:
            outputs.append(ValueRef("literal", arg))
    counts = {c.value: sum(1 for v in categories.values() if v is c) for c in Category}
    report = {
        "node_categories": counts,
        "device_inputs_from_host": [str(ref) for ref in programs["device"].inputs if ref.program == "host"],
        "host_nodes": [n.name for n in members["host"]],
        "post_nodes": [n.name for n in members["post"]],
    }
    return LiftedGraph(programs["host"], programs["device"], programs["post"], outputs, categories, report)


def _flatten_outputs(value):
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _flatten_outputs(item)
    else:
        yield value


def _extract(name, nodes, outputs, placeholders, owner, exported, size_symbols, categories) -> Program:
    new_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[ValueRef] = []
    member_set = set(nodes)

    def add_input(node: torch.fx.Node, ref: ValueRef) -> None:
        placeholder = new_graph.placeholder(node.name)
        placeholder.meta = dict(node.meta)
        env[node] = placeholder
        inputs.append(ref)

    external = []
    for node in nodes:
        if name != "device" and categories.get(node) is Category.SIZE and is_size_query(node):
            continue  # becomes evaluate_size over the dynamic sizes; the tensor is not an input
        for arg in node.all_input_nodes:
            if arg not in member_set and arg not in external:
                external.append(arg)
    symbol_inputs = {}
    for arg in external:
        if arg.op == "placeholder":
            add_input(arg, ValueRef("arg", placeholders[arg]))
        else:
            add_input(arg, ValueRef(owner[arg], exported[owner[arg]].index(arg)))
    if name != "device":
        for node in nodes:
            if categories.get(node) is Category.SIZE and is_size_query(node):
                for symbol, placeholder in size_symbols.items():
                    if placeholder not in env and placeholder not in symbol_inputs:
                        symbol_inputs[placeholder] = symbol
        for placeholder in symbol_inputs:
            add_input(placeholder, ValueRef("arg", placeholders[placeholder]))

    for node in nodes:
        if name != "device" and categories.get(node) is Category.SIZE and is_size_query(node):
            value = example_value(node)
            if isinstance(value, int):
                env[node] = value
                continue
            expr = value.node.expr if isinstance(value, torch.SymInt) else None
            if expr is None or free_unbacked_symbols(value):
                raise UnsupportedGraphError(f"{name} program needs the size {node.name}={value}, which is not a function of the call's sizes",
                                            "size not a function of the call's sizes")
            expression_id, symbols = register_size_expression(expr)
            missing = [s for s in symbols if s not in size_symbols]
            if missing:
                raise UnsupportedGraphError(f"size {node.name}={expr} uses symbols {missing} that are not graph inputs",
                                            "size not a function of the call's sizes")
            env[node] = new_graph.call_function(
                evaluate_size, (expression_id, *(env[size_symbols[s]] for s in symbols))
            )
            continue
        env[node] = new_graph.node_copy(node, lambda arg: env[arg])
    new_graph.output(tuple(env[node] for node in outputs))
    new_graph.lint()
    gm = torch.fx.GraphModule(torch.nn.Module(), new_graph, class_name=f"KimiCG{name.capitalize()}Program")
    return Program(name, gm, inputs, list(outputs))
