"""Rows of a module-state table, combined per output row: ``torch.ops.kimi_cg.table_gather``.

    table:   [L, D]  float32 / bfloat16 / float16, or complex64 / complex128 (read as [L, D, 2] pairs)
    index:   [R, K]  int32 or int64, -1 = no contribution (a row of the host's plan, NOTE [table gathers])
    weight:  [R, K]  float32
    outer:   0: out[r] = sum_k weight[r, k] * table[index[r, k]];
             n > 0: the terms are the pairs of the first n entries and the other K - n:
             out[r] = sum_(i < n, j < K - n) weight[r, i] * weight[r, n + j] * table[index[r, i] + index[r, n + j]]
             (the weight product in float32; a pair with a -1 contributes nothing)
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


def _terms(index: torch.Tensor, weight: torch.Tensor, outer: int):
    """Each term's (rows [R], weights [R, 1]) in the kernel's order: k, or the pairs (i, j) row-major."""
    if not outer:
        for k in range(index.shape[1]):
            yield index[:, k], weight[:, k:k + 1]
        return
    for i in range(outer):
        for j in range(outer, index.shape[1]):
            valid = (index[:, i] >= 0) & (index[:, j] >= 0)
            yield torch.where(valid, index[:, i] + index[:, j], -1), weight[:, i:i + 1] * weight[:, j:j + 1]


def _gathered_float32(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, outer: int) -> torch.Tensor:
    """The weighted gather in float32, one term at a time ([R, D] memory, whatever K is); the first
    term is not added to zero, so a single term with weight 1 is the row itself, -0.0 included."""
    out = None
    for column, term_weight in _terms(index, weight, outer):
        valid = (column >= 0).unsqueeze(-1)
        term = torch.where(valid, table[column.clamp(min=0).long()].float() * term_weight, 0.0)
        out = term if out is None else out + term
    return out if out is not None else table.new_zeros((index.shape[0], table.shape[1]), dtype=torch.float32)


def _check_outer(index: torch.Tensor, outer: int) -> None:
    if outer < 0 or outer and outer >= index.shape[1]:
        raise ValueError(f"table_gather's outer must be in [0, K) for K={index.shape[1]}; got {outer}")


def table_gather_reference(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                           outer: int = 0) -> torch.Tensor:
    _check_outer(index, outer)
    rows = _real_rows(table)
    out = _gathered_float32(rows, index, weight, outer).to(rows.dtype)
    return out.view(index.shape[0], table.shape[1], 2) if table.is_complex() else out


@torch.library.custom_op("kimi_cg::table_gather", mutates_args=())
def table_gather(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, outer: int = 0) -> torch.Tensor:
    if table.dim() != 2:
        raise ValueError(f"table_gather expects a table of shape [L, D]; got {tuple(table.shape)}")
    if not use_triton(table):
        return table_gather_reference(table, index, weight, outer)
    from kimi_cg.kernels.merge_gather import merge_gather as merge_gather_triton

    out = merge_gather_triton(_real_rows(table), index, weight, outer=outer)
    return out.view(index.shape[0], table.shape[1], 2) if table.is_complex() else out


@table_gather.register_fake
def _(table, index, weight, outer=0):
    if table.is_complex():
        real = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}
        return table.new_empty((index.shape[0], table.shape[1], 2), dtype=real[table.dtype])
    return table.new_empty((index.shape[0], table.shape[1]))
