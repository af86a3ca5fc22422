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
- whole batches may take at most half of either (``BATCH_FRACTION``), and only what per-item values
  leave: a group that overflows evicts its least recently used batch first and an item only when it
  holds no batch, and a batch never evicts an item (a batch that does not fit is not kept). A batch
  repeats its items' values, and a stream of distinct batches must not evict the per-item values
  that make a new batch of seen sizes cheap: on the H200, W4's 40-request stream (item values ~0.7
  GB, 16 batches ~0.4 GB) otherwise missed its items on the second pass (an LRU over a cycle longer
  than what it holds): bench.py's W4_repeat rest was 4.1 ms per request, 3.3 ms with every item a hit.
Eviction is otherwise least-recently-used within each group that overflows. The store is safe to
use from several threads (one lock; lookups and insertions are short).

What else kimi_cg holds is reported, not budgeted here: captured graphs and their static buffers
(per bucket, freed with the weights they were captured for), device programs (one per structure),
state snapshots (NOTE [state tokens]) and resize matrices (bounded in count).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import threading
from typing import Any

import torch

DEFAULT_METADATA_BUDGET = 1 << 30


def _storages(value) -> dict:
    """Distinct storages in a tensor or a (nested) tuple / list / dict of values: {(device, data_ptr): bytes}."""
    found = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            found[(item.device, storage.data_ptr())] = storage.nbytes()
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        else:
            names = _field_names(type(item))  # a host stand-in (TableRows, RowCombination): its fields
            if names:
                stack.extend(getattr(item, name) for name in names)
    return found


@functools.lru_cache(maxsize=None)
def _field_names(kind: type) -> tuple[str, ...]:
    """A dataclass's field names; () for any other type (cached per type: a put walks many values)."""
    return tuple(field.name for field in dataclasses.fields(kind)) if dataclasses.is_dataclass(kind) else ()


BATCH_FRACTION = 0.5
"""Whole batches (NOTE [batch metadata cache]) may use at most this fraction of a budget: a batch
holds every item's metadata again, and a stream of distinct batches must not evict the per-item
values that make new batches of seen sizes cheap."""


@dataclasses.dataclass
class _Entry:
    value: Any
    groups: tuple
    bytes: int
    by_device: dict


class MetadataStore:
    """The process-wide LRU of host metadata (NOTE [metadata memory budget]).

    Every entry belongs to groups, each an LRU with a byte limit: the process, its owner, its pool
    ("item" or "batch") process-wide and within its owner. Inserting evicts the least recently used
    entries of each group that overflows."""

    def __init__(self, budget: int):
        self.budget = budget
        self._entries: dict[Any, _Entry] = {}
        self._groups: dict[tuple, collections.OrderedDict] = {}
        self._group_bytes: collections.Counter = collections.Counter()
        self._limits: dict[tuple, int] = {}
        self.evictions = 0
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._groups.clear()
            self._group_bytes.clear()
            self._limits.clear()
            self.evictions = 0

    def get(self, key):
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            for group in entry.groups:
                self._groups[group].move_to_end(key)
            return entry.value

    def put(self, key, value, owner: str, share: int, pool: str = "item") -> None:
        """Keep ``value`` under ``key``, counted against ``owner``'s share (at most ``share`` bytes),
        its pool and the process budget."""
        storages = _storages(value)
        size = sum(storages.values())
        by_device = {}
        for (device, _), nbytes in storages.items():
            by_device[device] = by_device.get(device, 0) + nbytes
        with self._lock:
            share = min(share, self.budget)
            limits = {("process",): self.budget, ("owner", owner): share}
            if pool == "batch":
                limits[("pool", pool)] = int(self.budget * BATCH_FRACTION)
                limits[("owner", owner, pool)] = int(share * BATCH_FRACTION)
            if size > min(limits.values()):
                return
            self._remove(key)
            entry = _Entry(value, tuple(limits), size, by_device)
            self._entries[key] = entry
            for group, limit in limits.items():
                self._limits[group] = limit
                self._groups.setdefault(group, collections.OrderedDict())[key] = None
                self._group_bytes[group] += size
            for group in entry.groups:
                while key in self._entries and self._group_bytes[group] > self._limits[group]:
                    self._evict(self._victim(group, pool))

    def pop(self, key) -> None:
        with self._lock:
            self._remove(key)

    def set_budget(self, budget: int) -> None:
        with self._lock:
            self.budget = budget
            self._limits[("process",)] = budget
            if ("pool", "batch") in self._limits:
                self._limits[("pool", "batch")] = int(budget * BATCH_FRACTION)
            for group in (("process",), ("pool", "batch")):
                while self._group_bytes[group] > self._limits.get(group, budget):
                    self._evict(self._victim(group, "item"))

    def _victim(self, group: tuple, pool: str):
        """The entry an overflowing group gives up for an entry of ``pool``: its least recently used
        batch, else (only for an item) its least recently used item."""
        batches = self._groups.get(_batch_group(group))
        if batches:
            return next(iter(batches))
        return next(iter(self._groups[group])) if pool == "item" else None

    def _evict(self, key) -> None:
        if key is None:
            raise AssertionError("metadata store: an overflowing group has no entry to evict")
        self._remove(key)
        self.evictions += 1

    def _remove(self, key) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        for group in entry.groups:
            self._groups[group].pop(key, None)
            self._group_bytes[group] -= entry.bytes

    def report(self) -> dict:
        with self._lock:
            by_device = collections.Counter()
            for entry in self._entries.values():
                for device, nbytes in entry.by_device.items():
                    by_device[str(device)] += nbytes
            return {"budget_bytes": self.budget, "bytes": self._group_bytes[("process",)], "entries": len(self._entries),
                    "evictions": self.evictions, "by_device": dict(by_device),
                    "by_pool": {group[1]: n for group, n in self._group_bytes.items() if group[0] == "pool" and n},
                    "by_owner": {group[1]: n for group, n in self._group_bytes.items() if group[0] == "owner" and len(group) == 2 and n}}


def _batch_group(group: tuple) -> tuple:
    """The group of the batches inside ``group`` (itself for a batch group)."""
    if group[-1] == "batch":
        return group
    if group == ("process",):
        return ("pool", "batch")
    return (*group, "batch")  # ("owner", owner)


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
    memory, static buffers and their host copies: NOTE [host block]), ``programs`` (device programs
    and their cached output sizes), ``resize_matrices`` and ``pinned_staging`` (NOTE [pinned staging])."""
    from kimi_cg import device_program
    from kimi_cg.ops import resize
    from kimi_cg.runtime.graphs import graph_sets
    from kimi_cg.runtime.staging import pinned_staging
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
                   "captured_bytes_by_device": dict(graph_bytes), "static_buffer_bytes_by_device": dict(static_bytes),
                   "host_block_bytes": sum(graphs.host_block_bytes() for graphs in sets)},
        "programs": {"device_programs": len(programs),
                     "output_size_entries": sum(len(p.output_shapes_by_signature) for p in programs)},
        "resize_matrices": resize.matrix_cache_report(),
        "pinned_staging": pinned_staging.report(),
    }
