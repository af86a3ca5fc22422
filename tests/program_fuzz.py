"""Differential program fuzzing of kimi_cg against eager PyTorch.

kimi_cg must never return a wrong number and never crash where eager runs. This module generates
small vision-tower-like programs from a grammar of what real towers do with their integer grid,
runs each in eager and through ``torch.compile(..., backend="kimi_cg")`` on a few grids, and
reports any difference. Used by ``tests/test_program_fuzz.py`` (CI) and
``scripts/fuzz_programs.py`` (long runs, failure folders, minimisation).

A program is the source text of a module ``Tower`` with ``forward(self, x, grid)``: ``x`` is
float32 ``[L, D]`` with ``L`` the sum of the items' ``h * w`` (``t * h * w`` for ``[N, 3]``
grids) and ``grid`` is an integer ``[N, 2]`` (h, w) or ``[N, 3]`` (t, h, w) tensor. Its first
line states the width D and what a grid must satisfy for eager to run it, e.g.::

    # kimi_cg program fuzz: dims=2 width=8 even=1 max_side=6 max_t=none

Programs are built from statements (``STATEMENT_OPTIONS``), each of which keeps ``x`` a packed
``[L, D]`` float tensor, and end with a return form (``RETURN_OPTIONS``). Every choice a statement
makes is one of a few named options whose first entry is the plainest; the minimiser walks
options towards it. A case (``FuzzCase``) adds two or three grids and how to call: dynamo's static
first trace or ``dynamic=True/False``, kimi_cg options (the bucketed runtime), an in-place weight
update between calls, x with a storage offset, an int32 grid, and outputs overwritten by the caller.

The property (``run_case``): for every grid of a case, in order,
- eager and compiled both return: same structure, shapes and dtypes; integer and boolean tensors
  equal, floating tensors within a relative 1e-5 of eager (the scale is the larger of 1 and the
  largest magnitude in eager's tensor); NaN never passes; the call leaves its inputs as eager
  leaves them; a returned tensor keeps its values after later calls, and writing into it does not
  change later calls' results;
- eager raises ``E``: the compiled call raises an instance of ``type(E)``;
- a grid that meets the program's stated needs must run in eager (else the generator is wrong).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
import traceback
from typing import Any, Callable

import torch
from hypothesis import strategies as st

import kimi_cg

# ---------------------------------------------------------------------------------------------
# Input needs: the width of x and what a program requires of a grid (its first line)
# ---------------------------------------------------------------------------------------------

HEADER_PREFIX = "# kimi_cg program fuzz:"
LARGEST_SIDE = 8  # grid sides are drawn from 1..LARGEST_SIDE
LARGEST_T = 4  # frames per item in [N, 3] grids
MOST_ITEMS = 4


@dataclasses.dataclass(frozen=True)
class InputNeeds:
    """The width D of a program's ``x`` and what a grid must satisfy for eager to run the program.

    ``max_side`` and ``max_t`` are None when the program has no limit of its own (the fuzzer then
    draws sides up to LARGEST_SIDE and t up to LARGEST_T, and never exceeds them on purpose).
    """

    dims: int = 2
    width: int = 8
    even: bool = False
    max_side: int | None = None
    max_t: int | None = None

    def header(self) -> str:
        def show(value):
            return "none" if value is None else str(value)

        return (
            f"{HEADER_PREFIX} dims={self.dims} width={self.width} even={int(self.even)}"
            f" max_side={show(self.max_side)} max_t={show(self.max_t)}"
        )

    @classmethod
    def from_source(cls, source: str) -> "InputNeeds":
        match = re.search(r"dims=(\d) width=(\d+) even=(\d) max_side=(\w+) max_t=(\w+)", source.splitlines()[0])
        if not source.startswith(HEADER_PREFIX) or match is None:
            raise ValueError("not a fuzz program: its first line must state its input needs")
        dims, width, even, max_side, max_t = match.groups()
        return cls(
            int(dims),
            int(width),
            even == "1",
            None if max_side == "none" else int(max_side),
            None if max_t == "none" else int(max_t),
        )

    def side_limit(self) -> int:
        return min(LARGEST_SIDE, self.max_side) if self.max_side is not None else LARGEST_SIDE

    def t_limit(self) -> int:
        return min(LARGEST_T, self.max_t) if self.max_t is not None else LARGEST_T

    def accepts(self, grid: list[list[int]]) -> bool:
        if not grid or any(len(item) != self.dims for item in grid):
            return False
        for item in grid:
            *time, h, w = item
            if min(item) < 1 or h > self.side_limit() or w > self.side_limit():
                return False
            if self.even and (h % 2 or w % 2):
                return False
            if time and time[0] > self.t_limit():
                return False
        return True


def item_rows(grid: list[list[int]]) -> int:
    total = 0
    for item in grid:
        rows = 1
        for side in item:
            rows *= side
        total += rows
    return total


# ---------------------------------------------------------------------------------------------
# Program specs and their rendering to source text
# ---------------------------------------------------------------------------------------------

# Each statement kind: option name -> choices; the first choice of each option is the plainest.
STATEMENT_OPTIONS: dict[str, dict[str, tuple]] = {
    "linear": {"norm": (False, True), "act": ("none", "gelu", "gelu_tanh"), "residual": (False, True)},
    # F.interpolate of a learned position grid to each item's (h, w), as MoonViT's patch embedding.
    "pos_interp": {
        "mode": ("bicubic", "bilinear", "nearest"),
        "align_corners": (None, False, True),
        "antialias": (False, True),  # F.interpolate's bilinear / bicubic only
        "size": (4, 2, 3, 5),
        "layout": ("hwd", "dhw"),
        "compare": ("none", "size", "list"),  # upstream's `[h, w] == weight.shape[:-1]` (never true) / a real value branch
        "time": ("none", "branch_free", "branch"),  # [N, 3] only: a time table added to video items
        "repeat": ("repeat", "expand"),  # [N, 3] only: how the 2D term is repeated over frames
        # F.grid_sample at each item's pixel centres, as GLM-4V (NOTE [grid sampler]); its padding mode.
        "method": ("interpolate", "grid_sample"),
        "padding": ("border", "zeros", "reflection"),
    },
    # A table sliced per item: table[:h, :w], as the RoPE lookup.
    "table_slice": {
        "rows": (8, 6),
        "storage": ("buffer", "parameter", "attribute", "lazy"),
        "guard": ("none", "check", "assert"),
        "combine": ("add", "mul"),
        "flatten": ("reshape", "flatten"),
    },
    # torch.arange-based row / column ids per item into embeddings or as numbers.
    # (index / bag: a table read by the ids, NOTE [embedding reads]: table[ids] from both ends, an embedding_bag)
    "ids": {"form": ("repeat", "divmod", "expand"), "use": ("embedding", "float", "index", "bag")},
    # 2D rotary embedding: from ids (angles) or from a complex table sliced per item.
    "rope": {"source": ("ids", "table", "lazy_table"), "apply": ("complex", "rotate_half", "complex_heads")},
    "attention": {
        "cu": ("pad_cumsum", "cat_cumsum_int32", "frames"),  # frames: one segment per frame of a [N, 3] item
        "impl": ("sdpa_mask", "manual_mask", "float_mask", "varlen", "segments", "split_segments"),
        "bounds": ("tensor", "list", "item"),  # how the mask loop reads cu_seqlens
        "mask_index": ("ellipsis", "zero", "colon"),
        "scale": (None, 0.5, "head"),
        "heads": (1, 2),
        "layout": ("4d", "3d"),
        "qkv": ("shared", "packed"),
        "out": ("residual", "plain"),
        "softmax": ("masked_fill", "where"),
        # The mask loop's order, and masks that are not block-diagonal over the items (eager attends
        # as the mask says; only block-diagonal masks may become varlen attention).
        "mask_order": ("forward", "reverse", "twice"),
        "mask_extra": ("none", "global_first", "pairs"),
    },
    # torch.split by grid-derived sizes, an op per piece, cat.
    "split": {
        "sizes": ("shapes", "tolist", "cu_diff"),
        "op": ("center", "softmax", "by_length", "flip", "cumsum", "layer_norm", "amax"),
        "api": ("torch_split", "method", "tensor_split"),
    },
    # Python branches on grid values.
    "branch": {"condition": ("h_gt", "h_eq_w", "area_gt", "t_gt"), "threshold": (4, 1, 2, 3, 5, 6),
               # `if`, or the comparison as a number (Kimi-K2.5's `int(t > 1)`: NOTE [int of a grid comparison])
               "form": ("if", "int_scale", "int_offset_ids")},
    # Assertions and torch._check on grid values.
    "checks": {
        "kind": ("check_total", "check_bounds", "assert_bounds", "assert_total", "check_even", "assert_positive",
                 # messages that are expressions (Kimi-VL's attention: NOTE [asserts with a computed message])
                 "assert_cu_message", "assert_cu_chained", "assert_bounds_message"),
        "bound": (8, 4, 5, 6, 7),
    },
    # .item() results passed into ops.
    "item": {"use": ("max_seqlen", "first_side", "total_checked", "total", "head_slice", "arange_length", "full")},
    # Per-item mean merged into a zeros buffer and broadcast back.
    "pool": {
        "index": ("repeat_interleave", "loop_full"),
        "merge": ("index_add", "scatter_add", "index_put"),
        "gather": ("index", "index_select"),
        "buffer": ("zeros", "new_zeros"),
    },
    # A host-made permutation gathered with x[perm], maybe undone.
    "permute": {
        "order": ("transpose", "flip", "windows"),
        "apply": ("index", "index_select", "gather"),
        "inverse": ("none", "argsort", "scatter"),
        "between": (False, True),
    },
    # Views of a buffer that is later mutated in place.
    "buffer_view": {"variant": ("prefix_add", "slice_fill", "clone_view", "copy_add", "column_view")},
    # A convolution over rows seen as pre-cut patches, as the towers' patch embeddings (NOTE [patch
    # convolution as a matmul]); padding 1 makes it an ordinary convolution, which stays one.
    "patch_conv": {"dims": (2, 3, 1), "stride": ("kernel", "one"), "bias": (True, False), "padding": (0, 1)},
}

RETURN_OPTIONS: dict[str, dict[str, tuple]] = {
    "x": {},
    "list": {"form": ("split", "views")},
    # (x, extra): extra is a grid-only value (kimi_cg computes it on the host and may cache it).
    "tuple": {"extra": ("lengths", "cu", "rows", "int", "pos_embedding", "table_rows")},
    "merger": {
        "form": ("reshape_4d", "view_4", "flatten", "reshape_4_d"),
        "output": ("list", "projector", "projector_list"),
        "offsets": ("running", "cu_tensor"),
    },
    "merge_index_add": {"merge": ("index_add", "scatter_add"), "output": ("tensor", "list")},
    "pool_list": {"form": ("list", "stack")},
}

STATEMENT_WEIGHTS = {
    "linear": 3,
    "pos_interp": 3,
    "table_slice": 2,
    "ids": 2,
    "rope": 2,
    "attention": 5,
    "split": 2,
    "branch": 1,
    "checks": 2,
    "item": 2,
    "pool": 2,
    "permute": 2,
    "buffer_view": 2,
    "patch_conv": 1,
}
RETURN_WEIGHTS = {"x": 3, "list": 2, "tuple": 2, "merger": 4, "merge_index_add": 1, "pool_list": 1}


@dataclasses.dataclass(frozen=True)
class Statement:
    kind: str
    options: tuple[tuple[str, Any], ...]  # (name, value) in STATEMENT_OPTIONS / RETURN_OPTIONS order

    def get(self, name: str):
        options = dict(self.options)
        if name in options:
            return options[name]
        # A case saved before the option existed: its plainest choice, which renders as before.
        table = STATEMENT_OPTIONS if self.kind in STATEMENT_OPTIONS else RETURN_OPTIONS
        return table[self.kind][name][0]

    def replace(self, name: str, value) -> "Statement":
        return Statement(self.kind, tuple((key, value if key == name else old) for key, old in self.options))

    @classmethod
    def plainest(cls, kind: str, table: dict) -> "Statement":
        return cls(kind, tuple((name, choices[0]) for name, choices in table[kind].items()))


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    dims: int
    width: int
    statements: tuple[Statement, ...]
    returns: Statement
    loop: str = "tolist"  # per-item loops over grid.tolist(), or "item": grid[i, j].item() per entry

    def to_json(self) -> dict:
        return {
            "dims": self.dims,
            "width": self.width,
            "loop": self.loop,
            "statements": [[s.kind, [list(o) for o in s.options]] for s in self.statements],
            "returns": [self.returns.kind, [list(o) for o in self.returns.options]],
        }

    @classmethod
    def from_json(cls, data: dict) -> "ProgramSpec":
        def statement(item):
            kind, options = item
            return Statement(kind, tuple((name, value) for name, value in options))

        return cls(
            data["dims"],
            data["width"],
            tuple(statement(s) for s in data["statements"]),
            statement(data["returns"]),
            data.get("loop", "tolist"),
        )


class _Writer:
    """Accumulates a program's __init__ and forward lines and the prerequisites already defined."""

    def __init__(self, dims: int, width: int, loop_style: str = "tolist"):
        self.dims = dims
        self.width = width
        self.loop_style = loop_style
        self.init: list[str] = []
        self.body: list[str] = []
        self.defined: set[str] = set()
        self.imports: set[str] = set()
        self.even = False
        self.max_side: int | None = None
        self.max_t: int | None = None
        self._next = 0

    # -- names and lines --
    def fresh(self) -> int:
        self._next += 1
        return self._next - 1

    def line(self, text: str, indent: int = 0) -> None:
        self.body.append("    " * indent + text)

    def member(self, text: str) -> None:
        self.init.append(text)

    def limit_side(self, side: int) -> None:
        self.max_side = side if self.max_side is None else min(self.max_side, side)

    def limit_t(self, t: int) -> None:
        self.max_t = t if self.max_t is None else min(self.max_t, t)

    # -- per-item loop vocabulary --
    @property
    def item_vars(self) -> str:
        return "t, h, w" if self.dims == 3 else "h, w"

    @property
    def item_size(self) -> str:
        return "t * h * w" if self.dims == 3 else "h * w"

    @property
    def lengths_expr(self) -> str:
        return "grid[:, 0] * grid[:, 1] * grid[:, 2]" if self.dims == 3 else "grid[:, 0] * grid[:, 1]"

    def loop(self, indent: int = 0, enumerate_items: bool = False) -> None:
        """Open a per-item loop binding h, w (and t; and i with ``enumerate_items``)."""
        if self.loop_style == "item":
            # One .item() per grid entry instead of one .tolist().
            names = self.item_vars.split(", ")
            self.line("for i in range(grid.shape[0]):", indent)
            self.line(f"{self.item_vars} = " + ", ".join(f"grid[i, {axis}].item()" for axis in range(len(names))), indent + 1)
            return
        self.shapes()
        if enumerate_items:
            self.line(f"for i, ({self.item_vars}) in enumerate(shapes):", indent)
        else:
            self.line(f"for {self.item_vars} in shapes:", indent)

    # -- prerequisites, defined once --
    def once(self, name: str, *lines: str) -> str:
        if name not in self.defined:
            self.defined.add(name)
            for text in lines:
                self.line(text)
        return name

    def shapes(self) -> str:
        return self.once("shapes", "shapes = grid.tolist()")

    def length(self) -> str:
        return self.once("L", "L = x.shape[0]")

    def sizes(self) -> str:
        self.shapes()
        return self.once("sizes", f"sizes = [{self.item_size} for {self.item_vars} in shapes]")

    def cu(self, variant: str) -> str:
        if variant == "frames" and self.dims != 3:
            variant = "pad_cumsum"
        name = {"pad_cumsum": "cu", "cat_cumsum_int32": "cu32", "frames": "cu_frames"}[variant]
        if variant == "pad_cumsum":
            self.imports.add("F")
            return self.once(name, f"cu = F.pad(({self.lengths_expr}).cumsum(0), (1, 0))")
        if variant == "cat_cumsum_int32":
            return self.once(name, f"cu32 = torch.cat([grid.new_zeros(1), {self.lengths_expr}]).cumsum(0, dtype=torch.int32)")
        self.imports.add("F")
        return self.once(
            name, "cu_frames = F.pad(torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).cumsum(0), (1, 0))"
        )


