"""TableGatherPass: per-item reads of a module-state table become one device gather with a host-made plan.

MoonViT's RoPE table is sliced per image and the slices concatenated (NOTE [table gathers] in
kimi_cg/runtime/table_rows.py)::

    getitem: "c64[u0, u1, 36]" = freqs_cis[(slice(None, u0), slice(None, u1))]
    reshape: "c64[u0*u1, 36]" = getitem.reshape(-1, 36)
    ... (the same for the next image)
    cat: "c64[u0*u1 + u2*u3, 36]" = torch.cat([reshape, reshape_1])

becomes the same chain on the host, on a stand-in that records which table rows each row reads,
and one gather on the device that reads the table where it lives::

    source = table_source((512, 512), 36)                                  # host, cached
    getitem' = table_getitem(source, (slice(None, u0), slice(None, u1)))   # host, per item
    ...
    cat' = table_cat([reshape', reshape_1'])                               # host
    gathered: "f32[R, 36, 2]" = kimi_cg.table_gather(freqs_cis.reshape(-1, 36), table_plan_index(cat'),
                                                     table_plan_weight(cat'))   # device

The position grid's bicubic resize (``kimi_cg.bicubic_resize`` after SeparableResizePass) is such a
read too, of 16 rows per output row; of the table's own grid (its input made from the table alone, so
evaluated here, at compile time, and found affine) it stays 4 row taps by 4 column taps
(``table_bicubic_pairs``, the op's ``outer`` 4). A chain qualifies when it starts at a module-state tensor of
static shape, reads it only through the ops of table_rows.py with the features kept whole, has a
grid-dependent (per-item) shape somewhere, and leaves through one tensor [R, c..., D] that only
feeds device work (through views). Anything else is left as it was: the host computes it as before.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import kimi_cg.ops  # noqa: F401  (registers torch.ops.kimi_cg.*)
from kimi_cg import capture
from kimi_cg.aliasing import Aliasing
from kimi_cg.capture import example_value
from kimi_cg.canonicalize.base import GraphPass, fake_value, replay_before, stable_topological_sort
from kimi_cg.counters import counters
from kimi_cg.lift import activation_dependent_nodes
from kimi_cg.runtime import table_rows as tr
from kimi_cg.runtime.gather_plan import row_numel, row_size
from kimi_cg.runtime.table_rows import DEVICE_PLACEMENT, TABLE_ROWS

_METHODS = {
    "view": tr.table_view, "reshape": tr.table_reshape, "permute": tr.table_permute, "transpose": tr.table_transpose,
    "contiguous": tr.table_identity, "clone": tr.table_identity, "flatten": tr.table_flatten,
    "unsqueeze": tr.table_unsqueeze, "squeeze": tr.table_squeeze, "repeat": tr.table_repeat,
    "expand": tr.table_expand, "mul": tr.table_scale,
}
_FUNCTIONS = {
    operator.getitem: tr.table_getitem, torch.cat: tr.table_cat, torch.concat: tr.table_cat,
    torch.permute: tr.table_permute, torch.reshape: tr.table_reshape, torch.flatten: tr.table_flatten,
    torch.transpose: tr.table_transpose, torch.unsqueeze: tr.table_unsqueeze, torch.squeeze: tr.table_squeeze,
    torch.ops.kimi_cg.bicubic_resize.default: tr.table_bicubic, operator.mul: tr.table_scale, torch.mul: tr.table_scale,
}


def stand_in_steps() -> frozenset:
    """Every table_rows.py step the pass puts on a stand-in (pure functions of their arguments: NOTE
    [table constants folded] runs those that read no call's input once)."""
    return frozenset({*_METHODS.values(), *_FUNCTIONS.values(), tr.table_source, tr.table_bicubic_pairs})


_SIZE_QUERIES = {
    torch.ops.aten.sym_size.int: row_size,
    torch.ops.aten.sym_numel.default: row_numel,
    torch.ops.aten.sym_storage_offset.default: tr.table_storage_offset,
}
_VIEWS = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "expand", "permute", "transpose", "contiguous",
          "select", "narrow"}


def _function(node: torch.fx.Node):
    if node.op == "call_method":
        return _METHODS.get(node.target)
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    return None


