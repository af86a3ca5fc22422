"""Host-made tensors to the GPU without blocking the host: pinned staging buffers.

NOTE [pinned staging]
The host program makes its outputs on the CPU (cu_seqlens, gather plans, table-gather plans) and the
runner moves them to the activations' device before the device program runs. A copy from pageable
memory of more than 64 KB blocks the host until it is done, and it is queued behind the work already
on the stream: the host cannot run ahead of the device (a serving loop's next request waits for the
previous replay, and a split call's second part waits for the first). Such tensors (the
table-gather plans, NOTE [table gathers]: 64 bytes per resized row) go through pinned memory
instead: a host memcpy (numpy's, on one thread: torch's copy of a plan's size wakes its thread pool),
then an asynchronous copy. Smaller ones the driver stages without blocking.

The process has ``SLOTS`` pinned buffers, used in turn by the calls of every runner: a call packs its
large tensors into one slot (each at a 64-byte boundary) and records an event after its copies; a
slot is rewritten only after that event, so the host may run that many calls ahead of the device.
A slot holds 1 MiB (a W4 request's plans need ~0.4 MB) and grows to the next power of two a call
needs; pinned allocations are slow, so slots are kept for the process's life.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import numpy
import torch

STAGED_BYTES = 1 << 16
"""Pageable copies of at least this many bytes go through pinned memory."""

SLOTS = 2
"""Pinned buffers: how many calls the host may run ahead of the device's copies."""

_ALIGN = 64
_FIRST_BYTES = 1 << 20


def current_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """The current CUDA stream of ``device`` (default: the current device). torch's own default looks
    the device up through ``torch.cuda.is_available()``, which re-reads the environment each time
    (~35 us a call on an H200 host, twice or more per kimi_cg call); an index skips that."""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return torch.cuda.current_stream(index)


class _Slot:
    __slots__ = ("buffer", "bytes", "done")

    def __init__(self):
        self.buffer: torch.Tensor | None = None  # uint8, pinned
        self.bytes = None  # the buffer as a numpy array
        self.done: torch.cuda.Event | None = None


class PinnedStaging:
    """Moves a call's host-made CPU tensors to a CUDA device (NOTE [pinned staging])."""

    def __init__(self):
        self._slots = [_Slot() for _ in range(SLOTS)]
        self._turn = 0
        self._lock = threading.Lock()
        self.staged_copies = 0  # tensors that went through pinned memory (tests, reports)

    def move(self, values: dict[int, torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
        """``values`` (position -> tensor) on the CUDA ``device``; large CPU ones through a pinned slot."""
        large = {position: value for position, value in values.items()
                 if value.device.type == "cpu" and not value.is_pinned()
                 and value.numel() * value.element_size() >= STAGED_BYTES}
        moved = {position: value.to(device, non_blocking=True) for position, value in values.items()
                 if position not in large}
        if not large:
            return moved
        offsets, total = {}, 0
        for position, value in large.items():
            offsets[position] = total
            total += -(-value.numel() * value.element_size() // _ALIGN) * _ALIGN
        with self._lock:
            slot = self._slots[self._turn]
            self._turn = (self._turn + 1) % SLOTS
            if slot.done is not None:
                slot.done.synchronize()  # the copies out of this slot, SLOTS calls ago
                slot.done = None
            if slot.buffer is None or slot.buffer.numel() < total:
                slot.buffer = slot.bytes = None  # the old one goes back to the host allocator first
                slot.buffer = torch.empty(max(_FIRST_BYTES, 1 << (total - 1).bit_length()), dtype=torch.uint8,
                                          pin_memory=True)
                slot.bytes = slot.buffer.numpy()
            for position, value in large.items():
                moved[position] = write_bytes(slot.buffer, slot.bytes, offsets[position], value).to(device, non_blocking=True)
            slot.done = torch.cuda.Event()
            slot.done.record(current_stream(device))
            self.staged_copies += len(large)
        return moved

    def report(self) -> dict:
        with self._lock:
            return {"slots": SLOTS, "staged_copies": self.staged_copies,
                    "bytes": sum(slot.buffer.numel() for slot in self._slots if slot.buffer is not None)}


pinned_staging = PinnedStaging()


def write_bytes(buffer: torch.Tensor, array, start: int, value: torch.Tensor) -> torch.Tensor:
    """Writes ``value`` into the uint8 CPU ``buffer`` (``array``: the same memory as a numpy array) at
    byte ``start``; returns that part of ``buffer`` as a tensor of ``value``'s dtype and shape. A dense
    value's bytes go by numpy's copy (one thread: torch's copy of a plan's size wakes its thread pool);
    others (strided, conjugate or negative views, or values that require grad) by torch's copy."""
    nbytes = value.numel() * value.element_size()
    stage = buffer[start:start + nbytes].view(value.dtype).view(value.shape)
    if not pack_bytes(array, start, value):
        stage.copy_(value)
    return stage


# dtypes whose CPU tensors ``numpy()`` takes as they are; others go by their bits (bfloat16 has no numpy dtype)
_NUMPY_DTYPES = frozenset((torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool))
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype per element width: a tensor viewed as it copies or compares its bits exactly."""


def pack_bytes(array, start: int, value: torch.Tensor) -> bool:
    """numpy's copy of a dense CPU value's bytes into the uint8 numpy ``array`` at byte ``start``;
    False (nothing written) for a value numpy cannot read as it is (strided, a conjugate or negative
    view, one that requires grad): the caller copies it with torch."""
    if not value.is_contiguous() or value.requires_grad or value.is_conj() or value.is_neg():
        return False
    source = value.numpy() if value.dtype in _NUMPY_DTYPES else value.view(BITS[value.element_size()]).numpy()
    array[start:start + source.nbytes] = source.reshape(-1).view(numpy.uint8)
    return True


class ReadOnly:
    """Tensors that nothing writes once made (NOTE [moved batches]), by identity: a static buffer
    that a copy of one of them filled still holds it while that tensor lives."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self._refs[key] = weakref.ref(tensor, lambda _, key=key: self._refs.pop(key, None))

    def __contains__(self, tensor) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor


read_only = ReadOnly()


@dataclasses.dataclass(frozen=True)
class MovedBatch:
    """A cached batch's host outputs on the device (NOTE [moved batches]): ``values`` maps device-program
    positions to the copies, made on ``stream``: (their device, the CUDA stream's handle)."""

    stream: tuple
    values: dict
