"""The host-side algebra of per-item data movement, run by the host program at call time.

MergeGatherPass (canonicalize/merge_gather.py) replaces a per-item chain of views on the packed
activations (slice, view, permute, mean over frames, cat) by the same chain of ``row_*`` calls on a
``RowCombination``: a stand-in that records, for every output row, which rows of the packed tensor
it combines and with which weights. ``pack_rows`` turns the chain's results into one gather plan
(index [R, K], weight [R, K]) for ``kimi_cg.merge_gather``; ``take_rows`` cuts each result back out
of the gathered rows after the device program. A step that cannot be expressed as a row gather
raises UnsupportedGraphError (reason "per-item view not expressible as a gather"): a compiler
limit, so the call runs the captured graph instead (NOTE [errors by who must act]).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kimi_cg.errors import UnsupportedGraphError

_NOT_A_GATHER = "per-item view not expressible as a gather"


@dataclasses.dataclass
class RowCombination:
    """Host stand-in for a device tensor [*S, D]: row s equals sum_k weight[s, k] * anchor[index[s, k]].

    ``index`` and ``weight`` are [*S, K]; index -1 contributes nothing. The stand-in has as many
    dims as the tensor it replaces, so ops that leave the last dim alone apply to it unchanged.
    """

    index: torch.Tensor
    weight: torch.Tensor | None  # None: every weight 1 (slices and views of the source)
    dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.index.shape[:-1]) + (self.dim,)

    def map(self, fn) -> "RowCombination":
        return RowCombination(fn(self.index), None if self.weight is None else fn(self.weight), self.dim)


def _weights(rows: RowCombination) -> torch.Tensor:
    return torch.ones(rows.index.shape, dtype=torch.float64) if rows.weight is None else rows.weight


@dataclasses.dataclass
class RowPlan:
    """All region exits packed for one gather: rows [offsets[i], offsets[i] + numel(shapes[i]))."""

    index: torch.Tensor  # [R, K] int64
    weight: torch.Tensor  # [R, K] float32
    offsets: list[int]
    shapes: list[tuple[int, ...]]


def _normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _keep_last(rows: RowCombination, dims, op: str) -> None:
    ndim = rows.index.dim()
    if any(_normalize_dim(d, ndim) == ndim - 1 for d in dims):
        raise UnsupportedGraphError(f"{op} touches the feature dimension of a per-item activation", _NOT_A_GATHER)


def row_source(leading: tuple[int, ...], dim: int) -> RowCombination:
    count = math.prod(leading)
    index = torch.arange(count, dtype=torch.int64).view(*leading, 1)
    return RowCombination(index, None, dim)


def row_getitem(rows: RowCombination, item) -> RowCombination:
    items = item if isinstance(item, tuple) else (item,)
    explicit = [i for i in items if i is not None and i is not Ellipsis]
    if len(explicit) >= rows.index.dim() and not (Ellipsis in items or explicit[-1] == slice(None)):
        raise UnsupportedGraphError("indexing the feature dimension of a per-item activation", _NOT_A_GATHER)
    if any(isinstance(i, torch.Tensor) for i in items):
        raise UnsupportedGraphError("tensor indexing of a per-item activation", _NOT_A_GATHER)
    return rows.map(lambda t: t[item])


def row_view(rows: RowCombination, *sizes, copy: bool = False) -> RowCombination:
    """``view`` of a per-item activation on its stand-in; ``copy``: ``reshape``, which copies where a
    view cannot follow the strides (after a permute), so it succeeds where the real reshape does."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    leading, last = list(sizes[:-1]), sizes[-1]
    if last not in (rows.dim, -1) or (last == -1 and -1 in leading):
        raise UnsupportedGraphError(f"view {tuple(sizes)} changes the feature dimension {rows.dim}", _NOT_A_GATHER)
    if last == -1 and math.prod(leading) != math.prod(rows.index.shape[:-1]):
        raise RuntimeError(f"shape {list(sizes)} is invalid for input of size {math.prod(rows.shape)}")
    keep = rows.index.shape[-1]
    return rows.map(lambda t: t.reshape(*leading, keep) if copy else t.view(*leading, keep))


def row_reshape(rows: RowCombination, *sizes) -> RowCombination:
    return row_view(rows, *sizes, copy=True)


def row_permute(rows: RowCombination, *dims) -> RowCombination:
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    ndim = rows.index.dim()
    if _normalize_dim(dims[-1], ndim) != ndim - 1:
        raise UnsupportedGraphError("permute moves the feature dimension of a per-item activation", _NOT_A_GATHER)
    return rows.map(lambda t: t.permute(*dims))


def row_transpose(rows: RowCombination, dim0: int, dim1: int) -> RowCombination:
    _keep_last(rows, (dim0, dim1), "transpose")
    return rows.map(lambda t: t.transpose(dim0, dim1))


def row_identity(rows: RowCombination, *args, **kwargs) -> RowCombination:
    return rows.map(lambda t: t.contiguous())


