"""Rows of a module-state table, combined per output row: ``torch.ops.kimi_cg.table_gather``.

    table:   [L, D]  float32 / bfloat16 / float16, or complex64 / complex128 (read as [L, D, 2] pairs)
    index:   [R, K]  int64, -1 = no contribution (a row of the host's plan, NOTE [table gathers])
    weight:  [R, K]  float32
    returns  [R, D]  table.dtype; for a complex table [R, D, 2] of its real dtype (view_as_real of the rows)

The merge gather's computation (kimi_cg/ops/merge_gather.py: the Triton kernel on CUDA, the float32
reference elsewhere), under its own name: the runtime pads this op's plan like the patch rows it
is aligned with (zeros), never rebases it as a merge plan of activation rows, and the lift keeps the
op in the device program although its inputs are module state and host values.
"""

from __future__ import annotations

import torch

from kimi_cg.ops.merge_gather import use_triton


def _real_rows(table: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(table).flatten(-2) if table.is_complex() else table


def _gathered_float32(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weighted gather in float32, one term at a time ([R, D] memory, whatever K is); the first
    term is not added to zero, so a single term with weight 1 is the row itself, -0.0 included."""
    out = None
    for k in range(index.shape[1]):
        column = index[:, k]
        valid = (column >= 0).unsqueeze(-1)
        term = torch.where(valid, table[column.clamp(min=0)].float() * weight[:, k:k + 1], 0.0)
        out = term if out is None else out + term
    return out if out is not None else table.new_zeros((index.shape[0], table.shape[1]), dtype=torch.float32)


def table_gather_reference(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = _real_rows(table)
    out = _gathered_float32(rows, index, weight).to(rows.dtype)
    return out.view(index.shape[0], table.shape[1], 2) if table.is_complex() else out


@torch.library.custom_op("kimi_cg::table_gather", mutates_args=())
def table_gather(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if table.dim() != 2:
        raise ValueError(f"table_gather expects a table of shape [L, D]; got {tuple(table.shape)}")
    if not use_triton(table):
        return table_gather_reference(table, index, weight)
    from kimi_cg.kernels.merge_gather import merge_gather as merge_gather_triton

    out = merge_gather_triton(_real_rows(table), index, weight)
    return out.view(index.shape[0], table.shape[1], 2) if table.is_complex() else out


@table_gather.register_fake
def _(table, index, weight):
    if table.is_complex():
        real = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}
        return table.new_empty((index.shape[0], table.shape[1], 2), dtype=real[table.dtype])
    return table.new_empty((index.shape[0], table.shape[1]))
