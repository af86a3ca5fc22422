"""Whether a device program may run on a bucket's padded rows: NOTE [row locality].

NOTE [row locality]
The bucketed path (graphs.py) runs a call of L packed rows in a bucket of C >= L rows: the row inputs
get C - L zero rows, and outputs are sliced back to L rows. That is only the call's result when no
real output element reads a padding row. Ops that keep rows apart do (pointwise math, per-row
linear layers, with a GELU fused or not (NOTE [linear + GELU epilogue]), and norms, views that keep or
merge whole rows, gathers by row index); kimi_cg's own ops do too by construction (varlen attention
with the padding in its own segment, merge gathers whose padding plan rows read nothing). Ops that
combine rows do not: a mean, softmax, scan, sort or attention over the row axis, a matmul contracting
it, a slice of it, a cat along it.

``padding_hazard(gm, rules, inputs)`` walks the program and returns None when every op that touches
row data is on a list of row-local ops with the row axis where the op keeps it, else the first op
that is not, with its source line. An op it does not know counts as a hazard: such programs run
unpadded (the plain device program), never wrong, only not replayed as a CUDA graph.

The row axis of a value is found by running the program twice on meta tensors: once with one call's
input shapes, once with its rows and merge-plan rows doubled; a row axis is a dim whose size differs.
A value computed from row data must keep exactly one such axis. Dynamo's static first trace is not
analysed (BucketedGraphs' ``exact_rows``): its one bucket is its exact row count, nothing is padded.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx
import torch.nn.functional as F

from kimi_cg.varlen_registry import argument, registered_segments

_KIMI_CG_GATHERS = ("kimi_cg.merge_gather", "kimi_cg.merge_gather_layernorm", "merge_gather", "merge_gather_layernorm")


def _objects(*candidates):
    found = set()
    for owner, names in candidates:
        for name in names.split():
            value = getattr(owner, name, None)
            if value is not None:
                found.add(value)
    return found


_POINTWISE_NAMES = ("add sub mul div true_divide floor_divide neg exp log log1p expm1 sigmoid tanh sin cos rsqrt sqrt "
                    "pow clamp clamp_min clamp_max where abs erf reciprocal square maximum minimum masked_fill lerp "
                    "sign relu gelu silu mish softplus hardtanh hardswish hardsigmoid leaky_relu elu selu celu "
                    "logical_not logical_and logical_or bitwise_and bitwise_or eq ne lt le gt ge isnan isfinite "
                    "nan_to_num float half bfloat16 double to type type_as contiguous clone detach fill zeros_like "
                    "ones_like full_like empty_like")
_POINTWISE_FUNCTIONS = _objects((torch, _POINTWISE_NAMES), (torch._C._nn, "gelu silu relu hardtanh leaky_relu elu softplus"),
                                (F, "gelu silu relu sigmoid tanh mish softplus hardtanh hardswish hardsigmoid leaky_relu "
                                 "elu selu celu"), (torch.Tensor, _POINTWISE_NAMES)) | {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.neg, operator.pow,
    operator.mod, operator.and_, operator.or_, operator.invert, operator.eq, operator.ne, operator.lt, operator.le,
    operator.gt, operator.ge, operator.abs, operator.pos}
_POINTWISE_METHODS = set(_POINTWISE_NAMES.split()) | {"__add__", "__mul__", "__sub__", "__truediv__", "__neg__",
                                                      "__radd__", "__rmul__", "__rsub__", "__rtruediv__", "__pow__"}
_PERMUTES = {"transpose", "permute", "movedim", "swapaxes", "t", "mT"}
_RESHAPES = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "expand", "expand_as", "view_as",
             "reshape_as"}
# [..., n] complex <-> [..., n, 2] real: each element's pair stays with it (a reshape of the storage).
_COMPLEX_VIEWS = {"view_as_real", "view_as_complex"}
_AXIS_OPS = {"softmax", "log_softmax", "sum", "mean", "amax", "amin", "max", "min", "cumsum", "cumprod", "logsumexp",
             "norm", "var", "std", "prod", "any", "all", "argmax", "argmin", "sort", "argsort", "flip", "roll",
             "split", "chunk", "unbind", "narrow", "select", "cummax", "cummin", "split_with_sizes", "tensor_split"}


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket._qualified_op_name).replace("::", ".")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target._qualified_op_name).replace("::", ".")
    return getattr(target, "__name__", str(target))


def _shapes(gm: torch.fx.GraphModule, rules, inputs, scale: int) -> dict:
    """Every node's output shape(s) when the program runs on meta tensors shaped like ``inputs`` with the
    padded sizes (rows and merge-plan rows) multiplied by ``scale``: shapes only, nothing computed."""
    args = []
    for rule, value in zip(rules, inputs):
        if rule.kind in ("size", "index_size"):
            args.append(value * scale)
        elif isinstance(value, torch.Tensor):
            shape = list(value.shape)
            if rule.kind in ("rows", "plan_index", "plan_weight", "row_index") and shape:
                shape[rule.dim] *= scale
            args.append(torch.empty(shape, dtype=value.dtype, device="meta"))
        else:
            args.append(value)
    shapes = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            shapes[node] = _shape_of(result)
            return result

    Recorder(gm).run(*args)
    return shapes


def _shape_of(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (tuple, list)):
        return tuple(_shape_of(item) for item in value)
    return value if isinstance(value, int) else None


def _dims(node: torch.fx.Node, rank: int, position: int = 1, name: str = "dim"):
    """The dim argument(s) of an axis op, normalised; None when absent (all dims)."""
    dim = node.args[position] if len(node.args) > position else node.kwargs.get(name)
    if dim is None:
        return None
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return "unknown"
    return {d + rank if d < 0 else d for d in dims}


def padding_hazard(gm: torch.fx.GraphModule, rules, inputs) -> str | None:
    """None when zero padding rows can never reach a real output element (NOTE [row locality]), else
    the first op that could move padding into real rows, with where it comes from. ``inputs``: one
    call's device inputs; the program is run twice on meta tensors (that call's shapes, and twice its
    rows) and an axis is a row axis where the two runs' sizes differ."""
    from kimi_cg.lift import is_size_query, source_location

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    row_inputs = {node for node, rule in zip(placeholders, rules) if rule.kind == "rows"}
    if not row_inputs:
        return None
    try:
        small, large = _shapes(gm, rules, inputs, 1), _shapes(gm, rules, inputs, 2)
    except Exception as error:  # noqa: BLE001 - an op without a meta kernel: not provably row-local
        return f"the program does not run on meta tensors ({type(error).__name__}: {str(error)[:200]})"
    shapes = _Shapes(small, large)
    # The packed rows in both runs (the row inputs' sizes up to their row axis: dim 0, or dim 1 after a
    # batch of one, NOTE [rows on dim 1] in kimi_cg/capture.py), or None when they disagree.
    row_counts = {shapes.leading(node, rule.dim + 1) for node, rule in zip(placeholders, rules)
                  if node in row_inputs and shapes.is_tensor(node) and shapes.rank(node) > rule.dim}
    rows = row_counts.pop() if len(row_counts) == 1 else None
    segment_inputs = {node for node, rule in zip(placeholders, rules) if rule.kind == "cu_seqlens"}
    group_indices = {node for node, rule in zip(placeholders, rules) if rule.kind == "row_index"}
    tainted = set(row_inputs)
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or is_size_query(node):
            continue  # a size query reads the shape, not the rows
        inputs_ = [arg for arg in node.all_input_nodes if arg in tainted]
        if not inputs_:
            continue
        problem = _check(node, inputs_, shapes, segment_inputs, group_indices, rows)
        if problem is not None:
            return f"{problem}: {_name(node)} at {source_location(node)}"
        tainted.add(node)
    for index in group_indices:  # padded with the identity: only a permutation of row groups may read it
        for user in index.users:
            if user not in tainted:
                return f"a row-group index into a tensor without rows: {_name(user)} at {source_location(user)}"
    return None


