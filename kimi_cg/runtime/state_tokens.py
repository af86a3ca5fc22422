"""Tokens for module state: an integer that changes whenever a weight's identity, storage or content does.

NOTE [state tokens]
The host caches (NOTE [per-item metadata cache], NOTE [batch metadata cache]) keep values computed
from module state (a position table resized per image size) and must never return one computed
from other weights. Keys built from what a tensor looks like from outside are not enough:
- a data pointer and a version counter recur: a model compiled after another was freed gets the
  freed model's addresses, and a fresh tensor starts at version 0;
- ``p.data.add_(...)``, ``p.data.copy_(...)`` (how many weight loaders write) change the content
  without bumping ``p``'s version counter (``.data`` is a new tensor with its own counter);
- inference tensors have no version counter at all.
So each state tensor gets a record in a map held weakly by tensor identity: its layout (data
pointer, shape, strides, dtype, device), its version when it has one, and a snapshot of its
content. A call validates the host program's state inputs once: a record whose layout, version or
content differs from the tensor gets a fresh serial (from a counter that never repeats), which is
the token the cache keys use. A freed tensor drops its record with it, so a new tensor at the same
address can never inherit its token. Content is compared bitwise (NaN equals NaN, -0 differs
from +0), on the tensor's device, with one host sync per tensor and call (``torch.equal``).

The snapshots cost one copy of each state tensor the host program reads (the position table,
RoPE tables, a time table: megabytes, reported by ``kimi_cg.memory_report()``); the device
program's weights are not host inputs and get none.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kimi_cg.counters import counters
from kimi_cg.runtime.staging import BITS


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (bitwise comparison)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.dtype == torch.bool:
        return tensor
    return tensor.view(BITS[tensor.element_size()]) if tensor.is_floating_point() else tensor


def _layout(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


@dataclasses.dataclass
class _Record:
    serial: int
    layout: tuple
    version: int | None
    snapshot: torch.Tensor


class StateTokens:
    """Serial numbers of state tensors (NOTE [state tokens])."""

    def __init__(self):
        self._records = WeakIdKeyDictionary()
        self._serials = itertools.count(1)
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._records = WeakIdKeyDictionary()

    def validate(self, tensors: list[torch.Tensor]) -> tuple[int, ...]:
        """Each tensor's token, after comparing it with its record (one host sync per device)."""
        with self._lock:
            records = [self._records.get(tensor) for tensor in tensors]
            compare = [i for i, (tensor, record) in enumerate(zip(tensors, records))
                       if record is not None and record.layout == _layout(tensor) and record.version == _version(tensor)]
            unchanged = set(self._unchanged_content(tensors, records, compare))
            tokens = []
            for i, (tensor, record) in enumerate(zip(tensors, records)):
                if i not in unchanged:
                    record = self._record(tensor)
                tokens.append(record.serial)
            return tuple(tokens)

    def current(self, tensor: torch.Tensor) -> int:
        """The token of a tensor validated in this call (validated now if it has no valid record)."""
        record = self._records.get(tensor)
        if record is not None and record.layout == _layout(tensor) and record.version == _version(tensor):
            return record.serial
        return self.validate([tensor])[0]

    def _record(self, tensor: torch.Tensor) -> _Record:
        with torch.inference_mode(False), torch.no_grad():
            snapshot = tensor.detach().clone()
        record = _Record(next(self._serials), _layout(tensor), _version(tensor), snapshot)
        counters["state_snapshots_taken"] += 1
        self._records[tensor] = record
        return record

    @staticmethod
    def _unchanged_content(tensors, records, positions: list[int]) -> list[int]:
        counters["state_content_checks"] += len(positions)
        with torch.no_grad():
            # torch.equal: the comparison and its read in one ATen call (on CUDA one sync per tensor:
            # the first waits for the device, the others find it idle).
            return [i for i in positions if torch.equal(_bits(tensors[i]), _bits(records[i].snapshot))]

    def report(self) -> dict:
        with self._lock:
            records = list(self._records.values())
        return {"tensors": len(records), "bytes": sum(r.snapshot.numel() * r.snapshot.element_size() for r in records)}


state_tokens = StateTokens()
