"""Host-made tensors to the GPU without blocking the host: pinned staging buffers.

NOTE [pinned staging]
The host program makes its outputs on the CPU (cu_seqlens, gather plans, table-gather plans) and the
runner moves them to the activations' device before the device program runs. A copy from pageable
memory of more than 64 KB blocks the host until it is done, and it is queued behind the work already
on the stream: the host cannot run ahead of the device (a serving loop's next request waits for the
previous replay, and a split call's second part waits for the first). Such tensors (the
table-gather plans, NOTE [table gathers]: 64 bytes per resized row) go through a pinned buffer
instead: a host memcpy, then an asynchronous copy. Smaller ones the driver stages without blocking.

Each input position has a ring of ``SLOTS`` buffers; a slot is rewritten only after the copies out
of it finished (an event recorded after the call's copies), so the host may run that many calls
ahead of the device. Buffers grow geometrically (pinned allocations are slow) and are kept for the
runner's life. One lock per runner: calls from several threads take turns here only.
"""

from __future__ import annotations

import threading

import torch

STAGED_BYTES = 1 << 16
"""Pageable copies of at least this many bytes go through a pinned buffer."""

SLOTS = 2
"""Buffers per input position: how many calls the host may run ahead of the device's copies."""


class _Slot:
    __slots__ = ("buffer", "done")

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None


class PinnedStaging:
    """Moves a call's host-made CPU tensors to a CUDA device (NOTE [pinned staging])."""

    def __init__(self):
        self._rings: dict[int, list[_Slot]] = {}
        self._turn = 0
        self._lock = threading.Lock()
        self.staged_copies = 0  # how many tensors went through a pinned buffer (tests, reports)

    def move(self, values: dict[int, torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
        """``values`` (position -> tensor) on the CUDA ``device``; large CPU ones through the pinned slots."""
        moved, used = {}, []
        with self._lock:
            turn, self._turn = self._turn, (self._turn + 1) % SLOTS
            for position, value in values.items():
                if (value.device.type != "cpu" or value.numel() * value.element_size() < STAGED_BYTES
                        or value.is_pinned()):
                    moved[position] = value.to(device, non_blocking=True)
                    continue
                slot = self._slot(position, turn)
                stage = self._stage(slot, value)
                moved[position] = stage.to(device, non_blocking=True)
                used.append(slot)
            if used:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(device))
                for slot in used:
                    slot.done = done
                self.staged_copies += len(used)
        return moved

    def _slot(self, position: int, turn: int) -> _Slot:
        ring = self._rings.get(position)
        if ring is None:
            ring = self._rings[position] = [_Slot() for _ in range(SLOTS)]
        slot = ring[turn]
        if slot.done is not None:
            slot.done.synchronize()  # the copy out of this buffer, SLOTS calls ago
            slot.done = None
        return slot

    @staticmethod
    def _stage(slot: _Slot, value: torch.Tensor) -> torch.Tensor:
        buffer = slot.buffer
        if buffer is None or buffer.dtype != value.dtype or buffer.numel() < value.numel():
            size = value.numel() if buffer is None or buffer.dtype != value.dtype else max(value.numel(), 2 * buffer.numel())
            buffer = slot.buffer = torch.empty(size, dtype=value.dtype, pin_memory=True)
        stage = buffer[:value.numel()].view(value.shape)
        stage.copy_(value)
        return stage

    def report(self) -> dict:
        with self._lock:
            return {"positions": len(self._rings), "staged_copies": self.staged_copies,
                    "bytes": sum(slot.buffer.numel() * slot.buffer.element_size() for ring in self._rings.values()
                                 for slot in ring if slot.buffer is not None)}
