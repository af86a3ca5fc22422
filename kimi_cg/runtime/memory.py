"""One memory budget per process for kimi_cg's host-made metadata, and ``kimi_cg.memory_report()``.

NOTE [metadata memory budget]
Every value the host caches keep (per-item values: NOTE [per-item metadata cache]; whole batches:
NOTE [batch metadata cache]) lives in one process-wide store, an LRU bounded in bytes:
- the process budget (default 1 GiB, ``KIMI_CG_METADATA_BUDGET_BYTES`` or
  ``kimi_cg.set_memory_budget(metadata_bytes=...)``) bounds the sum over every model;
- a model's ``metadata_cache_bytes`` option bounds its own share (the entries made under its options)
  below that: it can lower its share, never raise the process budget or shrink another model's;
- a value's bytes are those of the distinct storages it holds, counted on the device they live on
  (host metadata of a CUDA tower lives on the GPU); a value larger than its share is not kept.
Eviction is least-recently-used, first within the owner that overflows, then process-wide. The
store is safe to use from several threads (one lock; lookups and insertions are short).

What else kimi_cg holds is reported, not budgeted here: captured graphs and their static buffers
(per bucket, freed with the weights they were captured for), device programs (one per structure),
state snapshots (NOTE [state tokens]) and resize matrices (bounded in count).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Any

import torch

DEFAULT_METADATA_BUDGET = 1 << 30


def _storages(value) -> dict:
    """Distinct storages in a tensor or a (nested) tuple/list of values: {(device, data_ptr): bytes}."""
    found = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            found[(str(item.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
    return found


@dataclasses.dataclass
class _Entry:
    value: Any
    owner: str
    bytes: int
    by_device: dict


class MetadataStore:
    """The process-wide LRU of host metadata (NOTE [metadata memory budget])."""

    def __init__(self, budget: int):
        self.budget = budget
        self._entries: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self._owner_bytes: collections.Counter[str] = collections.Counter()
        self._owner_entries: dict[str, collections.OrderedDict] = {}
        self._bytes = 0
        self.evictions = 0
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._owner_bytes.clear()
            self._owner_entries.clear()
            self._bytes = 0
            self.evictions = 0

    def get(self, key):
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self._owner_entries[entry.owner].move_to_end(key)
            return entry.value

    def put(self, key, value, owner: str, share: int) -> None:
        """Keep ``value`` under ``key``, counted against ``owner``'s share and the process budget."""
        storages = _storages(value)
        size = sum(storages.values())
        by_device = collections.Counter()
        for (device, _), nbytes in storages.items():
            by_device[device] += nbytes
        with self._lock:
            share = min(share, self.budget)
            if size > share:
                return
            self._remove(key)
            self._entries[key] = _Entry(value, owner, size, dict(by_device))
            self._owner_entries.setdefault(owner, collections.OrderedDict())[key] = None
            self._owner_bytes[owner] += size
            self._bytes += size
            owned = self._owner_entries[owner]
            while self._owner_bytes[owner] > share:
                self._evict(next(iter(owned)))
            while self._bytes > self.budget:
                self._evict(next(iter(self._entries)))

    def pop(self, key) -> None:
        with self._lock:
            self._remove(key)

    def set_budget(self, budget: int) -> None:
        with self._lock:
            self.budget = budget
            while self._bytes > self.budget:
                self._evict(next(iter(self._entries)))

    def _evict(self, key) -> None:
        self._remove(key)
        self.evictions += 1

    def _remove(self, key) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._owner_entries[entry.owner].pop(key, None)
        self._owner_bytes[entry.owner] -= entry.bytes
        self._bytes -= entry.bytes

    def report(self) -> dict:
        with self._lock:
            by_device = collections.Counter()
            for entry in self._entries.values():
                by_device.update(entry.by_device)
            return {"budget_bytes": self.budget, "bytes": self._bytes, "entries": len(self._entries),
                    "evictions": self.evictions, "by_device": dict(by_device),
                    "by_owner": {owner: nbytes for owner, nbytes in self._owner_bytes.items() if nbytes}}


def _budget_from_environment() -> int:
    text = os.environ.get("KIMI_CG_METADATA_BUDGET_BYTES")
    if not text:
        return DEFAULT_METADATA_BUDGET
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"KIMI_CG_METADATA_BUDGET_BYTES must be a non-negative int of bytes; got {text!r}") from None
    if value < 0:
        raise ValueError(f"KIMI_CG_METADATA_BUDGET_BYTES must be a non-negative int of bytes; got {text!r}")
    return value


metadata_store = MetadataStore(_budget_from_environment())


def set_memory_budget(metadata_bytes: int | None = None) -> None:
    """Set the process budget of host metadata in bytes (None: the default, or the environment's
    ``KIMI_CG_METADATA_BUDGET_BYTES``); entries beyond it are evicted now."""
    if metadata_bytes is None:
        metadata_bytes = _budget_from_environment()
    if isinstance(metadata_bytes, bool) or not isinstance(metadata_bytes, int) or metadata_bytes < 0:
        raise ValueError(f"metadata_bytes must be a non-negative int of bytes or None; got {metadata_bytes!r}")
    metadata_store.set_budget(metadata_bytes)


def memory_report() -> dict:
    """What kimi_cg holds, in bytes where it lives (NOTE [metadata memory budget]):
    ``metadata`` (the budgeted store: budget, bytes, entries, evictions, by_device, by_owner),
    ``state_snapshots`` (NOTE [state tokens]), ``graphs`` (graph sets, buckets, captured-graph
    memory and static buffers), ``programs`` (device programs and their cached output sizes) and
    ``resize_matrices``."""
    from kimi_cg import device_program
    from kimi_cg.ops import resize
    from kimi_cg.runtime.graphs import graph_sets
    from kimi_cg.runtime.state_tokens import state_tokens

    sets = graph_sets()
    graph_bytes = collections.Counter()
    static_bytes = collections.Counter()
    for graphs in sets:
        device, captured, static = graphs.memory()
        graph_bytes[device] += captured
        static_bytes[device] += static
    programs = list(device_program.programs())
    return {
        "metadata": metadata_store.report(),
        "state_snapshots": state_tokens.report(),
        "graphs": {"sets": len(sets), "buckets": sum(len(g.buckets) for g in sets),
                   "captured_bytes_by_device": dict(graph_bytes), "static_buffer_bytes_by_device": dict(static_bytes)},
        "programs": {"device_programs": len(programs),
                     "output_size_entries": sum(len(p.output_rows_by_shape) for p in programs)},
        "resize_matrices": resize.matrix_cache_report(),
    }
