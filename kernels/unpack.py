"""Unpacking a call's host-made inputs into a bucket's padded buffers, on the device (NOTE [host block]).

    packed:      [P] one buffer, viewed as int64 for the header and as integers of an input's
                 width for its values; the header holds, for input slot s, four int64 at 4 * s:
                 written (0 or 1), the value's first element (in elements of its width), its rows
                 (count), its columns (frames, plans only); after the last slot, the call's patch rows
    block:       [B] the bucket's static inputs, each a view of it (same widths)
    descriptors: [N, 7] int64, one row per input of one width, fixed per bucket:
                 slot, kind (ROWS / PLAN / BOUNDARIES), elements, row width, first element in
                 ``block``, padding value (as bits of the width), the bucket's capacity

For an input whose header says written, every element e of its static buffer (row r = e // width,
column c = e % width) becomes
    ROWS:        value[e]                 if r < count                   else 0
    PLAN:        value[r * frames + c]    if r < count and c < frames    else padding (-1 / 0)
    BOUNDARIES:  value[e]                 if e < count                   else the last entry: capacity;
                                          others: min(capacity, patches + PADDING_ROWS * (e - count + 1))
which is what ``BucketedGraphs._fill`` writes from a separate value (NOTE [segment tables] for the
boundaries). An input whose header says not written is left alone (``_fill`` wrote it). The header
is read on the device, so the kernel is captured once in a bucket's graph and replays for every call:
the host only packs the values and copies one buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_cg.kernels import on_device_of

ROWS, PLAN, BOUNDARIES = 0, 1, 2
HEADER_FIELDS = 4  # per slot: written, first element, count, frames
DESCRIPTOR_FIELDS = 7  # slot, kind, elements, row width, first element in the block, padding, capacity
BLOCK_SIZE = 1024


@triton.jit
def _unpack_kernel(
    descriptor_ptr,
    header_ptr,
    packed_ptr,
    block_ptr,
    patches_slot,
    PLAN_KIND: tl.constexpr,
    BOUNDARIES_KIND: tl.constexpr,
    PADDING_ROWS: tl.constexpr,
    DESCRIPTOR_FIELDS: tl.constexpr,
    HEADER_FIELDS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Program (k, b): elements [b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE) of descriptor k's input. Programs
    # past an input's end, or of an input the call did not write, store nothing.
    k = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * BLOCK_SIZE
    descriptor = descriptor_ptr + k * DESCRIPTOR_FIELDS
    slot = tl.load(descriptor)
    kind = tl.load(descriptor + 1)
    elements = tl.load(descriptor + 2)
    width = tl.load(descriptor + 3)
    first = tl.load(descriptor + 4)
    padding = tl.load(descriptor + 5)
    capacity = tl.load(descriptor + 6)
    fields = header_ptr + slot * HEADER_FIELDS
    written = tl.load(fields)
    if (written != 0) & (start < elements):
        source = tl.load(fields + 1)
        count = tl.load(fields + 2)
        frames = tl.load(fields + 3)
        patches = tl.load(header_ptr + patches_slot)
        e = start + tl.arange(0, BLOCK_SIZE).to(tl.int64)
        inside = e < elements
        row = e // width
        column = e % width
        is_plan = kind == PLAN_KIND
        valid = (row < count) & ((column < frames) | (kind != PLAN_KIND))
        offset = tl.where(is_plan, row * frames + column, e)
        value = tl.load(packed_ptr + source + offset, mask=inside & valid, other=0)
        step = tl.minimum(patches + PADDING_ROWS * (e - count + 1), capacity)
        boundary = tl.where(e == elements - 1, capacity, step)
        fill = tl.where(kind == BOUNDARIES_KIND, boundary, padding)
        out = tl.where(valid, value, fill.to(value.dtype))
        tl.store(block_ptr + first + e, out, mask=inside)


def unpack(descriptors: torch.Tensor, header: torch.Tensor, packed: torch.Tensor, block: torch.Tensor,
           patches_slot: int, padding_rows: int, max_elements: int) -> None:
    """The kernel over ``descriptors`` (one width: ``packed`` and ``block`` viewed as that width's
    integers: runtime/staging.py's BITS); ``max_elements``: the largest input's elements (the grid's second dim)."""
    if descriptors.shape[0] == 0 or max_elements == 0:
        return
    grid = (descriptors.shape[0], triton.cdiv(max_elements, BLOCK_SIZE))
    with on_device_of(block):
        _unpack_kernel[grid](descriptors, header, packed, block, patches_slot, PLAN_KIND=PLAN,
                             BOUNDARIES_KIND=BOUNDARIES, PADDING_ROWS=padding_rows,
                             DESCRIPTOR_FIELDS=DESCRIPTOR_FIELDS, HEADER_FIELDS=HEADER_FIELDS, BLOCK_SIZE=BLOCK_SIZE)


def unpack_reference(descriptors: torch.Tensor, header: torch.Tensor, packed: torch.Tensor, block: torch.Tensor,
                     patches_slot: int, padding_rows: int) -> None:
    """What ``unpack`` writes, with slices of the packed value instead of index arithmetic (host reads of
    the header: for the CPU and tests)."""
    table, head = descriptors.tolist(), header.tolist()
    patches = head[patches_slot]
    for slot, kind, elements, width, first, padding, capacity in table:
        written, source, count, frames = head[HEADER_FIELDS * slot:HEADER_FIELDS * (slot + 1)]
        if not written:
            continue
        static = block[first:first + elements]
        if kind == BOUNDARIES:
            static[:count] = packed[source:source + count]
            steps = torch.arange(1, elements - count + 1, device=block.device) * padding_rows + patches
            static[count:] = steps.clamp(max=capacity).to(packed.dtype)
            if count < elements:
                static[-1] = capacity
            continue
        columns = frames if kind == PLAN else width
        rows = static.view(elements // width, width)
        rows.fill_(padding)
        rows[:count, :columns] = packed[source:source + count * columns].view(count, columns)
