"""Hypothesis strategies for grid batches: what a vision tower's processor hands it, and what breaks it.

A grid batch is a list of rows, one per item: ``[h, w]`` (dims=2, images) or ``[t, h, w]`` (dims=3,
images with t=1 and video chunks with t>1), in patches. Every side is a multiple of ``multiple`` (the
patch merger's kernel, 2 for MoonViT and the Qwen/GLM towers), between ``multiple`` and ``max_side``;
a batch has ``min_items..max_items`` items and at most ``max_patches`` patches (sum of t*h*w).

Items come from three families, mixed within a batch:
  uniform      sides drawn uniformly (shrinks towards the smallest item);
  realistic    what an image processor makes of real pictures: a resolution and an aspect ratio
               (photos, phone and desktop screenshots, documents, receipts, panoramas), cut into
               ``patch_size`` patches, rounded to the multiple, scaled down under ``patch_limit``;
  adversarial  one-row strips (``multiple`` x long side, both ways), the smallest item, sides at the
               position table's edge (``table_size`` and one multiple either side).
Batches also repeat earlier items (the per-size caches must hit, not alias), and, when ``buckets``
is given, some batches hold exactly a bucket's capacity, or one merged row under or over it.

Hypothesis shrinks towards fewer items, the uniform family and smaller sides: a failing batch
shrinks to the smallest batch that still fails.
"""

from __future__ import annotations

import math
from typing import Sequence

from hypothesis import strategies as st

# (kind, width : height) of pictures a processor sees; realistic items pick one and a resolution.
ASPECT_RATIOS = (
    ("photo 4:3", 4 / 3), ("photo 3:2", 3 / 2), ("photo 3:4 portrait", 3 / 4), ("square", 1.0),
    ("widescreen 16:9", 16 / 9), ("desktop screenshot 16:10", 16 / 10), ("phone screenshot 9:19.5", 9 / 19.5),
    ("document A4 portrait", 1 / math.sqrt(2)), ("document A4 landscape", math.sqrt(2)),
    ("receipt 1:3", 1 / 3), ("panorama 4:1", 4.0), ("banner 8:1", 8.0),
)
LONG_SIDE_PIXELS = (224, 336, 448, 640, 800, 1024, 1080, 1280, 1920, 2048, 2560, 3024, 4032)