def _linear(out: _Writer, s: Statement) -> None:
    k = out.fresh()
    out.member(f"self.lin{k} = nn.Linear({out.width}, {out.width})")
    value = "x"
    if s.get("norm"):
        out.member(f"self.norm{k} = nn.LayerNorm({out.width})")
        value = f"self.norm{k}(x)"
    value = f"self.lin{k}({value})"
    act = s.get("act")
    if act != "none":
        out.imports.add("F")
        value = f"F.gelu({value})" if act == "gelu" else f'F.gelu({value}, approximate="tanh")'
    out.line(f"x = x + {value}" if s.get("residual") else f"x = {value}")


def _pos_interp(out: _Writer, s: Statement) -> None:
    k, size, width = out.fresh(), s.get("size"), out.width
    out.imports.add("F")
    layout, compare = s.get("layout"), s.get("compare")
    if layout == "hwd":
        out.member(f"self.pos{k} = nn.Parameter(torch.randn({size}, {size}, {width}))")
        source = f"self.pos{k}.permute(2, 0, 1).unsqueeze(0)"
    else:
        out.member(f"self.pos{k} = nn.Parameter(torch.randn(1, {width}, {size}, {size}))")
        source = f"self.pos{k}"
        compare = "none"
    mode, align = s.get("mode"), s.get("align_corners")
    align_text = "" if align is None or mode == "nearest" else f", align_corners={align}"  # nearest takes none
    if mode != "nearest" and s.get("antialias"):
        align_text += ", antialias=True"
    time = s.get("time") if out.dims == 3 else "none"
    if time != "none":
        out.member(f'self.register_buffer("time{k}", torch.randn(4, {width}))')
        out.limit_t(4)
    out.line(f"pos_embs{k} = []")
    out.loop(enumerate_items=time == "branch_free")
    body = 1
    if compare != "none":
        target = f"self.pos{k}.shape[:-1]" if compare == "size" else f"list(self.pos{k}.shape[:-1])"
        out.line(f"if [h, w] == {target}:", 1)
        out.line(f"emb = self.pos{k}.flatten(end_dim=1)", 2)
        out.line("else:", 1)
        body = 2
    if s.get("method") == "grid_sample":
        out.line("ys = (torch.arange(h, dtype=torch.float32, device=x.device) + 0.5) / h * 2 - 1", body)
        out.line("xs = (torch.arange(w, dtype=torch.float32, device=x.device) + 0.5) / w * 2 - 1", body)
        out.line(f"points = torch.stack([xs.repeat(h), ys.repeat_interleave(w)], -1).view(1, h * w, 1, 2)"
                 f".to(self.pos{k}.dtype)", body)
        out.line(f'emb = F.grid_sample({source}, points, mode="{mode}", padding_mode="{s.get("padding")}", '
                 f'align_corners={bool(align)})', body)
        out.line("emb = emb[0, :, :, 0].t()", body)
    else:
        out.line(f'emb = F.interpolate({source}, size=(h, w), mode="{mode}"{align_text})', body)
        rows = "emb.squeeze(0).permute(1, 2, 0).flatten(end_dim=1)" if layout == "hwd" else "emb[0].flatten(1).t()"
        out.line(f"emb = {rows}", body)
    if out.dims == 3:
        if s.get("repeat") == "repeat":
            out.line("emb = emb.repeat(t, 1)", 1)
        else:
            out.line(f"emb = emb.unsqueeze(0).expand(t, -1, -1).reshape(-1, {width})", 1)
        if time == "branch":
            out.line("if t > 1:", 1)
            out.line(f"emb = emb + self.time{k}[:t].repeat_interleave(h * w, dim=0)", 2)
        elif time == "branch_free":
            out.line("is_video = (grid[i, 0] > 1).to(emb.dtype)", 1)
            out.line(f"emb = emb + self.time{k}[:t].repeat_interleave(h * w, dim=0) * is_video", 1)
    out.line(f"pos_embs{k}.append(emb)", 1)
    out.line(f"x = x + torch.cat(pos_embs{k})")


def _table_slice(out: _Writer, s: Statement) -> None:
    k, rows, width = out.fresh(), s.get("rows"), out.width
    storage = s.get("storage")
    if storage == "buffer":
        out.member(f'self.register_buffer("table{k}", torch.randn({rows}, {rows}, {width}))')
    elif storage == "parameter":
        out.member(f"self.table{k} = nn.Parameter(torch.randn({rows}, {rows}, {width}))")
    elif storage == "attribute":
        out.member(f"self.table{k} = torch.randn({rows}, {rows}, {width})")
    else:
        out.member(f"self.table{k} = None")
        out.line(f"if self.table{k} is None:")
        out.line(f"self.table{k} = torch.linspace(-2.0, 2.0, {rows * rows * width}).view({rows}, {rows}, {width}).sin()", 1)
    out.limit_side(rows)
    out.line(f"pieces{k} = []")
    out.loop()
    guard = s.get("guard")
    if guard == "check":
        out.line(f"torch._check(h <= {rows})", 1)
        out.line(f"torch._check(w <= {rows})", 1)
    elif guard == "assert":
        out.line(f"assert h <= {rows} and w <= {rows}", 1)
    piece = f"self.table{k}[:h, :w]" + (f".reshape(-1, {width})" if s.get("flatten") == "reshape" else ".flatten(0, 1)")
    if out.dims == 3:
        piece += ".repeat(t, 1)"
    out.line(f"pieces{k}.append({piece})", 1)
    out.line(f"x = x {'+' if s.get('combine') == 'add' else '*'} torch.cat(pieces{k})")


