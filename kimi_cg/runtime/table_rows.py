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
getitem, view/reshape, cat, repeat, expand) apply to it almost unchanged, and a product with a number
or a 0-dim tensor scales its weights (NOTE [sums of table reads] in canonicalize/table_gather.py). Anything
else that mixes features or is not a movement op is not a table read: the pass leaves such chains alone.

Plans are int32 (a table has far fewer than 2**31 rows). A bicubic resize of the table's own grid
(each row of the read is table row base + y * row_step + x * column_step, proven by the pass at
compile time) keeps its 16 terms as pairs: 4 row taps and 4 column taps (``outer`` = 4), the
device forming the 16 sums and weight products. Its plan is 8 integers and 8 weights per row
instead of 16 and 16, and a new size costs two small tap tables instead of a 16-way gather.

NOTE [pairs kept by side]
A pairs read's terms at output (y, x) are the row taps of y and the column taps of x: all of it is
in two tap tables, [h, 4] and [w, 4], each cached per (input, output) size. ``PairGrid`` keeps just
those, with the stand-in's shape, for as long as the chain only reshapes the grid (squeeze,
unsqueeze, flatten, view / reshape, a permute that moves only dims of size 1, contiguous): the
stand-in is then the [h, w, 8] plan reshaped, and the steps cost no per-row work. The plan is made
once, in numpy, a tap row (4 values of 4 bytes) copied as one 16-byte element: when the per-item
cache keeps the item's value (``settled``), or, for reads not cached per item, at the cat:
``PairRows``, reads of one image after another (each [h * w] along the cat's dim), makes all of
its rows in a few batch-wide numpy ops (``_pair_plans``). Item values are kept built because a
batch of sizes seen before then joins them with one copy, which was faster than gathering every
row again (2-core CPU host: a 5-item batch's plans ~33-53 us joined, ~75-115 us gathered). Any
other step reads ``index`` / ``weight``, which make the plan (the forms are interchangeable; a
differential test holds them equal bit for bit). On the 2-core CPU host MoonViT's position chain
of a new size, built, went from ~65-75 us to ~40 us, and the host pass of 120 W4 requests with
every first size new from 0.93 to 0.85 ms a request (medians of 8 alternating passes in one
process; 1-layer 64-wide tower; a throwaway script): the rest of a new size's cost is the item
cache's bookkeeping and the other chains.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy
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
    rows = concrete(rows)  # a PairGrid's plan made once for both reads below
    n = rows.outer
    first, second = rows.index[..., :n].unsqueeze(-1), rows.index[..., n:].unsqueeze(-2)
    index = torch.where((first >= 0) & (second >= 0), first + second, -1).flatten(-2)
    weight = None if rows.weight is None else (
        rows.weight[..., :n].unsqueeze(-1) * rows.weight[..., n:].unsqueeze(-2)).flatten(-2)
    return TableRows(index, weight, rows.axis, rows.dim)


class _SideTables:
    """What ``PairGrid`` and ``PairRows`` share: the stand-in's shape and a plan made on demand."""

    outer = 4  # pairs: 4 row taps, then 4 column taps

    @property
    def ndim(self) -> int:
        return len(self.leading)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.leading)
        shape[self.axis] = self.dim
        return tuple(shape)

    @property
    def index(self) -> torch.Tensor:
        return self.plans()[0].view(*self.leading, 8)

    @property
    def weight(self) -> torch.Tensor:
        return self.plans()[1].view(*self.leading, 8)

    def map(self, fn, axis: int) -> TableRows:
        return concrete(self).map(fn, axis)


@dataclasses.dataclass(eq=False)
class PairGrid(_SideTables):
    """A pairs read of one [h, w] grid kept as its tap tables (NOTE [pairs kept by side]): the
    stand-in equals the [h, w, 8] plan (row taps, then column taps, of each (y, x)) reshaped to
    ``leading`` + [8]; ``leading`` holds the feature dim (at ``axis``) as 1."""

    row_index: torch.Tensor  # [h, 4] int32, shared (cached per size): never written
    row_weight: torch.Tensor  # [h, 4] float32
    column_index: torch.Tensor  # [w, 4] int32
    column_weight: torch.Tensor  # [w, 4] float32
    leading: tuple[int, ...]
    axis: int
    dim: int

    def plans(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _pair_plans([self])

    def reshaped(self, leading: tuple[int, ...], axis: int) -> "PairGrid":
        return PairGrid(self.row_index, self.row_weight, self.column_index, self.column_weight, leading, axis,
                        self.dim)


@dataclasses.dataclass(eq=False)
class PairRows(_SideTables):
    """A cat of ``PairGrid`` reads along their one non-unit dim (NOTE [pairs kept by side]): their
    plans' rows one after another; the plan is made once, when first read."""

    parts: tuple[PairGrid, ...]
    leading: tuple[int, ...]
    axis: int
    dim: int
    made: list = dataclasses.field(default_factory=list)  # [(index, weight)] once read (a field: counted)

    def plans(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.made:
            self.made.append(_pair_plans(self.parts))
        return self.made[0]


def _pair_plans(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """The [R, 8] index (int32) and weight (float32) of ``PairGrid`` reads one after another, each
    in (y, x) order: row r of item i at (y, x) holds the item's row taps of y and column taps of x."""
    if len(parts) == 1:
        return _grid_plans(parts[0])
    heights = numpy.array([part.row_index.shape[0] for part in parts], dtype=numpy.int64)
    widths = numpy.array([part.column_index.shape[0] for part in parts], dtype=numpy.int64)
    # All items' row tap tables, then all their column tap tables, one 16-byte element per tap row
    # (numpy copies it whole); output row r takes element pick[r, 0] then element pick[r, 1]. Every
    # item's output rows y form one list of grid rows: grid row g has its item's width and reads
    # the column taps from its item's first column on.
    row_widths = numpy.repeat(widths, heights)
    row_starts = numpy.cumsum(row_widths) - row_widths
    total = int(row_starts[-1] + row_widths[-1])
    pick = numpy.empty((total, 2), dtype=numpy.int64)
    pick[:, 0] = numpy.repeat(numpy.arange(len(row_widths)), row_widths)
    first_columns = numpy.repeat(numpy.cumsum(widths) - widths + len(row_widths), heights)
    pick[:, 1] = numpy.arange(total) - numpy.repeat(row_starts - first_columns, row_widths)
    made = []
    for row_name, column_name in (("row_index", "column_index"), ("row_weight", "column_weight")):
        tables = torch.cat([getattr(part, row_name) for part in parts] + [getattr(part, column_name) for part in parts])
        taps = tables.numpy().view(numpy.complex128)[:, 0]
        made.append(torch.from_numpy(numpy.take(taps, pick).view(tables.numpy().dtype).reshape(total, 8)))
    return made[0], made[1]


def _grid_plans(part: PairGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """``_pair_plans`` of one read: each tap row broadcast over the other side (16 bytes a copy)."""
    height, width = part.row_index.shape[0], part.column_index.shape[0]
    made = []
    for row_taps, column_taps in ((part.row_index, part.column_index), (part.row_weight, part.column_weight)):
        plan = numpy.empty((height, width, 2), dtype=numpy.complex128)
        plan[:, :, 0] = row_taps.numpy().view(numpy.complex128)
        plan[:, :, 1] = column_taps.numpy().view(numpy.complex128)[:, 0]
        made.append(torch.from_numpy(plan.view(row_taps.numpy().dtype).reshape(height * width, 8)))
    return made[0], made[1]


def settled(value):
    """``value`` with every ``PairGrid`` / ``PairRows`` in it as a TableRows (its plan made now). The
    per-item cache keeps item values settled (NOTE [pairs kept by side]): a batch of seen sizes then
    joins plans with a copy instead of gathering every row again."""
    if isinstance(value, _SideTables):
        return concrete(value)
    if isinstance(value, (tuple, list)):
        items = [settled(item) for item in value]
        if any(new is not old for new, old in zip(items, value)):
            return type(value)(items)
    return value


def concrete(rows):
    """``rows`` as a TableRows (a ``PairGrid`` / ``PairRows`` builds its plan)."""
    if isinstance(rows, _SideTables):
        index, weight = rows.plans()
        return TableRows(index.view(*rows.leading, 8), weight.view(*rows.leading, 8), rows.axis, rows.dim, 4)
    return rows


def _grid_kept(old: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    """Whether a permute by ``dims`` keeps the dims larger than 1 in their order (a reshape then)."""
    order = [d for d in dims if old[d] != 1]
    return order == sorted(order)


def _view_sizes(leading: tuple[int, ...], sizes: tuple) -> tuple[int, ...]:
    """``sizes`` (a -1 at most once) for a view of ``leading``'s elements, as torch's view checks them."""
    count = math.prod(leading)
    known = math.prod(s for s in sizes if s != -1)
    if sizes.count(-1) > 1 or any(s < -1 for s in sizes):
        raise RuntimeError(f"invalid shape {list(sizes)} for a view")
    if -1 in sizes:
        if known == 0 or count % known:
            raise RuntimeError(f"shape '{list(sizes)}' is invalid for input of size {count}")
        sizes = tuple(count // known if s == -1 else s for s in sizes)
    if math.prod(sizes) != count:
        raise RuntimeError(f"shape '{list(sizes)}' is invalid for input of size {count}")
    return tuple(sizes)


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


def expand_check(ndim: int, axis: int, feature: int, sizes) -> tuple:
    """An expand's sizes, one per dim (no new dims), the feature dim's kept (-1 or its size)."""
    sizes = _dims_argument(sizes)
    if len(sizes) != ndim or not (sizes[axis] == -1 or sizes[axis] == feature):
        raise NotATableRead(f"expand {tuple(sizes)} adds dims or changes the feature dim")
    return sizes


def scale_check(factor) -> None:
    """A factor a read may be multiplied by: a number or a one-element 0-dim tensor (of any device)."""
    if isinstance(factor, bool) or not (isinstance(factor, (int, float, torch.SymInt, torch.SymFloat))
                                        or isinstance(factor, torch.Tensor) and factor.dim() == 0
                                        and not factor.is_complex()):
        raise NotATableRead("a product with something other than a real number or a 0-dim tensor")


def cat_check(ndim: int, axis: int, dim: int) -> None:
    if normalize_dim(dim, ndim) == axis:
        raise NotATableRead("cat along the feature dim")


def bicubic_check(ndim: int, axis: int) -> None:
    if ndim != 4 or axis != 1:
        raise NotATableRead("bicubic resize of a read whose features are not on dim 1 of 4")


def table_permute(rows: TableRows, *dims) -> TableRows:
    axis = permute_axis(rows.ndim, rows.axis, dims)
    dims = tuple(normalize_dim(d, rows.ndim) for d in _dims_argument(dims))
    if isinstance(rows, PairGrid) and _grid_kept(rows.leading, dims):
        return rows.reshaped(tuple(rows.leading[d] for d in dims), axis)
    return rows.map(lambda t: t.permute(*dims, rows.ndim), axis)


def table_transpose(rows: TableRows, dim0: int, dim1: int) -> TableRows:
    return table_permute(rows, *transpose_dims(rows.ndim, dim0, dim1))


def table_unsqueeze(rows: TableRows, dim: int) -> TableRows:
    axis = unsqueeze_axis(rows.ndim, rows.axis, dim)
    if isinstance(rows, PairGrid):
        at = normalize_dim(dim, rows.ndim + 1)
        return rows.reshaped(rows.leading[:at] + (1,) + rows.leading[at:], axis)
    return rows.map(lambda t: t.unsqueeze(normalize_dim(dim, rows.ndim + 1)), axis)


def table_squeeze(rows: TableRows, dim: int) -> TableRows:
    dim = squeeze_check(rows.ndim, rows.axis, dim)
    if rows.shape[dim] != 1:
        return rows  # as torch: squeezing a dim that is not 1 keeps it
    if isinstance(rows, PairGrid):
        return rows.reshaped(rows.leading[:dim] + rows.leading[dim + 1:], rows.axis - (dim < rows.axis))
    return rows.map(lambda t: t.squeeze(dim), rows.axis - (dim < rows.axis))


def table_flatten(rows: TableRows, start_dim: int = 0, end_dim: int = -1) -> TableRows:
    axis = flatten_axis(rows.ndim, rows.axis, start_dim, end_dim)
    start, end = normalize_dim(start_dim, rows.ndim), normalize_dim(end_dim, rows.ndim)
    if isinstance(rows, PairGrid) and start <= end:
        leading = rows.leading
        return rows.reshaped(leading[:start] + (math.prod(leading[start:end + 1]),) + leading[end + 1:], axis)
    return rows.map(lambda t: t.flatten(normalize_dim(start_dim, rows.ndim), normalize_dim(end_dim, rows.ndim)), axis)


def table_view(rows: TableRows, *sizes) -> TableRows:
    leading = view_check(rows.ndim, rows.axis, rows.dim, sizes)
    if isinstance(rows, PairGrid):
        return rows.reshaped(_view_sizes(rows.leading, leading) + (1,), len(leading))
    return rows.map(lambda t: t.view(*leading, 1, t.shape[-1]), len(leading))


def table_reshape(rows: TableRows, *sizes) -> TableRows:
    leading = view_check(rows.ndim, rows.axis, rows.dim, sizes)
    if isinstance(rows, PairGrid):
        return rows.reshaped(_view_sizes(rows.leading, leading) + (1,), len(leading))
    return rows.map(lambda t: t.reshape(*leading, 1, t.shape[-1]), len(leading))


def table_identity(rows: TableRows, *args, **kwargs) -> TableRows:
    if isinstance(rows, _SideTables):
        return rows  # already a contiguous plan (and never written)
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
    kept = _cat_side_tables(tensors, dim)
    if kept is not None:
        return kept
    tensors = [concrete(t) for t in tensors]
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


def _cat_side_tables(tensors, dim: int) -> PairRows | None:
    """The cat as ``PairRows`` when every read is a ``PairGrid`` / ``PairRows`` of one table whose
    dims other than ``dim`` are all 1 (NOTE [pairs kept by side]); else None."""
    first = tensors[0]
    if not all(isinstance(t, _SideTables) and t.ndim == first.ndim and t.axis == first.axis and t.dim == first.dim
               for t in tensors):
        return None
    cat_check(first.ndim, first.axis, dim)
    dim = normalize_dim(dim, first.ndim)
    if any(size != 1 for t in tensors for d, size in enumerate(t.leading) if d != dim):
        return None
    if len(tensors) == 1 and isinstance(first, PairRows):
        return first
    parts = tuple(part for t in tensors for part in (t.parts if isinstance(t, PairRows) else (t,)))
    leading = first.leading[:dim] + (sum(t.leading[dim] for t in tensors),) + first.leading[dim + 1:]
    return PairRows(parts, leading, first.axis, first.dim)


def cat_outer(outers) -> int:
    """``outer`` of a cat of reads with these ``outer`` values (table_cat's rule; pairs always have 8 terms)."""
    outers = set(outers)
    return outers.pop() if len(outers) == 1 else 0


def table_repeat(rows: TableRows, *sizes) -> TableRows:
    sizes = repeat_check(rows.ndim, rows.axis, sizes)
    if all(type(size) is int and size == 1 for size in sizes):
        return rows  # the same elements (a stand-in is never written); a PairGrid stays one
    return rows.map(lambda t: tiled(t, (*sizes, 1)), rows.axis)


def tiled(tensor: torch.Tensor, sizes: tuple) -> torch.Tensor:
    """``tensor.repeat(*sizes)`` for as many sizes as dims, as a broadcast copy (~5x faster on the host
    for the small plans here: each dim d becomes [sizes[d], size_d], expanded, then flattened back)."""
    shape = tensor.shape
    spread = tensor.reshape([part for size in shape for part in (1, size)])
    expanded = spread.expand([part for pair in zip(sizes, shape) for part in pair])
    return expanded.reshape([size * dim for size, dim in zip(sizes, shape)])


def table_expand(rows: TableRows, *sizes) -> TableRows:
    """``expand`` of a read to sizes of its own dims (NOTE [sums of table reads]): a view, as torch's."""
    sizes = expand_check(rows.ndim, rows.axis, rows.dim, sizes)
    keep = tuple(-1 if d == rows.axis else int(size) for d, size in enumerate(sizes))
    return concrete(rows).map(lambda t: t.expand(*keep, t.shape[-1]), rows.axis)


def table_scale(rows: TableRows, factor) -> TableRows:
    """``rows * factor`` for a number or a 0-dim tensor (NOTE [sums of table reads]): its weights scaled,
    in float32 (for pairs the row taps' only, so each product is scaled once)."""
    scale_check(factor)
    value = float(factor)
    rows = concrete(rows)
    if rows.outer:
        weight = weights(rows).clone()  # the plan's own weights (a kept read's) are never written
        weight[..., :rows.outer] *= value
    else:
        weight = weights(rows) * value
    return TableRows(rows.index, weight, rows.axis, rows.dim, rows.outer)


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
    _, _, in_h, in_w = rows.shape  # affine_grid: one image (its shape: no plan made for a kept read)
    h, w = int(height), int(width)
    rows_index, rows_weight = _pair_part(in_h, h, base, row_step)
    cols_index, cols_weight = _pair_part(in_w, w, 0, column_step)
    return PairGrid(rows_index, rows_weight, cols_index, cols_weight, (1, 1, h, w), 1, rows.dim)


@functools.lru_cache(maxsize=1024)
def _pair_part(in_size: int, out_size: int, base: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One axis of a pairs plan: its taps as table-row offsets (int32) and their weights (float32), [out, 4]."""
    taps, weights = _taps(in_size, out_size)
    return (base + taps * step).to(torch.int32), weights.float()


def table_storage_offset(rows: TableRows) -> int:
    # Only read by dynamo's `offset >= 0` checks: the offset a slice of the table would have (for
    # pairs a lower bound: the least first entry plus the least second one).
    if isinstance(rows, _SideTables):  # the plan's first 4 entries are its row taps, the other 4 its column taps
        grids = rows.parts if isinstance(rows, PairRows) else (rows,)
        parts = [torch.cat([part.row_index.view(-1) for part in grids]),
                 torch.cat([part.column_index.view(-1) for part in grids])]
    else:
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
    if isinstance(rows, _SideTables) and outer == rows.outer:
        return rows.plans()[0]
    rows = _as_planned(rows, outer)
    return rows.index.reshape(-1, rows.index.shape[-1])


def table_plan_weight(rows: TableRows, outer: int = 0) -> torch.Tensor:
    if isinstance(rows, _SideTables) and outer == rows.outer:
        return rows.plans()[1]
    rows = _as_planned(rows, outer)
    weight = weights(rows)
    return weight.reshape(-1, weight.shape[-1])