def grids(
    *,
    dims: int = 2,
    min_items: int = 1,
    max_items: int = 8,
    multiple: int = 2,
    max_side: int = 64,
    max_patches: int = 8192,
    max_frames: int = 4,
    video_fraction: float = 0.3,
    patch_size: int = 14,
    patch_limit: int | None = None,
    table_size: int | None = None,
    buckets: Sequence[int] | None = None,
    families: Sequence[str] = ("uniform", "realistic", "adversarial"),
) -> st.SearchStrategy[list[list[int]]]:
    """A strategy of grid batches (lists of ``[h, w]`` or ``[t, h, w]`` rows); see the module docstring.

    ``max_frames`` and ``video_fraction`` apply to dims=3 (the share of items with t > 1);
    ``patch_limit`` caps one realistic item (default: ``max_side**2`` and ``max_patches``, as a
    processor's patch limit); ``table_size`` is the tower's learned position grid side (MoonViT: 64),
    whose edge the adversarial family hits; ``buckets`` are kimi_cg's token buckets (e.g.
    ``KimiCGConfig().buckets()``), whose capacities some batches fill exactly or miss by one merged row.
    """
    _check_arguments(dims, min_items, max_items, multiple, max_side, max_patches, max_frames, video_fraction,
                     patch_size, patch_limit, table_size, buckets, families)
    limit = min(patch_limit or max_side * max_side, max_side * max_side, max_patches)
    frames = _frames(dims, max_frames, video_fraction)
    family = {
        "uniform": _uniform_item(multiple, max_side),
        "realistic": _realistic_item(multiple, max_side, patch_size, limit),
        "adversarial": _adversarial_item(multiple, max_side, table_size),
    }
    item = st.one_of([family[name] for name in families])
    if frames is not None:
        item = st.tuples(frames, item).map(lambda pair: [pair[0], *pair[1]])
    batch = _mixed_batches(item, min_items, max_items, max_patches, multiple, dims)
    unit = multiple * multiple  # one merged row: every total is a multiple of it
    edges = [c // unit * unit + d for c in (buckets or ()) for d in (-unit, 0, unit)]
    edges = sorted({edge for edge in edges if min_items * unit <= edge <= max_patches})
    if edges:
        edge_batch = st.sampled_from(edges).map(lambda total: _fill(total, multiple, max_side, dims))
        edge_batch = edge_batch.filter(lambda grid: min_items <= len(grid) <= max_items)
        batch = st.one_of(batch, edge_batch)  # one_of shrinks towards its first branch
    return batch


def patches(grid: Sequence[Sequence[int]]) -> int:
    """Total patches of a grid batch: the sum over items of t*h*w (or h*w)."""
    return sum(math.prod(row) for row in grid)


def _check_arguments(dims, min_items, max_items, multiple, max_side, max_patches, max_frames, video_fraction,
                     patch_size, patch_limit, table_size, buckets, families) -> None:
    if dims not in (2, 3):
        raise ValueError(f"dims must be 2 ([h, w] rows) or 3 ([t, h, w] rows); got {dims!r}")
    for name, value in (("min_items", min_items), ("max_items", max_items), ("multiple", multiple),
                        ("max_side", max_side), ("max_patches", max_patches), ("max_frames", max_frames),
                        ("patch_size", patch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    if min_items > max_items:
        raise ValueError(f"min_items ({min_items}) is larger than max_items ({max_items})")
    if max_side < multiple:
        raise ValueError(f"max_side ({max_side}) is smaller than multiple ({multiple})")
    if max_patches < min_items * multiple * multiple:
        raise ValueError(f"max_patches ({max_patches}) cannot hold {min_items} items of {multiple} x {multiple}")
    if not 0.0 <= video_fraction <= 1.0:
        raise ValueError(f"video_fraction must be in [0, 1]; got {video_fraction!r}")
    if patch_limit is not None and (not isinstance(patch_limit, int) or patch_limit < multiple * multiple):
        raise ValueError(f"patch_limit must be an int of at least multiple**2; got {patch_limit!r}")
    if table_size is not None and (not isinstance(table_size, int) or table_size < 1):
        raise ValueError(f"table_size must be a positive int; got {table_size!r}")
    if buckets is not None and not all(isinstance(b, int) and b > 0 for b in buckets):
        raise ValueError(f"buckets must be positive ints; got {buckets!r}")
    unknown = sorted(set(families) - {"uniform", "realistic", "adversarial"})
    if unknown or not families:
        raise ValueError(f"families must be a non-empty subset of uniform, realistic, adversarial; got {families!r}")


def _frames(dims: int, max_frames: int, video_fraction: float):
    if dims == 2:
        return None
    if max_frames == 1 or video_fraction == 0.0:
        return st.just(1)
    # t = 1 first, so that shrinking turns video chunks into images when the failure allows it.
    percent = round(100 * video_fraction)
    return st.integers(0, 99).flatmap(lambda roll: st.integers(2, max_frames) if roll < percent else st.just(1))


def _side(multiple: int, max_side: int):
    return st.integers(1, max_side // multiple).map(lambda k: k * multiple)


def _uniform_item(multiple: int, max_side: int):
    return st.tuples(_side(multiple, max_side), _side(multiple, max_side)).map(list)


def _realistic_item(multiple: int, max_side: int, patch_size: int, limit: int):
    def to_patches(args) -> list[int]:
        (_, ratio), long_side = args
        width, height = (long_side, long_side / ratio) if ratio >= 1 else (long_side * ratio, long_side)
        h, w = max(1.0, height / patch_size), max(1.0, width / patch_size)
        scale = min(1.0, math.sqrt(limit / (h * w)))  # a processor's patch limit keeps the aspect ratio
        h, w = _round_to(h * scale, multiple, max_side), _round_to(w * scale, multiple, max_side)
        while h * w > limit:  # rounding up may cross the limit: give back one multiple on the long side
            if h >= w:
                h -= multiple
            else:
                w -= multiple
        return [h, w]

    return st.tuples(st.sampled_from(ASPECT_RATIOS), st.sampled_from(LONG_SIDE_PIXELS)).map(to_patches)


def _round_to(value: float, multiple: int, max_side: int) -> int:
    return max(multiple, min(max_side // multiple * multiple, round(value / multiple) * multiple))


def _adversarial_item(multiple: int, max_side: int, table_size: int | None):
    top = max_side // multiple * multiple
    shapes = [[multiple, multiple], [multiple, top], [top, multiple], [top, top]]
    if table_size is not None:
        for side in (table_size - multiple, table_size, table_size + multiple):
            side = side // multiple * multiple
            if multiple <= side <= top:
                shapes += [[side, side], [side, multiple], [multiple, side]]
    unique = sorted({tuple(shape) for shape in shapes}, key=lambda shape: (shape[0] * shape[1], shape))
    return st.sampled_from([list(shape) for shape in unique])


def _mixed_batches(item, min_items: int, max_items: int, max_patches: int, multiple: int, dims: int):
    @st.composite
    def batch(draw) -> list[list[int]]:
        items = draw(st.lists(item, min_size=min_items, max_size=max_items))
        # Repeats of earlier items: drawn as (position, source) pairs so that shrinking drops them.
        for position, source in draw(st.lists(st.tuples(st.integers(0, max_items), st.integers(0, max_items)), max_size=2)):
            if len(items) < max_items:
                items.insert(min(position, len(items)), list(items[source % len(items)]))
        kept, total = [], 0
        for row in items:  # keep the batch under max_patches, skipping items that do not fit
            if total + math.prod(row) <= max_patches:
                kept.append(row)
                total += math.prod(row)
        smallest = [multiple, multiple] if dims == 2 else [1, multiple, multiple]
        while len(kept) < min_items:
            kept.append(list(smallest))
        return kept

    return batch()


def _fill(total: int, multiple: int, max_side: int, dims: int) -> list[list[int]]:
    """Items (t = 1) of exactly ``total`` patches (a multiple of multiple**2), each side at most max_side."""
    units, per_side = total // (multiple * multiple), max_side // multiple
    grid = []
    while units:
        w = min(units, per_side)
        h = min(units // w, per_side)
        grid.append([h * multiple, w * multiple])
        units -= h * w
    return [[1, *row] for row in grid] if dims == 3 else grid
