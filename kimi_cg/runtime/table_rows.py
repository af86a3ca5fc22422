"""The host-side algebra of per-item reads of a module-state table, run by the host program at call time.

NOTE [table gathers]
Towers read learned tables per item: MoonViT resizes its 64x64 position grid to each image's
(h, w) (a bicubic interpolation) and slices its RoPE table to [:h, :w]. Computed on the host, each
new size costs device work on the request's critical path, every call must check that the tables
did not change (NOTE [state tokens]: a content comparison, one host sync), and the results are
copied into the bucket's buffers (thousands of floats per row). TableGatherPass
(canonicalize/table_gather.py) replays such a chain on a stand-in instead: ``TableRows`` records,
for every row of the real result, which rows of the table it combines and with which weights
(a slice or view keeps one term, a bicubic resize makes 16: 4 taps by 4). The host then produces
integers and weights only, cached per item by size; the device program reads the table itself,
at its current content, in one ``kimi_cg.table_gather`` (the merge gather's kernel): a state
table no host program reads needs no check and no snapshot.

The stand-in keeps the real tensor's dims, the feature dim held as size 1 (its position is
``axis``), plus a trailing K dim of terms, so movement ops (permute, unsqueeze, squeeze, flatten,
getitem, view/reshape, cat, repeat) apply to it almost unchanged. Anything that mixes features or
is not a movement op is not a table read: the pass leaves such chains alone.

Plans are int32 (a table has far fewer than 2**31 rows). A bicubic resize of the table's own grid
(each row of the read is table row base + y * row_step + x * column_step, proven by the pass at
compile time) keeps its 16 terms as pairs: 4 row taps and 4 column taps (``outer`` = 4), the
device forming the 16 sums and weight products. Its plan is 8 integers and 8 weights per row
instead of 16 and 16, and a new size costs two small tap tables instead of a 16-way gather.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from kimi_cg.ops.resize import resize_taps_float64
from kimi_cg.runtime.gather_plan import padded_terms

DEVICE_PLACEMENT = "kimi_cg_device"
"""Node meta key: the lift puts the node in the device program whatever its inputs (lift.py)."""
TABLE_ROWS = "kimi_cg_table_rows"
"""Node meta key: a host node whose value is a TableRows stand-in (the per-item cache keeps it)."""


@dataclasses.dataclass(eq=False)
class TableRows:
    """Host stand-in for a tensor read from a table: element [..., f, ...] (f at ``axis``) equals
    sum_k weight[..., k] * table_rows[index[..., k], f]; index -1 contributes nothing."""

    index: torch.Tensor  # the real shape with the feature dim as 1, then K (int32)
    # float32, the same shape (a bicubic's tap weights rounded once, from float64); None: every weight 1
    # (slices and views of the table: movement ops then skip the weights, ``weights`` makes them)
    weight: torch.Tensor | None
    axis: int
    dim: int
    # 0: the K terms as listed. n > 0: the terms are the pairs (i, j) of the first n entries and the
    # other K - n: table row index[i] + index[n + j], weight weight[i] * weight[n + j] (in float32);
    # a pair with a -1 contributes nothing. The op ``kimi_cg.table_gather`` takes the same ``outer``.
    outer: int = 0

    @property
    def ndim(self) -> int:
        return self.index.dim() - 1

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.index.shape[:-1])
        shape[self.axis] = self.dim
        return tuple(shape)

    def map(self, fn, axis: int) -> "TableRows":
        return TableRows(fn(self.index), None if self.weight is None else fn(self.weight), axis, self.dim, self.outer)


def weights(rows: TableRows) -> torch.Tensor:
    """The read's weights as a tensor (ones where the stand-in keeps none)."""
    return torch.ones(rows.index.shape, dtype=torch.float32) if rows.weight is None else rows.weight


