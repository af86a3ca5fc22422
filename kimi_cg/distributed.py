"""Data-parallel encoding: the ranks of a torch.distributed group each encode a share of a request.

    tower = torch.compile(model, backend="kimi_cg")
    encode = kimi_cg.data_parallel(tower)          # on every rank, after init_process_group
    features = encode(pixel_values, grid_thws)     # every rank passes the same request, gets the same outputs

Serving engines run the vision tower data-parallel beside a tensor-parallel language model: every
rank holds the whole request and must end with every item's features.

NOTE [data-parallel protocol]
1. Plan (no communication). Items sorted by cost, by default their token count (``prod(grid row)``:
   ``t*h*w`` for a video chunk), largest first, each onto the least-loaded rank (ties to the lower
   rank). The grid is the same on every rank, so every rank computes the same plan.
2. Local run. The rank's items (pixel rows and grid rows, in the request's order) in one call of the
   tower: kimi_cg's buckets and CUDA graphs; a share over the largest bucket is split into graphed
   calls by the runtime, an item over it runs unsplit and non-graphed on its rank. A rank with no
   items does not call the tower; it still takes part in both collectives below.
3. Agreement, before any collective on the outputs, over a CPU (gloo) group so it runs while the
   GPU still works: an all-gather of four integers per rank (status, a fingerprint of the request,
   items in its share, output structure). If any rank failed, or the ranks were handed different
   requests, every rank raises ``DataParallelError`` naming the failing ranks and their errors, and
   none enters the output collective: no rank can hang waiting for one that raised. Then an
   all-gather of each rank's items' output dtypes and shapes (its width is fixed by the plan, which
   every rank now knows to be the same): no sentinel size for an empty share (zero items is a valid
   share). Exchanging the shapes, rather than deriving them from the grid, keeps this independent
   of the tower: any per-item output works, with no per-model rule.
4. Outputs. One all-gather of every rank's outputs as bytes, each rank's part padded to the largest
   part; every rank cuts the received buffer into items and returns them in the request's order. The
   bytes every rank returns are the same (a rank's own items are also read from the gathered buffer).

Calls on one group must come in the same order on every rank, one at a time (as any collective):
two threads calling through the same group concurrently would pair up different requests' messages.
A rank that dies (a crash, not an exception) leaves the others waiting until the process group's
timeout, as in any torch.distributed program.

Output structures: a list (or tuple) with one tensor per item (MoonViT, MoonViT3d), or one tensor of
the items' rows packed in order (transformers' towers); a packed tensor needs the rows of each item,
``item_rows(grid_row) -> int``, found from the tower's ``spatial_merge_size`` (Qwen2-VL, Qwen2.5-VL,
GLM-4V: ``t*h*w / m**2``) or ``merge_kernel_size`` (Kimi-K2.5: ``h*w / (kh*kw)``, frames pooled) when
not given. A tower that returns a model output object (transformers' towers return
``BaseModelOutputWithPooling``) names the field to gather: ``data_parallel(tower, output="pooler_output")``
(or a callable picking it); the other fields are not gathered.

Rows on dim 1: a tower that keeps a batch of one in front of its rows (PaddleOCR-VL's patches
``[1, L, 3, p, p]``, NOTE [rows on dim 1] in kimi_cg/capture.py) gets each share's rows cut and packed
along dim 1, and a packed output of the same form (``[1, L', D]``) is split and gathered along dim 1.
Which dim holds the input's rows follows from the request alone (dim 0 when its size is the items' rows),
so every rank reads it the same way; the output's is sent with the output kind in step 3.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kimi_cg.capture import input_rows_dim
from kimi_cg.errors import KimiCGError

log = logging.getLogger(__name__)

MAX_DIMS = 6  # the most dimensions an item's output may have (the fixed width per item of step 3)
# Output dtypes step 3 can name (by index); anything else is a local failure with a clear message.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_SUMMARY_FIELDS = 3  # status, fingerprint, output kind
_ITEM_FIELDS = 2 + MAX_DIMS  # dtype, ndim, dims
_OK, _FAILED = 0, 1
_ALIGN = 16  # bytes: each item's slot in the gathered buffer starts at a multiple
_LIST, _TUPLE, _PACKED, _PACKED_ON_DIM_1 = 0, 1, 2, 3


class DataParallelError(KimiCGError):
    """A data-parallel call failed on some rank; raised on every rank of the group.

    ``errors`` maps each failing rank to its error (``"TypeName: message"``); on a failing rank the
    original exception is the ``__cause__``."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors


