"""The varlen attention ops kimi_cg knows, and which of their integer arguments are upper bounds.

A varlen attention kernel takes ``max_seqlen`` (the longest segment) only to size its launch grid:
any larger value gives the same result (NOTE [max_seqlen] in segment_attention.py). Models compute it
from the grid (``(cu[1:] - cu[:-1]).max().item()``), which would make a graph depend on a data value;
SegmentAttentionPass replaces every declared bound with the packed length of the tensor it bounds
(``q.size(0)``), which depends only on the patch count (and, replayed, is the bucket capacity).

Known ops (by qualified name, so an op whose package is absent costs nothing):

==========================================  ==============================================  ==========================
op                                          bounds (argument <= rows of tensor)             segment boundaries
==========================================  ==============================================  ==========================
``kimi_cg::varlen_attention``               ``max_seqlen`` <= ``q``                         ``cu_seqlens``
``flash_attn::_flash_attn_varlen_forward``  ``max_seqlen_q`` <= ``q``, ``max_seqlen_k`` <= ``k``  ``cu_seqlens_q``, ``cu_seqlens_k``
``torch_attn::_varlen_attn``                ``max_q`` <= ``query``, ``max_k`` <= ``key``    ``cu_seq_q``, ``cu_seq_k``
==========================================  ==============================================  ==========================

The segment boundaries get the CUDA-graph runtime's ``cu_seqlens`` padding rule (NOTE [padding
rules] in runtime/graphs.py: the padded rows form one trailing segment, so the kernel computes them).
Users add their own: ``kimi_cg.register_varlen_attention(op, {"max_seqlen_q": "q", ...},
segments=("cu_seqlens_q", "cu_seqlens_k"))``. Declaring an argument a bound is a promise that the op's
result does not change when that argument grows; kimi_cg cannot check it.
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# qualified op name ("namespace::name") -> ({bound argument: tensor argument whose dim 0 bounds it},
#                                            segment-boundary (cu_seqlens) arguments)
_REGISTRY: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "kimi_cg::varlen_attention": ({"max_seqlen": "q"}, ("cu_seqlens",)),
    "flash_attn::_flash_attn_varlen_forward": ({"max_seqlen_q": "q", "max_seqlen_k": "k"}, ("cu_seqlens_q", "cu_seqlens_k")),
    "torch_attn::_varlen_attn": ({"max_q": "query", "max_k": "key"}, ("cu_seq_q", "cu_seq_k")),
}


def register_varlen_attention(op, bounds: dict[str, str], segments: tuple[str, ...] | list[str]) -> None:
    """Declare ``op`` a varlen attention whose arguments named in ``bounds`` are upper bounds on a
    segment length, each bounded by dim 0 of the tensor argument it maps to, and whose ``segments``
    arguments are cumulative segment boundaries (int32 ``cu_seqlens``: padded by the CUDA-graph
    runtime with one trailing segment over the padding rows).

    ``op``: a ``torch.ops`` overload or packet, a ``torch.library.custom_op`` object, or its qualified
    name ``"namespace::name"``. Raises ValueError when an argument name is not in the op's schema
    (checked when the op exists now; names are checked again at use)."""
    name = qualified_name(op)
    if name is None:
        raise ValueError(f"{op!r} is not a torch.library op or a 'namespace::name' string")
    if not isinstance(bounds, dict) or not bounds or not all(isinstance(k, str) and isinstance(v, str)
                                                             for k, v in bounds.items()):
        raise ValueError(f"bounds must map bound argument names to tensor argument names, got {bounds!r}")
    if isinstance(segments, str) or not segments or not all(isinstance(n, str) for n in segments):
        raise ValueError(f"segments must name the op's cu_seqlens arguments, got {segments!r}")
    schema_names = _argument_names(name)
    if schema_names is not None:
        missing = sorted({*bounds, *bounds.values(), *segments} - set(schema_names))
        if missing:
            raise ValueError(f"{name} has no argument(s) {missing}; its arguments: {schema_names}")
    with _lock:
        _REGISTRY[name] = (dict(bounds), tuple(segments))


def registered_bounds(target) -> list[tuple[int, str, int, str]] | None:
    """For a graph node's target: (position, name) of each bound argument with (position, name) of the
    tensor that bounds it, or None when the target is not a registered varlen attention."""
    name = qualified_name(target)
    if name is None:
        return None
    with _lock:
        bounds = _REGISTRY.get(name, (None,))[0]
    if bounds is None:
        return None
    names = _argument_names(name)
    if names is None:
        return None
    positions = []
    for bound, tensor in bounds.items():
        if bound in names and tensor in names:
            positions.append((names.index(bound), bound, names.index(tensor), tensor))
        else:
            logger.debug("kimi_cg: %s has no argument %s or %s in this torch version", name, bound, tensor)
    return positions


def registered_segments(target) -> list[tuple[int, str]]:
    """(position, name) of a registered varlen attention's segment-boundary arguments ([] otherwise)."""
    name = qualified_name(target)
    with _lock:
        segments = _REGISTRY.get(name, (None, ()))[1] if name is not None else ()
    names = _argument_names(name) if segments else None
    return [(names.index(segment), segment) for segment in segments if segment in names] if names else []


def argument(node, position: int, name: str):
    """A call node's argument, given positionally or by keyword."""
    return node.args[position] if position < len(node.args) else node.kwargs.get(name)


def qualified_name(op) -> str | None:
    """``"namespace::name"`` of an op overload, packet, custom op object or string; None otherwise."""
    if isinstance(op, str):
        return op if "::" in op else None
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    inner = getattr(op, "_opoverload", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(inner, torch._ops.OpOverload):
        return inner._schema.name
    return None


def _argument_names(name: str) -> list[str] | None:
    namespace, op_name = name.split("::", 1)
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return [argument.name for argument in packet.default._schema.arguments]
    except (AttributeError, RuntimeError):
        return None