def _row_col_ids(out: _Writer, k: int, form: str) -> tuple[str, str]:
    """Emit per-item row and column ids (int64, [L]) named rows{k}, cols{k}."""
    out.line(f"rows{k}, cols{k} = [], []")
    out.loop()
    if form == "repeat":
        out.line("r = torch.arange(h).repeat_interleave(w)", 1)
        out.line("c = torch.arange(w).repeat(h)", 1)
    elif form == "divmod":
        out.line("n = torch.arange(h * w)", 1)
        out.line("r, c = n // w, n % w", 1)
    else:
        out.line("r = torch.arange(h)[:, None].expand(h, w).reshape(-1)", 1)
        out.line("c = torch.arange(w)[None, :].expand(h, w).reshape(-1)", 1)
    if out.dims == 3:
        out.line("r, c = r.repeat(t), c.repeat(t)", 1)
    out.line(f"rows{k}.append(r)", 1)
    out.line(f"cols{k}.append(c)", 1)
    out.line(f"rows{k}, cols{k} = torch.cat(rows{k}), torch.cat(cols{k})")
    return f"rows{k}", f"cols{k}"


def _ids(out: _Writer, s: Statement) -> None:
    k, width = out.fresh(), out.width
    rows, cols = _row_col_ids(out, k, s.get("form"))
    if s.get("use") == "embedding":
        out.member(f"self.row_emb{k} = nn.Embedding({LARGEST_SIDE}, {width})")
        out.member(f"self.col_emb{k} = nn.Embedding({LARGEST_SIDE}, {width})")
        out.limit_side(LARGEST_SIDE)
        out.line(f"x = x + self.row_emb{k}({rows}) + self.col_emb{k}({cols})")
    elif s.get("use") == "index":
        out.member(f'self.register_buffer("id_table{k}", torch.randn({LARGEST_SIDE}, {width}))')
        out.limit_side(LARGEST_SIDE)
        out.line(f"x = x + self.id_table{k}[{rows}] - self.id_table{k}[-1 - {cols}]")
    elif s.get("use") == "bag":
        out.member(f"self.id_bag{k} = nn.Parameter(torch.randn({LARGEST_SIDE}, {width}))")
        out.limit_side(LARGEST_SIDE)
        out.imports.add("F")
        out.line(f"taps{k} = torch.stack([{rows}, {cols}, ({rows} + {cols}) // 2], dim=1)")
        out.line(f"x = x + F.embedding_bag(taps{k}, self.id_bag{k}, per_sample_weights=(taps{k} + 1).float().reciprocal(), mode='sum')")
    else:
        out.member(f"self.id_scale{k} = nn.Parameter(torch.randn({width}) * 0.1)")
        out.line(f"x = x + ({rows} - {cols}).float()[:, None] * self.id_scale{k}")


def _rope(out: _Writer, s: Statement) -> None:
    k, width = out.fresh(), out.width
    quarter = width // 4
    length = out.length()
    source = s.get("source")
    if source == "ids":
        rows, cols = _row_col_ids(out, k, "repeat")
        out.member(f'self.register_buffer("freq{k}", 1.0 / 10.0 ** torch.arange({quarter}).float())')
        out.line(f"ang{k} = torch.cat([{rows}.float()[:, None] * self.freq{k}, {cols}.float()[:, None] * self.freq{k}], dim=-1)")
        cis = f"torch.polar(torch.ones_like(ang{k}), ang{k})"
    else:
        shape = f"{LARGEST_SIDE}, {LARGEST_SIDE}, {width // 2}"
        count = LARGEST_SIDE * LARGEST_SIDE * width // 2
        build = f"torch.polar(torch.ones({shape}), torch.linspace(0.0, 3.0, {count}).view({shape}))"
        if source == "table":
            out.member(f'self.register_buffer("cis_table{k}", {build})')
        else:
            out.member(f"self.cis_table{k} = None")
            out.line(f"if self.cis_table{k} is None:")
            out.line(f"self.cis_table{k} = {build}", 1)
        out.limit_side(LARGEST_SIDE)
        out.shapes()
        repeat = ".repeat(t, 1)" if out.dims == 3 else ""
        cis = f"torch.cat([self.cis_table{k}[:h, :w].reshape(-1, {width // 2}){repeat} for {out.item_vars} in shapes])"
    out.line(f"cis{k} = {cis}")
    apply = s.get("apply")
    if apply == "complex":
        out.line(f"x = torch.view_as_real(torch.view_as_complex(x.reshape({length}, -1, 2)) * cis{k}).flatten(1)")
    elif apply == "complex_heads":
        # As MoonViT's apply_rope: [L, heads, d] viewed as complex pairs, freqs broadcast over heads.
        out.line(f"xc{k} = torch.view_as_complex(x.float().view({length}, 1, -1, 2))")
        out.line(f"x = torch.view_as_real(xc{k} * cis{k}.unsqueeze(-2)).flatten(-2).reshape({length}, {width}).type_as(x)")
    else:
        out.line(f"cos{k}, sin{k} = cis{k}.real.repeat(1, 2), cis{k}.imag.repeat(1, 2)")
        out.line("x1, x2 = x.chunk(2, dim=-1)")
        out.line(f"x = x * cos{k} + torch.cat([-x2, x1], dim=-1) * sin{k}")


def _attention(out: _Writer, s: Statement) -> None:
    k, width = out.fresh(), out.width
    heads = s.get("heads")
    head_dim = width // heads
    out.imports.add("F")
    length = out.length()
    cu = out.cu(s.get("cu"))
    if s.get("qkv") == "shared":
        out.line(f"q{k} = k{k} = v{k} = x.view({length}, {heads}, {head_dim})")
    else:
        out.member(f"self.qkv{k} = nn.Linear({width}, {3 * width})")
        out.line(f"q{k}, k{k}, v{k} = self.qkv{k}(x).view({length}, 3, {heads}, {head_dim}).unbind(1)")
    impl = s.get("impl")
    scale = s.get("scale")
    scale_value = {None: None, 0.5: "0.5", "head": f"{head_dim} ** -0.5"}[scale]
    scale_arg = "" if scale_value is None else f", scale={scale_value}"
    if impl == "varlen":
        out.imports.add("kimi_cg.ops")
        out.line(f"torch._check({cu}[-1].item() == {length})")
        out.line(f"max_seqlen{k} = ({cu}[1:] - {cu}[:-1]).max().item()")
        out.line(f"o{k} = torch.ops.kimi_cg.varlen_attention(q{k}, k{k}, v{k}, {cu}.to(torch.int32), max_seqlen{k})")
        result = f"o{k}.reshape({length}, {width})"
    else:
        if s.get("layout") == "4d":
            out.line(
                f"q{k}, k{k}, v{k} = "
                f"q{k}.transpose(0, 1).unsqueeze(0), k{k}.transpose(0, 1).unsqueeze(0), v{k}.transpose(0, 1).unsqueeze(0)"
            )
            result = f"o{k}[0].transpose(0, 1).reshape({length}, {width})"
        else:
            out.line(f"q{k}, k{k}, v{k} = q{k}.transpose(0, 1), k{k}.transpose(0, 1), v{k}.transpose(0, 1)")
            result = f"o{k}.transpose(0, 1).reshape({length}, {width})"
        if impl in ("segments", "split_segments"):
            if impl == "segments":
                out.line(f"bounds{k} = {cu}.tolist()")
                out.line(f"parts{k} = []")
                out.line(f"for a, b in zip(bounds{k}, bounds{k}[1:]):")
                out.line(
                    f"parts{k}.append(F.scaled_dot_product_attention("
                    f"q{k}[..., a:b, :], k{k}[..., a:b, :], v{k}[..., a:b, :]{scale_arg}))",
                    1,
                )
            else:
                lengths = f"({cu}[1:] - {cu}[:-1]).tolist()"
                out.line(f"seg{k} = {lengths}")
                out.line(
                    f"parts{k} = [F.scaled_dot_product_attention(a, b, c{scale_arg}) for a, b, c in "
                    f"zip(q{k}.split(seg{k}, dim=-2), k{k}.split(seg{k}, dim=-2), v{k}.split(seg{k}, dim=-2))]"
                )
            out.line(f"o{k} = torch.cat(parts{k}, dim=-2)")
        else:
            index = {"ellipsis": "...", "zero": "0", "colon": ":"}[s.get("mask_index")]
            out.line(f"mask{k} = torch.zeros([1, {length}, {length}], dtype=torch.bool)")
            bounds, order = s.get("bounds"), s.get("mask_order")
            for _ in range(2 if order == "twice" else 1):
                steps = f"range(1, len({cu}))" if order != "reverse" else f"reversed(range(1, len({cu})))"
                if bounds == "tensor":
                    out.line(f"for i in {steps}:")
                    out.line(f"mask{k}[{index}, {cu}[i - 1]:{cu}[i], {cu}[i - 1]:{cu}[i]] = True", 1)
                elif bounds == "list":
                    out.line(f"bounds{k} = {cu}.tolist()")
                    pairs = (
                        f"zip(bounds{k}, bounds{k}[1:])"
                        if order != "reverse"
                        else f"reversed(list(zip(bounds{k}, bounds{k}[1:])))"
                    )
                    out.line(f"for a, b in {pairs}:")
                    out.line(f"mask{k}[{index}, a:b, a:b] = True", 1)
                else:
                    out.line(f"for i in {steps}:")
                    out.line(f"a, b = {cu}[i - 1].item(), {cu}[i].item()", 1)
                    out.line(f"mask{k}[{index}, a:b, a:b] = True", 1)
            extra = s.get("mask_extra")
            if extra == "global_first":
                out.line(f"mask{k}[{index}, 0, :] = True")
                out.line(f"mask{k}[{index}, :, 0] = True")
            elif extra == "pairs":
                out.line(f"for i in range(2, len({cu})):")
                out.line(f"mask{k}[{index}, {cu}[i - 2]:{cu}[i], {cu}[i - 2]:{cu}[i]] = True", 1)
            if impl == "sdpa_mask":
                out.line(f"o{k} = F.scaled_dot_product_attention(q{k}, k{k}, v{k}, mask{k}{scale_arg})")
            elif impl == "float_mask":
                out.line(f'bias{k} = torch.zeros(1, {length}, {length}).masked_fill(~mask{k}, float("-inf"))')
                out.line(f"o{k} = F.scaled_dot_product_attention(q{k}, k{k}, v{k}, bias{k}{scale_arg})")
            else:
                factor = scale_value if scale_value is not None else f"{head_dim} ** -0.5"
                out.line(f"scores{k} = q{k} @ k{k}.transpose(-2, -1) * ({factor})")
                if s.get("softmax") == "masked_fill":
                    out.line(f'scores{k} = scores{k}.masked_fill(~mask{k}, float("-inf"))')
                else:
                    out.line(f'scores{k} = torch.where(mask{k}, scores{k}, float("-inf"))')
                out.line(f"o{k} = scores{k}.softmax(dim=-1) @ v{k}")
    if s.get("out") == "residual":
        out.member(f"self.wo{k} = nn.Linear({width}, {width})")
        out.line(f"x = x + self.wo{k}({result})")
    else:
        out.line(f"x = {result}")


_PIECE_OPS = {
    "center": "p - p.mean(0, keepdim=True)",
    "softmax": "p.softmax(0)",
    "by_length": "p / p.shape[0]",
    "flip": "p.flip(0)",
    "cumsum": "p.cumsum(0) / p.shape[0]",
    "layer_norm": "F.layer_norm(p, (p.shape[-1],))",
    "amax": "p - p.amax(0)",
}