def _argument(node: torch.fx.Node, position: int, name: str, default):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _axis_after(node: torch.fx.Node, axes: dict, feature: int) -> int:
    """The feature dim's position in node's value (its table inputs' positions in ``axes``); raises
    NotATableRead for a step the stand-in cannot take (the checks table_rows.py makes at run time)."""
    function = _function(node)
    source = node.args[0] if node.args else None
    if function is tr.table_cat:
        tensors = list(source) if isinstance(source, (list, tuple)) else []
        if not tensors or any(t not in axes for t in tensors) or len({axes[t] for t in tensors}) != 1:
            raise tr.NotATableRead("cat of values that are not reads of the table alike")
        ndim = example_value(tensors[0]).dim()
        tr.cat_check(ndim, axes[tensors[0]], _argument(node, 1, "dim", 0))
        return axes[tensors[0]]
    if source not in axes:
        raise tr.NotATableRead("the table read is not the op's first argument")
    if any(arg in axes for arg in node.all_input_nodes if arg is not source):
        raise tr.NotATableRead("an op reading the table twice")
    ndim, axis = example_value(source).dim(), axes[source]
    rest = node.args[1:]
    if function is tr.table_permute or function is tr.table_transpose:
        dims = tr.transpose_dims(ndim, *rest) if function is tr.table_transpose else rest
        return tr.permute_axis(ndim, axis, dims)
    if function is tr.table_unsqueeze:
        return tr.unsqueeze_axis(ndim, axis, _argument(node, 1, "dim", None))
    if function is tr.table_squeeze:
        dim = _argument(node, 1, "dim", None)
        if not isinstance(dim, int):
            raise tr.NotATableRead("squeeze without one literal dim")
        tr.squeeze_check(ndim, axis, dim)
        size = example_value(source).shape[dim]
        if not isinstance(size, int):
            raise tr.NotATableRead("squeeze of a grid-dependent dim")
        return axis - (tr.normalize_dim(dim, ndim) < axis and size == 1)
    if function is tr.table_flatten:
        return tr.flatten_axis(ndim, axis, _argument(node, 1, "start_dim", 0), _argument(node, 2, "end_dim", -1))
    if function is tr.table_view or function is tr.table_reshape:
        return len(tr.view_check(ndim, axis, feature, rest))
    if function is tr.table_getitem:
        return tr.getitem_plan(ndim, axis, feature, node.args[1])[1]
    if function is tr.table_repeat:
        tr.repeat_check(ndim, axis, rest)
        return axis
    if function is tr.table_bicubic:
        tr.bicubic_check(ndim, axis)
        return axis
    if function is tr.table_expand:
        tr.expand_check(ndim, axis, feature, rest)
        return axis
    if function is tr.table_scale:
        if len(node.args) != 2 or node.kwargs:
            raise tr.NotATableRead("a product of other than two factors")
        factor = node.args[1]
        tr.scale_check(example_value(factor) if isinstance(factor, torch.fx.Node) else factor)
        if example_value(node).dtype != example_value(source).dtype:
            raise tr.NotATableRead("a product that changes the table's dtype")
        return axis
    if function is tr.table_identity:
        if node.kwargs or len(node.args) > 1:
            raise tr.NotATableRead("contiguous / clone with arguments")
        return axis
    raise tr.NotATableRead(f"{node.target} is not a table read")


class _NotStatic(Exception):
    pass


def _static_read(node: torch.fx.Node, anchor: torch.fx.Node, feature: int, values: dict):
    """The stand-in of a read made from the table alone (no per-item value on the way), evaluated now;
    None for any other node."""
    if node in values:
        return values[node]
    value = None
    if node is anchor:
        value = tr.table_source(tuple(example_value(anchor).shape[:-1]), feature)
    elif _function(node) is not None and not _unbacked(node):
        def evaluate(arg):
            read = _static_read(arg, anchor, feature, values)
            if read is None:
                raise _NotStatic
            return read

        try:
            args = torch.fx.node.map_arg(node.args, evaluate)
            kwargs = torch.fx.node.map_arg(node.kwargs, evaluate)
            value = _function(node)(*args, **kwargs)
        except (_NotStatic, tr.NotATableRead, IndexError, TypeError, ValueError, RuntimeError):
            value = None
    values[node] = value
    return value


def _pair_bicubics(anchor: torch.fx.Node, feature: int, keep: list) -> dict:
    """{bicubic node: (base, row_step, column_step)} for the resizes of the table's own grid."""
    pairs, values = {}, {}
    for node in keep:
        if _function(node) is tr.table_bicubic and len(node.args) == 3 and not node.kwargs:
            read = _static_read(node.args[0], anchor, feature, values)
            steps = tr.affine_grid(read) if read is not None else None
            if steps is not None:
                pairs[node] = steps
    return pairs


