"""CUDA graphs of the device program, one per token bucket, replayed with padded static inputs.

NOTE [padding rules]
A bucket of capacity C (patches) owns static inputs sized for C. A call with L <= C patches copies
its inputs in and pads:
- activation rows and row-aligned host metadata (position embeddings, RoPE factors): rows L..C-1
  are zero;
- ``cu_seqlens`` (the segment boundaries of any registered varlen attention, kimi_cg/varlen_registry.py):
  the real boundaries, then segments of padding rows only, up to the static length (NOTE [segment
  tables]). Every row of the bucket is therefore attended and finite, even when the graph pool
  holds stale NaNs from earlier work: padded rows never read uninitialised memory;
- ``max_seqlen`` is C (the canonicalised program already uses the packed length);
- gather plans (index [R, K], weight [R, K]): rows R..C-1 and frames K..max_frames-1 get index -1
  (no contribution: the gather writes zeros and reads nothing), weight 0;
- a row index over groups of k rows (``x.reshape(L // k, k, D)[index]``: Qwen2.5-VL's window
  permutation, its inverse): n = L / k real entries, checked in [-n, n) and made non-negative, then
  the identity n..C/k-1, so padding groups read themselves; the size inputs that are its length get
  C / k. k is the call's L / n, the same for every such index, and C must be a multiple of it.
After the replay each output is sliced to the size the unpadded call would have (from the device
program's symbolic output shapes) and cloned, so a later call never changes an earlier result.

NOTE [segment tables]
A bucket's boundary buffer has room for a fixed number of segments. Most towers attend per item
(per frame at most): ``max_items`` segments plus one for the padding. Window attention (Qwen2.5-VL:
8 x 8-patch windows, hundreds per call at real sizes) has many more: the first call with more
segments than that makes the input's table dense, ``max_items + 1 + C // ROWS_PER_DENSE_SEGMENT``
segments in a bucket of C rows (+ C in dynamo's static first trace, whose one bucket is its call's rows;
the buckets made so far are dropped and made again, once), and a
call picks the smallest bucket whose rows and tables hold it. The padding rows [L, C) are cut into
segments of PADDING_SEGMENT_ROWS rows while the table has room, the rest in the last one: attention
over padding is then linear in C - L, not quadratic, and the work-list kernel that runs tables with
many segments (NOTE [work list or flash] in kimi_cg/ops/varlen_attention.py) launches one block per
padding segment. Padding rows still only attend to padding rows.

NOTE [exact-size graphs]
A one-item call replayed in a bucket pays for its table: flash launches (C / 128) query blocks for
each of the table's max_items + 1 segments, most of them empty (W1, one 32x32 image: 1.55 ms of
attention over 27 layers, against 0.95 ms on the exact segment and 0.53 ms with cuDNN's dense kernel
on the H200, docs/benchmarks.md). Single images are common and repeat (thumbnails, a fixed
preprocessing size). So a call whose every boundary input is one segment [0, L] over all its rows
gets a graph of its own at its third call of that L (EXACT_GRAPH_SIGHTINGS): capacity L, tables of
two entries, nothing padded, its attention on cuDNN (NOTE [one segment on cuDNN] in
kimi_cg/ops/varlen_attention.py; the warm-up runs before the capture build cuDNN's plan for L, ~80
ms, once). A size's first two calls replay its bucket as before, so a stream of sizes seen once or
twice captures nothing: making a graph costs 70-400 ms on the H200 (the cuDNN plan, two runs, the
capture), which only sizes that recur pay back. At most ``exact_size_graphs`` (config) such graphs
are kept, the least recently used dropped; they share the buckets' pool. A graph that cannot be
made (out of memory, a failed capture) turns them off for the program: its calls replay the
buckets. Only tables the host made (read without a sync) and only programs whose every kimi_cg
varlen attention takes such a table as is qualify.

NOTE [segment-length classes]
Flash launches (max_seqlen / 128) query blocks per segment of a table, and in a bucket max_seqlen
is its capacity C, so a bucket's attention pays for the blocks of max_items + 1 segments of C rows
whatever the call's segments are (on the H200, over W4-like requests on kimi_cg's bucket ladder:
1.13x the attention time of exact segments; 1.07x with classes, docs/benchmarks.md, 2026-12-04).
So each bucket is also captured at shorter bounds, C / 2, C / 4, ...
(``attention_length_classes`` graphs in all, bounds rounded up to 128 rows): the same program under
``longest_segment_bound(C, B)`` (kimi_cg/ops/varlen_attention.py), whose flash calls over C rows
take max_seqlen = B. A call replays the graph of the smallest bound that holds the longest segment
its tables get in the bucket: its real segments, read from the tables the host made, and the
padding segments ``_fill`` adds (pieces of PADDING_SEGMENT_ROWS, the rest in the last). It is a
promise the runtime keeps by construction and the op checks on CPU tables (the padded path in the
tests); a call whose tables are on the GPU (reading them would sync) runs at capacity. Only
programs whose every kimi_cg varlen attention takes a boundary input as is get classes (the same
condition as NOTE [one segment on cuDNN]); attention ops kimi_cg does not implement keep C. The
bounded graphs share the buckets' static inputs and pool and copy their outputs into the capacity
graph's output buffers at their end, so a bucket keeps one set of outputs; one that cannot be
captured turns classes off for the program.

NOTE [host block]
The host program makes a call's plans and boundaries on the CPU (cu_seqlens, table-gather and
merge-gather plans: seven tensors for MoonViT). Moved one by one and padded on the GPU, they cost a
copy each and two or three small kernels each for padding: about thirty launches per replay, seen
sizes or not (``_fill``: 0.29-0.31 ms of host time per W4 request on an H100 host, 2026-12-07).
With the ``host_block`` option (on by default) a bucket keeps its host-made inputs (rules with ``host``, kinds in
HOST_BLOCK_KINDS) as views of one device buffer, a packed buffer beside it on the device, and two
host copies of the packed buffer (pinned on CUDA), used in turn. A call writes its values' bytes,
unpadded, one after another into the next host copy, with a header saying where each starts and how
many rows (and plan columns) it has, plus the call's patch rows; then copies the used bytes to the
device in one copy on the current stream, ahead of the replay. The padding is written on the device:
every graph of the bucket starts with ``kimi_cg.kernels.unpack``, one kernel per width, which reads
the header and writes each static input as ``_fill`` would (rows after the call's: -1 / 0 for plans,
zero for rows; boundaries as NOTE [segment tables]); an input the header does not mark written (a
value the host program made on the device, or of another dtype than the bucket's: ``_fill``'s path)
is left as ``_fill`` wrote it. A call with nothing to write still sends a header that marks nothing
(once: the host remembers the device's header is clear). A host copy is written again only after
the event recorded after its copy. The runner leaves these values on the host (a replay needs them
there) and moves them only when no replay runs (a split, the plain program). A bucket run without a
graph (the CPU, a failed capture) unpacks before the program, with the kernel's PyTorch reference on
the CPU.
The device buffers are twice as large as the separate buffers were (statics and the packed copy);
the host copies add twice the packed size in host memory per bucket (``kimi_cg.memory_report()``).
History: the first form wrote the host copies padded, in the bucket's layout, with torch's CPU ops
and then numpy's (one thread, ~1 us an op). On an H200 host (b7773f4, bench.py with the option off
and on in one process) it saved ~0.2 ms of W1's host time but added 0.9-1.9 ms to W4's: its host
writes grow with the bucket (~1 MB at 8,192 rows) where ``_fill`` copies only the rows a call has
and pads on the GPU. The packed form writes only the call's bytes, and pads inside the graph.

All buckets share one graph memory pool and are captured largest first (smaller graphs reuse the
largest one's blocks). Without CUDA the same padded path runs without capture (CPU tests cover
the padding and slicing logic; only the capture itself needs a GPU).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import operator
import threading
import time
import weakref

import numpy
import torch

import kimi_cg.kernels.unpack as unpack_kernel
import kimi_cg.ops  # noqa: F401  (registers torch.ops.kimi_cg.*)
from kimi_cg.capture import example_value, row_dim
from kimi_cg.counters import counters, timings
from kimi_cg.device_program import DeviceProgram
from kimi_cg.fallback import record_fallback
from kimi_cg.ops.varlen_attention import dense_single_segment, longest_segment_bound
from kimi_cg.runtime.staging import BITS, current_stream, pack_bytes, read_only
from kimi_cg.varlen_registry import argument, registered_bounds, registered_segments

logger = logging.getLogger(__name__)

_MERGE_GATHER = torch.ops.kimi_cg.merge_gather
_MERGE_GATHER_LAYERNORM = torch.ops.kimi_cg.merge_gather_layernorm
_TABLE_GATHER = torch.ops.kimi_cg.table_gather
_VARLEN_ATTENTION = torch.ops.kimi_cg.varlen_attention
# NOTE [segment tables]: a dense table holds a segment per this many rows of its bucket (window
# attention's edge windows are smaller; a call of such windows picks a larger bucket); padding rows
# go in segments of this many rows (the work-list kernel's query block).
ROWS_PER_DENSE_SEGMENT = 16
PADDING_SEGMENT_ROWS = 64
# NOTE [exact-size graphs]: a one-item size gets its own graph at its EXACT_GRAPH_SIGHTINGS-th call;
# sizes seen fewer times are counted, the count forgotten after MAX_SIGHTINGS sizes.
EXACT_GRAPH_SIGHTINGS = 3
MAX_SIGHTINGS = 4096


# NOTE [segment-length classes]: flash's query blocks are 128 rows; a class bound is a multiple of it.
CLASS_BOUND_ROWS = 128


def _attention_context(capacity: int, exact: bool, bound: int | None = None):
    """What a run of a graph of ``capacity`` rows runs under: an exact-size graph's one segment on
    cuDNN (NOTE [one segment on cuDNN]), a bucket's segments bounded by ``bound`` (NOTE
    [segment-length classes]), or a bucket's attention as it is."""
    if exact:
        return dense_single_segment(capacity)
    return longest_segment_bound(capacity, bound) if bound is not None else contextlib.nullcontext()