def _split(out: _Writer, s: Statement) -> None:
    k = out.fresh()
    op = s.get("op")
    if op == "layer_norm":
        out.imports.add("F")
    api, sizes = s.get("api"), s.get("sizes")
    if api == "tensor_split":
        cu = out.cu("pad_cumsum")
        pieces = f"torch.tensor_split(x, {cu}[1:-1].tolist())"
    else:
        if sizes == "shapes":
            size_list = out.sizes()
        elif sizes == "tolist":
            out.line(f"sizes{k} = ({out.lengths_expr}).tolist()")
            size_list = f"sizes{k}"
        else:
            cu = out.cu("pad_cumsum")
            out.line(f"sizes{k} = ({cu}[1:] - {cu}[:-1]).tolist()")
            size_list = f"sizes{k}"
        pieces = f"torch.split(x, {size_list})" if api == "torch_split" else f"x.split({size_list})"
    out.line(f"x = torch.cat([{_PIECE_OPS[op]} for p in {pieces}])")


def _branch(out: _Writer, s: Statement) -> None:
    k = out.fresh()
    condition, threshold = s.get("condition"), s.get("threshold")
    if condition == "t_gt" and out.dims != 3:
        condition = "h_gt"
    test = {
        "h_gt": f"h > {threshold}",
        "h_eq_w": "h == w",
        "area_gt": f"h * w > {threshold * 4}",
        "t_gt": f"t > {min(threshold, 3)}",
    }[condition]
    form = s.get("form")
    out.line(f"pieces{k} = []")
    out.line(f"start{k} = 0")
    out.loop()
    out.line(f"p = x[start{k}:start{k} + {out.item_size}]", 1)
    if form == "if":
        out.line(f"if {test}:", 1)
        out.line("p = p.flip(0) * 2.0", 2)
        out.line("else:", 1)
        out.line("p = p - 1.0", 2)
    elif form == "int_scale":
        out.line(f"p = p * (1.0 + int({test}))", 1)
    else:  # per-row ids shifted by the comparison, as a frame index into a table
        out.line(f"ids = torch.arange({out.item_size}, device=x.device) % 3 + int({test})", 1)
        out.line("p = p + ids[:, None].to(p.dtype)", 1)
    out.line(f"pieces{k}.append(p)", 1)
    out.line(f"start{k} += {out.item_size}", 1)
    out.line(f"x = torch.cat(pieces{k})")


def _checks(out: _Writer, s: Statement) -> None:
    kind, bound = s.get("kind"), s.get("bound")
    if kind in ("check_total", "assert_total"):
        sizes = out.sizes()
        if kind == "check_total":
            out.line(f"torch._check(x.shape[0] == sum({sizes}))")
        else:
            out.line(f"assert x.shape[0] == sum({sizes})")
        return
    if kind in ("assert_cu_message", "assert_cu_chained"):
        cu = out.cu("pad_cumsum")
        if kind == "assert_cu_message":
            out.line(f"assert {cu}[-1] == x.shape[0], ({cu}[-1], x.shape[0])")
        else:
            out.line(f"assert {cu}[-1] == x.shape[0] == x.size(0), ({cu}[-1], x.shape)")
        return
    out.loop()
    if kind == "assert_bounds_message":
        out.limit_side(bound)
        out.line(f'assert h <= {bound}, f"item of height {{h}} over {bound}"', 1)
        out.line(f"assert w <= {bound}, (w, {bound})", 1)
    elif kind == "assert_positive":
        out.line("assert h >= 1 and w >= 1", 1)
    elif kind == "check_bounds":
        out.limit_side(bound)
        out.line(f"torch._check(h <= {bound})", 1)
        out.line(f"torch._check(w <= {bound})", 1)
    elif kind == "assert_bounds":
        out.limit_side(bound)
        out.line(f"assert h <= {bound}", 1)
        out.line(f"assert w <= {bound}", 1)
    else:
        out.even = True
        out.line("torch._check(h % 2 == 0)", 1)
        out.line("torch._check(w % 2 == 0)", 1)


def _item(out: _Writer, s: Statement) -> None:
    k, use, width = out.fresh(), s.get("use"), out.width
    if use == "max_seqlen":
        cu = out.cu("pad_cumsum")
        out.line(f"m{k} = ({cu}[1:] - {cu}[:-1]).max().item()")
        out.line(f"x = x / m{k}")
    elif use == "first_side":
        out.line(f"n{k} = grid[0, -1].item()")
        out.line(f"x = x * n{k} / (n{k} + 1)")
    elif use in ("total_checked", "total"):
        out.line(f"s{k} = grid.prod(-1).sum().item()")
        if use == "total_checked":
            out.line(f"torch._check(s{k} == x.shape[0])")
        out.line(f"x = x + torch.arange(s{k}).float()[:, None] / s{k}")
    elif use == "head_slice":
        out.line(f"n{k} = int(grid[0, 0])")
        out.line(f"x = torch.cat([x[:n{k}] * 2.0, x[n{k}:]])")
    elif use == "arange_length":
        out.line(f"n{k} = grid[:, -1].max().item()")
        out.line(f"x = x + torch.arange(n{k}).float().mean()")
    else:
        out.line(f"n{k} = grid[-1, 0].item()")
        out.line(f"x = x + torch.full((1, {width}), n{k}, dtype=x.dtype)")


def _pool(out: _Writer, s: Statement) -> None:
    k, width = out.fresh(), out.width
    out.line(f"lengths{k} = {out.lengths_expr}")
    if s.get("index") == "repeat_interleave":
        out.line(f"idx{k} = torch.repeat_interleave(torch.arange(grid.shape[0]), lengths{k})")
    else:
        out.shapes()
        out.line(f"idx{k} = torch.cat([torch.full(({out.item_size},), i) for i, ({out.item_vars}) in enumerate(shapes)])")
    buffer = f"torch.zeros(grid.shape[0], {width})" if s.get("buffer") == "zeros" else f"x.new_zeros(grid.shape[0], {width})"
    merge = s.get("merge")
    if merge == "index_add":
        out.line(f"pooled{k} = {buffer}.index_add_(0, idx{k}, x)")
    elif merge == "scatter_add":
        out.line(f"pooled{k} = {buffer}.scatter_add_(0, idx{k}[:, None].expand(-1, {width}), x)")
    else:
        out.line(f"pooled{k} = {buffer}.index_put_((idx{k},), x, accumulate=True)")
    out.line(f"pooled{k} = pooled{k} / lengths{k}[:, None]")
    gather = f"pooled{k}[idx{k}]" if s.get("gather") == "index" else f"pooled{k}.index_select(0, idx{k})"
    out.line(f"x = x + {gather}")
    out.defined.add(f"pooled:pooled{k}")


def _permute(out: _Writer, s: Statement) -> None:
    k, width = out.fresh(), out.width
    order = s.get("order")
    out.line(f"perm{k} = []")
    out.line(f"start{k} = 0")
    out.loop()
    size = out.item_size
    if order == "transpose":
        if out.dims == 3:
            out.line(f"p = torch.arange({size}).view(t, h, w).transpose(1, 2).reshape(-1)", 1)
        else:
            out.line("p = torch.arange(h * w).view(h, w).t().reshape(-1)", 1)
    elif order == "flip":
        out.line(f"p = torch.arange({size}).flip(0)", 1)
    else:
        out.even = True
        if out.dims == 3:
            out.line(f"p = torch.arange({size}).view(t, h // 2, 2, w // 2, 2).permute(0, 1, 3, 2, 4).reshape(-1)", 1)
        else:
            out.line("p = torch.arange(h * w).view(h // 2, 2, w // 2, 2).permute(0, 2, 1, 3).reshape(-1)", 1)
    out.line(f"perm{k}.append(p + start{k})", 1)
    out.line(f"start{k} += {size}", 1)
    out.line(f"perm{k} = torch.cat(perm{k})")
    apply = s.get("apply")
    gathered = {
        "index": f"x[perm{k}]",
        "index_select": f"x.index_select(0, perm{k})",
        "gather": f"torch.gather(x, 0, perm{k}[:, None].expand(-1, {width}))",
    }[apply]
    out.line(f"x = {gathered}")
    if s.get("between"):
        out.member(f"self.mix{k} = nn.Linear({width}, {width})")
        out.line(f"x = self.mix{k}(x)")
    inverse = s.get("inverse")
    if inverse == "argsort":
        out.line(f"x = x[torch.argsort(perm{k})]")
    elif inverse == "scatter":
        out.line(f"inv{k} = torch.empty_like(perm{k})")
        out.line(f"inv{k}[perm{k}] = torch.arange(perm{k}.shape[0])")
        out.line(f"x = x[inv{k}]")


def _buffer_view(out: _Writer, s: Statement) -> None:
    k, width = out.fresh(), out.width
    length = out.length()
    variant = s.get("variant")
    if variant == "prefix_add":
        out.line(f"n{k} = int(grid[0].prod())")
        out.line(f"buf{k} = torch.zeros({length}, {width})")
        out.line(f"v{k} = buf{k}[:n{k}]")
        out.line(f"buf{k}[:n{k}] += x[:n{k}]")
        out.line(f"x = x + buf{k} + v{k}.mean(0)")
    elif variant == "slice_fill":
        out.line(f"buf{k} = torch.zeros_like(x)")
        out.line(f"start{k} = 0")
        out.loop(enumerate_items=True)
        out.line(f"buf{k}[start{k}:start{k} + {out.item_size}] = x[start{k}:start{k} + {out.item_size}] * (i + 1)", 1)
        out.line(f"start{k} += {out.item_size}", 1)
        out.line(f"x = buf{k}")
    elif variant == "clone_view":
        sizes = out.sizes()
        out.line(f"y{k} = x.clone()")
        out.line(f"v{k} = y{k}[:{sizes}[0]]")
        out.line(f"y{k}.mul_(2.0)")
        out.line(f"x = y{k} + v{k}.mean(0)")
    elif variant == "copy_add":
        out.line(f"buf{k} = torch.empty_like(x)")
        out.line(f"buf{k}.copy_(x)")
        out.line(f"v{k} = buf{k}.view({length}, {width // 2}, 2)")
        out.line(f"buf{k}.add_(1.0)")
        out.line(f"x = v{k}.flatten(1) * 0.5")
    else:
        out.line(f"buf{k} = torch.zeros({length}, {width})")
        out.line(f"v{k} = buf{k}[:, :{width // 2}]")
        out.line(f"start{k} = 0")
        out.loop()
        out.line(f"buf{k}[start{k}:start{k} + {out.item_size}] = x[start{k}:start{k} + {out.item_size}].flip(0)", 1)
        out.line(f"start{k} += {out.item_size}", 1)
        out.line(f"x = x + v{k}.repeat(1, 2)")


def _patch_conv(out: _Writer, s: Statement) -> None:
    k, width, dims = out.fresh(), out.width, s.get("dims")
    kernel = {1: (2,), 2: (2, 2), 3: (2, 1, 2)}[dims]
    channels = width // math.prod(kernel)
    stride = kernel if s.get("stride") == "kernel" else 1
    out.member(f"self.conv{k} = nn.Conv{dims}d({channels}, {width}, kernel_size={kernel}, stride={stride}, "
               f"padding={s.get('padding')}, bias={s.get('bias')})")
    patches = ", ".join(str(side) for side in kernel)
    out.line(f"x = self.conv{k}(x.reshape(x.shape[0], {channels}, {patches})).flatten(2).mean(-1)")


