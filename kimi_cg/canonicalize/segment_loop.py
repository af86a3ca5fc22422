"""Attention written as a loop over segments becomes one varlen attention call.

transformers' vision towers (and many others) run attention per image in their sdpa and eager paths::

    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    splits = [torch.split(t, lengths.tolist(), dim=2) for t in (q, k, v)]     # [1, H, L, D] each
    outs = [attention(q_i, k_i, v_i) for q_i, k_i, v_i in zip(*splits)]        # per segment
    out = torch.cat(outs, dim=1)                                               # after .transpose(1, 2)

Traced with the item count fixed, this is ``split(q, [u0, u1, ...])`` with grid-dependent sizes, one
attention subgraph per segment and a ``cat``: every device shape depends on a grid value, so the graph
cannot be lifted. When every per-segment subgraph is the same attention (a vocabulary of two forms,
below) on the i-th pieces of q, k and v, and the pieces are cut along the sequence axis with one list
of sizes, the loop is replaced by::

    cu = sizes_to_cu_seqlens((u0, u1, ...), L)                                 # host
    o = kimi_cg.varlen_attention(q.squeeze(0).transpose(0, 1), ..., cu, L, scale)
    out = <the per-segment epilogue>(o.transpose(0, 1).unsqueeze(0))

Attention forms (``p`` = q_i, k_i, v_i of shape [1, H, n, D]):
  sdpa:   ``scaled_dot_product_attention(q, k, v, scale=s)`` (no mask, no dropout, not causal, no GQA)
  eager:  ``matmul(q, k.transpose(-2, -1)) * s`` (or ``/ c``) -> ``softmax(dim=-1[, dtype])`` ->
          ``.to(dtype)`` / ``dropout(p=0 or training=False)`` (any of them) -> ``matmul(., v)``;
          k and v may be grouped heads widened by transformers' ``repeat_kv`` (``[:, :, None]`` ->
          ``expand`` -> ``reshape``), which becomes one ``repeat_interleave`` on the packed k and v
The epilogue between the attention output and the ``cat`` may transpose, make contiguous, clone or
cast; it is the same for every segment and is applied once to the packed result, and the ``cat``
must join the pieces along the axis the sequence lands on.

Soundness: the rewrite needs structural identity, not numerics: every segment's subgraph must match
the same form with the same constants, read only its own pieces, and have no other users. The host
checks at call time that the sizes are non-negative and sum to L (``sizes_to_cu_seqlens``).
The eager form's softmax in fp32 followed by a cast is computed by the varlen kernels in fp32
internally; in fp32 the two agree to rounding, in bf16 the kernel is the more accurate.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from kimi_cg.capture import example_value
from kimi_cg.errors import UnsupportedGraphError

_VARLEN = torch.ops.kimi_cg.varlen_attention.default
_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SPLIT_FUNCTIONS = {torch.split, torch.functional.split, torch.Tensor.split}
_MATMUL = {torch.matmul, operator.matmul, torch.Tensor.matmul}
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax}
_DROPOUT = {F.dropout, torch.dropout}
_CAT = {torch.cat, torch.concat, torch.concatenate}


def sizes_to_cu_seqlens(sizes: tuple[int, ...], total: int) -> torch.Tensor:
    """Host: per-segment lengths -> int32 cu_seqlens, checking they are >= 0 and cover ``total`` rows."""
    bounds, end = [0], 0
    for segment, size in enumerate(sizes):
        if size < 0:
            raise UnsupportedGraphError(f"segment {segment} has length {size}", "negative segment length")
        end += size
        bounds.append(end)
    if end != total:
        raise UnsupportedGraphError(f"segment lengths {list(sizes)} sum to {end}, the packed sequence has {total} rows",
                                    "segments do not cover the sequence")
    return torch.tensor(bounds, dtype=torch.int32)


@dataclass
class _Segment:
    pieces: tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]  # q_i, k_i, v_i (getitems of the splits)
    form: tuple  # the attention form and its constants: equal for every segment
    scale: float | None
    epilogue: list[torch.fx.Node]  # from the attention output to the cat input, in order
    nodes: list[torch.fx.Node]  # every node of the segment's subgraph (for erasing)


def _call(node, functions=(), methods=()) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    return (node.op == "call_function" and node.target in functions) or (node.op == "call_method" and node.target in methods)


def _arg(node: torch.fx.Node, position: int, name: str, default=None):
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(name, default)


def _dim(value, rank: int):
    return value + rank if isinstance(value, int) and value < 0 else value


def is_split_by_sizes(node) -> bool:
    """``split(t, [sizes...], dim)`` in any spelling (a list of sizes, not one chunk size)."""
    if _call(node, {torch.ops.aten.split_with_sizes.default}):
        return True
    return _call(node, _SPLIT_FUNCTIONS, {"split", "split_with_sizes"}) and isinstance(
        _arg(node, 1, "split_size_or_sections"), (list, tuple))


def _split_piece(node) -> tuple[torch.fx.Node, int] | None:
    """(split node, index) when ``node`` is ``split(...)[index]``."""
    if _call(node, {operator.getitem}) and isinstance(node.args[1], int) and is_split_by_sizes(node.args[0]):
        return node.args[0], node.args[1]
    return None


def _split_sizes(split: torch.fx.Node):
    sizes = _arg(split, 1, "split_size_or_sections")
    if sizes is None:
        sizes = split.kwargs.get("split_sizes", split.kwargs.get("split_size"))
    return tuple(sizes) if isinstance(sizes, (list, tuple)) else None


def _split_dim(split: torch.fx.Node) -> int:
    tensor = example_value(split.args[0])
    return _dim(_arg(split, 2, "dim", 0), tensor.dim())


def _scalar(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _transposed_last_two(node) -> torch.fx.Node | None:
    """``k`` when ``node`` is ``k.transpose(-2, -1)`` (any spelling of the last two axes) on a 4-D k."""
    if not _call(node, {torch.transpose}, {"transpose"}):
        return None
    source = node.args[0]
    value = example_value(source)
    if not isinstance(value, torch.Tensor):
        return None
    rank = value.dim()
    dims = {_dim(_arg(node, 1, "dim0"), rank), _dim(_arg(node, 2, "dim1"), rank)}
    return source if dims == {rank - 2, rank - 1} else None


def _eager_form(output: torch.fx.Node):
    """Match ``matmul(softmax(matmul(q, k^T) * s) [.to / dropout], v)``: (pieces, form, scale, nodes) or None."""
    found = match_eager_attention(output)
    return None if found is None else found[:4]


def match_eager_attention(output: torch.fx.Node, unmask=None):
    """``_eager_form``'s match, with ``unmask(scores)`` -> (unmasked scores, extra, nodes) or None applied
    between the softmax and the scale when given (segment_attention.py's masked form): (pieces, form,
    scale, nodes, extra) or None."""
    if not _call(output, _MATMUL, {"matmul"}):
        return None
    weights, value = output.args[0], output.args[1]
    nodes = [output]
    casts = []
    while True:  # .to(dtype) and eval-mode dropout between softmax and the second matmul
        if _call(weights, _DROPOUT):
            p, training = _arg(weights, 1, "p", 0.5), _arg(weights, 2, "training", True)
            if not (p in (0, 0.0) or training is False):
                return None
            casts.append(("dropout",))
        elif _call(weights, (), {"to"}) and len(weights.args) == 2 and isinstance(weights.args[1], torch.dtype) and not weights.kwargs:
            casts.append(("to", weights.args[1]))
        else:
            break
        nodes.append(weights)
        weights = weights.args[0]
    if not _call(weights, _SOFTMAX, {"softmax"}):
        return None
    scores = weights.args[0]
    rank = example_value(scores).dim() if isinstance(example_value(scores), torch.Tensor) else None
    if rank is None or _dim(_arg(weights, 1, "dim"), rank) != rank - 1 or set(weights.kwargs) - {"dim", "dtype"}:
        return None
    softmax_dtype = weights.kwargs.get("dtype", _arg(weights, 3, "dtype") if weights.op == "call_function" else None)
    nodes.append(weights)
    extra = None
    if unmask is not None:
        unmasked = unmask(scores)
        if unmasked is None:
            return None
        scores, extra, mask_nodes = unmasked
        nodes += mask_nodes
    scale = None
    if _call(scores, {operator.mul, torch.mul}, {"mul"}):
        constant = [_scalar(a) for a in scores.args]
        factor = constant[1] if constant[1] is not None else constant[0]
        product = scores.args[0] if constant[1] is not None else scores.args[1]
        if factor is None:
            return None
        scale, nodes = factor, nodes + [scores]
        scores = product
    elif _call(scores, {operator.truediv, torch.div}, {"div"}) and _scalar(scores.args[1]) not in (None, 0.0):
        scale, nodes = 1.0 / _scalar(scores.args[1]), nodes + [scores]
        scores = scores.args[0]
    if not _call(scores, _MATMUL, {"matmul"}):
        return None
    key = _transposed_last_two(scores.args[1])
    if key is None:
        return None
    nodes += [scores, scores.args[1]]
    if scale is None:
        scale = 1.0  # a bare q k^T: the kernel must not apply its default 1/sqrt(D)
    (key, key_groups, key_nodes), (value, value_groups, value_nodes) = _repeated_heads(key), _repeated_heads(value)
    if key_groups != value_groups:
        return None
    nodes += key_nodes + value_nodes
    form = ("eager", scale, softmax_dtype, tuple(casts), key_groups)
    return (scores.args[0], key, value), form, scale, nodes, extra


def _repeated_heads(node: torch.fx.Node):
    """transformers' ``repeat_kv`` (grouped key/value heads read by ``groups`` query heads each)::

        x[:, :, None, :, :].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)

    -> (x, groups, its nodes); (node, 1, []) for anything else."""
    reshaped = node
    if not _call(reshaped, {torch.reshape}, {"reshape", "view"}):
        return node, 1, []
    expanded = reshaped.args[0]
    if not _call(expanded, (), {"expand"}) or len(expanded.users) != 1:
        return node, 1, []
    indexed = expanded.args[0]
    if not _call(indexed, {operator.getitem}) or len(indexed.users) != 1:
        return node, 1, []
    source, index = indexed.args
    whole = slice(None, None, None)
    if index != (whole, whole, None, whole, whole):
        return node, 1, []
    values = [example_value(n) for n in (source, indexed, expanded, reshaped)]
    if not all(isinstance(v, torch.Tensor) for v in values) or values[0].dim() != 4:
        return node, 1, []
    base, _, wide, out = values
    batch, heads, rows, width = base.shape
    groups = wide.shape[2] if wide.dim() == 5 else None
    if not isinstance(groups, int):
        return node, 1, []
    try:  # sizes may be unbacked symbols: equal ones compare without a guard, others may not decide
        same = (tuple(wide.shape) == (batch, heads, groups, rows, width)
                and tuple(out.shape) == (batch, heads * groups, rows, width))
    except Exception:  # noqa: BLE001 - undecidable: not the pattern as far as this pass can tell
        same = False
    return (source, groups, [reshaped, expanded, indexed]) if same else (node, 1, [])


def _groups(form: tuple) -> int:
    """Query heads per key / value head of a matched form (the eager form's repeat_kv), else 1."""
    return form[4] if form[0] == "eager" else 1


def _sdpa_form(output: torch.fx.Node):
    if not _call(output, _SDPA) or len(output.args) > 3:
        return None
    kwargs = dict(output.kwargs)
    if kwargs.pop("attn_mask", None) is not None or kwargs.pop("dropout_p", 0.0) not in (0, 0.0):
        return None
    if kwargs.pop("is_causal", False) is not False or kwargs.pop("enable_gqa", False) is not False:
        return None
    scale = kwargs.pop("scale", None)
    if kwargs or not (scale is None or _scalar(scale) is not None):
        return None
    return tuple(output.args[:3]), ("sdpa", scale), scale, [output]


_EPILOGUE_METHODS = {"transpose", "contiguous", "to", "clone"}


def _segment(cat_input: torch.fx.Node) -> _Segment | None:
    """Parse one cat input back through its epilogue to an attention form on split pieces."""
    epilogue = []
    node = cat_input
    while _call(node, {torch.transpose}, _EPILOGUE_METHODS):
        if node.target == "to" and not (len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs):
            return None
        if node.target == "clone" and node.kwargs.get("memory_format") not in (None, torch.contiguous_format):
            return None
        epilogue.append(node)
        node = node.args[0]
    epilogue.reverse()
    for match in (_sdpa_form, _eager_form):
        found = match(node)
        if found is not None:
            break
    else:
        return None
    pieces, form, scale, nodes = found
    if not all(_split_piece(piece) for piece in pieces):
        return None
    return _Segment(tuple(pieces), form, scale, epilogue, nodes + epilogue)


def _epilogue_signature(node: torch.fx.Node):
    return (node.op, node.target, tuple(a for a in node.args[1:]), tuple(sorted(node.kwargs.items())))


def _sequence_axis_after(epilogue: list[torch.fx.Node], axis: int, rank: int) -> int:
    for node in epilogue:
        if node.target in (torch.transpose, "transpose"):
            a, b = _dim(_arg(node, 1, "dim0"), rank), _dim(_arg(node, 2, "dim1"), rank)
            axis = b if axis == a else a if axis == b else axis
    return axis


def rewrite_segment_loops(graph: torch.fx.Graph) -> tuple[int, list[str]]:
    """Replace every per-segment attention loop (module docstring) by one varlen call.
    Returns (loops rewritten, reasons for cats of split attention left alone)."""
    from kimi_cg.lift import source_location

    rewritten, left = 0, []
    for cat in [n for n in graph.nodes if _call(n, _CAT)]:
        parts = _arg(cat, 0, "tensors")
        if not isinstance(parts, (list, tuple)) or not parts or not all(isinstance(p, torch.fx.Node) for p in parts):
            continue
        segments = [_segment(part) for part in parts]
        if not any(segments):
            continue
        reason = _loop_problem(cat, parts, segments)
        if reason is not None:
            left.append(f"{cat.name} ({reason}) at {source_location(cat)}")
            continue
        _rewrite(graph, cat, segments)
        rewritten += 1
    return rewritten, left


def _loop_problem(cat, parts, segments) -> str | None:
    if not all(segments):
        return "not every piece is the same attention"
    first = segments[0]
    splits = [_split_piece(piece)[0] for piece in first.pieces]
    sizes = [_split_sizes(split) for split in splits]
    if None in sizes or len(set(sizes)) != 1 or len(sizes[0]) != len(segments):
        return "q, k and v are not cut by one list of sizes into as many pieces as the cat joins"
    axes = {_split_dim(split) for split in splits}
    values = [example_value(split.args[0]) for split in splits]
    if len(axes) != 1 or not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in values):
        return "q, k and v are not 4-D tensors cut along one axis"
    axis = axes.pop()
    groups = _groups(first.form)
    query, key, value = values
    if axis != 2 or any(v.shape[0] != 1 for v in values) or not (
            key.shape == value.shape and query.shape[1] == key.shape[1] * groups and query.shape[2:] == key.shape[2:]):
        return "expected q, k, v of one shape [1, H, L, D] cut along L (k, v: H / groups heads)"
    for index, segment in enumerate(segments):
        if segment.form != first.form or [_epilogue_signature(n) for n in segment.epilogue] != [_epilogue_signature(n) for n in first.epilogue]:
            return f"piece {index} computes a different attention or epilogue"
        for role, piece in enumerate(segment.pieces):
            split, position = _split_piece(piece)
            if split is not splits[role] or position != index:
                return f"piece {index} reads another segment's q, k or v"
        allowed = set(segment.nodes) | {cat}
        for node in (*segment.nodes, *segment.pieces):
            if any(user not in allowed for user in node.users):
                return f"{node.name} (piece {index}) has users outside its attention"
    for split in splits:
        if any(_split_piece(user) is None for user in split.users):
            return "a split has users other than its pieces"
    rank = 4
    sequence_axis = _sequence_axis_after(first.epilogue, axis, rank)
    cat_dim = _dim(_arg(cat, 1, "dim", 0), rank)
    if cat_dim != sequence_axis:
        return f"the cat joins axis {cat_dim}, the sequence is on axis {sequence_axis}"
    return None