def listed_terms(rows: TableRows) -> TableRows:
    """The same read with its terms listed (``outer`` 0): pairs become their sums and products."""
    if not rows.outer:
        return rows
    n = rows.outer
    first, second = rows.index[..., :n].unsqueeze(-1), rows.index[..., n:].unsqueeze(-2)
    index = torch.where((first >= 0) & (second >= 0), first + second, -1).flatten(-2)
    weight = None if rows.weight is None else (
        rows.weight[..., :n].unsqueeze(-1) * rows.weight[..., n:].unsqueeze(-2)).flatten(-2)
    return TableRows(index, weight, rows.axis, rows.dim)


class NotATableRead(Exception):
    """A step the stand-in cannot express: raised while the pass replays a chain at compile time."""


def normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"dimension {dim} out of range for {ndim} dims")
    return dim + ndim if dim < 0 else dim


def _dims_argument(dims) -> tuple:
    return tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)) else tuple(dims)


@functools.lru_cache(maxsize=64)
def table_source(leading: tuple[int, ...], dim: int) -> TableRows:
    """The stand-in of a [*leading, dim] table: row r is table row r. Cached and never written (every
    op below makes new tensors or views), so host programs share one per table shape."""
    count = math.prod(leading)
    index = torch.arange(count, dtype=torch.int32).view(*leading, 1, 1)
    return TableRows(index, None, len(leading), dim)


def permute_axis(ndim: int, axis: int, dims) -> int:
    dims = tuple(normalize_dim(d, ndim) for d in _dims_argument(dims))
    if sorted(dims) != list(range(ndim)):
        raise NotATableRead(f"permute {dims} of {ndim} dims")
    return dims.index(axis)


def transpose_dims(ndim: int, dim0: int, dim1: int) -> list[int]:
    dims = list(range(ndim))
    a, b = normalize_dim(dim0, ndim), normalize_dim(dim1, ndim)
    dims[a], dims[b] = dims[b], dims[a]
    return dims


def unsqueeze_axis(ndim: int, axis: int, dim: int) -> int:
    return axis + (normalize_dim(dim, ndim + 1) <= axis)


def squeeze_check(ndim: int, axis: int, dim: int) -> int:
    if normalize_dim(dim, ndim) == axis:
        raise NotATableRead("squeeze of the feature dim")
    return normalize_dim(dim, ndim)


def flatten_axis(ndim: int, axis: int, start_dim: int = 0, end_dim: int = -1) -> int:
    start, end = normalize_dim(start_dim, ndim), normalize_dim(end_dim, ndim)
    if start < end and start <= axis <= end:
        raise NotATableRead("flatten across the feature dim")
    return axis - (end - start) * (axis > end and start < end)


def view_check(ndim: int, axis: int, feature: int, sizes) -> tuple:
    """The leading sizes of a view that keeps the features last (a literal last size, not -1)."""
    sizes = _dims_argument(sizes)
    if axis != ndim - 1 or not sizes or sizes[-1] != feature or not isinstance(sizes[-1], int):
        raise NotATableRead(f"view {tuple(sizes)} does not keep the feature dim {feature} last")
    return tuple(sizes[:-1])


def getitem_plan(ndim: int, axis: int, feature: int, item) -> tuple[tuple, int]:
    """The stand-in's index items (the feature dim's entry a full slice) and the feature dim's
    position after ``tensor[item]``; slices, ints and None only."""
    items = list(item) if isinstance(item, tuple) else [item]
    if any(not (i is None or i is Ellipsis or isinstance(i, (slice, int, torch.SymInt))) or isinstance(i, bool)
           for i in items) or items.count(Ellipsis) > 1:
        raise NotATableRead("tensor or boolean indexing of a table")
    consuming = sum(1 for i in items if i is not None and i is not Ellipsis)
    if consuming > ndim:
        raise NotATableRead(f"too many indices for a tensor of {ndim} dims")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (ndim - consuming)
    items += [slice(None)] * (ndim - sum(1 for i in items if i is not None))
    real_dim, out_dim, new_axis, index_items = 0, 0, None, []
    for entry in items:
        if entry is None:
            index_items.append(None)
            out_dim += 1
            continue
        if real_dim == axis:
            full = isinstance(entry, slice) and entry.step in (None, 1) and entry.start in (None, 0) and (
                entry.stop is None or isinstance(entry.stop, int) and not isinstance(entry.stop, bool)
                and entry.stop >= feature)
            if not full:
                raise NotATableRead("indexing the feature dim of a table")
            new_axis = out_dim
            index_items.append(slice(None))
        else:
            index_items.append(entry)
        if isinstance(entry, slice):
            out_dim += 1
        real_dim += 1
    return tuple(index_items), new_axis


