"""How kimi_cg.testing compares a compiled output with eager: structure, non-finite values, dtype rules.

Rules (one per dtype, never one tolerance for all):
  fp32 / fp64  each output tensor: max |compiled - eager| / max |eager| <= 1e-5 (fp64: 1e-12);
  bf16 / fp16  flash-attention's rule: against an fp32 copy of the model run on the same inputs,
               ||compiled - fp32|| / ||fp32|| <= 2 x (||eager - fp32|| / ||fp32||) + a rounding floor
               (bf16 2e-3, fp16 2.5e-4: a quarter of the dtype's epsilon), per output tensor.
Everywhere: the same output structure (containers, keys, lengths, shapes, dtypes, non-tensor leaves),
and no NaN or inf at a position where eager's output is finite.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Rule:
    """The comparison rule of one dtype (see the module docstring)."""

    dtype: torch.dtype
    relative: float | None = None
    """Full-precision rule: the largest allowed max |compiled - eager| / max |eager|."""
    factor: float | None = None
    """Low-precision rule: the allowed multiple of eager's own error against the fp32 reference."""
    floor: float | None = None
    """Low-precision rule: added to the allowed error (rounding noise of near-exact outputs)."""

    @property
    def needs_reference(self) -> bool:
        return self.factor is not None

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        if self.needs_reference:
            return f"{name} rule: error vs fp32 <= {self.factor:g} x eager {name}'s error + {self.floor:g}"
        return f"{name} rule: max |compiled - eager| / max |eager| <= {self.relative:g}"


def rule_for(dtype: torch.dtype, relative: float | None = None, floor: float | None = None) -> Rule:
    """The rule for ``dtype``; ``relative`` overrides the full-precision bound, ``floor`` the low one."""
    if dtype in (torch.float32, torch.float64):
        return Rule(dtype, relative=relative if relative is not None else (1e-5 if dtype == torch.float32 else 1e-12))
    if dtype in (torch.bfloat16, torch.float16):
        return Rule(dtype, factor=2.0, floor=floor if floor is not None else (2e-3 if dtype == torch.bfloat16 else 2.5e-4))
    raise ValueError(f"no comparison rule for {dtype}: kimi_cg.testing compares float32, float64, bfloat16, float16 models")


def flatten(value: Any, path: str = "output") -> list[tuple[str, Any]]:
    """The leaves of a return value with their paths, depth first: tensors, and any other leaf by value.
    Containers: list, tuple, dict (transformers' ModelOutput is one: its non-None fields)."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in flatten(item, f"{path}[{key!r}]")]
    if isinstance(value, (list, tuple)):
        return [leaf for index, item in enumerate(value) for leaf in flatten(item, f"{path}[{index}]")]
    return [(path, value)]


def structure_difference(got: Any, want: Any) -> str | None:
    """Why two return values differ in structure (None when they match): the first differing path."""
    if type(got) is not type(want) and not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return f"a {type(got).__name__}, eager returns a {type(want).__name__}"
    if isinstance(want, dict):
        if list(got.keys()) != list(want.keys()):
            return f"keys {list(got.keys())}, eager {list(want.keys())}"
        return next((f"[{key!r}]: {why}" for key in want if (why := structure_difference(got[key], want[key]))), None)
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return f"{len(got)} elements, eager {len(want)}"
        return next((f"[{index}]: {why}" for index, (g, w) in enumerate(zip(got, want))
                     if (why := structure_difference(g, w))), None)
    if isinstance(want, torch.Tensor):
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{tuple(got.shape)} {got.dtype}, eager {tuple(want.shape)} {want.dtype}"
        return None
    if got != want:
        return f"{got!r}, eager {want!r}"
    return None


def new_non_finite(got: torch.Tensor, want: torch.Tensor) -> int:
    """Positions where ``got`` is NaN or inf and ``want`` (eager) is finite."""
    if not got.is_floating_point() and not got.is_complex():
        return 0
    return int((~torch.isfinite(got) & torch.isfinite(want)).sum())


def max_relative_error(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max |got - want| / max |scale| over the positions where ``want`` is finite (scale: want)."""
    if not want.is_floating_point() and not want.is_complex():
        return 0.0 if torch.equal(got, want) else math.inf
    finite = torch.isfinite(want)
    if not finite.any():
        return 0.0
    difference = (got.double() - want.double()).abs()[finite]
    largest = (scale if scale is not None else want).double().abs()
    largest = largest[torch.isfinite(largest)].max() if largest.numel() else torch.tensor(0.0)
    return float(difference.max()) / max(float(largest), torch.finfo(torch.float32).tiny)


def norm_relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """||got - reference|| / ||reference|| over the positions where the reference is finite."""
    finite = torch.isfinite(reference)
    if not finite.any():
        return 0.0
    reference = reference.double()[finite]
    difference = got.double()[finite] - reference
    return float(difference.norm()) / max(float(reference.norm()), torch.finfo(torch.float32).tiny)


def item_spans(grid: Sequence[Sequence[int]], tensors: Sequence[torch.Tensor]) -> list[list[tuple[int, slice]] | None]:
    """For each output tensor, the rows each item owns, when the tensor says so unambiguously: one
    tensor per item (a per-item list), or rows packed in item order with the same number of patches
    per row for every item (t*h*w / rows: the merge factor). None where neither holds (a temporal merge
    of video chunks, a pooled output): the failure then names the worst rows, not the worst item."""
    tokens = [math.prod(row) for row in grid]
    if len(tensors) == len(grid) and all(t.dim() >= 1 for t in tensors):
        return [[(index, slice(0, tensor.shape[0]))] for index, tensor in enumerate(tensors)]
    spans = []
    for tensor in tensors:
        rows = tensor.shape[0] if tensor.dim() >= 1 else 0
        if rows == 0 or sum(tokens) % rows or any(count % (sum(tokens) // rows) for count in tokens):
            spans.append(None)
            continue
        per_row, start, owned = sum(tokens) // rows, 0, []
        for index, count in enumerate(tokens):
            owned.append((index, slice(start, start + count // per_row)))
            start += count // per_row
        spans.append(owned)
    return spans