def class_bounds(capacity: int, classes: int) -> list[int]:
    """NOTE [segment-length classes]: the bounds below ``capacity`` a bucket is also captured at,
    largest first (capacity / 2, / 4, ..., rounded up to CLASS_BOUND_ROWS)."""
    bounds = []
    for j in range(1, classes):
        bound = -(-capacity // (2 ** j * CLASS_BOUND_ROWS)) * CLASS_BOUND_ROWS
        if bound < capacity and bound not in bounds:
            bounds.append(bound)
    return bounds


def _packet(target):
    """An op overload's packet (``kimi_cg.varlen_attention.default`` -> ``kimi_cg.varlen_attention``)."""
    return getattr(target, "overloadpacket", target)


@dataclasses.dataclass(frozen=True)
class InputRule:
    kind: str  # "rows", "size", "static", "fixed", "cu_seqlens", "plan_index", "plan_weight", "row_index",
    #            "index_size", "unpadded"
    shape: tuple[int, ...] | None = None  # "fixed": the shape every call's value has
    dim: int = 0  # "rows": the dim that holds the rows (NOTE [rows on dim 1] in kimi_cg/capture.py)
    host: bool = False  # made by the host program (NOTE [host block])


def input_rules(program: DeviceProgram, kinds: list[str]) -> list[InputRule]:
    """Padding rule per device-program input; ``kinds`` says where each comes from
    ("activation", "state", "size", "grid", "host": backend.device_input_kinds)."""
    placeholders = [n for n in program.gm.graph.nodes if n.op == "placeholder"]
    # The packed rows: the activations' leading size (symbolic, or in dynamo's static first trace the
    # largest). Inputs of one fixed shape that is not row-aligned (a table a previous piece computed)
    # are copied in as they are each call.
    leading = [_rows_size(node) for node, kind in zip(placeholders, kinds) if kind == "activation"]
    symbolic = [size for size in leading if size is not None and not isinstance(size, int)]
    static_rows = None if symbolic else max((size for size in leading if size is not None), default=None)
    rules = []
    for node, kind in zip(placeholders, kinds):
        if kind == "activation":
            # A float input whose trailing sizes vary too (one frame called with tensors of two widths)
            # does not fit one static buffer per bucket.
            dim = row_dim(example_value(node))
            rules.append(InputRule("unpadded") if _has_symbolic_trailing_dims(node, dim) else InputRule("rows", dim=dim))
        elif kind == "state":
            rules.append(InputRule("static"))
        elif kind == "size":
            rules.append(InputRule("size"))
        elif kind == "grid":
            # A call's integer tensor consumed by a device op as is: padded as segment boundaries when
            # it is some varlen attention's, like rows when it is one index per patch row that only
            # reads (padding rows read entry 0 of the indexed tensor, into padding rows), else the
            # call runs the plain program (never replayed with another call's values).
            if _is_segment_boundary(node):
                rules.append(InputRule("cu_seqlens" if _segments_over_rows(node, static_rows, symbolic) else "unpadded"))
            elif _row_aligned(node, static_rows, symbolic) and _only_gathers_with(node):
                rules.append(InputRule("rows"))
            elif _row_group_index(node, symbolic, static_rows):
                rules.append(InputRule("row_index"))
            else:
                rules.append(InputRule("unpadded"))
        else:
            uses = {(_packet(user.target), user.args.index(node)) for user in node.users if node in user.args}
            if (_TABLE_GATHER, 1) in uses or (_TABLE_GATHER, 2) in uses:
                rules.append(InputRule("rows"))  # NOTE [table gathers]: a plan row per patch row, zeros pad
            elif (_MERGE_GATHER, 1) in uses or (_MERGE_GATHER_LAYERNORM, 1) in uses:
                rules.append(InputRule("plan_index"))
            elif (_MERGE_GATHER, 2) in uses or (_MERGE_GATHER_LAYERNORM, 2) in uses:
                rules.append(InputRule("plan_weight"))
            elif _is_segment_boundary(node):
                rules.append(InputRule("cu_seqlens" if _segments_over_rows(node, static_rows, symbolic) else "unpadded"))
            elif _row_group_index(node, symbolic, static_rows):
                rules.append(InputRule("row_index"))
            elif _has_symbolic_trailing_dims(node):
                # e.g. a dense [L, L] mask or bias made on the host: padding its rows alone would not
                # fit the bucket; such calls run the plain device program (correct, not graphed).
                rules.append(InputRule("unpadded"))
            else:
                rules.append(InputRule("rows"))
        fixed = _fixed_shape(node) if rules[-1].kind in ("rows", "unpadded") else None
        if fixed is not None and (symbolic or (static_rows is not None and fixed[:1] != (static_rows,))):
            rules[-1] = InputRule("fixed", fixed)
        if kind == "host":
            rules[-1] = dataclasses.replace(rules[-1], host=True)
    # A size input that is a row-group index's length (and not the rows) is that index's C / k.
    lengths = {_expr(_leading_size(node)) for node, rule in zip(placeholders, rules) if rule.kind == "row_index"}
    rows_exprs = {_expr(size) for size in symbolic}
    for position, (node, rule) in enumerate(zip(placeholders, rules)):
        value = example_value(node)
        if rule.kind == "size" and isinstance(value, torch.SymInt) and _expr(value) in lengths - rows_exprs:
            rules[position] = InputRule("index_size")
    return rules


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _row_group_index(node: torch.fx.Node, row_sizes: list, static_rows=None) -> bool:
    """A 1-D integer tensor of symbolic length other than the rows that only indexes the leading dim of
    tensors of symbolic length (NOTE [padding rules]: a row index over groups of k rows). That those
    tensors are row data as long as the index, for any row count, is the row-locality check's to prove
    (runtime/row_locality.py runs the program at two row counts). In dynamo's static first trace
    (``static_rows``) every size is a number and nothing is padded: the index is its call's as is."""
    size = _leading_size(node)
    if size is None or isinstance(size, int) or _expr(size) in {_expr(s) for s in row_sizes}:
        return False
    if not _only_gathers_with(node):
        return False
    for user in node.users:  # the indexed tensor's leading size varies with the call, as the rows do
        table = example_value(user.args[0]) if user.op == "call_function" and user.target is operator.getitem else None
        if not (isinstance(table, torch.Tensor) and table.dim() >= 1 and (static_rows is not None or not isinstance(table.shape[0], int))):
            return False
    return True


def _is_segment_boundary(node: torch.fx.Node) -> bool:
    """The node feeds a registered varlen attention as its segment boundaries (kimi_cg/varlen_registry.py)."""
    for user in node.users:
        if user.op != "call_function":
            continue
        for position, name in registered_segments(user.target):
            if argument(user, position, name) is node:
                return True
    return False


def _segments_over_rows(node: torch.fx.Node, static_rows, row_sizes) -> bool:
    """Whether the attentions that take ``node`` as segment boundaries run over the packed rows: each
    of their bounded tensors (q, k: registered_bounds) has the activations' leading size. Padding adds
    the trailing segment [L, C) of the bucket's rows, which is only those attentions' trailing segment
    when their rows are the activations' rows; a tower whose layers keep a [1, L, D] batch dim (its
    rows are dim 1) or that attends over merged rows would get boundaries that do not cover its
    tensors (found on HunYuan-VL: [0, 24, 1, 1, ...] for 24 rows)."""
    for user in node.users:
        if user.op != "call_function" or not any(argument(user, position, name) is node
                                                 for position, name in registered_segments(user.target)):
            continue
        for _, _, position, name in registered_bounds(user.target) or ():
            tensor = argument(user, position, name)
            value = _traced_or_derived_value(tensor) if isinstance(tensor, torch.fx.Node) else None
            rows = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() >= 1 else None
            if rows is None:
                return False
            if (static_rows is not None or isinstance(rows, int)) and not (isinstance(rows, int) and rows == static_rows):
                return False  # dynamo's static first trace (or a leading 1): the numbers must agree
            # Symbolic rows on both sides (a window permutation's rows read s48 * (s47 // (s47 // 4))):
            # row_locality's two meta runs check that they are the packed rows (NOTE [row locality]).
    return True


# Layout methods kimi_cg's canonicalising passes put around an attention they rewrite (those nodes hold
# no traced value): their value is the method applied to the input's fake tensor.
_LAYOUT_METHODS = ("transpose", "squeeze", "unsqueeze", "contiguous", "permute", "view", "reshape")


def _traced_or_derived_value(node: torch.fx.Node, depth: int = 0):
    value = example_value(node)
    if value is not None or depth > 8:
        return value
    if node.op == "call_method" and node.target in _LAYOUT_METHODS and node.args:
        base = _traced_or_derived_value(node.args[0], depth + 1) if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(base, torch.Tensor):
            try:
                return getattr(base, node.target)(*node.args[1:], **node.kwargs)
            except Exception:  # noqa: BLE001 - not derivable: the caller treats it as unknown (unpadded)
                return None
    return None


def _leading_size(node: torch.fx.Node):
    value = example_value(node)
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() >= 1 else None


def _rows_size(node: torch.fx.Node):
    """An activation's row count: its size at its row dim (NOTE [rows on dim 1])."""
    value = example_value(node)
    return value.shape[row_dim(value)] if isinstance(value, torch.Tensor) and value.dim() >= 1 else None


def _row_aligned(node: torch.fx.Node, static_rows, row_sizes) -> bool:
    """One entry per packed row: the activations' symbolic leading size, or the static first trace's
    row count."""
    size = _leading_size(node)
    if size is None:
        return False
    if isinstance(size, int):
        return size == static_rows
    return _expr(size) in {_expr(s) for s in row_sizes}


def _fixed_shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    value = example_value(node)
    if isinstance(value, torch.Tensor) and all(isinstance(size, int) for size in value.shape):
        return tuple(value.shape)
    return None


def _only_gathers_with(node: torch.fx.Node) -> bool:
    """Every use of this 1-D integer tensor indexes the leading dim of a non-empty tensor, reading only
    (``table[index]``, ``index_select(table, 0, index)``, ``embedding(index, table)``)."""
    value = example_value(node)
    if not (isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point()):
        return False

    def non_empty(table) -> bool:
        table = example_value(table) if isinstance(table, torch.fx.Node) else None
        return isinstance(table, torch.Tensor) and table.dim() >= 1 and not (isinstance(table.shape[0], int) and table.shape[0] == 0)

    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and _indexes_leading_dim(user.args[1], node):
            table = user.args[0]
        elif user.op == "call_function" and user.target in (torch.index_select, torch.Tensor.index_select) and (
                len(user.args) == 3 and user.args[1] == 0 and user.args[2] is node):
            table = user.args[0]
        elif user.op == "call_method" and user.target == "index_select" and user.args[1:] == (0, node):
            table = user.args[0]
        elif user.op == "call_function" and user.target is torch.nn.functional.embedding and user.args[0] is node and (
                len(user.args) == 2 and not user.kwargs):
            table = user.args[1]
        else:
            return False
        if not non_empty(table):
            return False
    return bool(node.users)


def _has_symbolic_trailing_dims(node: torch.fx.Node, dim: int = 0) -> bool:
    """Whether a size after the row dim ``dim`` is symbolic."""
    value = example_value(node)
    return isinstance(value, torch.Tensor) and any(not isinstance(size, int) for size in value.shape[dim + 1:])


@dataclasses.dataclass
class SplitPlan:
    """A call split into parts: each part's device inputs, its items (call indices, ascending) and,
    per item, its patch rows and gather-plan rows (to put the parts' outputs back in call order)."""

    pieces: list[list]
    parts: list[list[int]]
    patch_rows: list[int]
    plan_rows: list[int]

    @property
    def in_call_order(self) -> bool:
        flat = [item for part in self.parts for item in part]
        return flat == sorted(flat)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def _side_stream() -> torch.cuda.Stream:
    """The stream every capture's warm-up runs on, one per device for the process. A new stream per
    capture grew GPU memory by tens of MB with every capture and never gave it back (a per-stream
    cuBLAS workspace is the likely holder), exact-size graphs made and dropped over a long run
    included. H200, 2026-12-04: the real Kimi-VL config's first call held 1839 MB (17 buckets, 3
    graphs each) and 1375 MB (1 each) with a stream per capture, 847 MB with this one;
    tests/test_gpu.py's churn of exact-size graphs grew 209 MB over 6 captures before, under 16 after."""
    device = torch.cuda.current_device()
    with _SIDE_STREAMS_LOCK:
        if device not in _SIDE_STREAMS:
            _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        return _SIDE_STREAMS[device]


def _unpadded(output, shape):
    """A copy of a bucket's output cut to the unpadded call's ``shape``: rows are on dim 0 (or on
    the dim after a batch of one: NOTE [rows on dim 1]); the other dims already have their size."""
    if not isinstance(output, torch.Tensor) or shape is None:
        return output
    return output[tuple(slice(0, size) for size in shape)].clone()


def _copy_outputs(outputs, targets) -> None:
    """A bounded graph's outputs into its bucket's output buffers (NOTE [segment-length classes])."""
    outputs = tuple(outputs)
    if len(outputs) != len(targets):
        raise RuntimeError("a bounded run returned another number of outputs")
    for target, value in zip(targets, outputs):
        if isinstance(target, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                raise RuntimeError("a bounded run returned outputs of other shapes")
            target.copy_(value)


HOST_BLOCK_KINDS = frozenset(("rows", "cu_seqlens", "plan_index", "plan_weight"))
"""Rules whose host-made values a bucket takes through its host block (NOTE [host block]); "rows" on dim 0."""

HOST_BLOCK_STAGES = 2
"""Host copies of a bucket's block, used in turn: how many calls of one bucket the host may run ahead
of the device's copies."""


class _Stage:
    """One host copy of a bucket's packed buffer (pinned on CUDA): the header as int64 (numpy), and
    the event after its copy to the device."""

    __slots__ = ("buffer", "bytes", "header", "done")

    def __init__(self, nbytes: int, header_bytes: int, pinned: bool):
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.bytes = self.buffer.numpy()
        self.header = self.bytes[:header_bytes].view(numpy.int64)
        self.done: torch.cuda.Event | None = None


def _view(block: torch.Tensor, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    return block[offset:offset + nbytes].view(dtype).view(shape)


_UNPACKED_KINDS = {"rows": unpack_kernel.ROWS, "plan_index": unpack_kernel.PLAN, "plan_weight": unpack_kernel.PLAN,
                   "cu_seqlens": unpack_kernel.BOUNDARIES}


class _HostBlock:
    """NOTE [host block]: a bucket's host-made static inputs as views of one device buffer, written on
    the device from a packed copy of the call's values."""

    def __init__(self, static: list, positions: list[int], rules: list, capacity: int):
        layout, total = {}, 0
        for position in positions:
            value = static[position]
            layout[position] = (total, tuple(value.shape), value.dtype)
            total += _aligned(value.numel() * value.element_size())
        device = static[positions[0]].device
        self.block = torch.empty(total, dtype=torch.uint8, device=device)
        self.layout = layout
        self.slots = {position: slot for slot, position in enumerate(positions)}
        self.kinds = {position: rules[position].kind for position in positions}
        descriptors: dict[int, list] = {}
        for position in positions:  # the buffers as allocated (padding values) become views of the block
            view = _view(self.block, *layout[position])
            view.copy_(static[position])
            static[position] = view
            offset, shape, dtype = layout[position]
            kind = self.kinds[position]
            descriptors.setdefault(dtype.itemsize, []).append(
                (self.slots[position], _UNPACKED_KINDS[kind], view.numel(),
                 1 if kind == "cu_seqlens" else view.numel() // shape[0] if shape[0] else 1,
                 offset // dtype.itemsize, -1 if kind == "plan_index" else 0, capacity))
        # The header: HEADER_FIELDS int64 per slot, then the call's patch rows.
        self.patches_slot = unpack_kernel.HEADER_FIELDS * len(positions)
        self.header_bytes = _aligned(8 * (self.patches_slot + 1))
        self.packed = torch.zeros(self.header_bytes + total, dtype=torch.uint8, device=device)
        self.descriptors = {width: (torch.tensor(rows, dtype=torch.int64, device=device), max(row[2] for row in rows))
                            for width, rows in descriptors.items()}
        self.stages: list[_Stage] = []
        self.turn = 0
        self.header_clear = True  # the device's header marks no input written
        # NOTE [moved batches]: (patch rows, weak references to the read-only values, their positions)
        # the packed buffer holds, or None
        self.held: tuple | None = None

    def host_bytes(self) -> int:
        """Host memory it holds: its host copies."""
        return sum(stage.buffer.numel() for stage in self.stages)

    def _next_stage(self) -> _Stage:
        if len(self.stages) < HOST_BLOCK_STAGES:
            self.stages.append(_Stage(self.packed.numel(), self.header_bytes, self.block.is_cuda))
        stage = self.stages[self.turn]
        self.turn = (self.turn + 1) % HOST_BLOCK_STAGES
        if stage.done is not None:
            stage.done.synchronize()  # its copy to the device, HOST_BLOCK_STAGES calls of this bucket ago
            stage.done = None
        return stage

    def _fits(self, position: int, value: torch.Tensor) -> bool:
        """A host-made value of the bucket's dtype that its static buffer holds (others go to ``_fill``)."""
        _, shape, dtype = self.layout[position]
        if value.device.type != "cpu" or value.dtype != dtype or value.dim() != len(shape):
            return False
        if self.kinds[position] == "rows":
            return value.shape[0] <= shape[0] and value.shape[1:] == shape[1:]
        return all(have <= room for have, room in zip(value.shape, shape))

    def write(self, inputs, rows: int) -> list[int]:
        """Packs the call's host-made values at the block's positions into a host copy (each value's
        bytes, unpadded; the header says where) and copies it to the device; ``unpack`` then writes the
        static buffers, padded, inside the replay. The positions it will write.
        NOTE [moved batches]: a call whose values are the read-only ones the last copy held, for the
        same patch rows, copies nothing: the packed buffer and its header still hold them."""
        written = [position for position in self.layout if self._fits(position, inputs[position])]
        if not written and self.header_clear:
            return written
        held = self.held
        if (held is not None and held[0] == rows and held[2] == written
                and all(ref() is inputs[position] for position, ref in zip(written, held[1]))):
            counters["fills_skipped"] += len(written)
            return written
        stage = self._next_stage()
        header, array = stage.header, stage.bytes
        header[:] = 0
        cursor = self.header_bytes
        for position in written:
            value = inputs[position]
            width = value.element_size()
            if not pack_bytes(array, cursor, value):  # a strided or flagged value: torch's copy
                _view(stage.buffer, cursor, tuple(value.shape), value.dtype).copy_(value)
            fields = unpack_kernel.HEADER_FIELDS * self.slots[position]
            header[fields] = 1
            header[fields + 1] = cursor // width
            header[fields + 2] = value.shape[0]
            if self.kinds[position] in ("plan_index", "plan_weight"):
                header[fields + 3] = value.shape[1]
            cursor += _aligned(value.numel() * width)
        header[self.patches_slot] = rows
        self.packed[:cursor].copy_(stage.buffer[:cursor], non_blocking=True)
        if self.packed.is_cuda:
            stage.done = torch.cuda.Event()
            stage.done.record(current_stream())
        self.header_clear = not written
        self.held = ((rows, [weakref.ref(inputs[position]) for position in written], written)
                     if written and all(inputs[position] in read_only for position in written) else None)
        counters["host_block_copies"] += 1
        return written

    def unpack(self) -> None:
        """Writes the static buffers from the packed copy, as the header says (the kernel on CUDA, where
        a bucket's graphs capture it; its reference on the CPU)."""
        header = self.packed[:self.header_bytes].view(torch.int64)
        for width, (descriptors, elements) in self.descriptors.items():
            bits = BITS[width]
            packed, block = self.packed.view(bits), self.block.view(bits)
            if self.block.is_cuda:
                unpack_kernel.unpack(descriptors, header, packed, block, self.patches_slot, PADDING_SEGMENT_ROWS, elements)
            else:
                unpack_kernel.unpack_reference(descriptors, header, packed, block, self.patches_slot, PADDING_SEGMENT_ROWS)


_BLOCK_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _BLOCK_ALIGN) * _BLOCK_ALIGN


class _Bucket:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.inputs: list = []
        self.host_block: _HostBlock | None = None  # NOTE [host block]
        # NOTE [moved batches]: position -> (a weak reference to the read-only value the static input
        # was last filled from, the patch count its padding was written for)
        self.sources: dict[int, tuple] = {}
        self.outputs: tuple = ()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.padding_steps: torch.Tensor | None = None  # PADDING_SEGMENT_ROWS * (1, 2, ...): NOTE [segment tables]
        self.graph_bytes = 0  # what its capture added to the graph pool
        # NOTE [segment-length classes]: the shorter bounds this bucket runs at, largest first, and
        # (on CUDA) a graph per bound, each writing the same output buffers as ``graph``.
        self.bounds: list[int] = []
        self.class_graphs: dict[int, torch.cuda.CUDAGraph] = {}


def _indexes_leading_dim(index, node) -> bool:
    """``index`` is ``node`` or ``(node, :, ..., :)``: a gather along the leading dim only."""
    if index is node:
        return True
    full = slice(None, None, None)
    return isinstance(index, tuple) and len(index) >= 1 and index[0] is node and all(item == full for item in index[1:])


class BucketedGraphs:
    """Runs a device program through padded per-bucket static buffers (CUDA graphs on CUDA)."""

    def __init__(self, program: DeviceProgram, rules: list[InputRule], buckets: tuple[int, ...], max_items: int,
                 max_frames: int, capture: bool, poison_pool: bool = False, exact_rows: bool = False,
                 exact_graphs: int = 0, length_classes: int = 1, host_block: bool = False):
        self.program = program
        self.rules = rules
        # Per-call loops skip the static inputs (the weights, hundreds of them): they need no copy.
        self.padded = [(i, rule) for i, rule in enumerate(rules) if rule.kind != "static"]
        self.row_dims = [(i, rule.dim) for i, rule in self.padded if rule.kind == "rows"]  # (position, row dim)
        # The buckets' device: a rows input the host program did not make (a host-made one may stay on the
        # host until the bucket's copy, NOTE [host block]; MoonViT3d's program lists its table plans first).
        self.device_position = next((i for i, rule in self.padded if rule.kind == "rows" and not rule.host),
                                    self.row_dims[0][0] if self.row_dims else None)
        self.group_index_positions = [i for i, rule in self.padded if rule.kind == "row_index"]
        # NOTE [host block]: host-made inputs a bucket takes in one copy per call
        self.host_block_positions = [i for i, rule in self.padded if host_block and rule.host
                                     and rule.kind in HOST_BLOCK_KINDS and not (rule.kind == "rows" and rule.dim)]
        self.group = None  # k of NOTE [padding rules]'s row-group indices, set at the first call
        # No rows to pad, or an input no rule pads: every call runs the plain program.
        self.never_padded = not self.row_dims or any(rule.kind == "unpadded" for rule in rules)
        self.capacities = buckets
        self.max_segments = max_items + 1  # real segments plus the trailing padding segment
        self.dense_tables: set[int] = set()  # positions of boundary inputs with dense tables (NOTE [segment tables])
        self.max_frames = max_frames
        self.capture = capture
        self.on_cuda = capture  # capture is asked for exactly when the activations are on CUDA
        self.poison_pool = poison_pool
        # NOTE [row locality]: decided at the first call (it needs one call's input shapes); a program
        # whose padding rows could reach real rows never runs padded.
        # exact_rows: dynamo's static first trace, whose one bucket is its exact row count (nothing padded).
        self.hazard: str | None = None
        self._hazard_checked = exact_rows
        self.exact_rows = exact_rows  # its program runs at its traced sizes only: never split (NOTE [splitting])
        self.buckets: dict[int, _Bucket] = {}
        # NOTE [exact-size graphs]: one-item sizes seen often, most recently used last.
        self.exact_limit = exact_graphs
        self.exact: collections.OrderedDict[int, _Bucket] = collections.OrderedDict()
        self.sightings: dict[int, int] = {}
        self._exact_tables_checked: bool | None = None
        self.length_classes = length_classes  # NOTE [segment-length classes]; 1: each bucket at its capacity only
        self.pool = None
        self.graph_bytes = 0
        # NOTE [concurrent calls]: the buckets' static buffers and the graph pool are shared by
        # every call. One lock per graph set is held from filling the static inputs until the
        # outputs are cloned; on CUDA the next call's stream also waits for the event recorded
        # after the previous call's clones, so calls from threads on different streams never
        # overwrite buffers a queued replay still reads.
        self.weight_identities: frozenset = frozenset()  # set by the backend (NOTE [graphs and weights])
        self.lock = threading.RLock()
        self._last_use: torch.cuda.Event | None = None
        _GRAPH_SETS.add(self)

    # -- planning -------------------------------------------------------------------------------
    def patch_rows(self, inputs) -> int:
        """The call's packed patch rows (the size a bucket must hold)."""
        return self._patches(inputs)

    def _patches(self, inputs) -> int:
        return max((inputs[i].shape[dim] for i, dim in self.row_dims), default=0)

    def check_padding(self, inputs) -> str | None:
        """Why this program must not run on padded rows (NOTE [row locality]), or None; decided at the
        first call. The row-group size k is set then too, also in dynamo's static first trace."""
        if self.hazard is None and self.group is None and self.group_index_positions:
            self._found(self._group_size(inputs))
        if self.hazard is None and not self._hazard_checked:
            from kimi_cg.runtime.row_locality import padding_hazard

            gm = getattr(self.program, "gm", None)  # (tests' stand-in programs have no graph to analyse)
            if gm is not None and not self.never_padded:
                self._found(padding_hazard(gm, self.rules, inputs))
        self._hazard_checked = True
        return self.hazard

    def _found(self, hazard: str | None) -> None:
        if hazard is not None:
            self.hazard = hazard
            counters["padding_hazards"] += 1
            logger.info("kimi_cg: a device program runs unpadded, without CUDA graphs: %s", hazard)

    def _group_size(self, inputs) -> str | None:
        """Sets ``group`` (rows per entry of the row-group indices) from this call, or says why not."""
        rows = self._patches(inputs)
        groups = {rows // inputs[i].shape[0] if inputs[i].shape[0] and rows % inputs[i].shape[0] == 0 else None
                  for i in self.group_index_positions}
        if len(groups) != 1 or None in groups:
            return "an index whose length does not divide the rows, or two indices over different groups"
        self.group = groups.pop()
        return None

    def _index_in_range(self, inputs) -> bool:
        for i in self.group_index_positions:
            value = inputs[i]
            if value.numel():
                low, high = torch.aminmax(value)
                if int(low) < -value.shape[0] or int(high) >= value.shape[0]:
                    return False  # eager raises: the plain program does too
        return True

    def choose(self, inputs) -> int | None:
        """The smallest bucket this call fits, or None (then the caller runs the plain program)."""
        if self.never_padded or self.check_padding(inputs) is not None:
            return None
        fit = self._fit(inputs)
        if fit is None:
            return None
        needed, tables = fit
        return next((c for c in self.capacities if c >= needed and (not self.group_index_positions or c % self.group == 0)
                     and all(bounds <= self.segment_slots(i, c) for i, bounds in tables)), None)

    def _fit(self, inputs) -> tuple[int, list[tuple[int, int]]] | None:
        """(rows a bucket must hold, [(position, entries)] of the boundary inputs), or None when the
        call cannot run padded at all."""
        rows = self._patches(inputs)
        needed = rows
        tables = []  # (position, boundaries): each must fit its bucket's table
        for i, rule in self.padded:
            value = inputs[i]
            if rule.kind == "fixed" and tuple(value.shape) != rule.shape:
                return None
            if rule.kind == "cu_seqlens":
                tables.append((i, value.shape[0]))
            if rule.kind == "cu_seqlens" and value.device.type == "cpu" and value.numel() and int(value[-1]) != rows:
                return None  # boundaries that do not end at the rows: the trailing segment [L, C) would not be the padding's
            if rule.kind in ("plan_index", "plan_weight"):
                if value.shape[1] > self.max_frames:
                    return None
                needed = max(needed, value.shape[0])
            if rule.kind == "rows" and value.shape[rule.dim] != rows:
                return None  # host metadata that is not row-aligned with the patches
            if rule.kind == "row_index" and value.shape[0] * self.group != rows:
                return None
            if rule.kind == "size" and value != rows:
                return None  # a size that is not the row count (a standalone argument): set to C it would lie
            if rule.kind == "index_size" and value * self.group != rows:
                return None
        if self.group_index_positions and not self._index_in_range(inputs):
            return None
        return needed, tables

    def choose_exact(self, inputs, host_side: dict | None = None) -> int | None:
        """NOTE [exact-size graphs]: the rows of this call when it runs (or, from this call, will run)
        an exact-size graph of its own; None otherwise. ``host_side``: input position -> the host
        tensor an input was copied from (the runner moves host-made tables to the activations' device)."""
        if not self.exact_limit or self.exact_rows or self.never_padded or self.check_padding(inputs) is not None:
            return None
        fit = self._fit(inputs)
        rows = self._patches(inputs)
        if fit is None or fit[0] != rows or not fit[1] or any(entries != 2 for _, entries in fit[1]):
            return None
        host_side = host_side or {}
        tables = [host_side.get(i, inputs[i]) for i, _ in fit[1]]
        if any(table.device.type != "cpu" or table.tolist() != [0, rows] for table in tables):
            # Only host-made tables are read here. A table the host pass made on the GPU (a grid kept
            # there, as transformers' towers are called) would cost a copy to read: not yet measured
            # on the H200, so those calls replay their buckets.
            return None
        if not self._tables_are_inputs():
            return None
        with self.lock:
            if rows in self.exact:
                self.exact.move_to_end(rows)
                return rows
            if len(self.sightings) >= MAX_SIGHTINGS:
                self.sightings.clear()
            self.sightings[rows] = self.sightings.get(rows, 0) + 1
            return rows if self.sightings[rows] >= EXACT_GRAPH_SIGHTINGS else None

    def _tables_are_inputs(self) -> bool:
        """Every kimi_cg varlen attention of the program takes a boundary input as its table, so
        that inside an exact-size graph every one-segment table is [0, L] (NOTE [one segment on cuDNN])."""
        if self._exact_tables_checked is None:
            gm = getattr(self.program, "gm", None)
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"] if gm is not None else []
            tables = {node for node, rule in zip(placeholders, self.rules) if rule.kind == "cu_seqlens"}
            calls = [n for n in gm.graph.nodes if n.op == "call_function" and _packet(n.target) is _VARLEN_ATTENTION] \
                if gm is not None else []
            self._exact_tables_checked = gm is not None and all(argument(n, 3, "cu_seqlens") in tables for n in calls)
        return self._exact_tables_checked

    def segment_slots(self, position: int, capacity: int) -> int:
        """Segments (real and padding) the boundary input at ``position`` holds in a bucket of
        ``capacity`` rows: NOTE [segment tables]. Its static buffer has one entry more."""
        if position in self.dense_tables:
            # dynamo's static first trace pads nothing and has one bucket: room for any segmentation of it
            return self.max_segments + (capacity if self.exact_rows else capacity // ROWS_PER_DENSE_SEGMENT)
        return self.max_segments

    def make_tables_dense(self, inputs) -> bool:
        """NOTE [segment tables]: boundary inputs of this call with more segments than their tables
        hold in the largest bucket get dense tables (buckets made with the old ones are dropped and
        captured again at the next call that fits one). True when a table changed (choose again).
        The runner asks only after a split (whole items in several replays) did not apply."""
        if not self.capacities or self.never_padded or self.hazard is not None:
            return False
        largest = max(self.capacities)
        new = [i for i, rule in self.padded if rule.kind == "cu_seqlens" and i not in self.dense_tables
               and inputs[i].shape[0] > self.segment_slots(i, largest)]
        if not new:
            return False
        with self.lock:  # NOTE [concurrent calls]: a replay in flight keeps its bucket object
            self.dense_tables.update(new)
            self.buckets, self.graph_bytes = {}, 0
            counters["segment_tables_made_dense"] += 1
        logger.info("kimi_cg: boundary inputs %s get a segment table per %d rows (NOTE [segment tables])",
                    new, ROWS_PER_DENSE_SEGMENT)
        return True

    def split(self, inputs, sort: bool = True) -> "SplitPlan | None":
        """NOTE [splitting]: a call too large for the largest bucket (or with too many items) becomes
        several calls of whole segments (items). With ``sort``, items are packed first-fit
        decreasing by size into parts of at most the largest bucket and ``max_items`` items (fewer
        replays, less padding); a part's inputs gather its items' rows, cu_seqlens, and gather-plan
        rows (rebased). Without, items are packed greedily in call order and each part's inputs are
        slices. Returns None when the inputs do not decompose into items (then the call runs unsplit).

        Parts out of call order need each item's output rows to put the outputs back; those are the
        device program's own output sizes for a call of that item alone (LiftedRunner._rows_per_item),
        never a ratio: a video chunk's merged rows follow its gather-plan rows (h * w / 4, frames
        averaged), not its patch rows (t * h * w), and both ratios can be whole numbers."""
        if self.exact_rows:
            # dynamo's static first trace has literal sizes (a reshape to [3740, 3, 16, -1]): a part of
            # fewer rows fails it. On the H200, Qwen2.5-VL's static block graph split its window
            # boundaries as if they were items, and every call of it fell back (28 per first forward).
            return None
        cu_positions = [i for i, r in enumerate(self.rules) if r.kind == "cu_seqlens"]
        # A fixed-shape input is the whole call's (a table, the grid): not cut per item, so no split.
        if not cu_positions or self.never_padded or any(r.kind in ("fixed", "row_index") for r in self.rules) or (
                self.check_padding(inputs) is not None):
            return None
        if any(r.kind == "rows" and r.dim for r in self.rules):
            return None  # NOTE [rows on dim 1]: parts are cut on dim 0; such calls run unsplit
        cu = inputs[cu_positions[0]]
        if any(not torch.equal(inputs[i].cpu(), cu.cpu()) for i in cu_positions[1:]):
            return None
        bounds = cu.tolist()
        patches = self._patches(inputs)
        if bounds[0] != 0 or bounds[-1] != patches or any(b < a for a, b in zip(bounds, bounds[1:])):
            return None
        items = len(bounds) - 1
        plan = self._plan_rows(inputs, [(bounds[i], bounds[i + 1]) for i in range(items)])
        if plan is None:
            return None
        patch_rows = [bounds[i + 1] - bounds[i] for i in range(items)]
        plan_rows = [b - a for a, b in plan]
        need = [max(p, q) for p, q in zip(patch_rows, plan_rows)]  # a bucket holds both (see choose)
        if not self.capacities:
            return None
        largest, per_part = max(self.capacities), self.max_segments - 1
        parts: list[list[int]] = []
        loads: list[int] = []
        for item in (sorted(range(items), key=lambda i: -need[i]) if sort else range(items)):
            candidates = range(len(parts)) if sort else range(len(parts))[-1:]  # in call order: the open part
            home = next((p for p in candidates if loads[p] + need[item] <= largest and len(parts[p]) < per_part), None)
            if home is None:
                parts.append([])
                loads.append(0)
                home = len(parts) - 1
            parts[home].append(item)
            loads[home] += need[item]
        for part in parts:
            part.sort()  # call order inside a part: runs of neighbouring items stay slices
        pieces = [self._part_inputs(inputs, part, bounds, plan) for part in parts]
        return SplitPlan(pieces, parts, patch_rows, plan_rows)

    def _part_inputs(self, inputs, part: list[int], bounds: list[int], plan: list[tuple[int, int]]) -> list:
        runs = []  # maximal runs of consecutive items: (first, last)
        for item in part:
            if runs and runs[-1][1] == item - 1:
                runs[-1][1] = item
            else:
                runs.append([item, item])
        row_runs = [(bounds[a], bounds[b + 1]) for a, b in runs]
        plan_runs = [(plan[a][0], plan[b][1]) for a, b in runs]
        offsets, total = [], 0  # where each run's rows start in the part
        for a, b in row_runs:
            offsets.append(total)
            total += b - a

        def concat(chunks):
            return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

        piece = []
        for rule, value in zip(self.rules, inputs):
            if rule.kind == "static":
                piece.append(value)
            elif rule.kind == "size":
                piece.append(total)
            elif rule.kind == "rows":
                piece.append(concat([value[a:b] for a, b in row_runs]))
            elif rule.kind == "cu_seqlens":
                cumulative = itertools.accumulate((bounds[i + 1] - bounds[i] for i in part), initial=0)
                piece.append(torch.tensor(list(cumulative), dtype=value.dtype, device=value.device))
            elif rule.kind == "plan_index":  # rebased: a run's first patch row moves to its offset in the part
                piece.append(concat([torch.where(value[a:b] >= 0, value[a:b] - row_start + offset, value[a:b])
                                     for (a, b), (row_start, _), offset in zip(plan_runs, row_runs, offsets)]))
            else:
                piece.append(concat([value[a:b] for a, b in plan_runs]))
        return piece

    def _plan_rows(self, inputs, row_ranges) -> list[tuple[int, int]] | None:
        """For each part's patch rows [a, b), the block of gather-plan rows that reads them."""
        positions = [i for i, r in enumerate(self.rules) if r.kind == "plan_index"]
        if not positions:
            return [(0, 0)] * len(row_ranges)
        index = inputs[positions[0]]
        valid = index >= 0
        if not bool(valid.any(dim=1).all()):
            return None
        first = torch.where(valid, index, torch.iinfo(index.dtype).max).amin(dim=1).cpu()
        last = torch.where(valid, index, -1).amax(dim=1).cpu()
        starts = torch.tensor([start for start, _ in row_ranges], dtype=first.dtype)
        part_of_first = torch.searchsorted(starts, first, right=True) - 1
        part_of_last = torch.searchsorted(starts, last, right=True) - 1
        if not bool((part_of_first == part_of_last).all()):
            return None  # a plan row mixes patches of two parts
        if not bool((part_of_first[1:] >= part_of_first[:-1]).all()):
            return None  # plan rows are not grouped by part
        counts = torch.bincount(part_of_first, minlength=len(row_ranges)).tolist()
        blocks, offset = [], 0
        for count in counts:
            blocks.append((offset, offset + count))
            offset += count
        return blocks

    # -- static buffers ---------------------------------------------------------------------------
    def _allocate(self, capacity: int, inputs, exact: bool = False) -> list:
        # Every buffer lives on the activations' device, whatever device the host pass produced a
        # value on (cu_seqlens from a host-side grid is a CPU tensor): a graph cannot copy from
        # pageable host memory during capture, and _fill does that copy before each replay.
        device = self._device(inputs)
        static = []
        for position, (rule, value) in enumerate(zip(self.rules, inputs)):
            if rule.kind == "static":
                static.append(None)  # the call's own weights (a capture reads them at their address)
            elif rule.kind == "size":
                static.append(capacity)
            elif rule.kind == "index_size":
                static.append(capacity // self.group)
            elif rule.kind == "row_index":
                static.append(torch.arange(capacity // self.group, dtype=value.dtype, device=device))
            elif rule.kind == "rows":
                shape = list(value.shape)
                shape[rule.dim] = capacity
                static.append(torch.zeros(shape, dtype=value.dtype, device=device))
            elif rule.kind == "fixed":
                static.append(torch.zeros(rule.shape, dtype=value.dtype, device=device))
            elif rule.kind == "cu_seqlens":
                slots = 1 if exact else self.segment_slots(position, capacity)
                buffer = torch.full((slots + 1,), capacity, dtype=torch.int32, device=device)
                buffer[0] = 0
                static.append(buffer)
            elif rule.kind == "plan_index":
                static.append(torch.full((capacity, self.max_frames), -1, dtype=value.dtype, device=device))
            elif rule.kind == "plan_weight":
                static.append(torch.zeros((capacity, self.max_frames), dtype=value.dtype, device=device))
        return static

    def _device(self, inputs) -> torch.device:
        return inputs[self.device_position].device

    def _host_block(self, bucket: _Bucket) -> _HostBlock | None:
        positions = [i for i in self.host_block_positions if isinstance(bucket.inputs[i], torch.Tensor)]
        return _HostBlock(bucket.inputs, positions, self.rules, bucket.capacity) if positions else None

    def _fill(self, bucket: _Bucket, inputs) -> None:
        capacity = bucket.capacity
        # NOTE [host block]: first, so that the copies below overwrite what it wrote at their positions
        written = bucket.host_block.write(inputs, self._patches(inputs)) if bucket.host_block else ()
        for i in written:  # the unpack writes these; the block's other positions are _fill's below
            bucket.sources.pop(i, None)
        for i, rule in self.padded:
            if i in written:
                continue
            static, value = bucket.inputs[i], inputs[i]
            if value in read_only:  # NOTE [moved batches]: unchanged since a copy of this very value?
                patches = self._patches(inputs) if rule.kind == "cu_seqlens" else None
                held = bucket.sources.get(i)
                if held is not None and held[0]() is value and held[1] == patches:
                    counters["fills_skipped"] += 1
                    continue
                bucket.sources[i] = (weakref.ref(value), patches)
            else:
                bucket.sources.pop(i, None)
            if rule.kind == "rows":
                rows = value.shape[rule.dim]
                static.narrow(rule.dim, 0, rows).copy_(value, non_blocking=True)
                static.narrow(rule.dim, rows, capacity - rows).zero_()
            elif rule.kind == "fixed":
                static.copy_(value, non_blocking=True)
            elif rule.kind == "row_index":
                count = value.shape[0]
                static[:count].copy_(torch.where(value < 0, value + count, value), non_blocking=True)
                torch.arange(count, static.shape[0], out=static[count:])  # padding groups read themselves
            elif rule.kind == "cu_seqlens":
                count = value.shape[0]
                static[:count].copy_(value, non_blocking=True)
                padding = static[count:]
                if padding.numel():  # NOTE [segment tables]: [L, C) in pieces of PADDING_SEGMENT_ROWS, the rest last
                    torch.add(bucket.padding_steps[:padding.numel()], self._patches(inputs), out=padding)
                    padding.clamp_(max=capacity)
                    padding[-1:].fill_(capacity)
            elif rule.kind in ("plan_index", "plan_weight"):
                rows, frames = value.shape
                static[:rows, :frames].copy_(value, non_blocking=True)
                static[:rows, frames:].fill_(-1 if rule.kind == "plan_index" else 0)
                static[rows:].fill_(-1 if rule.kind == "plan_index" else 0)

    # -- capture and replay -----------------------------------------------------------------------
    def prepare(self, inputs) -> None:
        """Allocate (and on CUDA capture) every bucket, largest first, into one memory pool."""
        missing = [c for c in sorted(self.capacities, reverse=True) if c not in self.buckets]
        if not missing:
            return
        progress = _progress(missing) if self.capture and len(missing) > 1 else missing
        start, compile_before = time.perf_counter(), timings["device_compile"]
        # Static buffers are filled in place by later calls: never inference tensors.
        with torch.inference_mode(False), torch.no_grad():
            for capacity in progress:
                bucket = _Bucket(capacity)
                try:
                    bucket.inputs = self._allocate(capacity, inputs)
                    slots = max((self.segment_slots(i, capacity) for i, rule in self.padded if rule.kind == "cu_seqlens"), default=0)
                    bucket.padding_steps = torch.arange(1, slots + 1, dtype=torch.int32, device=self._device(inputs)) * PADDING_SEGMENT_ROWS
                    bucket.host_block = self._host_block(bucket)
                    bucket.bounds = self._class_bounds(capacity)
                    if self.capture:
                        self._capture(bucket, inputs)
                        self._capture_classes(bucket, inputs)
                except torch.OutOfMemoryError as error:
                    del bucket
                    self._drop_bucket(capacity, error)
                    continue
                except Exception as error:  # noqa: BLE001 - an uncapturable program still runs padded
                    if not self.capture:
                        raise
                    self._stop_capturing(error)
                    bucket.graph = None
                self.buckets[capacity] = bucket
        seconds = time.perf_counter() - start
        timings["capture"] += seconds - (timings["device_compile"] - compile_before)  # a first call compiles
        logger.info("kimi_cg: prepared %d buckets %s in %.1f s", len(missing), missing, seconds)

    def _drop_bucket(self, capacity: int, error: BaseException) -> None:
        """NOTE [memory pressure]: a bucket whose buffers or capture ran out of memory is dropped
        (buckets are prepared largest first, so the largest go first) and the smaller ones are
        tried after the allocator's cache is emptied. Calls that needed the dropped bucket split
        into smaller ones or run the plain device program: slower, never a crash eager would not
        have. With every bucket dropped, every call runs the plain program."""
        self.capacities = tuple(c for c in self.capacities if c != capacity)
        if self.capture and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        counters["buckets_dropped_for_memory"] += 1
        record_fallback("out of memory preparing a bucket", f"bucket of {capacity} patches",
                        str(error).splitlines()[0] if str(error) else "OutOfMemoryError",
                        f"the bucket is dropped; buckets left: {list(self.capacities)}")

    def _stop_capturing(self, error: BaseException) -> None:
        """A device program that cannot be captured (an op reads a device value on the host) runs
        through the padded buffers without capture from now on, instead of failing every call."""
        self.capture = False
        for bucket in self.buckets.values():
            bucket.graph = None
        counters["capture_failures"] += 1
        record_fallback("CUDA graph capture failed", "the device program",
                        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                        "its buckets run padded, without CUDA graphs")

    def _arguments(self, bucket: _Bucket, inputs) -> list:
        """The bucket's padded buffers, with the call's own weights in the static positions."""
        return [inputs[i] if value is None else value for i, value in enumerate(bucket.inputs)]

    def _capture(self, bucket: _Bucket, inputs, exact: bool = False) -> None:
        arguments = self._arguments(bucket, inputs)
        dense = _attention_context(bucket.capacity, exact)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            if self.poison_pool:
                self._fill_pool_with_nan(arguments)
        # Two warm-up runs: compile, autotune, cuDNN plans and allocator warm-up stay out of the graph.
        bucket.graph, bucket.outputs, bucket.graph_bytes = self._captured(arguments, dense, warm_up_runs=2,
                                                                          host_block=bucket.host_block)
        self.graph_bytes += bucket.graph_bytes
        counters["exact_size_captures" if exact else "captures"] += 1

    def _captured(self, arguments, context, warm_up_runs: int, into: tuple | None = None,
                  host_block: _HostBlock | None = None):
        """(graph, outputs, bytes it added to the pool): the program on ``arguments`` under
        ``context``, run ``warm_up_runs`` times on the side stream, then captured into the pool. With
        ``into``, the graph copies its outputs into those buffers (its own die inside the capture);
        with ``host_block``, it first unpacks the block's inputs (NOTE [host block])."""
        before = torch.cuda.memory_allocated()
        stream = _side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), context:
            for _ in range(warm_up_runs):
                if host_block is not None:
                    host_block.unpack()
                self.program(*arguments)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), context:
            if host_block is not None:
                host_block.unpack()
            outputs = tuple(self.program(*arguments))
            if into is not None:
                _copy_outputs(outputs, into)
                outputs = into
        return graph, outputs, max(0, torch.cuda.memory_allocated() - before)

    def _class_bounds(self, capacity: int) -> list[int]:
        """NOTE [segment-length classes]: the shorter bounds a bucket of ``capacity`` runs at; none
        when classes are off or the program has no kimi_cg varlen attention whose table is a boundary
        input as is (only such tables are the ones the runtime reads the longest segment from)."""
        if self.length_classes <= 1 or self.exact_rows or not self._tables_are_inputs():
            return []
        gm = self.program.gm
        if not any(n.op == "call_function" and _packet(n.target) is _VARLEN_ATTENTION for n in gm.graph.nodes):
            return []
        return class_bounds(capacity, self.length_classes)

    def _capture_classes(self, bucket: _Bucket, inputs) -> None:
        """NOTE [segment-length classes]: a graph per shorter bound, each writing the bucket's output
        buffers. One that cannot be made turns classes off for the program (its buckets replay at
        their capacity, as without classes)."""
        if not bucket.bounds or bucket.graph is None:
            return
        arguments = self._arguments(bucket, inputs)
        try:
            for bound in bucket.bounds:
                # One warm-up run (the allocator's): the program is compiled already.
                graph, _, grown = self._captured(arguments, longest_segment_bound(bucket.capacity, bound),
                                                 warm_up_runs=1, into=bucket.outputs, host_block=bucket.host_block)
                bucket.class_graphs[bound] = graph
                bucket.graph_bytes += grown
                self.graph_bytes += grown
                counters["length_class_captures"] += 1
        except Exception as error:  # noqa: BLE001 - out of memory or a failed capture: classes off, buckets stay
            self.length_classes = 1
            for each in (*self.buckets.values(), bucket):
                each.bounds, each.class_graphs = [], {}
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            counters["length_class_failures"] += 1
            logger.warning("kimi_cg: segment-length classes are off for a device program (%s: %s); its buckets "
                           "replay at their capacity", type(error).__name__, str(error).splitlines()[0] if str(error) else "")

    def _bound_for(self, bucket: _Bucket, inputs, host_side: dict | None) -> int | None:
        """NOTE [segment-length classes]: the smallest of the bucket's bounds that holds every segment
        this call's tables get in it (real and padding), or None (its capacity). Reads host-made
        tables only: a table on the GPU would cost a sync to read, and such calls run at capacity."""
        if not bucket.bounds:
            return None
        longest = self.longest_segment(bucket, inputs, host_side)
        return None if longest is None else next((bound for bound in reversed(bucket.bounds) if bound >= longest), None)

    def longest_segment(self, bucket: _Bucket, inputs, host_side: dict | None = None) -> int | None:
        """The longest segment of the tables ``_fill`` writes for this call into ``bucket``, from the
        host-made tables alone (no read of the device), or None when a table is on the device."""
        host_side = host_side or {}
        capacity, rows, longest = bucket.capacity, self._patches(inputs), 0
        for i, rule in self.padded:
            if rule.kind != "cu_seqlens":
                continue
            table = host_side.get(i, inputs[i])
            if table.device.type != "cpu":
                return None
            boundaries = table.tolist()
            longest = max(longest, max((b - a for a, b in zip(boundaries, boundaries[1:])), default=0))
            padding = bucket.inputs[i].shape[0] - len(boundaries)  # entries _fill writes after the real ones
            if padding == 1:
                longest = max(longest, capacity - rows)
            elif padding > 1:  # pieces of PADDING_SEGMENT_ROWS, the rest in the last (NOTE [segment tables])
                longest = max(longest, min(PADDING_SEGMENT_ROWS, capacity - rows),
                              capacity - min(rows + PADDING_SEGMENT_ROWS * (padding - 1), capacity))
        return longest

    def _fill_pool_with_nan(self, inputs) -> None:
        """Capture and replay a graph that fills (and frees) a large block of the pool with NaN; the
        bucket graphs captured next reuse those blocks for their intermediates."""
        device = self._device(inputs)
        poison_bytes = 4 * sum(v.numel() * v.element_size() for v in inputs if isinstance(v, torch.Tensor)) + (256 << 20)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            block = torch.empty(poison_bytes // 4, dtype=torch.float32, device=device)
            block.fill_(float("nan"))
            del block
        graph.replay()
        torch.cuda.synchronize()

    def run(self, inputs, capacity: int, exact: bool = False, host_side: dict | None = None):
        """Replay the bucket of ``capacity`` on these inputs (with ``exact``, the exact-size graph of
        that many rows, made at its first use: NOTE [exact-size graphs]; else the graph of the call's
        segment-length class: NOTE [segment-length classes]); None when that bucket was dropped (NOTE
        [memory pressure]) or the exact-size graph could not be made: the caller then chooses again
        or runs the plain program. ``host_side``: as in ``choose_exact``."""
        with self.lock:  # NOTE [concurrent calls]
            self.prepare(inputs)
            bucket = self._exact_bucket(capacity, inputs) if exact else self.buckets.get(capacity)
            if bucket is None:
                return None
            shapes = self.program.output_shapes(self._on_device(bucket, inputs))
            if self._last_use is not None:
                current_stream().wait_event(self._last_use)
            self._fill(bucket, inputs)
            bound = None if exact else self._bound_for(bucket, inputs, host_side)
            if bucket.graph is not None:
                # A captured bucket has a graph per bound it lists (failures clear both).
                (bucket.graph if bound is None else bucket.class_graphs[bound]).replay()
                outputs = bucket.outputs
                counters["graph_replays"] += 1
                if exact:
                    counters["exact_size_replays"] += 1
                if bound is not None:
                    counters["length_class_replays"] += 1
            else:
                if bucket.host_block is not None:
                    bucket.host_block.unpack()
                with _attention_context(capacity, exact, bound):
                    outputs = tuple(self.program(*self._arguments(bucket, inputs)))
                counters["padded_runs"] += 1
                if bound is not None:
                    counters["length_class_runs"] += 1
            results = tuple(_unpadded(out, shape) for out, shape in zip(outputs, shapes))
            if self.on_cuda:  # captured or not, the static buffers are reused by the next call's stream
                self._last_use = torch.cuda.Event()
                self._last_use.record(current_stream())
            return results

    def _on_device(self, bucket: _Bucket, inputs) -> list:
        """``inputs`` with each host-made value the runner left on the host (NOTE [host block]) replaced
        by a view of the bucket's buffer of its shape: the program's symbolic shape runs take inputs on
        one device. Sizes are all they read."""
        if bucket.host_block is None or not bucket.host_block.block.is_cuda:
            return inputs
        shaped = list(inputs)
        for position in bucket.host_block.layout:
            value = inputs[position]
            if value.device.type == "cpu":
                static = bucket.inputs[position]
                shaped[position] = static[tuple(slice(0, size) for size in value.shape)]
        return shaped

    def _exact_bucket(self, rows: int, inputs) -> _Bucket | None:
        """NOTE [exact-size graphs]: the graph of one-item calls of ``rows`` rows, made (and the least
        recently used one dropped) when new; None when it cannot be made (exact-size graphs then stop)."""
        bucket = self.exact.get(rows)
        if bucket is not None:
            return bucket
        bucket = _Bucket(rows)
        start = time.perf_counter()
        try:
            with torch.inference_mode(False), torch.no_grad():
                bucket.inputs = self._allocate(rows, inputs, exact=True)
                bucket.padding_steps = torch.zeros(0, dtype=torch.int32, device=self._device(inputs))
                bucket.host_block = self._host_block(bucket)
                if self.capture:
                    self._capture(bucket, inputs, exact=True)
        except Exception as error:  # noqa: BLE001 - out of memory, or cuDNN's kernels would not capture
            del bucket
            self.exact_limit, self.exact = 0, collections.OrderedDict()
            if self.capture and torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            counters["exact_size_graph_failures"] += 1
            record_fallback("exact-size graph failed", f"one-item call of {rows} patches",
                            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                            "exact-size graphs are off for this device program; its calls replay the buckets")
            return None
        timings["capture"] += time.perf_counter() - start
        self.exact[rows] = bucket
        self.sightings.pop(rows, None)
        while len(self.exact) > self.exact_limit:
            _, dropped = self.exact.popitem(last=False)
            self.graph_bytes -= dropped.graph_bytes
            counters["exact_size_graphs_dropped"] += 1
        return bucket

    def host_block_bytes(self) -> int:
        """Host memory of the buckets' host copies (NOTE [host block])."""
        return sum(bucket.host_block.host_bytes()
                   for bucket in (*self.buckets.values(), *self.exact.values()) if bucket.host_block is not None)

    def memory(self) -> tuple[str, int, int]:
        """(device, bytes the captures added to the graph pool, bytes of static input buffers)."""
        static = sum(value.numel() * value.element_size() for bucket in (*self.buckets.values(), *self.exact.values())
                     for value in bucket.inputs if isinstance(value, torch.Tensor))
        device = next((str(v.device) for b in self.buckets.values() for v in b.inputs if isinstance(v, torch.Tensor)), "none")
        return device, self.graph_bytes, static


_GRAPH_SETS: "weakref.WeakSet[BucketedGraphs]" = weakref.WeakSet()


def graph_sets() -> list[BucketedGraphs]:
    """Graph sets alive in this process (``kimi_cg.memory_report()``, benchmarks)."""
    return list(_GRAPH_SETS)


def _progress(items):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; stay quiet if it is missing anyway
        return items
    return tqdm(items, desc="kimi_cg: capturing CUDA graphs (patch buckets)", unit="bucket", leave=False)