def repeat_check(ndim: int, axis: int, sizes) -> tuple:
    sizes = _dims_argument(sizes)
    if len(sizes) != ndim or not isinstance(sizes[axis], int) or sizes[axis] != 1:
        raise NotATableRead(f"repeat {tuple(sizes)} adds dims or repeats the feature dim")
    return sizes


def cat_check(ndim: int, axis: int, dim: int) -> None:
    if normalize_dim(dim, ndim) == axis:
        raise NotATableRead("cat along the feature dim")


def bicubic_check(ndim: int, axis: int) -> None:
    if ndim != 4 or axis != 1:
        raise NotATableRead("bicubic resize of a read whose features are not on dim 1 of 4")


def table_permute(rows: TableRows, *dims) -> TableRows:
    axis = permute_axis(rows.ndim, rows.axis, dims)
    dims = tuple(normalize_dim(d, rows.ndim) for d in _dims_argument(dims))
    return rows.map(lambda t: t.permute(*dims, rows.ndim), axis)


def table_transpose(rows: TableRows, dim0: int, dim1: int) -> TableRows:
    return table_permute(rows, *transpose_dims(rows.ndim, dim0, dim1))


def table_unsqueeze(rows: TableRows, dim: int) -> TableRows:
    axis = unsqueeze_axis(rows.ndim, rows.axis, dim)
    return rows.map(lambda t: t.unsqueeze(normalize_dim(dim, rows.ndim + 1)), axis)


def table_squeeze(rows: TableRows, dim: int) -> TableRows:
    dim = squeeze_check(rows.ndim, rows.axis, dim)
    if rows.index.shape[dim] != 1:
        return rows  # as torch: squeezing a dim that is not 1 keeps it
    return rows.map(lambda t: t.squeeze(dim), rows.axis - (dim < rows.axis))


def table_flatten(rows: TableRows, start_dim: int = 0, end_dim: int = -1) -> TableRows:
    axis = flatten_axis(rows.ndim, rows.axis, start_dim, end_dim)
    return rows.map(lambda t: t.flatten(normalize_dim(start_dim, rows.ndim), normalize_dim(end_dim, rows.ndim)), axis)


def table_view(rows: TableRows, *sizes) -> TableRows:
    leading = view_check(rows.ndim, rows.axis, rows.dim, sizes)
    return rows.map(lambda t: t.view(*leading, 1, t.shape[-1]), len(leading))


def table_reshape(rows: TableRows, *sizes) -> TableRows:
    leading = view_check(rows.ndim, rows.axis, rows.dim, sizes)
    return rows.map(lambda t: t.reshape(*leading, 1, t.shape[-1]), len(leading))


def table_identity(rows: TableRows, *args, **kwargs) -> TableRows:
    return rows.map(lambda t: t.contiguous(), rows.axis)


def table_getitem(rows: TableRows, item) -> TableRows:
    index_items, axis = getitem_plan(rows.ndim, rows.axis, rows.dim, item)
    return rows.map(lambda t: t[index_items], axis)


def _pad_terms(rows: TableRows, terms: int) -> TableRows:
    if terms == rows.index.shape[-1]:
        return rows
    return TableRows(*padded_terms(rows.index, weights(rows), terms), rows.axis, rows.dim)