_STATEMENT_RENDERERS: dict[str, Callable[[_Writer, Statement], None]] = {
    "linear": _linear,
    "pos_interp": _pos_interp,
    "table_slice": _table_slice,
    "ids": _ids,
    "rope": _rope,
    "attention": _attention,
    "split": _split,
    "branch": _branch,
    "checks": _checks,
    "item": _item,
    "pool": _pool,
    "permute": _permute,
    "buffer_view": _buffer_view,
    "patch_conv": _patch_conv,
}


def _render_return(out: _Writer, s: Statement) -> None:
    kind, width = s.kind, out.width
    if kind == "x":
        out.line("return x")
    elif kind == "list":
        if s.get("form") == "split":
            out.line(f"return list(x.split({out.sizes()}))")
        else:
            out.line("outs = []")
            out.line("start = 0")
            out.loop()
            out.line(f"outs.append(x[start:start + {out.item_size}])", 1)
            out.line(f"start += {out.item_size}", 1)
            out.line("return outs")
    elif kind == "tuple":
        extra = s.get("extra")
        if extra == "cu":
            value = out.cu("pad_cumsum")
        elif extra == "rows":
            rows, _ = _row_col_ids(out, out.fresh(), "repeat")
            value = rows
        elif extra == "int":
            value = "x.shape[0]"
        elif extra == "pos_embedding":
            out.imports.add("F")
            out.member(f"self.pos_out = nn.Parameter(torch.randn(3, 3, {width}))")
            out.line("pos_out = []")
            out.loop()
            out.line('emb = F.interpolate(self.pos_out.permute(2, 0, 1).unsqueeze(0), size=(h, w), mode="bicubic")', 1)
            out.line("emb = emb.squeeze(0).permute(1, 2, 0).flatten(end_dim=1)", 1)
            out.line("pos_out.append(emb.repeat(t, 1))" if out.dims == 3 else "pos_out.append(emb)", 1)
            value = "torch.cat(pos_out)"
        elif extra == "table_rows":
            out.member(f'self.register_buffer("table_out", torch.randn({LARGEST_SIDE}, {LARGEST_SIDE}, {width}))')
            out.limit_side(LARGEST_SIDE)
            out.shapes()
            repeat = ".repeat(t, 1)" if out.dims == 3 else ""
            value = f"torch.cat([self.table_out[:h, :w].reshape(-1, {width}){repeat} for {out.item_vars} in shapes])"
        else:
            pooled = sorted(name.split(":", 1)[1] for name in out.defined if name.startswith("pooled:"))
            value = pooled[0] if pooled else f"{out.lengths_expr}"
        out.line(f"return x, {value}")
    elif kind == "merger":
        out.even = True
        form, output, offsets = s.get("form"), s.get("output"), s.get("offsets")
        if offsets == "cu_tensor" and out.dims == 2:
            cu = out.cu("pad_cumsum")
            out.line("outs = []")
            out.loop(enumerate_items=True)
            out.line(f"seq = x[{cu}[i]:{cu}[i + 1]]", 1)
        else:
            out.line("outs = []")
            out.line("start = 0")
            out.loop()
            out.line(f"seq = x[start:start + {out.item_size}]", 1)
            out.line(f"start += {out.item_size}", 1)
        if out.dims == 3:
            out.line(f"windows = seq.view(t, h // 2, 2, w // 2, 2, {width}).mean(0).permute(0, 2, 1, 3, 4)", 1)
        else:
            out.line(f"windows = seq.view(h // 2, 2, w // 2, 2, {width}).permute(0, 2, 1, 3, 4)", 1)
        shaped = {
            "reshape_4d": f"windows.reshape(-1, {4 * width})",
            "view_4": f"windows.contiguous().view(h * w // 4, 4, {width})",
            "flatten": "windows.flatten(0, 1).flatten(1)",
            "reshape_4_d": f"windows.reshape(-1, 4, {width})",
        }[form]
        out.line(f"outs.append({shaped})", 1)
        if output == "list":
            out.line("return outs")
        else:
            if form in ("view_4", "reshape_4_d"):
                out.member(f"self.pre_norm = nn.LayerNorm({width})")
                value = f"self.pre_norm(torch.cat(outs)).view(-1, {4 * width})"
            else:
                out.member(f"self.pre_norm = nn.LayerNorm({4 * width})")
                value = "self.pre_norm(torch.cat(outs))"
            out.member(f"self.proj = nn.Linear({4 * width}, {width + 2})")
            out.line(f"y = self.proj({value})")
            out.line("return list(y.split([o.shape[0] for o in outs]))" if output == "projector_list" else "return y")
    elif kind == "merge_index_add":
        out.even = True
        out.line("idx = []")
        out.line("counts = []")
        out.line("offset = 0")
        out.loop()
        out.line("r = torch.arange(h).repeat_interleave(w) // 2", 1)
        out.line("c = torch.arange(w).repeat(h) // 2", 1)
        if out.dims == 3:
            out.line("r, c = r.repeat(t), c.repeat(t)", 1)
        out.line("idx.append(r * (w // 2) + c + offset)", 1)
        out.line("counts.append(h * w // 4)", 1)
        out.line("offset += h * w // 4", 1)
        out.line("idx = torch.cat(idx)")
        if s.get("merge") == "index_add":
            out.line(f"merged = torch.zeros(offset, {width}).index_add_(0, idx, x) / 4")
        else:
            out.line(f"merged = torch.zeros(offset, {width}).scatter_add_(0, idx[:, None].expand(-1, {width}), x) / 4")
        out.line("return merged" if s.get("output") == "tensor" else "return list(merged.split(counts))")
    elif kind == "pool_list":
        pooled = f"[p.mean(0) for p in x.split({out.sizes()})]"
        out.line(f"return {pooled}" if s.get("form") == "list" else f"return torch.stack({pooled})")
    else:
        raise ValueError(f"unknown return form {kind!r}")


def render(spec: ProgramSpec) -> str:
    """The source text of the program ``spec`` describes; its first line states its grid needs."""
    out = _Writer(spec.dims, spec.width, spec.loop)
    for statement in spec.statements:
        _STATEMENT_RENDERERS[statement.kind](out, statement)
    _render_return(out, spec.returns)
    needs = InputNeeds(spec.dims, spec.width, out.even, out.max_side, out.max_t)
    lines = [needs.header(), "import torch", "import torch.nn as nn"]
    if "F" in out.imports:
        lines.append("import torch.nn.functional as F")
    if "kimi_cg.ops" in out.imports:
        lines.append("import kimi_cg.ops  # registers torch.ops.kimi_cg.varlen_attention")
    lines += ["", "", "class Tower(nn.Module):", "    def __init__(self):", "        super().__init__()"]
    lines += ["        " + text for text in out.init]
    lines += ["", "    def forward(self, x, grid):"]
    lines += ["        " + text for text in out.body]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Drawing cases: one grammar, driven by hypothesis (strategies) or by a seeded random.Random
# ---------------------------------------------------------------------------------------------
#
# Every draw below goes through ``chooser.choice(sequence)`` and ``chooser.randint(low, high)``:
# ``random.Random`` has both, and ``_HypothesisChooser`` gives hypothesis's ``draw`` the same face.
# The fuzzing loops use random.Random: hypothesis's generator replays and mutates earlier examples
# (76 distinct programs in 150 examples) and favours each option's first choice, which starves the
# rarer statements; a seeded Random draws every program afresh from the stated weights.


class _HypothesisChooser:
    def __init__(self, draw):
        self._draw = draw

    def choice(self, sequence):
        return self._draw(st.sampled_from(list(sequence)))

    def randint(self, low: int, high: int) -> int:
        return self._draw(st.integers(low, high))


def _weighted(chooser, weights: dict[str, int]) -> str:
    return chooser.choice([name for name, weight in weights.items() for _ in range(weight)])


def _draw_statement(chooser, kind: str, table: dict) -> Statement:
    return Statement(kind, tuple((name, chooser.choice(choices)) for name, choices in table[kind].items()))


# Statements per program: mostly two or three (each statement adds per-item loops that dynamo
# unrolls, so longer programs cost more compile time than they add coverage).
STATEMENT_COUNT_WEIGHTS = {1: 3, 2: 4, 3: 3, 4: 2}


def draw_program_spec(chooser, max_statements: int = 4) -> ProgramSpec:
    dims = chooser.choice([2, 2, 3])
    width = chooser.choice([4, 8])
    counts = {count: weight for count, weight in STATEMENT_COUNT_WEIGHTS.items() if count <= max_statements}
    count = chooser.choice([count for count, weight in counts.items() for _ in range(weight)])
    statements = tuple(_draw_statement(chooser, _weighted(chooser, STATEMENT_WEIGHTS), STATEMENT_OPTIONS) for _ in range(count))
    returns = _draw_statement(chooser, _weighted(chooser, RETURN_WEIGHTS), RETURN_OPTIONS)
    return ProgramSpec(dims, width, statements, returns, chooser.choice(["tolist", "tolist", "item"]))