def row_flatten(rows: RowCombination, start_dim: int = 0, end_dim: int = -1) -> RowCombination:
    _keep_last(rows, (end_dim,), "flatten")
    return rows.map(lambda t: t.flatten(start_dim, end_dim))


def row_unsqueeze(rows: RowCombination, dim: int) -> RowCombination:
    if _normalize_dim(dim, rows.index.dim() + 1) == rows.index.dim():
        raise UnsupportedGraphError("unsqueeze after the feature dimension of a per-item activation", _NOT_A_GATHER)
    return rows.map(lambda t: t.unsqueeze(dim))


def row_squeeze(rows: RowCombination, dim: int) -> RowCombination:
    _keep_last(rows, (dim,), "squeeze")
    return rows.map(lambda t: t.squeeze(dim))


def row_mean(rows: RowCombination, dim, keepdim: bool = False, dtype=None) -> RowCombination:
    """mean over leading dim(s): the reduced rows join the combination with weight / count."""
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if dtype is not None or len(dims) != 1:
        raise UnsupportedGraphError("mean with dtype= or over several dims of a per-item activation", _NOT_A_GATHER)
    _keep_last(rows, dims, "mean")
    d = _normalize_dim(dims[0], rows.index.dim())
    count = rows.index.shape[d]
    index = rows.index.movedim(d, -2).flatten(-2)
    weight = _weights(rows).movedim(d, -2).flatten(-2) / count
    result = RowCombination(index, weight, rows.dim)
    return result.map(lambda t: t.unsqueeze(d)) if keepdim else result


def padded_terms(index: torch.Tensor, weight: torch.Tensor, terms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """index / weight [..., K] widened to ``terms`` with terms that contribute nothing (-1, weight 0)."""
    pad = list(index.shape[:-1]) + [terms - index.shape[-1]]
    return (torch.cat([index, torch.full(pad, -1, dtype=index.dtype)], dim=-1),
            torch.cat([weight, torch.zeros(pad, dtype=weight.dtype)], dim=-1))


def _pad_terms(rows: RowCombination, terms: int) -> RowCombination:
    if terms == rows.index.shape[-1]:
        return rows
    return RowCombination(*padded_terms(rows.index, _weights(rows), terms), rows.dim)


def row_cat(tensors, dim: int = 0) -> RowCombination:
    tensors = list(tensors)
    _keep_last(tensors[0], (dim,), "cat")
    terms = max(t.index.shape[-1] for t in tensors)
    padded = [_pad_terms(t, terms) for t in tensors]
    weight = None if all(t.weight is None for t in padded) else torch.cat([_weights(t) for t in padded], dim=dim)
    return RowCombination(torch.cat([t.index for t in padded], dim=dim), weight, tensors[0].dim)


def row_size(rows, dim: int) -> int:
    """A stand-in's size (RowCombination here, TableRows of table_rows.py: both have ``shape``)."""
    return rows.shape[dim]


def row_numel(rows) -> int:
    return math.prod(rows.shape)


def row_storage_offset(rows: RowCombination) -> int:
    # Only used by dynamo's `offset >= 0` checks; the offset a slice of the anchor would have.
    index = rows.index
    if not index.numel():
        return 0
    smallest = int(index.masked_fill(index < 0, torch.iinfo(index.dtype).max).min())  # no compaction: ~4x faster
    return 0 if smallest == torch.iinfo(index.dtype).max else smallest * rows.dim


def row_slice_offset(start, stop, total: int, dim: int) -> int:
    """``row_storage_offset(row_getitem(row_source((total,), dim), slice(start, stop)))`` from the integers
    alone (the slice's first row, as the index would give it)."""
    first, end, _ = slice(start, stop).indices(total)
    return first * dim if end > first else 0


def pack_rows(exits: list[RowCombination]) -> RowPlan:
    terms = max(rows.index.shape[-1] for rows in exits)
    flat = [_pad_terms(rows, terms) for rows in exits]
    offsets, total = [], 0
    for rows in flat:
        offsets.append(total)
        total += math.prod(rows.index.shape[:-1])
    index = torch.cat([rows.index.reshape(-1, terms) for rows in flat])
    if all(rows.weight is None for rows in flat):
        weight = torch.ones(index.shape, dtype=torch.float32)
    else:
        weight = torch.cat([_weights(rows).reshape(-1, terms) for rows in flat]).to(torch.float32)
    return RowPlan(index, weight, offsets, [tuple(rows.index.shape[:-1]) for rows in exits])


def plan_index(plan: RowPlan) -> torch.Tensor:
    return plan.index


def plan_weight(plan: RowPlan) -> torch.Tensor:
    return plan.weight


def take_rows(gathered: torch.Tensor, plan: RowPlan, exit_index: int) -> torch.Tensor:
    """After the device program: exit i's rows of the gather result, as a view of its shape."""
    start, shape = plan.offsets[exit_index], plan.shapes[exit_index]
    return gathered[start : start + math.prod(shape)].view(*shape, gathered.shape[-1])