def _refresh_shapes_after(start: torch.fx.Node) -> None:
    """Recompute the example values downstream of ``start`` whose shapes came from the per-segment
    sizes (``[s0, (64*u8 + 64*u9)//s0]`` after the cat): later passes read shapes from metadata and
    would take a stale unbacked size for a grid-dependent one. Stops where a shape does not change."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    frontier = list(start.users)
    seen = set()
    order = {node: i for i, node in enumerate(start.graph.nodes)}
    while frontier:
        frontier.sort(key=order.__getitem__)
        node = frontier.pop(0)
        if node in seen or node.op not in ("call_function", "call_method"):
            continue
        seen.add(node)
        old = example_value(node)
        if not (isinstance(old, torch.Tensor) and free_unbacked_symbols(old.shape)):
            continue
        args = torch.fx.node.map_arg(node.args, example_value)
        kwargs = torch.fx.node.map_arg(node.kwargs, example_value)
        try:
            if node.op == "call_method":
                new = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                new = node.target(*args, **kwargs)
        except Exception:  # leave it: the lift checks arguments, not these shapes
            continue
        if isinstance(new, torch.Tensor):
            node.meta["example_value"] = new
            frontier.extend(node.users)


def _rewrite(graph: torch.fx.Graph, cat: torch.fx.Node, segments: list[_Segment]) -> None:
    first = segments[0]
    splits = [_split_piece(piece)[0] for piece in first.pieces]
    sizes = _split_sizes(splits[0])
    query = example_value(splits[0].args[0])  # [1, H, L, D], a fake tensor of dynamo's trace

    def method(name, value, *args):
        node = graph.call_method(name, (value, *args))
        node.meta["example_value"] = getattr(example_value(value), name)(*args)
        return node

    with graph.inserting_before(cat):
        packed = [method("transpose", method("squeeze", split.args[0], 0), 0, 1) for split in splits]
        groups = _groups(first.form)
        if groups > 1:  # [L, H / groups, D] -> [L, H, D]: query head h reads key / value head h // groups
            packed[1:] = [method("repeat_interleave", tensor, groups, 1) for tensor in packed[1:]]
        total = graph.call_function(torch.ops.aten.sym_size.int, (packed[0], 0))
        total.meta["example_value"] = query.shape[2]
        cu_seqlens = graph.call_function(sizes_to_cu_seqlens, (sizes, total))
        cu_seqlens.meta["stack_trace"] = splits[0].meta.get("stack_trace")
        with query.fake_mode:
            cu_seqlens.meta["example_value"] = torch.empty(len(sizes) + 1, dtype=torch.int32)
        out = graph.call_function(_VARLEN, (*packed, cu_seqlens, total, first.scale))
        out.meta["stack_trace"] = first.nodes[0].meta.get("stack_trace")
        out.meta["example_value"] = example_value(packed[0]).clone()
        out = method("unsqueeze", method("transpose", out, 0, 1), 0)
        for node in first.epilogue:  # the same methods, now on the packed result (shapes recomputed)
            copy = graph.node_copy(node, lambda arg, node=node: out if arg is node.args[0] else arg)
            if copy.op == "call_method":
                copy.meta["example_value"] = getattr(example_value(out), copy.target)(*copy.args[1:], **copy.kwargs)
            else:
                copy.meta["example_value"] = copy.target(example_value(out), *copy.args[1:], **copy.kwargs)
            out = copy
    out.meta = {**cat.meta, "example_value": example_value(out)}
    cat.replace_all_uses_with(out)
    graph.erase_node(cat)
    _refresh_shapes_after(out)
    doomed = {node for segment in segments for node in (*segment.nodes, *segment.pieces)} | set(splits)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(doomed, key=order.__getitem__, reverse=True):  # users before what they read
        if not node.users:
            graph.erase_node(node)