def draw_valid_grid(chooser, needs: InputNeeds, items: int | None = None) -> list[list[int]]:
    count = items if items is not None else chooser.randint(1, MOST_ITEMS)
    step = 2 if needs.even else 1
    grid = []
    for _ in range(count):
        item = [chooser.randint(1, needs.side_limit() // step) * step for _ in range(2)]
        if needs.dims == 3:
            item.insert(0, chooser.randint(1, needs.t_limit()))
        grid.append(item)
    return grid


def draw_invalid_grid(chooser, needs: InputNeeds) -> list[list[int]]:
    """A grid that breaks one of the program's needs (or has an empty item): eager may raise."""
    grid = draw_valid_grid(chooser, needs)
    index = chooser.randint(0, len(grid) - 1)
    item = list(grid[index])
    breaks = ["empty"]
    if needs.even:
        breaks.append("odd")
    if needs.max_side is not None:
        breaks.append("too_large")
    if needs.dims == 3 and needs.max_t is not None:
        breaks.append("too_many_frames")
    kind = chooser.choice(breaks)
    axis = chooser.choice([-1, -2])
    if kind == "empty":
        item[axis] = 0
    elif kind == "odd":
        item[axis] = chooser.choice([1, 3, 5, 7])
    elif kind == "too_large":
        item[axis] = needs.max_side + chooser.randint(1, 2)
    else:
        item[0] = needs.max_t + 1
    grid[index] = item
    return grid


def draw_grid_sequence(chooser, needs: InputNeeds) -> tuple:
    """Two or three grids, each valid or (about one in ten) not: fresh grids, the same item
    count with new sizes, the previous grid's items reordered or each item's h and w swapped (same
    N and L, other segment bounds: dynamo's static first trace is reused), or the previous grid
    again (cache hits)."""
    count = chooser.randint(2, 3)
    sequence: list[list[list[int]]] = []
    for _ in range(count):
        how = (
            chooser.choice(
                ["fresh", "fresh", "fresh", "same_count", "same_count", "reordered", "transposed", "repeat", "invalid"]
            )
            if sequence
            else "fresh"
        )
        if how == "invalid" or (not sequence and chooser.randint(0, 15) == 0):
            grid = draw_invalid_grid(chooser, needs)
        elif how == "fresh" or not needs.accepts(sequence[-1]):
            grid = draw_valid_grid(chooser, needs)
        else:
            previous = sequence[-1]
            if how == "same_count":
                grid = draw_valid_grid(chooser, needs, len(previous))
            elif how == "transposed" or (how == "reordered" and len(previous) == 1):
                grid = [list(item[:-2]) + [item[-1], item[-2]] for item in previous]
            elif how == "reordered":
                grid = [list(item) for item in reversed(previous)]
            else:
                grid = [list(item) for item in previous]
        sequence.append(grid)
    return tuple((freeze_grid(grid), needs.accepts(grid)) for grid in sequence)


def draw_case(chooser, max_statements: int = 4) -> "FuzzCase":
    spec = draw_program_spec(chooser, max_statements)
    source = render(spec)
    sequence = draw_grid_sequence(chooser, InputNeeds.from_source(source))
    dynamic = chooser.choice([None, None, True, True, False])
    update = chooser.choice([None, None, None, 1, len(sequence) - 1])
    seed = chooser.randint(0, 2**16)
    options = chooser.choice([None, None, None] + list(OPTION_SETS))
    layout = chooser.choice(["contiguous", "contiguous", "contiguous", "offset"])
    grid_dtype = chooser.choice(["int64", "int64", "int64", "int32"])
    poison = chooser.choice([False, True])
    return FuzzCase(spec, source, sequence, dynamic, update, seed, "", options, layout, grid_dtype, poison)


# kimi_cg options a case may compile with: the bucketed, padded runtime of the CUDA-graph path
# (run without capture on the CPU), with small buckets so that calls land in several buckets, overflow
# the largest, or exceed max_items.
OPTION_SETS = (
    (("cuda_graphs", True), ("token_budgets", (16, 64, 256))),
    (("cuda_graphs", True), ("token_budgets", (32, 128)), ("max_items", 2)),
)


@st.composite
def program_specs(draw, max_statements: int = 4):
    return draw_program_spec(_HypothesisChooser(draw), max_statements)


def programs(max_statements: int = 4):
    """Hypothesis strategy: source texts of Tower modules (see the module docstring);
    ``InputNeeds.from_source`` reads what a grid must satisfy for each."""
    return program_specs(max_statements).map(render)


@st.composite
def grids(draw, needs: InputNeeds, valid: bool = True):
    """Hypothesis strategy: grids (lists of [h, w] or [t, h, w]) meeting ``needs``, or breaking them."""
    chooser = _HypothesisChooser(draw)
    return draw_valid_grid(chooser, needs) if valid else draw_invalid_grid(chooser, needs)


@st.composite
def fuzz_cases(draw, max_statements: int = 4):
    """Hypothesis strategy: a program, two or three grids, dynamic or not, maybe a weight update."""
    return draw_case(_HypothesisChooser(draw), max_statements)


def random_cases(seed: int, max_statements: int = 4):
    """An endless, reproducible stream of cases: case ``i`` of seed ``s`` is always the same."""
    import random

    index = 0
    while True:
        yield draw_case(random.Random(f"{seed}:{index}"), max_statements)
        index += 1


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """One program and the calls to make: each grid with whether it meets the program's needs."""

    spec: ProgramSpec | None
    source: str
    grids: tuple[tuple[tuple[tuple[int, ...], ...], bool], ...]
    dynamic: bool | None  # torch.compile(dynamic=...): None is dynamo's static first trace, then dynamic
    update_weights_before: int | None  # scale every float parameter, buffer and tensor attribute in place before this call
    seed: int = 0  # weights (torch.manual_seed before building the module) and inputs
    origin: str = ""  # where the case came from, e.g. "seed 7 case 12" of random_cases
    options: tuple[tuple[str, Any], ...] | None = None  # torch.compile(..., options=dict(options))
    input_layout: str = "contiguous"  # or "offset": x is a view starting one row into a larger tensor
    grid_dtype: str = "int64"  # or "int32"
    poison_outputs: bool = False  # after each call's comparison, overwrite kimi_cg's outputs (NaN / -7)

    @classmethod
    def from_source(cls, source: str, grids, dynamic: bool | None = None, **fields) -> "FuzzCase":
        """A case for a hand-written program (first line: its input needs) and grids given as lists;
        ``fields``: any other FuzzCase field (update_weights_before, options, ...)."""
        needs = InputNeeds.from_source(source)
        frozen = tuple((freeze_grid(grid), needs.accepts(grid)) for grid in grids)
        fields.setdefault("update_weights_before", None)
        return cls(None, source, frozen, dynamic, **fields)

    @property
    def needs(self) -> InputNeeds:
        return InputNeeds.from_source(self.source)

    def describe_setup(self) -> str:
        parts = [f"dynamic={self.dynamic}"]
        if self.options:
            parts.append(f"options={dict(self.options)}")
        if self.update_weights_before is not None:
            parts.append(f"update_weights_before={self.update_weights_before}")
        if self.input_layout != "contiguous":
            parts.append(f"input_layout={self.input_layout}")
        if self.grid_dtype != "int64":
            parts.append(f"grid_dtype={self.grid_dtype}")
        if self.poison_outputs:
            parts.append("poison_outputs=True")
        parts.append(f"seed={self.seed}")
        return " ".join(parts) + (f" ({self.origin})" if self.origin else "")

    def with_spec(self, spec: ProgramSpec) -> "FuzzCase":
        return dataclasses.replace(self, spec=spec, source=render(spec))

    def to_json(self) -> dict:
        return {
            "spec": self.spec.to_json() if self.spec is not None else None,
            "grids": [[[list(item) for item in grid], valid] for grid, valid in self.grids],
            "dynamic": self.dynamic,
            "update_weights_before": self.update_weights_before,
            "seed": self.seed,
            "origin": self.origin,
            "options": [list(option) for option in self.options] if self.options is not None else None,
            "input_layout": self.input_layout,
            "grid_dtype": self.grid_dtype,
            "poison_outputs": self.poison_outputs,
        }

    @classmethod
    def from_json(cls, data: dict, source: str) -> "FuzzCase":
        spec = ProgramSpec.from_json(data["spec"]) if data.get("spec") else None
        grids = tuple((tuple(tuple(item) for item in grid), bool(valid)) for grid, valid in data["grids"])
        options = data.get("options")
        options = (
            tuple((name, tuple(value) if isinstance(value, list) else value) for name, value in options) if options else None
        )
        return cls(
            spec,
            source,
            grids,
            data["dynamic"],
            data["update_weights_before"],
            int(data.get("seed", 0)),
            data.get("origin", ""),
            options,
            data.get("input_layout", "contiguous"),
            data.get("grid_dtype", "int64"),
            bool(data.get("poison_outputs", False)),
        )


def freeze_grid(grid) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(item) for item in grid)


# ---------------------------------------------------------------------------------------------
# Running a case: the property
# ---------------------------------------------------------------------------------------------

RTOL = 1e-5

WRONG_OUTPUT = "wrong output"
CRASH = "kimi_cg crashed where eager ran"
ERROR_CLASS = "error class mismatch"
MISSED_ERROR = "kimi_cg returned where eager raised"
GENERATOR = "generator defect (eager failed on a grid meeting the program's needs)"
HANG = "hang (time limit)"
# Not part of the property (results stay right): kimi_cg's own code failed and a fallback ran the
# captured graph instead. Reported only when asked (scripts/fuzz_programs.py --internal-errors).
HIDDEN = "internal error hidden by a fallback"
FAILURE_KINDS = (WRONG_OUTPUT, CRASH, ERROR_CLASS, MISSED_ERROR, GENERATOR, HANG, HIDDEN)
_INTERNAL_FALLBACKS = ("internal error", "lifted program failed", "lifted program rejects a valid input")


@dataclasses.dataclass
class Failure:
    kind: str
    call: int
    grid: tuple
    detail: str
    case: FuzzCase
    eager_error: str | None = None
    compiled_error: str | None = None
    compiled_traceback: str | None = None

    def signature(self) -> tuple:
        """What makes two failures the same kind of bug: the kind and, for crashes, the exception
        class and its first message line with numbers blanked."""
        if self.kind == WRONG_OUTPUT:
            return (self.kind, _wrong_output_class(self.detail))
        if self.kind == HIDDEN:
            return (self.kind, self.detail)
        error = (self.compiled_error or "").split("\n", 1)[0]
        error = re.sub(r'File "[^"]*"', "File", error)  # generated files live in temporary folders
        error = re.sub(r"\d+", "#", error)
        # Node and symbol names and the grid entries vary from program to program: blank them.
        error = re.sub(r"\((?:[^()]|\([^()]*\))*\)|\[(?:[^\[\]]|\[[^\[\]]*\])*\]", "(.)", error)
        error = re.sub(r"\b\w*#\w*\b", "#", error)
        return (self.kind, error[:120])

    def message(self) -> str:
        grids = "\n".join(
            f"  call {i}: grid={list(map(list, grid))}{'' if valid else ' (breaks the needs)'}"
            for i, (grid, valid) in enumerate(self.case.grids)
        )
        lines = [
            f"{self.kind} at call {self.call}, grid {list(map(list, self.grid))}",
            f"  {self.case.describe_setup()}",
            grids,
            f"  {self.detail}",
        ]
        if self.eager_error:
            lines.append(f"  eager: {self.eager_error}")
        if self.compiled_error:
            lines.append(f"  kimi_cg: {self.compiled_error}")
        lines += ["--- program ---", self.case.source.rstrip(), "---------------"]
        return "\n".join(lines)


def _wrong_output_class(detail: str) -> str:
    for marker, name in (
        ("later call", "a result changed by a later call"),
        ("input ", "inputs changed unlike eager"),
        ("NaN", "NaN"),
        ("expected a", "structure differs"),
        ("expected torch.", "shape or dtype differs"),
        ("elements differ", "integer or bool values differ"),
        ("max abs diff", "float values differ"),
    ):
        if marker in detail:
            return name
    return "other"


def load_tower(source: str, directory: str) -> type:
    """Import ``source`` from a real file under ``directory`` (dynamo and tracebacks see its lines)."""
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    name = f"kimi_cg_fuzz_tower_{digest}"
    module = sys.modules.get(name)
    if module is None:
        path = os.path.join(directory, f"{name}.py")
        with open(path, "w") as file:
            file.write(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module.Tower


def _describe(error: BaseException) -> str:
    """``module.Class: first message line``; a backend failure names the exception inside it."""
    inner = getattr(error, "inner_exception", None)
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if inner is not None:
        text = f"raised by {_describe(inner)}"
    elif text.endswith("raised:") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    return f"{type(error).__module__}.{type(error).__qualname__}: {text[:300]}"


def has_nan(value) -> bool:
    if isinstance(value, torch.Tensor):
        return (value.is_floating_point() or value.is_complex()) and bool(torch.isnan(value).any())
    if isinstance(value, (list, tuple)):
        return any(has_nan(v) for v in value)
    return isinstance(value, float) and value != value


def _snapshot(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def compare(got, want, where: str = "output", exact: bool = False) -> str | None:
    """Why ``got`` differs from ``want`` (see the module docstring), or None."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: expected a tensor, got {type(got).__name__}"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{where}: expected {want.dtype}{list(want.shape)}, got {got.dtype}{list(got.shape)}"
        if got.is_floating_point() or got.is_complex():
            got64, want64 = got.detach().double(), want.detach().double()
            if torch.isnan(got64).any() or torch.isnan(want64).any():
                return f"{where}: NaN (kimi_cg {int(torch.isnan(got64).sum())}, eager {int(torch.isnan(want64).sum())} elements)"
            if exact:
                bad = got64 != want64
                if bad.any():
                    return f"{where}: changed by a later call (max abs change {float((got64 - want64).abs().max()):.3g})"
                return None
            if want64.numel() == 0:
                return None
            scale = max(1.0, float(want64.abs().max()))
            error = (got64 - want64).abs()
            if not bool((error <= RTOL * scale).all()) or not bool(torch.isfinite(got64).eq(torch.isfinite(want64)).all()):
                worst = int(error.nan_to_num(float("inf")).argmax())
                return (
                    f"{where}: max abs diff {float(error.nan_to_num(float('inf')).max()):.6g} (scale {scale:.3g}, "
                    f"rtol {RTOL}); first worst at flat index {worst}: kimi_cg {float(got64.flatten()[worst]):.6g}"
                    f" vs eager {float(want64.flatten()[worst]):.6g}"
                )
            return None
        if not torch.equal(got, want):
            return f"{where}: {int((got != want).sum())} of {want.numel()} elements differ"
        return None
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want):
            return f"{where}: expected a {type(want).__name__}, got {type(got).__name__}"
        if len(got) != len(want):
            return f"{where}: expected {len(want)} elements, got {len(got)}"
        for index, (g, w) in enumerate(zip(got, want)):
            reason = compare(g, w, f"{where}[{index}]", exact)
            if reason:
                return reason
        return None
    if type(got) is not type(want) or got != want:
        return f"{where}: expected {want!r} ({type(want).__name__}), got {got!r} ({type(got).__name__})"
    return None


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and plain tensor attributes (lazily built tables) of every submodule."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for value in list(module._parameters.values()) + list(module._buffers.values()) + list(vars(module).values()):
            if isinstance(value, torch.Tensor):
                found[id(value)] = value
    return list(found.values())


def _update_weights(tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.mul_(1.25)


def _poison(got, want, protected: set[int]) -> None:
    """Overwrite kimi_cg's output tensors in place (where eager's are fresh memory)."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
        if want.untyped_storage().data_ptr() in protected or got.numel() == 0:
            return
        try:
            if got.is_floating_point() or got.is_complex():
                got.fill_(float("nan"))
            elif got.dtype != torch.bool:
                got.fill_(-7)
        except RuntimeError:
            pass  # e.g. an expanded view: not writable in place, by kimi_cg or by a caller
    elif isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        for g, w in zip(got, want):
            _poison(g, w, protected)


def make_inputs(
    grid, width: int, seed: int, layout: str = "contiguous", grid_dtype: str = "int64"
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, width] (unit normal, from ``seed``) and the grid tensor; with layout "offset", x is
    rows 1.. of a [L + 1, width] tensor (a nonzero storage offset)."""
    generator = torch.Generator().manual_seed(seed)
    grid_tensor = torch.tensor([list(item) for item in grid], dtype=getattr(torch, grid_dtype))
    rows = item_rows(grid)
    if layout == "offset":
        return torch.randn(rows + 1, width, generator=generator)[1:], grid_tensor
    return torch.randn(rows, width, generator=generator), grid_tensor


@dataclasses.dataclass
class _Call:
    """One call of a case: the inputs each side got, and what each side returned or raised."""

    index: int
    grid: tuple
    valid: bool
    eager_inputs: tuple[torch.Tensor, torch.Tensor]
    compiled_inputs: tuple[torch.Tensor, torch.Tensor]
    want: Any = None
    got: Any = None
    eager_error: Exception | None = None
    compiled_error: Exception | None = None
    compiled_traceback: str | None = None

    def failure(self, kind: str, detail: str, case: "FuzzCase") -> Failure:
        return Failure(
            kind,
            self.index,
            self.grid,
            detail,
            case,
            _describe(self.eager_error) if self.eager_error is not None else None,
            _describe(self.compiled_error) if self.compiled_error is not None else None,
            self.compiled_traceback,
        )


def _make_call(case: "FuzzCase", index: int, reference, compiled) -> _Call:
    grid, valid = case.grids[index]
    inputs = (case.needs.width, case.seed * 7 + index, case.input_layout, case.grid_dtype)
    call = _Call(index, grid, valid, make_inputs(grid, *inputs), make_inputs(grid, *inputs))
    with torch.no_grad():
        try:
            call.want = reference(*call.eager_inputs)
        except Exception as error:  # noqa: BLE001  (any eager error is part of the property)
            call.eager_error = error
        try:
            call.got = compiled(*call.compiled_inputs)
        except Exception as error:  # noqa: BLE001
            call.compiled_error = error
            call.compiled_traceback = traceback.format_exc()
    return call


def _judge(case: "FuzzCase", call: _Call) -> Failure | None:
    """The property for one call (see the module docstring); None when it holds or when eager's
    own result is NaN on a grid outside the program's domain (nothing to compare)."""
    eager_error, compiled_error = call.eager_error, call.compiled_error
    if eager_error is not None:
        if call.valid:
            return call.failure(GENERATOR, "eager raised on a grid that meets the program's stated needs", case)
        if compiled_error is None:
            return call.failure(MISSED_ERROR, f"eager raised {type(eager_error).__name__}; kimi_cg returned a result", case)
        # kimi_cg raises eager's class, or InvalidInputError: raised only after the captured graph
        # rejected the inputs too, and where dynamo's own runtime assertion on a data-dependent size
        # fires before the op eager fails in (NOTE [errors by who must act] in kimi_cg/errors.py).
        if not isinstance(compiled_error, (type(eager_error), kimi_cg.InvalidInputError)):
            return call.failure(
                ERROR_CLASS,
                f"eager raised {type(eager_error).__name__}; kimi_cg raised "
                f"{type(compiled_error).__name__}, not an instance of it",
                case,
            )
        return None
    if compiled_error is not None:
        return call.failure(CRASH, "eager returned; kimi_cg raised", case)
    if has_nan(call.want):
        if call.valid:
            return call.failure(GENERATOR, "eager returned NaN on a grid that meets the program's stated needs", case)
        return None
    reason = (
        compare(call.got, call.want)
        or compare(call.compiled_inputs[0], call.eager_inputs[0], "input x after the call", exact=True)
        or compare(call.compiled_inputs[1], call.eager_inputs[1], "input grid after the call", exact=True)
    )
    return call.failure(WRONG_OUTPUT, reason, case) if reason is not None else None


def run_case(case: FuzzCase, directory: str, internal_errors: bool = False) -> Failure | None:
    """Run ``case`` in eager and through kimi_cg; the first difference, or None. With
    ``internal_errors``, a case that passes but made kimi_cg fall back after an error in its own
    code fails as HIDDEN."""

    tower = load_tower(case.source, directory)
    torch._dynamo.reset()
    kimi_cg.reset()
    torch.manual_seed(case.seed)
    model = tower().eval()
    reference = copy.deepcopy(model)
    # The weight update scales the tensors the module has when built, not tables it builds lazily
    # in forward: after a call that raised, dynamo (with kimi_cg's capture of .tolist()) has dropped
    # the frame's attribute writes where eager kept them, so only eager would have the table to scale.
    model_state, reference_state = _tensors(model), _tensors(reference)
    options = dict(case.options) if case.options else None
    compiled = torch.compile(model, backend="kimi_cg", dynamic=case.dynamic, options=options)
    kept = []
    for index in range(len(case.grids)):
        if index == case.update_weights_before:
            _update_weights(model_state)
            _update_weights(reference_state)
        call = _make_call(case, index, reference, compiled)
        failure = _judge(case, call)
        if failure is not None:
            return failure
        if call.eager_error is not None or has_nan(call.want):
            continue
        if case.poison_outputs:
            # A caller may write into what it got back; that must not reach later calls (eager's
            # results are fresh memory unless they are views of the inputs or the module's state).
            protected = {tensor.untyped_storage().data_ptr() for tensor in _tensors(reference) + list(call.eager_inputs)}
            _poison(call.got, call.want, protected)
        else:
            kept.append((call, _snapshot(call.got)))
    for call, snapshot in kept:
        reason = compare(call.got, snapshot, f"output of call {call.index}", exact=True)
        if reason is not None:
            return call.failure(WRONG_OUTPUT, reason + " (a returned tensor aliases memory a later call wrote)", case)
    if internal_errors:
        for reason in sorted(getattr(kimi_cg, "fallbacks", {})):
            if reason.startswith(_INTERNAL_FALLBACKS):
                return Failure(HIDDEN, len(case.grids) - 1, case.grids[-1][0], reason, case)
    return None


# ---------------------------------------------------------------------------------------------
# Minimisation: smaller programs and grids that fail the same way
# ---------------------------------------------------------------------------------------------


def _smaller_grids(grid: tuple, needs: InputNeeds) -> list[tuple]:
    """Candidate grids one step simpler than ``grid``: an item dropped, a side or t made smaller."""
    candidates = []
    if len(grid) > 1:
        for index in range(len(grid)):
            candidates.append(grid[:index] + grid[index + 1 :])
    floor = 2 if needs.even else 1
    for index, item in enumerate(grid):
        for axis, value in enumerate(item):
            lowest = 1 if (needs.dims == 3 and axis == 0) else floor
            for smaller in sorted({lowest, value // 2, value - (2 if needs.even and axis >= len(item) - 2 else 1)}):
                if lowest <= smaller < value and (smaller % 2 == 0 or not needs.even or (needs.dims == 3 and axis == 0)):
                    new_item = item[:axis] + (smaller,) + item[axis + 1 :]
                    candidates.append(grid[:index] + (new_item,) + grid[index + 1 :])
    return candidates


def minimise(
    failure: Failure, directory: str, budget: int = 120, log: Callable[[str], None] | None = None, internal_errors: bool = False
) -> Failure:
    """Greedy: keep any one-step simplification (fewer calls, statements, options, items, sides)
    that fails with the same signature. ``budget`` bounds the number of case runs."""
    target = failure.signature()
    best = failure
    runs = 0

    def attempt(case: FuzzCase) -> Failure | None:
        nonlocal runs
        runs += 1
        try:
            result = run_case(case, directory, internal_errors or failure.kind == HIDDEN)
        except Exception:  # noqa: BLE001  (a candidate that cannot even build is simply not smaller)
            return None
        if result is not None and result.signature() == target:
            return result
        return None

    def candidates(case: FuzzCase):
        # Calls: keep only up to the failing one, then try dropping earlier calls.
        grids = case.grids[: best.call + 1]
        if len(grids) < len(case.grids):
            yield dataclasses.replace(case, grids=grids)
        for index in range(len(grids) - 1):
            shorter = grids[:index] + grids[index + 1 :]
            update = case.update_weights_before
            if update is not None and update > index:
                update -= 1
            yield dataclasses.replace(
                case, grids=shorter, update_weights_before=update if update and update < len(shorter) else None
            )
        if case.update_weights_before is not None:
            yield dataclasses.replace(case, update_weights_before=None)
        if case.dynamic is not None:
            yield dataclasses.replace(case, dynamic=None)
        if case.options is not None:
            yield dataclasses.replace(case, options=None)
        if case.poison_outputs:
            yield dataclasses.replace(case, poison_outputs=False)
        if case.input_layout != "contiguous":
            yield dataclasses.replace(case, input_layout="contiguous")
        if case.grid_dtype != "int64":
            yield dataclasses.replace(case, grid_dtype="int64")
        spec = case.spec
        if spec is None:
            return
        for index in range(len(spec.statements)):
            yield case.with_spec(dataclasses.replace(spec, statements=spec.statements[:index] + spec.statements[index + 1 :]))
        if spec.returns.kind != "x":
            yield case.with_spec(dataclasses.replace(spec, returns=Statement.plainest("x", RETURN_OPTIONS)))
        for index, statement in enumerate(spec.statements):
            for name, value in statement.options:
                plainest = STATEMENT_OPTIONS[statement.kind][name][0]
                if value != plainest:
                    statements = list(spec.statements)
                    statements[index] = statement.replace(name, plainest)
                    yield case.with_spec(dataclasses.replace(spec, statements=tuple(statements)))
        for name, value in spec.returns.options:
            plainest = RETURN_OPTIONS[spec.returns.kind][name][0]
            if value != plainest:
                yield case.with_spec(dataclasses.replace(spec, returns=spec.returns.replace(name, plainest)))
        if spec.width != 4:
            yield case.with_spec(dataclasses.replace(spec, width=4))
        if spec.loop != "tolist":
            yield case.with_spec(dataclasses.replace(spec, loop="tolist"))
        needs = case.needs
        for call, (grid, _) in enumerate(case.grids):
            for smaller in _smaller_grids(grid, needs):
                grids = list(case.grids)
                grids[call] = (smaller, needs.accepts(smaller))
                yield dataclasses.replace(case, grids=tuple(grids))

    improved = True
    while improved and runs < budget:
        improved = False
        for candidate in candidates(best.case):
            if runs >= budget:
                break
            if candidate.spec is not None:
                # The grids must still mean what they meant: a grid the new program accepts stays valid.
                needs = candidate.needs
                if any(len(grid[0]) != needs.dims for grid, _ in candidate.grids):
                    continue
                candidate = dataclasses.replace(
                    candidate, grids=tuple((grid, needs.accepts(grid)) for grid, _ in candidate.grids)
                )
            result = attempt(candidate)
            if result is not None:
                best = result
                improved = True
                if log:
                    log(
                        f"    minimised: {len(candidate.source.splitlines())} lines, "
                        f"grids {[list(map(list, g)) for g, _ in candidate.grids]}"
                    )
                break
    return best


def save_failure(failure: Failure, folder: str) -> None:
    """Write the program, the case (grids, flags) and the report into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tower.py"), "w") as file:
        file.write(failure.case.source)
    data = failure.case.to_json()
    data.update(
        kind=failure.kind,
        call=failure.call,
        detail=failure.detail,
        eager_error=failure.eager_error,
        compiled_error=failure.compiled_error,
    )
    with open(os.path.join(folder, "case.json"), "w") as file:
        json.dump(data, file, indent=1)
    with open(os.path.join(folder, "report.txt"), "w") as file:
        file.write(failure.message() + "\n")
        if failure.compiled_traceback:
            file.write("\n" + failure.compiled_traceback)


def load_case(folder: str) -> FuzzCase:
    with open(os.path.join(folder, "tower.py")) as file:
        source = file.read()
    with open(os.path.join(folder, "case.json")) as file:
        data = json.load(file)
    case = FuzzCase.from_json(data, source)
    try:
        rendered = render(case.spec) if case.spec is not None else source
    except (KeyError, ValueError):
        rendered = None
    if rendered != source:
        case = dataclasses.replace(case, spec=None)  # edited by hand, or an older grammar: run it as written
    return case


# ---------------------------------------------------------------------------------------------
# Fuzzing many cases: in this process or in several
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FuzzReport:
    """What a fuzzing run did: cases run, failures, seconds per case, and what was covered."""

    cases: int = 0
    seconds: float = 0.0
    failures: list[Failure] = dataclasses.field(default_factory=list)
    case_seconds: list[float] = dataclasses.field(default_factory=list)
    coverage: dict[str, int] = dataclasses.field(default_factory=dict)

    def merge(self, other: "FuzzReport") -> "FuzzReport":
        coverage = dict(self.coverage)
        for key, value in other.coverage.items():
            coverage[key] = coverage.get(key, 0) + value
        return FuzzReport(
            self.cases + other.cases,
            max(self.seconds, other.seconds),
            self.failures + other.failures,
            self.case_seconds + other.case_seconds,
            coverage,
        )


def _count(coverage: dict[str, int], key: str) -> None:
    coverage[key] = coverage.get(key, 0) + 1


def _record_coverage(coverage: dict[str, int], case: FuzzCase) -> None:

    spec = case.spec
    if spec is not None:
        for statement in spec.statements:
            _count(coverage, f"statement {statement.kind}")
            for name, value in statement.options:
                _count(coverage, f"option {statement.kind}.{name}={value}")
        _count(coverage, f"return {spec.returns.kind}")
        for name, value in spec.returns.options:
            _count(coverage, f"option return {spec.returns.kind}.{name}={value}")
        _count(coverage, f"dims {spec.dims}")
        _count(coverage, f"loop {spec.loop}")
    _count(coverage, f"dynamic {case.dynamic}")
    _count(coverage, f"options {dict(case.options) if case.options else None}")
    _count(coverage, f"input layout {case.input_layout}")
    _count(coverage, f"grid dtype {case.grid_dtype}")
    _count(coverage, f"poison outputs {case.poison_outputs}")
    _count(coverage, f"grids {len(case.grids)}")
    if not all(valid for _, valid in case.grids):
        _count(coverage, "a grid breaking the needs")
    if case.update_weights_before is not None:
        _count(coverage, "weights updated between calls")
    counters = kimi_cg.counters
    # What kimi_cg did with the program: lifted at least one graph, never got a graph (dynamo ran
    # the whole frame in eager), or got graphs and lifted none.
    for reason, count in getattr(kimi_cg, "fallbacks", {}).items():
        # Why kimi_cg ran a graph or a call unlifted ("lifted program failed (...)" is an internal
        # error that the fallback hid: the property holds, the speed does not).
        coverage[f"fallback {reason}"] = coverage.get(f"fallback {reason}", 0) + count
    if counters.get("dynamo_graphs", 0) == 0:
        _count(coverage, "kimi_cg got no graph")
    elif counters.get("host_programs_built", 0) > 0:
        _count(coverage, "kimi_cg lifted a graph")
    else:
        _count(coverage, "kimi_cg lifted nothing")


def fuzz(
    indices,
    seed: int,
    directory: str,
    time_budget: float | None = None,
    case_timeout: int = 120,
    max_statements: int = 4,
    progress: Callable[[str], None] | None = None,
    internal_errors: bool = False,
) -> FuzzReport:
    """Run the cases ``indices`` of the stream ``random_cases(seed)``, stopping early once
    ``time_budget`` seconds are spent; a case running longer than ``case_timeout`` seconds is a hang."""
    import random
    import signal
    import time

    report = FuzzReport()
    start = time.perf_counter()

    def on_alarm(signum, frame):
        raise TimeoutError(f"case ran longer than {case_timeout} s")

    for index in indices:
        if time_budget is not None and time.perf_counter() - start > time_budget:
            break
        case = dataclasses.replace(
            draw_case(random.Random(f"{seed}:{index}"), max_statements), origin=f"seed {seed} case {index}"
        )
        case_start = time.perf_counter()
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(case_timeout)
        try:
            failure = run_case(case, directory, internal_errors)
        except TimeoutError as error:
            failure = Failure(HANG, len(case.grids) - 1, case.grids[-1][0], str(error), case)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        seconds = time.perf_counter() - case_start
        report.cases += 1
        report.case_seconds.append(seconds)
        _record_coverage(report.coverage, case)
        if failure is not None:
            if failure.compiled_traceback:
                failure.compiled_traceback = failure.compiled_traceback[-6000:]
            report.failures.append(failure)
        if progress is not None and (failure is not None or report.cases % 25 == 0):
            status = f"FAIL {failure.kind}: {(failure.compiled_error or failure.detail)[:140]}" if failure else "ok"
            progress(f"[{case.origin}] {report.cases} cases, {time.perf_counter() - start:.0f} s: {status}")
    report.seconds = time.perf_counter() - start
    return report


def _fuzz_worker(arguments: tuple) -> FuzzReport:
    indices, seed, directory, time_budget, max_statements, verbose, internal_errors = arguments
    import logging

    logging.disable(logging.WARNING)  # kimi_cg's fallback warnings: counted by kimi_cg, not printed here
    torch.set_num_threads(1)
    return fuzz(
        indices,
        seed,
        directory,
        time_budget,
        max_statements=max_statements,
        progress=(lambda line: print(line, flush=True)) if verbose else None,
        internal_errors=internal_errors,
    )


def fuzz_in_processes(
    count: int,
    seed: int,
    directory: str,
    workers: int,
    time_budget: float | None = None,
    max_statements: int = 4,
    verbose: bool = False,
    internal_errors: bool = False,
) -> FuzzReport:
    """Cases ``0 .. count - 1`` of ``random_cases(seed)`` over ``workers`` fresh processes (one
    torch thread each; worker ``k`` takes cases k, k + workers, ...). Separate processes also keep
    dynamo's global state and the generated modules away from the caller."""
    import concurrent.futures
    import multiprocessing

    workers = max(1, min(workers, count))
    jobs = [
        (range(index, count, workers), seed, directory, time_budget, max_statements, verbose, internal_errors)
        for index in range(workers)
    ]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        reports = list(pool.map(_fuzz_worker, jobs))
    total = FuzzReport()
    for report in reports:
        total = total.merge(report)
    return total


def summarise(failures: list[Failure], shown: int = 6) -> str:
    """Counts by kind and by signature, then the shortest program of each signature in full."""
    by_kind: dict[str, int] = {}
    groups: dict[tuple, list[Failure]] = {}
    for failure in failures:
        by_kind[failure.kind] = by_kind.get(failure.kind, 0) + 1
        groups.setdefault(failure.signature(), []).append(failure)
    lines = [f"{len(failures)} failing programs"]
    lines += [f"  {count:4d}  {kind}" for kind, count in sorted(by_kind.items(), key=lambda item: -item[1])]
    lines.append("distinct signatures:")
    ordered = sorted(groups.items(), key=lambda item: -len(item[1]))
    for (kind, error), members in ordered:
        lines.append(f"  {len(members):4d}  {kind}{': ' + error if error else ''}")
    for _, members in ordered[:shown]:
        smallest = min(members, key=lambda failure: len(failure.case.source))
        lines += ["", smallest.message()]
    return "\n".join(lines)