def _plan_outer(keep: list, pairs: dict) -> dict:
    """Each region node's ``outer`` as table_rows.py's functions will make it at run time."""
    outer = {}
    for node in keep:
        function = _function(node)
        if node in pairs:
            outer[node] = 4
        elif function is tr.table_cat:
            outer[node] = tr.cat_outer(outer.get(t, 0) for t in node.args[0])
        elif function is tr.table_bicubic:
            outer[node] = 0
        else:
            outer[node] = outer.get(node.args[0], 0)
    return outer


def _unbacked(node: torch.fx.Node) -> bool:
    value = example_value(node)
    return isinstance(value, torch.Tensor) and bool(free_unbacked_symbols(value.shape))


def _feeds_device(node: torch.fx.Node, activation: set, depth: int = 4) -> bool:
    """Every use of node, through views, is device work (depends on activations)."""
    if not node.users:
        return False
    for user in node.users:
        if user in activation or user.meta.get(DEVICE_PLACEMENT):  # NOTE [sums of table reads]: a device add
            continue
        is_view = (user.op == "call_method" and user.target in _VIEWS
                   or user.op == "call_function" and user.target in (torch.view_as_real, torch.view_as_complex,
                                                                    operator.getitem, torch.select))
        if not (is_view and depth and _feeds_device(user, activation, depth - 1)):
            return False
    return True


def activation_devices(inputs) -> set:
    """The devices of the graph's activation inputs (a device gather runs there; one device expected)."""
    return {example_value(item.node).device for item in inputs if item.role is capture.InputRole.ACTIVATION
            and isinstance(example_value(item.node), torch.Tensor)}


def _table_anchor(node: torch.fx.Node) -> int | None:
    """The feature size of a module-state tensor the pass can gather from (static shape, float or complex)."""
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or not (value.is_floating_point() or value.is_complex()):
        return None
    if any(not isinstance(size, int) for size in value.shape):
        return None
    return value.shape[-1]


# NOTE [sums of table reads]
# MoonViT3d's position term of a chunk is its resized grid repeated over the t frames plus a time row
# per frame (a second table, ``time_weight[:t]``, scaled by the chunk's 0 / 1 video flag and broadcast
# over the patches), flattened, and the chunks' terms concatenated. A sum of two reads is not a read of
# one table, so the pass found no single exit and the host computed the whole [rows, D] term on each new
# size (the resize, the repeat, the add: most of a new 3D request's host pass, and a table the host reads
# must be checked every call). ``cat([flatten(a_i + b_i)])`` is split here, before the regions are found,
# into ``cat([flatten(a_i)]) + cat([flatten(b_i.expand(a_i's sizes))])``: the same element sums (a_i has
# the sum's shape, b_i broadcasts to it, all three of one dtype), so the same numbers. Each cat is then a
# read of one table, gathered on the device (the time rows with ``table_scale``: the flag scales their
# plan's weights; ``table_expand``: the broadcast), and the add between them is marked for the device. A
# split whose two sides both stay host values has its mark taken off again (one host tensor, as before).
_FLATTEN_METHODS = frozenset({"flatten", "reshape"})  # not view: the expanded side is not contiguous


def _flattened_sum(piece: torch.fx.Node, activation: set, anchors: set):
    """(full, broadcast) when ``piece`` is ``(full + broadcast).flatten(...)`` (or a reshape with literal
    sizes) used once, of reads of module state, the sum having ``full``'s shape and one dtype."""
    is_flatten = (piece.op == "call_method" and piece.target in _FLATTEN_METHODS
                  or piece.op == "call_function" and piece.target is torch.flatten)
    if not is_flatten or not piece.args or len(piece.users) != 1 or piece.all_input_nodes != [piece.args[0]]:
        return None
    total = piece.args[0]
    is_add = (total.op == "call_function" and total.target in (operator.add, torch.add)
              or total.op == "call_method" and total.target == "add")
    if not is_add or len(total.args) != 2 or total.kwargs or len(total.users) != 1:
        return None
    left, right = total.args
    if not (isinstance(left, torch.fx.Node) and isinstance(right, torch.fx.Node)) or left is right:
        return None
    if left in activation or right in activation:
        return None
    values = [example_value(n) for n in (total, left, right)]
    if not all(isinstance(v, torch.Tensor) for v in values) or len({v.dtype for v in values}) != 1:
        return None
    if len({v.dim() for v in values}) != 1:
        return None
    sizes = [tuple(str(size) for size in v.shape) for v in values]
    for full, other, full_sizes in ((left, right, sizes[1]), (right, left, sizes[2])):
        if full_sizes == sizes[0] and _reads_state(full, anchors) and _reads_state(other, anchors):
            return full, other
    return None


