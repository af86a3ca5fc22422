"""SegmentAttentionPass: every attention over packed images becomes the varlen op with an upper bound.

Three rewrites:

1. SDPA under a block-diagonal boolean mask built by the model (sdpa path of MoonViT)::

       mask: "b8[1, s0, s0]" = torch.zeros([1, s0, s0], dtype=torch.bool)
       mask[..., u8:u9, u8:u9] = True           # one setitem per segment
       mask[..., u12:u13, u12:u13] = True
       out: "f32[4, s0, 16]" = scaled_dot_product_attention(q_t, k_t, v_t, mask)

   becomes::

       cu: "i32[3]" = segments_to_cu_seqlens((u8, u9, u12, u13), s0)      # host
       out_v: "f32[s0, 4, 16]" = kimi_cg.varlen_attention(q_t.transpose(-3, -2), ..., cu, s0)
       out = out_v.transpose(-3, -2)

   The dense L x L mask disappears; ``segments_to_cu_seqlens`` checks on the host that the
   segments tile [0, L) back to back (the only masks this rewrite accepts). The same mask applied
   to explicit attention (the eager path of MoonViT's remote code)::

       scores = (q_t @ k_t.transpose(-2, -1)) * s
       scores = scores.masked_fill(~mask, float("-inf"))      # or torch.where(mask, scores, -inf)
       out = softmax(scores, dim=-1[, dtype]) [.to(dtype)] @ v_t

   becomes the same varlen call with scale ``s``. Only a fill that removes a key from the softmax
   is accepted (-inf, or float32's / bfloat16's lowest value: exp underflows to exactly 0 for any
   finite score); an additive bool mask (``scores + mask``, which adds 1 inside a segment and lets
   every row see every image: a bug in that remote code's eager path) is not a block mask and stays
   dense, so its numbers stay eager's.

2. Attention written as a loop over per-segment pieces (``torch.split(q, lengths.tolist())`` + one
   attention per piece + ``cat``, as transformers' sdpa and eager paths do): one varlen call
   (segment_loop.py).

3. Every upper-bound argument of a registered varlen attention op (kimi_cg's, flash-attn's, torch's
   varlen_attn, and users' own: kimi_cg/varlen_registry.py) computed from grid values
   (``(cu[1:] - cu[:-1]).max().item()``) becomes the packed length of the tensor it bounds
   (``q.size(0)``), an upper bound that only depends on L (NOTE [max_seqlen]).

NOTE [max_seqlen]: flash kernels use max_seqlen to size their launch grid; blocks past a segment's
end exit early, so any upper bound gives the same result. The CUDA-graph runtime passes the bucket
capacity, so one captured graph serves every segmentation of that capacity.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx
import torch.nn.functional as F

from kimi_cg.capture import example_value
from kimi_cg.canonicalize.base import GraphPass, eliminate_common_scalar_subexpressions
from kimi_cg.errors import UnsupportedGraphError
from kimi_cg.canonicalize.segment_loop import (is_split_by_sizes, match_eager_attention, rewrite_segment_loops,
                                               sizes_to_cu_seqlens)
from kimi_cg.lift import source_location
from kimi_cg.varlen_registry import argument, registered_bounds

logger = logging.getLogger(__name__)

_SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_VARLEN = torch.ops.kimi_cg.varlen_attention.default


def segments_to_cu_seqlens(bounds: tuple[int, ...], total: int) -> torch.Tensor:
    """Host: (start0, end0, start1, end1, ...) of mask blocks -> cu_seqlens, checking they tile [0, total)."""
    starts, ends = bounds[0::2], bounds[1::2]
    expected = 0
    for segment, (start, end) in enumerate(zip(starts, ends)):
        if start != expected or end < start:
            raise UnsupportedGraphError(
                f"attention mask block {segment} covers [{start}, {end}) but blocks must tile [0, {total}) back to "
                f"back (previous block ended at {expected}); the grid does not match the pixel rows",
                "mask blocks do not tile the sequence",
            )
        expected = end
    if expected != total:
        raise UnsupportedGraphError(f"attention mask blocks end at {expected}, the packed sequence has {total} rows",
                                    "mask blocks do not tile the sequence")
    return torch.tensor((0,) + tuple(ends), dtype=torch.int32)


# Fills that take a key out of a softmax exactly: exp(fill - max) is 0 in float32 for any finite score.
_REMOVING_FILLS = (float("-inf"), torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min)


def _negation_of(node) -> torch.fx.Node | None:
    """``mask`` when ``node`` is ``~mask``, ``mask.logical_not()``, ``torch.logical_not(mask)`` or
    ``mask == 0`` / ``mask == False`` on a bool mask."""
    if not isinstance(node, torch.fx.Node):
        return None
    if (node.op == "call_function" and node.target in (operator.invert, torch.logical_not, torch.bitwise_not)) or (
            node.op == "call_method" and node.target in ("logical_not", "bitwise_not", "__invert__")):
        source = node.args[0] if len(node.args) == 1 else None
    elif (node.op == "call_function" and node.target in (operator.eq, torch.eq)) or (
            node.op == "call_method" and node.target in ("eq", "__eq__")):
        source = node.args[0] if len(node.args) == 2 and node.args[1] is not True and node.args[1] in (0, False) else None
    else:
        return None
    value = example_value(source) if isinstance(source, torch.fx.Node) else None
    return source if isinstance(value, torch.Tensor) and value.dtype == torch.bool else None


def _removing_fill(value) -> bool:
    return isinstance(value, float) and value in _REMOVING_FILLS


def _block_masked(scores: torch.fx.Node):
    """For ``match_eager_attention``: (scores before masking, (mask, the node that reads the mask), nodes)
    when ``scores`` keeps what a bool mask allows and removes the rest from the softmax (who else reads
    them: ``_masked_part_feeds_only``)."""
    if not isinstance(scores, torch.fx.Node):
        return None
    if (scores.op == "call_method" and scores.target == "masked_fill") or (
            scores.op == "call_function" and scores.target is torch.masked_fill):
        if len(scores.args) != 3 or scores.kwargs or not _removing_fill(scores.args[2]):
            return None
        base, condition = scores.args[0], scores.args[1]
        mask = _negation_of(condition)
        if mask is None:
            return None
        return base, (mask, condition), [scores, condition]
    if scores.op == "call_function" and scores.target is torch.where and len(scores.args) == 3 and not scores.kwargs:
        condition, base, fill = scores.args  # torch.where(mask, scores, -inf)
    elif scores.op == "call_method" and scores.target == "where" and len(scores.args) == 3 and not scores.kwargs:
        base, condition, fill = scores.args  # scores.where(mask, -inf)
    else:
        return None
    value = example_value(condition) if isinstance(condition, torch.fx.Node) else None
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.bool and _removing_fill(fill)):
        return None
    return base, (condition, scores), [scores]


def _masked_part_feeds_only(output: torch.fx.Node, nodes: list[torch.fx.Node], reader: torch.fx.Node) -> bool:
    """Whether everything computed from the mask in an explicit attention (the masked scores, the
    softmax, its casts) is read by the attention alone: else, once the attention is rewritten, the
    mask would still be needed (the weights returned as attention probabilities, say)."""
    dependent = {reader}
    for node in sorted({*nodes, output}, key=_order(output.graph)):
        if any(arg in dependent for arg in node.all_input_nodes):
            dependent.add(node)
    return all(set(node.users) <= dependent for node in dependent if node is not output)


def _block_mask_bounds(mask: torch.fx.Node, attention_users: set[torch.fx.Node]):
    """The (start, end) args of each ``mask[..., a:b, a:b] = True`` on a zeros mask, or None."""
    if mask.op != "call_function" or mask.target is not torch.zeros or mask.kwargs.get("dtype") is not torch.bool:
        return None
    bounds, setitems = [], []
    for user in mask.users:
        if user in attention_users:
            continue
        if user.target is not operator.setitem or user.args[0] is not mask or user.args[2] is not True:
            return None
        index = user.args[1]
        if not isinstance(index, tuple) or len(index) < 2:
            return None
        rows, cols = index[-2], index[-1]
        leading_ok = all(i is Ellipsis or i == slice(None) for i in index[:-2])
        if not (leading_ok and isinstance(rows, slice) and rows == cols and rows.step is None):
            return None
        bounds += [rows.start if rows.start is not None else 0, rows.stop]
        setitems.append(user)
    order = {node: i for i, node in enumerate(mask.graph.nodes)}
    first_attention = min(order[n] for n in attention_users)
    if any(order[s] > first_attention for s in setitems) or None in bounds:
        return None
    return bounds, setitems


def _order(graph: torch.fx.Graph):
    positions = {node: i for i, node in enumerate(graph.nodes)}
    return positions.__getitem__


def _bound_argument(graph: torch.fx.Graph, node: torch.fx.Node, position: int, name: str, tensor_position: int,
                    tensor_name: str) -> int:
    """Replace a registered upper-bound argument computed in the graph by ``tensor.size(0)``; 1 if done."""
    value, tensor = argument(node, position, name), argument(node, tensor_position, tensor_name)
    if not isinstance(value, torch.fx.Node) or value.target is torch.ops.aten.sym_size.int:
        return 0
    if not isinstance(tensor, torch.fx.Node) or not isinstance(example_value(tensor), torch.Tensor):
        return 0
    with graph.inserting_before(node):
        bound = graph.call_function(torch.ops.aten.sym_size.int, (tensor, 0))
    bound.meta["example_value"] = example_value(tensor).shape[0]
    if position < len(node.args):
        node.args = node.args[:position] + (bound,) + node.args[position + 1:]
    else:
        node.kwargs = {**node.kwargs, name: bound}
    return 1


class SegmentAttentionPass(GraphPass):
    name = "segment_attention"

    def run(self, gm: torch.fx.GraphModule) -> dict:
        graph = gm.graph
        report = {"sdpa_rewritten": 0, "segment_loops_rewritten": 0, "max_seqlen_bounded": 0, "sdpa_left": []}
        if any(is_split_by_sizes(node) for node in graph.nodes):
            # q, k and v are cut by separate .tolist() reads of one lengths tensor: make them one list
            report["scalars_merged"] = eliminate_common_scalar_subexpressions(graph)
            report["segment_loops_rewritten"], loops_left = rewrite_segment_loops(graph)
            report["sdpa_left"] += loops_left
        masks: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target in _SDPA_TARGETS:
                mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
                if isinstance(mask, torch.fx.Node):
                    masks.setdefault(mask, []).append(node)
        eager: dict[torch.fx.Node, list[tuple]] = {}  # mask -> explicit attentions under it
        for node in graph.nodes:
            found = match_eager_attention(node, _block_masked) if node.op in ("call_function", "call_method") else None
            if found is not None:
                pieces, _, scale, nodes, (mask, reader) = found
                if _masked_part_feeds_only(node, nodes, reader):
                    eager.setdefault(mask, []).append((node, pieces, scale, nodes, reader))
        if masks or eager:  # each layer rebuilds its mask from cu_seqlens[i].item(): make those values shared
            report["scalars_merged"] = eliminate_common_scalar_subexpressions(graph)
        for mask in [*masks, *(m for m in eager if m not in masks)]:
            attentions, explicit = masks.get(mask, []), eager.get(mask, [])
            readers = {reader for *_, reader in explicit}
            found = _block_mask_bounds(mask, set(attentions) | readers)
            reasons = ["the mask is not written as one block per segment"] if found is None else []
            reasons += [reason for reason in map(self._unsupported_arguments, attentions) if reason]
            reasons += [reason for reason in (self._unsupported_pieces(pieces) for _, pieces, *_ in explicit) if reason]
            if reasons:
                left = [*attentions, *(output for output, *_ in explicit)]
                report["sdpa_left"] += [f"{node.name} ({reasons[0]}) at {source_location(node)}" for node in left]
                continue
            bounds, setitems = found
            shape = mask.args[0] if mask.args else mask.kwargs.get("size")
            total = shape[-1] if isinstance(shape, (tuple, list)) else None  # the mask's L: shared by all layers
            for node in attentions:
                self._rewrite_sdpa(graph, node, node.args[:3], node.kwargs.get("scale"), bounds, total)
                report["sdpa_rewritten"] += 1
            for output, pieces, scale, nodes, _ in explicit:
                self._rewrite_sdpa(graph, output, pieces, scale, bounds, total)
                rest = [matched for matched in nodes if matched is not output]  # (output: replaced and erased)
                for matched in sorted(rest, key=_order(graph), reverse=True):  # the attention's own nodes
                    if not matched.users:
                        graph.erase_node(matched)
                report["eager_rewritten"] = report.get("eager_rewritten", 0) + 1
            for setitem in setitems:
                graph.erase_node(setitem)
            graph.erase_node(mask)
        for node in list(graph.nodes):
            bounds = registered_bounds(node.target) if node.op == "call_function" else None
            for position, name, tensor_position, tensor_name in bounds or ():
                report["max_seqlen_bounded"] += _bound_argument(graph, node, position, name, tensor_position, tensor_name)
        if report["sdpa_rewritten"] or report["segment_loops_rewritten"] or report.get("eager_rewritten"):
            eliminate_common_scalar_subexpressions(graph, extra_pure=(segments_to_cu_seqlens, sizes_to_cu_seqlens))
        if report["sdpa_left"]:
            # Correct either way (the dense mask goes to the device); only slower and O(L^2) in memory.
            logger.info("kimi_cg: attention kept with its dense mask: %s", report["sdpa_left"])
        return report

    @staticmethod
    def _unsupported_arguments(node: torch.fx.Node) -> str | None:
        """Why this SDPA call cannot become the varlen op, or None."""
        kwargs = node.kwargs
        if len(node.args) > 4 or set(kwargs) - {"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"}:
            return "positional or unknown arguments"
        if kwargs.get("dropout_p", 0.0) not in (0, 0.0) or kwargs.get("is_causal", False) or kwargs.get("enable_gqa", False):
            return "dropout, is_causal or enable_gqa"
        if not isinstance(kwargs.get("scale"), (type(None), int, float)):
            return "a scale computed in the graph"
        return SegmentAttentionPass._unsupported_pieces(node.args[:3])

    @staticmethod
    def _unsupported_pieces(pieces) -> str | None:
        """Why an attention's q, k, v ([H, L, D] or [1, H, L, D]) cannot become the varlen op."""
        query, key, value = (example_value(arg) for arg in pieces)
        if not all(isinstance(t, torch.Tensor) for t in (query, key, value)) or not (query.shape == key.shape == value.shape):
            return "q, k and v differ in shape"
        if not (query.dim() == 3 or (query.dim() == 4 and query.shape[0] == 1)):
            return "a batch of more than one sequence"
        return None

    @staticmethod
    def _rewrite_sdpa(graph: torch.fx.Graph, node: torch.fx.Node, qkv, scale, bounds: list, mask_length) -> None:
        """``node`` (an attention over [H, L, D] or [1, H, L, D] q, k, v under the block mask) becomes the
        varlen op on ``qkv`` with ``scale``."""
        batched = example_value(qkv[0]).dim() == 4

        def valued(inserted: torch.fx.Node, value) -> torch.fx.Node:
            # Every inserted tensor node holds its (fake) example value, as dynamo's own nodes do:
            # later passes read shapes from it (a node without one looked like a region's root to the
            # merge-gather pass).
            inserted.meta["example_value"] = value
            return inserted

        with graph.inserting_before(node):
            packed = []
            for tensor in qkv:
                value = example_value(tensor)
                if batched:
                    value = value.squeeze(0)
                    tensor = valued(graph.call_method("squeeze", (tensor, 0)), value)
                # [H, L, D] -> [L, H, D]
                packed.append(valued(graph.call_method("transpose", (tensor, -3, -2)), value.transpose(-3, -2)))
            total = graph.call_function(torch.ops.aten.sym_size.int, (packed[0], 0))
            total.meta["example_value"] = example_value(qkv[0]).shape[-2]
            host_total = mask_length if mask_length is not None else total
            cu_seqlens = graph.call_function(segments_to_cu_seqlens, (tuple(bounds), host_total))
            cu_seqlens.meta["stack_trace"] = node.meta.get("stack_trace")
            varlen_value = torch.empty_like(example_value(packed[0]))  # the op's fake
            out = valued(graph.call_function(_VARLEN, (*packed, cu_seqlens, total, scale)), varlen_value)
            out = graph.call_method("transpose", (out, -3, -2))
            if batched:
                out = valued(out, varlen_value.transpose(-3, -2))
                out = graph.call_method("unsqueeze", (out, 0))
        out.meta = dict(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