class _Shapes:
    """A node's shape in both meta runs; its row axes are the dims whose sizes differ."""

    def __init__(self, small: dict, large: dict):
        self.small, self.large = small, large

    def rank(self, node) -> int:
        return len(self.small[node])

    def row_axes(self, node) -> list[int]:
        a, b = self.small.get(node), self.large.get(node)
        if not (isinstance(a, tuple) and all(isinstance(x, int) for x in a)):
            return []
        return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]

    def is_tensor(self, node) -> bool:
        shape = self.small.get(node)
        return isinstance(shape, tuple) and all(isinstance(x, int) for x in shape)

    def leading(self, node, axis: int) -> tuple[int, int]:
        a, b = self.small[node], self.large[node]
        return math.prod(a[:axis]), math.prod(b[:axis])


def _check(node, inputs, shapes: _Shapes, segment_inputs, group_indices=frozenset(), rows=None) -> str | None:
    name = _name(node)
    if node.op == "call_function" and node.target is operator.getitem and not shapes.is_tensor(node.args[0]):
        return None  # an element of a split / unbind tuple: checked at the op that made it
    axes_in = {arg: shapes.row_axes(arg) for arg in inputs}
    if any(len(axes) != 1 for axes in axes_in.values()):
        return "an input without a single row axis"
    segments = registered_segments(node.target) if node.op == "call_function" else []
    if segments:  # a registered varlen attention: rows on axis 0, boundaries padded as cu_seqlens
        bounds = [argument(node, position, arg_name) for position, arg_name in segments]
        ok = all(axes == [0] for axes in axes_in.values()) and all(
            isinstance(b, torch.fx.Node) and _comes_from(b, segment_inputs) for b in bounds)
        # The padded boundaries end at the bucket's rows: the attention's tensors must hold exactly the
        # packed rows, in both meta runs (not, say, merged rows: a quarter of them).
        ok = ok and rows is not None and all(shapes.leading(arg, 1) == rows for arg in inputs)
        return None if ok else "varlen attention not on rows padded with their own segment"
    if name in _KIMI_CG_GATHERS:
        # Output rows are plan rows: padding plan rows read nothing (index -1); real ones read real rows.
        ok = axes_in.get(node.args[0]) == [0] and all(arg not in inputs for arg in node.args[1:])
        return None if ok else "a gather plan made from rows"
    if name in ("kimi_cg.table_gather", "table_gather"):
        # NOTE [table gathers]: output row r reads plan row r (zeros in padding rows) and a table without rows.
        ok = node.args[0] not in inputs and all(axes_in.get(arg) == [0] for arg in node.args[1:3])
        return None if ok else "a table gather whose table has rows"
    tuple_out = not shapes.is_tensor(node)
    if not tuple_out:
        axes_out = shapes.row_axes(node)
        if len(axes_out) != 1:
            return "combines the rows (no single row axis left)"
        axis = axes_out[0]
        rank_out = shapes.rank(node)
    first = inputs[0]
    rank_in = shapes.rank(first)
    axis_in = axes_in[first][0]
    if _pointwise(node) and not tuple_out:
        if name == "dropout" or node.target in (F.dropout, torch.dropout):
            if not _eval_dropout(node):
                return "dropout in training mode"
        for arg in inputs:  # broadcasting aligns dims from the right
            if shapes.rank(arg) - axes_in[arg][0] != rank_out - axis:
                return "rows broadcast against another axis"
        return None
    if name in _PERMUTES and not tuple_out:
        return None  # each row's elements stay at that row's index of the moved axis
    if (name in _RESHAPES or name in _COMPLEX_VIEWS) and not tuple_out:
        # The same block before the row axis (in both runs): rows stay contiguous blocks, whole,
        # merged or split, never spread across another axis.
        return None if shapes.leading(first, axis_in) == shapes.leading(node, axis) else "a reshape that moves rows across axes"
    if name == "getitem" and not tuple_out:
        if _is_group_permutation(node, inputs, axis_in, shapes, group_indices):
            return None
        return _check_getitem(node, inputs, axis_in, rank_in)
    if tuple_out and name not in ("split", "chunk", "unbind", "split_with_sizes", "tensor_split"):
        return "an op not known to keep rows apart"
    if name in ("linear", "kimi_cg.linear_gelu_tanh") or node.target in (F.linear, torch._C._nn.linear):
        ok = node.args[0] in inputs and axis_in < rank_in - 1 and not any(a in inputs for a in node.args[1:])
        return None if ok else "a linear layer over the row axis"
    if name in ("layer_norm", "rms_norm"):
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        count = len(shape) if isinstance(shape, (list, tuple)) else 1
        others = [a for a in (*node.args[2:], *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
        ok = node.args[0] in inputs and axis_in < rank_in - count and not any(a in inputs for a in others)
        return None if ok else "a norm over the row axis"
    if name in ("matmul", "bmm", "__matmul__") or node.target in (torch.matmul, operator.matmul):
        a, b = node.args[:2]
        a_rank, b_rank = shapes.rank(a), shapes.rank(b)
        if a in inputs and b not in inputs and a_rank >= 2 and axis_in < a_rank - 1:
            return None
        if a in inputs and b in inputs and axes_in[a][0] < a_rank - 2 and a_rank - axes_in[a][0] == b_rank - axes_in[b][0]:
            return None  # rows as a batch axis of both
        return "a matmul that contracts or mixes the row axis"
    if name in ("conv1d", "conv2d", "conv3d"):
        ok = node.args[0] in inputs and axis_in == 0 and all(a not in inputs for a in node.args[1:3])
        return None if ok else "a convolution with rows off the batch axis"
    if name == "embedding" and node.target is F.embedding:
        return None if node.args[0] in inputs and node.args[1] not in inputs else "an embedding table made from rows"
    if name in ("cat", "concat", "concatenate", "stack"):
        tensors = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(dim, int) or any(t not in inputs for t in tensors):
            return "rows joined with values that have no rows, or along an unknown axis"
        if name == "stack":
            return None if all(axes_in[t][0] == axis_in for t in tensors) else "a stack of rows on different axes"
        dim = dim + rank_in if dim < 0 else dim
        return "a cat along the row axis" if dim == axis_in else None
    if name == "repeat_interleave":
        # Each element repeated a fixed count along another axis (grouped key/value heads read by
        # several query heads): a row's copies stay at that row's index.
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dims = _dims(node, rank_in, 2)
        ok = node.args[0] in inputs and isinstance(repeats, int) and isinstance(dims, set) and axis_in not in dims
        return None if ok else "a repeat_interleave along the row axis or by a tensor of counts"
    if name in _AXIS_OPS:
        position = 2 if name in ("split", "chunk", "split_with_sizes", "tensor_split") else 1
        dims = _dims(node, rank_in, position)
        if dims is None or dims == "unknown" or axis_in in dims:
            return "an op along the row axis"
        return None
    return "an op not known to keep rows apart"


def _comes_from(node: torch.fx.Node, sources: set) -> bool:
    """Every placeholder ``node`` is computed from is in ``sources`` (e.g. ``cu.to(torch.int32)``)."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            if current not in sources:
                return False
        else:
            stack.extend(current.all_input_nodes)
    return True


def _pointwise(node) -> bool:
    if node.op == "call_method":
        return node.target in _POINTWISE_METHODS or node.target == "dropout"
    return node.target in _POINTWISE_FUNCTIONS or node.target in (F.dropout, torch.dropout)


def _eval_dropout(node) -> bool:
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    return p == 0 or training is False


def _is_group_permutation(node, inputs, axis_in, shapes: _Shapes, group_indices) -> bool:
    """``rows[index]`` (or ``rows[index, :, ...]``) with ``index`` a row-group index input as long as
    the row axis in both runs: real entries lie in the real groups (checked per call), padding
    entries are the identity (NOTE [padding rules] in runtime/graphs.py), so rows stay apart."""
    base, index = node.args
    if base not in inputs or axis_in != 0:
        return False
    first = index[0] if isinstance(index, tuple) and index else index
    full = slice(None, None, None)
    if not isinstance(first, torch.fx.Node) or first not in group_indices:
        return False
    if isinstance(index, tuple) and any(item != full for item in index[1:]):
        return False
    return shapes.small[first][0] == shapes.small[base][0] and shapes.large[first][0] == shapes.large[base][0]


def _check_getitem(node, inputs, axis_in, rank) -> str | None:
    base, index = node.args
    if base not in inputs:  # table[index]: rows pick entries of a table that has no rows
        return None
    if isinstance(index, torch.fx.Node):
        return "an index into the row axis"
    items = index if isinstance(index, tuple) else (index,)
    # Walk the index against the dims: slices keep a dim, ints drop it, None adds one, Ellipsis fills.
    explicit = sum(1 for item in items if item is not None and item is not Ellipsis)
    dim = 0
    for item in items:
        if item is Ellipsis:
            dim += rank - explicit
            continue
        if item is None:
            continue
        if isinstance(item, torch.fx.Node):
            return "a tensor index beside the row axis"
        if dim == axis_in:
            full = isinstance(item, slice) and item.start in (None, 0) and item.stop is None and item.step in (None, 1)
            if not full:
                return "a slice or index of the row axis"
        dim += 1
    return None