def _reads_state(node: torch.fx.Node, anchors: set, depth: int = 16) -> bool:
    """Whether ``node`` is computed from a module-state tensor (within ``depth`` steps)."""
    seen, frontier = set(), [node]
    for _ in range(depth):
        following = []
        for current in frontier:
            if current in anchors:
                return True
            for arg in current.all_input_nodes:
                if arg not in seen:
                    seen.add(arg)
                    following.append(arg)
        frontier = following
    return False


def _split_table_sums(graph: torch.fx.Graph, activation: set, anchors: set) -> list[torch.fx.Node]:
    """NOTE [sums of table reads]: the adds that replaced a split cat."""
    splits = []
    for cat in list(graph.nodes):
        if cat.op != "call_function" or cat.target not in (torch.cat, torch.concat) or cat in activation:
            continue
        pieces = cat.args[0] if cat.args else None
        if (not isinstance(pieces, (list, tuple)) or not pieces or len(set(pieces)) != len(pieces)
                or not all(isinstance(p, torch.fx.Node) for p in pieces)):
            continue
        if "tensors" in cat.kwargs or not _feeds_device(cat, activation):
            continue
        found = [_flattened_sum(piece, activation, anchors) for piece in pieces]
        if any(pair is None for pair in found):
            continue
        made = []

        def new_node(node: torch.fx.Node) -> torch.fx.Node:
            made.append(node)
            node.meta["stack_trace"] = cat.meta.get("stack_trace")
            node.meta["val"] = fake_value(node)
            if node.meta["val"] is None:
                raise tr.NotATableRead("no example value")
            return node

        try:
            with graph.inserting_before(cat):
                sides = ([], [])
                for piece, (full, other) in zip(pieces, found):
                    sizes = [size if isinstance(size, int) else
                             new_node(graph.call_function(torch.ops.aten.sym_size.int, (full, d)))
                             for d, size in enumerate(example_value(full).shape)]
                    expanded = new_node(graph.call_method("expand", (other, *sizes)))
                    for side, value in zip(sides, (full, expanded)):
                        side.append(new_node(graph.create_node(piece.op, piece.target, (value, *piece.args[1:]),
                                                          dict(piece.kwargs))))
                first, second = (new_node(graph.call_function(cat.target, (side, *cat.args[1:]), dict(cat.kwargs)))
                                 for side in sides)
                total = new_node(graph.call_function(operator.add, (first, second)))
        except Exception:  # noqa: BLE001 - a form the fake values refuse: the cat stays as it was
            for node in reversed(made):
                graph.erase_node(node)
            continue
        total.meta[DEVICE_PLACEMENT] = True
        cat.replace_all_uses_with(total)
        graph.erase_node(cat)
        for piece in pieces:
            summed = piece.args[0]
            graph.erase_node(piece)
            graph.erase_node(summed)
        splits.append(total)
    return splits


