"""Varlen attention driven by a host-planned work list (issue 14's "host-planned varlen attention").

    q, k, v: [T, H, D]  float32 / bfloat16 / float16, packed rows of every segment
    work:    [W, 4]     int32; entry (q_start, q_end, k_start, k_end): the query rows
                        [q_start, q_end) (at most BLOCK_M of them) attend to the key rows
                        [k_start, k_end); an entry with q_end <= q_start does nothing
    out:     [T, H, D]  q.dtype, the softmax(q k^T * scale) v of each entry's rows

The host knows every segment of a call (kimi_cg lifts cu_seqlens into the host pass), so it plans
exactly the (segment, query block) pairs that have rows. A kernel launched over a bucket's padded
work list runs those and returns at once for the padding entries: its cost follows the call's
patches, not the bucket's capacity, and empty segments cost nothing. flash kernels given
``max_seqlen`` = the bucket capacity launch capacity / 128 query blocks per segment instead (the
profile in docs/benchmarks.md).

Padding rows of a bucket ([L, C) after the call's L rows) need some finite output and nobody reads
it: ``plan_work_list(..., padding_from=L)`` makes each block of them attend only to itself, so their
cost is linear in C - L (one trailing segment [L, C) would be quadratic).

NOTE [masked loads, not multiplied ones]
Keys and values outside an entry's range are never read: their loads are masked (rows of another
segment, or of a CUDA-graph pool, may hold NaN, and 0 * NaN is NaN). Every output row must be
covered by exactly one entry: rows no entry covers stay as torch.empty left them
(``work_list_rows`` lists the covered rows, for checks).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kimi_cg.kernels import FLOAT_DTYPES, on_device_of

WORK_ENTRY = 4  # q_start, q_end, k_start, k_end
BLOCK_M = 64
BLOCK_N = 64
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when @triton.jit below decides, too


# NOTE [head-dim split]
# Triton's blocks have power-of-two sides, so a head dim of 72 (MoonViT) or 80 (Qwen2-VL, Qwen2.5-VL)
# padded to one block of 128 spends 44% / 37% of the score product on zeros. The scores are computed
# as the sum of two products over a main part of the head dim (the largest power of two <= it, at
# least 16) and a tail (the rest rounded up to a power of two, at least ``min_tail``: tl.dot's
# smallest side is 16): 72 = 64 + 16 with 8 masked dims, 80 = 64 + 16, none for 64 or 128. The values
# and the output keep one block of the padded width: the same split of the second product (two
# accumulators) computed wrong values in bfloat16 and float16 on the H200 with Triton 3.6 (right in
# float32 and in the interpreter), so it is not used. On the H200 the split made the kernel 1.16x
# (images) and 1.33x (Qwen2.5-VL windows) faster than the same kernel over the padded head dim
# (docs/benchmarks.md, 2026-12-04).


def head_dim_split(head_dim: int, min_tail: int = 16) -> tuple[int, int]:
    """NOTE [head-dim split]: (main, tail) block widths covering ``head_dim`` (tail 0: none); a tail
    is at least ``min_tail`` wide (a power of two >= 16)."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive; got {head_dim}")
    if min_tail < 16 or min_tail & (min_tail - 1):
        raise ValueError(f"min_tail must be a power of two >= 16; got {min_tail}")
    main = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - main
    return main, 0 if rest <= 0 else max(min_tail, triton.next_power_of_2(rest))