def table_cat(tensors, dim: int = 0) -> TableRows:
    tensors = list(tensors)
    first = tensors[0]
    if any(not isinstance(t, TableRows) or t.axis != first.axis or t.dim != first.dim or t.ndim != first.ndim
           for t in tensors):
        raise NotATableRead("cat of tensors that are not reads of one table alike")
    cat_check(first.ndim, first.axis, dim)
    dim = normalize_dim(dim, first.ndim)
    if first.outer and all(t.outer == first.outer and t.index.shape[-1] == first.index.shape[-1] for t in tensors):
        padded, outer = tensors, first.outer  # pairs alike stay pairs (cat_outer: the pass's rule)
    else:
        listed = [listed_terms(t) for t in tensors]
        terms = max(t.index.shape[-1] for t in listed)
        padded, outer = [_pad_terms(t, terms) for t in listed], 0
    if len(padded) == 1:  # nothing to join (a one-item call): the read itself, never written
        return padded[0]
    weight = None if all(t.weight is None for t in padded) else torch.cat([weights(t) for t in padded], dim=dim)
    return TableRows(torch.cat([t.index for t in padded], dim=dim), weight, first.axis, first.dim, outer)


def cat_outer(outers) -> int:
    """``outer`` of a cat of reads with these ``outer`` values (table_cat's rule; pairs always have 8 terms)."""
    outers = set(outers)
    return outers.pop() if len(outers) == 1 else 0


def table_repeat(rows: TableRows, *sizes) -> TableRows:
    sizes = repeat_check(rows.ndim, rows.axis, sizes)
    return rows.map(lambda t: t.repeat(*sizes, 1), rows.axis)