class TableGatherPass(GraphPass):
    name = "table_gather"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        inputs = capture.classify_inputs(gm)
        activation = activation_dependent_nodes(graph, inputs)
        mutated = Aliasing(graph).mutated
        anchors = [item.node for item in inputs if item.role is capture.InputRole.MODULE_STATE]
        # The device program runs where the activations are: a table elsewhere (built on a CPU grid's
        # device) stays a host read, copied in as before.
        devices = activation_devices(inputs)
        splits = _split_table_sums(graph, activation, set(anchors))  # NOTE [sums of table reads]
        gathered = []
        for anchor in anchors:
            feature = _table_anchor(anchor)
            if feature is None or anchor in mutated or {example_value(anchor).device} != devices:
                continue
            found = self._region(graph, anchor, feature, activation, mutated)
            if found is not None:
                self._rewrite(graph, anchor, feature, *found)
                gathered.append(anchor.name)
        kept_splits = 0
        for total in splits:  # a split whose sides both stay host values goes back to the host
            if any(arg.op == "call_function" and arg.target is torch.ops.kimi_cg.table_gather.default
                   for side in total.all_input_nodes for arg in [side] + side.all_input_nodes):
                kept_splits += 1
            else:
                del total.meta[DEVICE_PLACEMENT]
        counters["table_sums_split"] += kept_splits
        if gathered or splits:
            stable_topological_sort(graph)
        if gathered:
            counters["table_gathers"] += len(gathered)
        return {"tables": len(gathered), "anchors": gathered, "sums_split": kept_splits}

    @staticmethod
    def _region(graph, anchor, feature, activation, mutated):
        """(region nodes in graph order, their feature positions, the exit) or None."""
        axes = {anchor: example_value(anchor).dim() - 1}
        region = []
        for node in graph.nodes:
            if node in activation or node in mutated or _function(node) is None:
                continue
            if not any(arg in axes for arg in node.all_input_nodes):
                continue
            try:
                axis = _axis_after(node, axes, feature)
            except (tr.NotATableRead, IndexError, TypeError, ValueError):
                continue
            value = example_value(node)
            if not isinstance(value, torch.Tensor) or value.dim() <= axis or value.shape[axis] != feature:
                continue
            axes[node] = axis
            region.append(node)
        per_item = [node for node in region if _unbacked(node)]
        if not per_item:
            return None
        # Keep what leads to a per-item read and what follows from one; a weight's other views stay.
        downstream = set(per_item)
        for node in region:
            if any(arg in downstream for arg in node.all_input_nodes):
                downstream.add(node)
        upstream, stack = set(), list(per_item)
        while stack:
            for arg in stack.pop().all_input_nodes:
                if arg in axes and arg is not anchor and arg not in upstream:
                    upstream.add(arg)
                    stack.append(arg)
        keep = [node for node in region if node in downstream or node in upstream]
        kept = set(keep)

        def outside_users(node):
            return [u for u in node.users
                    if u not in kept and not (u.op == "call_function" and u.target in _SIZE_QUERIES)]

        exits = [node for node in keep if node in downstream and outside_users(node)]
        if len(exits) != 1:
            return None
        (exit_node,) = exits
        shape = example_value(exit_node).shape
        if axes[exit_node] != len(shape) - 1 or any(not isinstance(size, int) for size in shape[1:]):
            return None
        if not _feeds_device(exit_node, activation):
            return None
        if any(outside_users(node) for node in keep if node in downstream and node is not exit_node):
            return None
        return keep, exit_node

    @staticmethod
    def _rewrite(graph, anchor, feature, keep, exit_node) -> None:
        value = example_value(anchor)
        leading = tuple(value.shape[:-1])
        first = keep[0]
        with graph.inserting_before(first):
            source = graph.call_function(tr.table_source, (leading, feature))
        source.meta[TABLE_ROWS] = True
        host = {anchor: source}
        pairs = _pair_bicubics(anchor, feature, keep)
        to_host = replay_before(graph, keep, host,
                                lambda node: tr.table_bicubic_pairs if node in pairs else _function(node),
                                marks=(TABLE_ROWS,))
        for node, steps in pairs.items():
            host[node].args = (*host[node].args, *steps)
        counters["table_gather_pairs"] += len(pairs)
        outer = _plan_outer(keep, pairs)[exit_node]
        kept = set(keep)
        for node in list(graph.nodes):  # sizes of the per-item reads are host values now
            if node.op == "call_function" and node.target in _SIZE_QUERIES and node.args and node.args[0] in kept:
                with graph.inserting_before(node):
                    replacement = graph.call_function(_SIZE_QUERIES[node.target], tuple(map(to_host, node.args)))
                node.replace_all_uses_with(replacement)
                graph.erase_node(node)

        shape = tuple(example_value(exit_node).shape)
        with graph.inserting_after(host[exit_node]):
            index = graph.call_function(tr.table_plan_index, (host[exit_node], outer))
        with graph.inserting_after(index):
            weight = graph.call_function(tr.table_plan_weight, (host[exit_node], outer))
        with graph.inserting_after(weight):
            flat = graph.call_method("reshape", (anchor, -1, feature)) if value.dim() != 2 else anchor
        with graph.inserting_after(flat):
            gathered = graph.call_function(torch.ops.kimi_cg.table_gather.default,
                                           (flat, index, weight, outer) if outer else (flat, index, weight))
        gathered.meta[DEVICE_PLACEMENT] = True
        gathered.meta["stack_trace"] = exit_node.meta.get("stack_trace")
        cursor = gathered
        if value.is_complex():
            pairs_shape = (-1, *shape[1:], 2)
            for user in list(exit_node.users):
                if user.op == "call_function" and user.target is torch.view_as_real and user.args == (exit_node,):
                    with graph.inserting_after(cursor):
                        cursor = graph.call_method("view", (gathered, *pairs_shape))
                    user.replace_all_uses_with(cursor)
                    graph.erase_node(user)
            if exit_node.users:
                with graph.inserting_after(cursor):
                    pairs = graph.call_method("view", (gathered, *pairs_shape))
                with graph.inserting_after(pairs):
                    cursor = graph.call_function(torch.view_as_complex, (pairs,))
                exit_node.replace_all_uses_with(cursor)
        else:
            if len(shape) != 2:
                with graph.inserting_after(cursor):
                    cursor = graph.call_method("view", (gathered, -1, *shape[1:]))
            exit_node.replace_all_uses_with(cursor)
        for node in reversed(keep):
            if not node.users:
                graph.erase_node(node)