@triton.jit
def _load_block(pointers, row_ok, dim_ok, MASK_ROWS: tl.constexpr, MASK_DIMS: tl.constexpr):
    """A [rows, dims] block; rows and dims outside their masks read as 0 and are never loaded."""
    if MASK_ROWS and MASK_DIMS:
        block = tl.load(pointers, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    elif MASK_ROWS:
        block = tl.load(pointers, mask=row_ok[:, None], other=0.0)
    elif MASK_DIMS:
        block = tl.load(pointers, mask=dim_ok[None, :], other=0.0)
    else:
        block = tl.load(pointers)
    return block


@triton.jit
def _attend_key_block(
    q_main, q_tail, acc, running_max, running_sum,
    k_ptr, v_ptr, start, k_end, head, k_row_stride, k_head_stride, v_row_stride, v_head_stride, qk_scale,
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, MASK_COLS: tl.constexpr,
):
    """One online-softmax step over the key rows [start, start + BLOCK_N) (those < k_end when MASK_COLS)."""
    cols = start + tl.arange(0, BLOCK_N)
    col_ok = cols < k_end
    dims_main = tl.arange(0, D_MAIN)
    k_rows = k_ptr + cols[:, None] * k_row_stride + head * k_head_stride
    v_rows = v_ptr + cols[:, None] * v_row_stride + head * v_head_stride
    keys = _load_block(k_rows + dims_main[None, :], col_ok, dims_main < HEAD_DIM, MASK_COLS, HEAD_DIM < D_MAIN)
    if UPCAST:
        keys = keys.to(tl.float32)
    scores = tl.dot(q_main, tl.trans(keys), input_precision=INPUT_PRECISION)
    if D_TAIL > 0:
        dims_tail = D_MAIN + tl.arange(0, D_TAIL)
        keys_tail = _load_block(k_rows + dims_tail[None, :], col_ok, dims_tail < HEAD_DIM, MASK_COLS,
                                D_MAIN + D_TAIL > HEAD_DIM)
        if UPCAST:
            keys_tail = keys_tail.to(tl.float32)
        scores += tl.dot(q_tail, tl.trans(keys_tail), input_precision=INPUT_PRECISION)
    scores = scores * qk_scale
    if MASK_COLS:
        scores = tl.where(col_ok[None, :], scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    rescale = tl.exp2(running_max - new_max)
    weights = tl.exp2(scores - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(weights, 1)
    value_dims = tl.arange(0, BLOCK_D)
    values = _load_block(v_rows + value_dims[None, :], col_ok, value_dims < HEAD_DIM, MASK_COLS, HEAD_DIM < BLOCK_D)
    weights = weights.to(values.dtype)  # rounded to the input dtype, as flash kernels do
    if UPCAST:
        weights = weights.to(tl.float32)
        values = values.to(tl.float32)
    acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision=INPUT_PRECISION)
    return acc, new_max, running_sum


@triton.jit
def _work_list_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, work_ptr,
    q_row_stride, q_head_stride, k_row_stride, k_head_stride,
    v_row_stride, v_head_stride, out_row_stride, out_head_stride,
    qk_scale,  # the softmax scale times log2(e): the kernel works in powers of two
    HEAD_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,  # NOTE [head-dim split]
    D_TAIL: tl.constexpr,
    BLOCK_D: tl.constexpr,  # the values' and the output's width: the head dim rounded up to a power of two
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # products in float32 (Triton 3.6's interpreter computes bfloat16 tl.dot wrongly)
    INTERPRETED: tl.constexpr,
):
    entry = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    q_start = tl.load(work_ptr + entry * 4).to(tl.int64)
    q_end = tl.load(work_ptr + entry * 4 + 1).to(tl.int64)
    k_start = tl.load(work_ptr + entry * 4 + 2).to(tl.int64)
    k_end = tl.load(work_ptr + entry * 4 + 3).to(tl.int64)
    if q_end > q_start:
        rows = q_start + tl.arange(0, BLOCK_M)
        row_ok = rows < q_end
        dims_main = tl.arange(0, D_MAIN)
        q_rows = q_ptr + rows[:, None] * q_row_stride + head * q_head_stride
        q_main = _load_block(q_rows + dims_main[None, :], row_ok, dims_main < HEAD_DIM, True, HEAD_DIM < D_MAIN)
        if UPCAST:
            q_main = q_main.to(tl.float32)
        if D_TAIL > 0:
            dims_tail = D_MAIN + tl.arange(0, D_TAIL)
            q_tail = _load_block(q_rows + dims_tail[None, :], row_ok, dims_tail < HEAD_DIM, True,
                                 D_MAIN + D_TAIL > HEAD_DIM)
            if UPCAST:
                q_tail = q_tail.to(tl.float32)
        else:
            q_tail = q_main  # unused
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        # Whole key blocks without column masks, then the partial one (if any) with them.
        full_blocks = ((k_end - k_start) // BLOCK_N).to(tl.int32)
        full_end = k_start + full_blocks * BLOCK_N
        if INTERPRETED:
            # A while loop: Triton 3.6's interpreter cannot take a loaded scalar as a range() bound
            # under NumPy >= 2.4. Compiled, range() lets Triton pipeline the loads (num_stages).
            block = 0
            while block < full_blocks:
                acc, running_max, running_sum = _attend_key_block(
                    q_main, q_tail, acc, running_max, running_sum,
                    k_ptr, v_ptr, k_start + block * BLOCK_N, k_end, head, k_row_stride, k_head_stride,
                    v_row_stride, v_head_stride, qk_scale, HEAD_DIM, D_MAIN, D_TAIL, BLOCK_D, BLOCK_N,
                    INPUT_PRECISION, UPCAST, False)
                block += 1
        else:
            for block in range(0, full_blocks):
                acc, running_max, running_sum = _attend_key_block(
                    q_main, q_tail, acc, running_max, running_sum,
                    k_ptr, v_ptr, k_start + block * BLOCK_N, k_end, head, k_row_stride, k_head_stride,
                    v_row_stride, v_head_stride, qk_scale, HEAD_DIM, D_MAIN, D_TAIL, BLOCK_D, BLOCK_N,
                    INPUT_PRECISION, UPCAST, False)
        if full_end < k_end:
            acc, running_max, running_sum = _attend_key_block(
                q_main, q_tail, acc, running_max, running_sum,
                k_ptr, v_ptr, full_end, k_end, head, k_row_stride, k_head_stride, v_row_stride, v_head_stride,
                qk_scale, HEAD_DIM, D_MAIN, D_TAIL, BLOCK_D, BLOCK_N, INPUT_PRECISION, UPCAST, True)
        out_rows = out_ptr + rows[:, None] * out_row_stride + head * out_head_stride
        value_dims = tl.arange(0, BLOCK_D)
        tl.store(out_rows + value_dims[None, :], (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (value_dims < HEAD_DIM)[None, :])


def work_list_capacity(rows: int, segments: int, block_m: int = BLOCK_M) -> int:
    """Entries enough for any call of at most ``rows`` rows in at most ``segments`` segments (each
    segment adds at most one partial query block), padding rows included."""
    return rows // block_m + segments + 1


def plan_work_list(cu_seqlens: Sequence[int], *, block_m: int = BLOCK_M, padding_from: int | None = None,
                   entries: int | None = None) -> torch.Tensor:
    """The work list of one call: one entry per query block of each segment of ``cu_seqlens`` (host
    integers, non-decreasing from 0). Rows from ``padding_from`` on (a bucket's padding: they must
    lie in the last segment) are planned as blocks that attend to themselves. ``entries`` pads the
    list with no-op entries to a fixed length (a bucket's static buffer); a call that needs more
    raises ValueError."""
    bounds = [int(b) for b in cu_seqlens]
    if not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing; got {bounds[:16]}")
    if block_m <= 0:
        raise ValueError(f"block_m must be positive; got {block_m}")
    last_start = bounds[-2] if len(bounds) > 1 else 0
    if padding_from is not None and not last_start <= padding_from <= bounds[-1]:
        raise ValueError(f"padding rows [{padding_from}, {bounds[-1]}) must lie in the last segment of {bounds[-3:]}")
    work = []
    for start, end in zip(bounds, bounds[1:]):
        real_end = end if padding_from is None else min(end, max(start, padding_from))
        for q in range(start, real_end, block_m):
            work.append((q, min(q + block_m, real_end), start, real_end))
        for q in range(real_end, end, block_m):  # padding rows: each block attends to itself
            work.append((q, min(q + block_m, end), q, min(q + block_m, end)))
    if entries is not None:
        if len(work) > entries:
            raise ValueError(f"the call needs {len(work)} work entries; the buffer holds {entries}")
        work.extend([(0, 0, 0, 0)] * (entries - len(work)))
    return torch.tensor(work, dtype=torch.int32).reshape(-1, WORK_ENTRY)


def plan_work_list_on_device(cu_seqlens: torch.Tensor, entries: int, block_m: int = BLOCK_M) -> torch.Tensor:
    """``plan_work_list(cu_seqlens, entries=entries)`` made with tensor ops of fixed shapes on the
    boundaries' device: no host read, so a CUDA graph can capture it and a replay plans the segments
    its static boundary buffer holds then. Entries beyond the call's blocks do nothing; a call whose
    blocks exceed ``entries`` would lose rows, so ``entries`` must be at least
    ``work_list_capacity(rows, segments)`` (the caller sizes it from the shapes, which bound it)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D and non-empty; got shape {tuple(cu_seqlens.shape)}")
    if block_m <= 0 or entries < 0:
        raise ValueError(f"block_m must be positive and entries non-negative; got {block_m}, {entries}")
    if cu_seqlens.numel() == 1:  # no segment: nothing to plan
        return torch.zeros(entries, WORK_ENTRY, dtype=torch.int32, device=cu_seqlens.device)
    bounds = cu_seqlens.to(torch.int64)
    starts, ends = bounds[:-1], bounds[1:]
    blocks = (ends - starts).clamp_min(0).add(block_m - 1).div(block_m, rounding_mode="floor")
    last_block = torch.cumsum(blocks, 0)  # entry e belongs to the first segment whose last_block > e
    entry = torch.arange(entries, device=cu_seqlens.device, dtype=torch.int64)
    segment = torch.searchsorted(last_block, entry, right=True).clamp_max(blocks.numel() - 1)
    first_block = last_block - blocks
    seg_start, seg_end = starts[segment], ends[segment]
    q_start = seg_start + (entry - first_block[segment]) * block_m
    q_end = torch.minimum(q_start + block_m, seg_end)
    used = entry < last_block[-1]
    work = torch.stack([q_start, q_end, seg_start, seg_end], dim=1)
    return torch.where(used[:, None], work, torch.zeros_like(work)).to(torch.int32)


def work_list_rows(work: torch.Tensor) -> torch.Tensor:
    """How many entries cover each query row (each must be covered exactly once): for checks."""
    entries = work.to(torch.int64).cpu().tolist()
    rows = max((q_end for _, q_end, _, _ in entries), default=0)
    counts = torch.zeros(rows, dtype=torch.int64)
    for q_start, q_end, _, _ in entries:
        if q_end > q_start:
            counts[q_start:q_end] += 1
    return counts


def work_list_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, work: torch.Tensor,
                        scale: float | None = None, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                        num_warps: int | None = None, num_stages: int | None = None,
                        min_tail: int = 16, split_scores: bool = True) -> torch.Tensor:
    """softmax(q k^T * scale) v for each entry of ``work`` (see the module docstring); ``work`` must have
    been planned with the same ``block_m``. ``num_warps`` / ``num_stages``: Triton's launch options
    (scripts/attention_bench.py sweeps them). ``split_scores`` / ``min_tail``: NOTE [head-dim split]
    (False: one score product over the head dim padded to a power of two)."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one shape [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one float dtype of {FLOAT_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if work.dim() != 2 or work.shape[1] != WORK_ENTRY or work.dtype != torch.int32 or work.device != q.device:
        raise ValueError(f"work must be int32 [W, 4] on {q.device}; got {work.dtype} {tuple(work.shape)} on {work.device}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("q, k, v need a contiguous last dim")
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = torch.empty_like(q)
    if work.shape[0] == 0 or q.shape[0] == 0:
        return out
    work = work.contiguous()
    block_d = max(16, triton.next_power_of_2(head_dim))
    d_main, d_tail = head_dim_split(head_dim, min_tail) if split_scores else (block_d, 0)
    grid = (work.shape[0], q.shape[1])
    with on_device_of(q):
        _work_list_attention_kernel[grid](
            q, k, v, out, work,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            scale * math.log2(math.e),
            HEAD_DIM=head_dim,
            D_MAIN=d_main,
            D_TAIL=d_tail,
            BLOCK_D=block_d,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            INPUT_PRECISION="ieee" if q.dtype == torch.float32 or _INTERPRETED else "tf32",
            UPCAST=_INTERPRETED and q.dtype != torch.float32,
            INTERPRETED=_INTERPRETED,
            **{name: value for name, value in (("num_warps", num_warps), ("num_stages", num_stages)) if value is not None},
        )
    return out