@functools.lru_cache(maxsize=1024)
def _taps(in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return resize_taps_float64(in_size, out_size)


def table_bicubic(rows: TableRows, height: int, width: int) -> TableRows:
    """``kimi_cg.bicubic_resize`` of an [N, C, H, W] read with the features on dim 1: each output
    element combines the 4 x 4 taps of its position (clamped taps repeat, their weights add)."""
    bicubic_check(rows.ndim, rows.axis)
    rows = listed_terms(rows)
    n, _, in_h, in_w, terms = rows.index.shape
    rows_taps, rows_weights = _taps(in_h, int(height))
    cols_taps, cols_weights = _taps(in_w, int(width))
    h, w = rows_taps.shape[0], cols_taps.shape[0]
    # Output (y, x) reads input positions rows_taps[y, i] * W + cols_taps[x, j]: one index_select of the
    # flattened input picks all 16 taps per output element, in (y, x, i, j) order (advanced indexing
    # over two dims was ~20x slower on the host).
    positions = (rows_taps.view(h, 1, 4, 1) * in_w + cols_taps.view(1, w, 1, 4)).reshape(-1)
    tap_weights = (rows_weights.view(h, 1, 4, 1) * cols_weights.view(1, w, 1, 4)).reshape(1, -1, 1)
    flat_index = rows.index.reshape(n, in_h * in_w, terms)
    if n == 1 and terms == 1 and _reads_each_row_once(flat_index, rows.weight):
        # The table's own grid (a permuted view of the source): the taps are the plan (no gathers).
        index = positions.view(1, -1, 1).to(torch.int32)
        weight = tap_weights.float()
    else:
        index = flat_index.index_select(1, positions)
        weight = (weights(rows).reshape(n, in_h * in_w, terms).index_select(1, positions) * tap_weights).float()
    return TableRows(index.view(n, 1, h, w, 16 * terms), weight.view(n, 1, h, w, 16 * terms), 1, rows.dim)


def _reads_each_row_once(flat_index: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether a [1, L, 1] read is rows 0..L-1 in order, each with weight 1 (a view of the source)."""
    count = flat_index.shape[1]
    return bool(torch.equal(flat_index.view(-1), _arange(count))) and (weight is None or bool((weight == 1).all()))


@functools.lru_cache(maxsize=16)
def _arange(count: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int32)


def affine_grid(rows: TableRows) -> tuple[int, int, int] | None:
    """(base, row_step, column_step) when the [1, C, H, W] read (features on dim 1) reads table row
    base + y * row_step + x * column_step at (y, x), once, with weight 1; else None. The pass asks this at
    compile time of a read made from the table alone (its value never changes)."""
    if rows.ndim != 4 or rows.axis != 1 or rows.outer or rows.index.shape[0] != 1 or rows.index.shape[-1] != 1:
        return None
    grid = rows.index.view(rows.index.shape[2], rows.index.shape[3]).long()
    height, width = grid.shape
    base = int(grid[0, 0])
    row_step = int(grid[1, 0]) - base if height > 1 else 0
    column_step = int(grid[0, 1]) - base if width > 1 else 0
    expected = (base + torch.arange(height).view(-1, 1) * row_step + torch.arange(width).view(1, -1) * column_step)
    if base < 0 or not torch.equal(grid, expected) or not (rows.weight is None or bool((rows.weight == 1).all())):
        return None
    return base, row_step, column_step


def table_bicubic_pairs(rows: TableRows, height: int, width: int, base: int, row_step: int,
                        column_step: int) -> TableRows:
    """table_bicubic of a read that ``affine_grid`` gave (base, row_step, column_step): each output row's
    16 terms as 4 row taps and 4 column taps (``outer`` 4); table row base + row tap * row_step + column
    tap * column_step, weight row weight * column weight."""
    bicubic_check(rows.ndim, rows.axis)
    _, _, in_h, in_w, _ = rows.index.shape  # affine_grid: one image
    h, w = int(height), int(width)
    rows_index, rows_weight = _pair_part(in_h, h, base, row_step)
    cols_index, cols_weight = _pair_part(in_w, w, 0, column_step)

    def pairs(by_row, by_column):
        return torch.cat([by_row.view(h, 1, 4).expand(h, w, 4), by_column.view(1, w, 4).expand(h, w, 4)],
                         dim=-1).view(1, 1, h, w, 8)

    return TableRows(pairs(rows_index, cols_index), pairs(rows_weight, cols_weight), 1, rows.dim, 4)


@functools.lru_cache(maxsize=1024)
def _pair_part(in_size: int, out_size: int, base: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One axis of a pairs plan: its taps as table-row offsets (int32) and their weights (float32), [out, 4]."""
    taps, weights = _taps(in_size, out_size)
    return (base + taps * step).to(torch.int32), weights.float()


def table_storage_offset(rows: TableRows) -> int:
    # Only read by dynamo's `offset >= 0` checks: the offset a slice of the table would have (for
    # pairs a lower bound: the least first entry plus the least second one).
    parts = [rows.index[..., :rows.outer], rows.index[..., rows.outer:]] if rows.outer else [rows.index]
    least = 0
    for part in parts:
        valid = part[part >= 0]
        least += int(valid.min()) if valid.numel() else 0
    return least * rows.dim


def _as_planned(rows: TableRows, outer: int) -> TableRows:
    """The read in the ``outer`` form the device program's gather was built for (the pass derives it at
    compile time with table_rows.py's rules): listed terms can always be made; pairs cannot be invented."""
    if rows.outer == outer:
        return rows
    if outer == 0:
        return listed_terms(rows)
    raise NotATableRead(f"a plan of outer {rows.outer} for a gather built for outer {outer}")


def table_plan_index(rows: TableRows, outer: int = 0) -> torch.Tensor:
    """The gather's index [R, K] (int32) for a read whose features are its last dim."""
    if rows.axis != rows.ndim - 1:
        raise NotATableRead("a table read that leaves its features off the last dim")
    rows = _as_planned(rows, outer)
    return rows.index.reshape(-1, rows.index.shape[-1])


def table_plan_weight(rows: TableRows, outer: int = 0) -> torch.Tensor:
    rows = _as_planned(rows, outer)
    weight = weights(rows)
    return weight.reshape(-1, weight.shape[-1])