@dataclass(frozen=True)
class Plan:
    """Which items each rank encodes: ``shares[r]`` lists item indices in the request's order."""

    shares: tuple[tuple[int, ...], ...]
    loads: tuple[float, ...]  # cost per rank (tokens by default)

    @property
    def max_share(self) -> int:
        return max(len(share) for share in self.shares)


def plan_items(tokens: Sequence[float], world_size: int) -> Plan:
    """Largest first onto the least-loaded rank (ties: earlier item first, lower rank first).

    The rule every rank applies to the same grid, so the plan needs no communication. Its property
    (tested): no rank's load exceeds another's by more than the largest item."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for item in sorted(range(len(tokens)), key=lambda index: (-tokens[index], index)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(item)
        loads[rank] += tokens[item]
    return Plan(tuple(tuple(sorted(share)) for share in shares), tuple(loads))


def data_parallel(tower: Callable, group: dist.ProcessGroup | None = None, *,
                  item_rows: Callable[[tuple[int, ...]], int] | None = None,
                  pixel_rows: Callable[[tuple[int, ...]], int] | None = None,
                  cost: Callable[[tuple[int, ...]], float] | None = None,
                  output: str | Callable | None = None) -> "DataParallelTower":
    """Wrap ``tower(pixel_values, grid)`` so each rank of ``group`` encodes a share of every request.

    Call it on every rank of the default group, in the same order as other group creations: with an
    NCCL group it creates a gloo group of the same ranks for the agreement step (NOTE [data-parallel
    protocol]). Without an initialised process group the wrapper calls the tower directly.

    ``pixel_rows(grid_row)``: the item's rows of ``pixel_values`` (default: the product of the grid row,
    one row per patch). ``item_rows(grid_row)``: the item's rows of a packed output tensor (default:
    from the tower's merge size; see the module docstring). ``cost(grid_row)``: what the plan balances
    (default: the item's tokens, the product of its grid row; ``attention_aware_cost`` adds the
    quadratic attention term). ``output``: the field of the tower's return value to gather (a name,
    read as an attribute or a key, or a callable), for towers that return a model output object."""
    return DataParallelTower(tower, group, item_rows=item_rows, pixel_rows=pixel_rows, cost=cost, output=output)


def attention_aware_cost(attention_tokens: float = 1400.0) -> Callable[[tuple[int, ...]], float]:
    """Cost ``n + n**2 / attention_tokens`` of an item of ``n`` tokens: its GEMMs grow with n, its
    attention with n**2. ``attention_tokens`` is the segment length at which attention costs as much
    time as the rest of the layer (about 1400 for the Kimi-VL config on an H200: attention took 0.7x
    the GEMM time on ~1000-token images, docs/benchmarks.md)."""
    if attention_tokens <= 0:
        raise ValueError(f"attention_tokens must be positive, got {attention_tokens}")
    return lambda row: math.prod(row) * (1.0 + math.prod(row) / attention_tokens)


class DataParallelTower:
    """The callable ``data_parallel`` returns; ``last_plan`` is the most recent call's plan."""

    def __init__(self, tower: Callable, group: dist.ProcessGroup | None = None, *,
                 item_rows: Callable[[tuple[int, ...]], int] | None = None,
                 pixel_rows: Callable[[tuple[int, ...]], int] | None = None,
                 cost: Callable[[tuple[int, ...]], float] | None = None,
                 output: str | Callable | None = None):
        self.tower = tower
        self.cost = cost or math.prod
        self.output = output
        self.group = group
        self.item_rows = item_rows
        self.pixel_rows = pixel_rows or math.prod
        self.last_plan: Plan | None = None
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed:
            if group is not None:
                raise ValueError("a process group was given but torch.distributed is not initialised")
            self.rank, self.world_size, self.agreement_group = 0, 1, None
            return
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if dist.get_backend(group) == "gloo":
            self.agreement_group = group
        else:  # a collective call on every rank of the default group (new_group's contract)
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self.agreement_group = dist.new_group(ranks=ranks, backend="gloo")

    def __call__(self, pixel_values: torch.Tensor, grid: torch.Tensor, *args, **kwargs):
        if not self.distributed or self.world_size == 1:
            return self._select(self.tower(pixel_values, grid, *args, **kwargs))
        plan, local, shapes, cause, fingerprint = None, ([], None), None, None, 0
        try:
            grid_rows = _grid_rows(grid)  # one host read of the grid: plan, fingerprint and item rows
            fingerprint = _fingerprint(pixel_values, grid_rows)
            rows, plan, rows_dim = self._plan(pixel_values, grid_rows)
            local = self._run_share(pixel_values, grid, grid_rows, rows, rows_dim, plan.shares[self.rank], args, kwargs)
            shapes = self._shapes(plan, local)
        except Exception as error:  # agreed on below: every rank raises, none hangs
            cause = error
        kind = self._agree(local, fingerprint, cause)
        fields = self._exchange_shapes(shapes)
        self.last_plan = plan
        return self._gather_outputs(plan, fields, kind, local)

    # -- steps 1-2: plan and local run -------------------------------------------------------------
    def _plan(self, pixel_values: torch.Tensor, grid_rows: list[tuple[int, ...]]):
        if not grid_rows:
            raise ValueError("the request has no items (grid has 0 rows)")
        rows = [int(self.pixel_rows(row)) for row in grid_rows]
        rows_dim = input_rows_dim(pixel_values, sum(rows))
        if pixel_values.shape[rows_dim] != sum(rows):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} has {pixel_values.shape[0]} rows but the grid's "
                             f"items have {sum(rows)} (one row per patch: the product of each grid row; rows on dim 0, "
                             "or on dim 1 after a batch of one)")
        return rows, plan_items([self.cost(row) for row in grid_rows], self.world_size), rows_dim

    def _run_share(self, pixel_values, grid, grid_rows, rows, rows_dim, share, args, kwargs):
        """The tower on this rank's items; returns (per-item tensors, output kind)."""
        if not share:
            return [], None
        starts = [0]
        for count in rows:
            starts.append(starts[-1] + count)
        if list(share) == list(range(len(rows))):
            pixels, sub_grid = pixel_values, grid
        else:
            pixels = torch.cat([pixel_values.narrow(rows_dim, starts[i], rows[i]) for i in share], dim=rows_dim)
            sub_grid = grid[list(share)]
        output = self._select(self.tower(pixels, sub_grid, *args, **kwargs))
        if isinstance(output, (list, tuple)):
            if len(output) != len(share) or not all(isinstance(item, torch.Tensor) for item in output):
                raise TypeError(f"the tower returned a {type(output).__name__} of {len(output)} entries for "
                                f"{len(share)} items; data_parallel needs one tensor per item (or one packed tensor)")
            return list(output), _TUPLE if isinstance(output, tuple) else _LIST
        if isinstance(output, torch.Tensor):
            counts = [self._item_rows(grid_rows[i]) for i in share]
            # A [1, L', ...] output of a tower whose input rows are on dim 1 is packed on dim 1 as well.
            output_dim = 1 if rows_dim == 1 and output.dim() >= 2 and output.shape[0] == 1 else 0
            if sum(counts) != output.shape[output_dim]:
                raise ValueError(f"the tower's packed output {tuple(output.shape)} has {output.shape[output_dim]} rows on "
                                 f"dim {output_dim} but item_rows gives {sum(counts)} for the items "
                                 f"{[grid_rows[i] for i in share]}: pass item_rows= that matches the tower")
            return list(torch.split(output, counts, dim=output_dim)), _PACKED_ON_DIM_1 if output_dim else _PACKED
        raise TypeError(f"the tower returned {type(output).__name__}; data_parallel gathers one tensor per item or "
                        "one packed tensor: name the field to gather, e.g. data_parallel(tower, output='pooler_output')")

    def _select(self, value):
        if self.output is None:
            return value
        if callable(self.output):
            return self.output(value)
        if hasattr(value, self.output):
            return getattr(value, self.output)
        try:
            return value[self.output]
        except (KeyError, TypeError, IndexError):
            raise TypeError(f"the tower's {type(value).__name__} has no field {self.output!r}") from None

    def _item_rows(self, row: tuple[int, ...]) -> int:
        if self.item_rows is None:
            self.item_rows = _item_rows_rule(self.tower)
        return int(self.item_rows(row))

    # -- step 3: agreement -------------------------------------------------------------------------
    def _shapes(self, plan: Plan, local) -> torch.Tensor:
        """This rank's items' output dtypes and shapes, ``_ITEM_FIELDS`` integers per item of the
        largest share (the width every rank computes from the same plan)."""
        items, _ = local
        shapes = torch.zeros(plan.max_share * _ITEM_FIELDS, dtype=torch.int64)
        for j, item in enumerate(items):
            if item.dtype not in _DTYPES:
                raise TypeError(f"output dtype {item.dtype} cannot be gathered (supported: {_DTYPES})")
            if item.dim() > MAX_DIMS:
                raise ValueError(f"an item's output has {item.dim()} dimensions; at most {MAX_DIMS} are supported")
            at = j * _ITEM_FIELDS
            shapes[at:at + 2 + item.dim()] = torch.tensor([_DTYPES.index(item.dtype), item.dim(), *item.shape])
        return shapes

    def _agree(self, local, fingerprint: int, cause: BaseException | None) -> int:
        """A fixed-size summary per rank (status, request fingerprint, output structure): every rank
        raises the same DataParallelError unless all succeeded on the same request. Returns the
        agreed output structure."""
        _, kind = local
        summary = torch.tensor([_FAILED if cause is not None else _OK, fingerprint, -1 if kind is None else kind])
        gathered = [torch.empty(_SUMMARY_FIELDS, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(gathered, summary, group=self.agreement_group)
        summaries = [h.tolist() for h in gathered]
        failed = [r for r, h in enumerate(summaries) if h[0] != _OK]
        fingerprints = {h[1] for h in summaries}
        kinds = {h[2] for h in summaries if h[2] >= 0}
        if not failed and len(fingerprints) == 1 and len(kinds) == 1:
            return kinds.pop()
        # Every rank reaches this point together: exchange the messages, then all raise.
        message = "" if cause is None else f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        messages: list = [None] * self.world_size
        dist.all_gather_object(messages, message, group=self.agreement_group)
        errors = {r: messages[r] for r in failed}
        if failed:
            text = "; ".join(f"rank {r}: {errors[r]}" for r in failed)
            reason = f"data-parallel call failed on rank(s) {failed} of {self.world_size}: {text}"
        elif len(fingerprints) > 1:
            reason = ("the ranks were given different requests (pixel_values shape or grid differ); every rank "
                      "must pass the same request to a data-parallel call")
        else:
            reason = "the ranks' towers returned different output structures (list, tuple, packed tensor)"
        raise DataParallelError(reason, errors) from cause

    def _exchange_shapes(self, shapes: torch.Tensor) -> list[torch.Tensor]:
        """Each rank's items' output dtypes and shapes. Runs only once every rank agreed, so every
        rank planned the same request and the widths match."""
        gathered = [torch.empty_like(shapes) for _ in range(self.world_size)]
        dist.all_gather(gathered, shapes, group=self.agreement_group)
        return gathered

    # -- step 4: outputs ---------------------------------------------------------------------------
    def _gather_outputs(self, plan: Plan, shape_fields: list[torch.Tensor], kind: int, local):
        items, _ = local
        shapes, dtypes, nbytes = [], [], []  # per rank, per item in share order
        for share, fields in zip(plan.shares, shape_fields):
            rank_shapes, rank_dtypes = [], []
            for j in range(len(share)):
                at = j * _ITEM_FIELDS
                dtype, ndim = _DTYPES[int(fields[at])], int(fields[at + 1])
                rank_shapes.append(tuple(int(d) for d in fields[at + 2:at + 2 + ndim]))
                rank_dtypes.append(dtype)
            shapes.append(rank_shapes)
            dtypes.append(rank_dtypes)
            nbytes.append([math.prod(s) * d.itemsize for s, d in zip(rank_shapes, rank_dtypes)])
        # Each item in a slot aligned to _ALIGN bytes, so any dtype's view of it is aligned.
        width = max(sum(_aligned(size) for size in sizes) for sizes in nbytes)
        device = items[0].device if items else self._output_device()
        send = torch.empty(width, dtype=torch.uint8, device=device)  # padding bytes are never read
        offset = 0
        for item in items:
            flat = item.contiguous().view(-1).view(torch.uint8)
            send[offset:offset + flat.numel()].copy_(flat)
            offset += _aligned(flat.numel())
        received = torch.empty(self.world_size * width, dtype=torch.uint8, device=device)
        if device.type == "cuda":
            dist.all_gather_into_tensor(received, send, group=self.group)
        else:
            dist.all_gather(list(received.view(self.world_size, width).unbind(0)), send, group=self.group)
        outputs: list = [None] * sum(len(share) for share in plan.shares)
        for rank, share in enumerate(plan.shares):
            offset = rank * width
            for item, shape, dtype, size in zip(share, shapes[rank], dtypes[rank], nbytes[rank]):
                outputs[item] = received[offset:offset + size].view(dtype).view(shape)
                offset += _aligned(size)
        if kind in (_PACKED, _PACKED_ON_DIM_1):
            return torch.cat(outputs, dim=1 if kind == _PACKED_ON_DIM_1 else 0)
        return tuple(outputs) if kind == _TUPLE else outputs

    def _output_device(self) -> torch.device:
        """Where an empty share's buffers live: the group's device (the current CUDA device for NCCL)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _grid_rows(grid) -> list[tuple[int, ...]]:
    if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.is_floating_point():
        raise ValueError(f"grid must be an integer tensor [items, dims], got "
                         f"{getattr(grid, 'dtype', type(grid).__name__)} {tuple(getattr(grid, 'shape', ()))}")
    return [tuple(row) for row in grid.tolist()]


def _fingerprint(pixel_values: torch.Tensor, grid_rows: list[tuple[int, ...]]) -> int:
    """A checksum of the request's shape and grid: ranks handed different requests disagree on it."""
    text = f"{tuple(pixel_values.shape)}|{pixel_values.dtype}|{grid_rows}"
    return zlib.crc32(text.encode())


def _item_rows_rule(tower) -> Callable[[tuple[int, ...]], int]:
    """The rows of each item in a packed output, from the tower module's merge attributes."""
    module = getattr(tower, "_orig_mod", tower)
    merge = getattr(module, "spatial_merge_size", None)
    if merge is None and getattr(module, "config", None) is not None:
        merge = getattr(module.config, "spatial_merge_size", None)
    if isinstance(merge, int):  # Qwen2-VL, Qwen2.5-VL, GLM-4V: every frame's patches merged m x m
        return lambda row: math.prod(row) // (merge * merge)
    kernel = getattr(module, "merge_kernel_size", None)
    if kernel is not None:  # Kimi-K2.5: frames pooled, then kh x kw windows
        kh, kw = kernel
        return lambda row: (row[-2] // kh) * (row[-1] // kw)
    raise TypeError(f"{type(module).__name__} returns one packed tensor and has no spatial_merge_size or "
                    "merge_kernel_size: pass data_parallel(..., item_rows=lambda grid_row: rows of that item)")
