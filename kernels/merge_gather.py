"""Weighted row gather ("merge gather"), optionally fused with a LayerNorm over each output row.

    x:       [L, D]  float32 / bfloat16 / float16, one row per patch
    index:   [R, K]  int64 or int32; an entry >= 0 is a row of x, -1 means "no contribution"
    weight:  [R, K]  float32
    out:     [R, D]  x.dtype
    out[r, :] = sum over k with index[r, k] >= 0 of weight[r, k] * x[index[r, k], :]

The sum is accumulated in float32 and cast to x.dtype once. The fused variant applies
LayerNorm(D) with ln_weight [D], ln_bias [D] to each float32 row before that single cast.

This is the patch merger of a vision tower written as data: K=1 with weight 1 is a pure gather
(bit-exact, equal to x[index[:, 0]]); K=t with weight 1/t is the mean over t video frames.

NOTE [skipped entries never touch memory]
An entry with index -1 (or, for memory safety, an index >= L) is skipped by masking the load
itself, never by multiplying a loaded row by 0: rows of x that no output refers to may hold
garbage such as NaN (padding of a CUDA-graph bucket), and 0 * NaN is NaN. Out-of-range indices are
a caller error: the kernels read nothing for them, the PyTorch references raise IndexError.
The first valid contribution initialises the accumulator (no `0.0 + w * x`), so K=1, weight 1
reproduces x bit for bit, signed zeros included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kimi_cg.kernels import FLOAT_DTYPES, on_device_of


# The plain gather loops over D in chunks of at most this many columns: wide enough to keep the
# loads vectorised, small enough that D=1152 wastes only one partial chunk.
_MAX_GATHER_BLOCK_SIZE = 512


@triton.jit
def _merge_gather_kernel(
    x_ptr,
    x_row_stride,
    index_ptr,
    index_row_stride,
    weight_ptr,
    weight_row_stride,
    out_ptr,
    out_row_stride,
    n_x_rows,
    n_cols: tl.constexpr,
    K: tl.constexpr,
    OUTER: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # OUTER 0: the K terms as listed. OUTER > 0: the terms are the pairs (i, j) of the first OUTER
    # entries and the other K - OUTER, row index[i] + index[OUTER + j], weight weight[i] * weight[OUTER + j]
    # (a table's bicubic resize as 4 row taps by 4 column taps, NOTE [table gathers]).
    # One program per output row; int64 so that row * stride cannot overflow for R * D >= 2**31.
    # n_cols (D) is a constexpr: it is fixed per model, so specialising costs one compile, lets the
    # column loop unroll, and keeps `range` off a runtime scalar, which Triton 3.6's interpreter
    # cannot turn into a Python int under NumPy >= 2.4.
    row = tl.program_id(0).to(tl.int64)
    index_row_ptr = index_ptr + row * index_row_stride
    weight_row_ptr = weight_ptr + row * weight_row_stride
    out_row_ptr = out_ptr + row * out_row_stride

    for col_start in range(0, n_cols, BLOCK_SIZE):
        cols = col_start + tl.arange(0, BLOCK_SIZE)
        col_mask = cols < n_cols
        # has_contribution: whether acc already holds a term (see NOTE [skipped entries ...]).
        # K >= 1 here (the host handles K == 0), so the k == 0 step always defines both.
        for k in tl.static_range(K if OUTER == 0 else OUTER * (K - OUTER)):
            if OUTER == 0:
                source_row = tl.load(index_row_ptr + k).to(tl.int64)
                source_weight = tl.load(weight_row_ptr + k).to(tl.float32)
            else:
                first = tl.load(index_row_ptr + k // (K - OUTER)).to(tl.int64)
                second = tl.load(index_row_ptr + OUTER + k % (K - OUTER)).to(tl.int64)
                source_row = tl.where((first >= 0) & (second >= 0), first + second, -1)
                source_weight = tl.load(weight_row_ptr + k // (K - OUTER)).to(tl.float32) * tl.load(
                    weight_row_ptr + OUTER + k % (K - OUTER)
                ).to(tl.float32)
            valid = (source_row >= 0) & (source_row < n_x_rows)
            values = tl.load(
                x_ptr + source_row * x_row_stride + cols, mask=col_mask & valid, other=0.0
            ).to(tl.float32)
            term = tl.where(valid, values * source_weight, 0.0)
            if k == 0:
                acc = term
                has_contribution = valid
            else:
                acc = tl.where(has_contribution, acc + term, term)
                has_contribution = has_contribution | valid
        tl.store(out_row_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _merge_gather_layernorm_kernel(
    x_ptr,
    x_row_stride,
    index_ptr,
    index_row_stride,
    weight_ptr,
    weight_row_stride,
    ln_weight_ptr,
    ln_bias_ptr,
    out_ptr,
    out_row_stride,
    n_x_rows,
    n_cols: tl.constexpr,
    eps,
    K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per output row; the whole row (BLOCK_SIZE >= D) stays in registers between the
    # gather and the normalisation, so x is read once and out written once.
    row = tl.program_id(0).to(tl.int64)
    index_row_ptr = index_ptr + row * index_row_stride
    weight_row_ptr = weight_ptr + row * weight_row_stride
    out_row_ptr = out_ptr + row * out_row_stride

    cols = tl.arange(0, BLOCK_SIZE)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    for k in tl.static_range(K):
        source_row = tl.load(index_row_ptr + k).to(tl.int64)
        source_weight = tl.load(weight_row_ptr + k).to(tl.float32)
        valid = (source_row >= 0) & (source_row < n_x_rows)
        values = tl.load(
            x_ptr + source_row * x_row_stride + cols, mask=col_mask & valid, other=0.0
        ).to(tl.float32)
        acc += tl.where(valid, values * source_weight, 0.0)

    # Columns beyond D hold 0 in acc but must not count in the variance: mask the centred values.
    mean = tl.sum(acc, axis=0) / n_cols
    centred = tl.where(col_mask, acc - mean, 0.0)
    variance = tl.sum(centred * centred, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(variance + eps)
    ln_weight = tl.load(ln_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    ln_bias = tl.load(ln_bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    normalised = centred * rstd * ln_weight + ln_bias
    tl.store(out_row_ptr + cols, normalised.to(out_ptr.dtype.element_ty), mask=col_mask)


def _check_merge_gather_inputs(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"merge_gather expects x of shape [L, D]; got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"merge_gather expects x in float32, bfloat16 or float16; got {x.dtype}")
    if index.dim() != 2:
        raise ValueError(f"merge_gather expects index of shape [R, K]; got {tuple(index.shape)}")
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"merge_gather expects an int64 or int32 index; got {index.dtype}")
    if weight.shape != index.shape:
        raise ValueError(
            f"merge_gather expects weight shaped like index {tuple(index.shape)}; got {tuple(weight.shape)}"
        )
    if weight.dtype != torch.float32:
        raise ValueError(f"merge_gather expects a float32 weight; got {weight.dtype}")
    if index.device != x.device or weight.device != x.device:
        raise ValueError(
            f"merge_gather expects x, index and weight on one device; got {x.device}, {index.device}, "
            f"{weight.device}"
        )


def _check_layernorm_inputs(
    x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float
) -> None:
    hidden = x.shape[1]
    for name, tensor in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if tensor.shape != (hidden,):
            raise ValueError(f"merge_gather_layernorm expects {name} of shape [{hidden}]; got {tuple(tensor.shape)}")
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"merge_gather_layernorm expects a floating {name}; got {tensor.dtype}")
        if tensor.device != x.device:
            raise ValueError(f"merge_gather_layernorm expects {name} on {x.device}; got {tensor.device}")
    if not eps > 0:
        raise ValueError(f"merge_gather_layernorm expects eps > 0; got {eps}")


def _num_warps(block_size: int) -> int:
    if block_size >= 2048:
        return 8
    if block_size >= 512:
        return 4
    return 2


def _output_buffer(x: torch.Tensor, n_rows: int, out: torch.Tensor | None) -> torch.Tensor:
    """A fresh [R, D] output, or the caller's buffer (e.g. a CUDA graph's static output) checked."""
    shape = (n_rows, x.shape[1])
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.shape != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {x.dtype} tensor of shape {list(shape)} on {x.device}; got "
            f"{out.dtype} {list(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )
    return out


def merge_gather(
    x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, *, outer: int = 0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton weighted row gather: [L, D], [R, K], [R, K] -> [R, D] in x.dtype; ``outer`` > 0 pairs the
    first ``outer`` entries of a row with the others (the kernel's OUTER).

    Every element of ``out`` is written, also for rows whose entries are all -1 (zeros).
    """
    _check_merge_gather_inputs(x, index, weight)
    if outer < 0 or outer and outer >= index.shape[1]:
        raise ValueError(f"merge_gather's outer must be in [0, K) for K={index.shape[1]}; got {outer}")
    x, index, weight = x.contiguous(), index.contiguous(), weight.contiguous()
    n_rows, n_terms = index.shape
    hidden = x.shape[1]
    out = _output_buffer(x, n_rows, out)
    if out.numel() == 0:
        return out
    if n_terms == 0:
        return out.zero_()
    block_size = min(triton.next_power_of_2(hidden), _MAX_GATHER_BLOCK_SIZE)
    with on_device_of(x):
        _merge_gather_kernel[(n_rows,)](
            x,
            x.stride(0),
            index,
            index.stride(0),
            weight,
            weight.stride(0),
            out,
            out.stride(0),
            x.shape[0],
            hidden,
            K=n_terms,
            OUTER=outer,
            BLOCK_SIZE=block_size,
            num_warps=_num_warps(block_size),
        )
    return out


def merge_gather_layernorm(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton weighted row gather followed by LayerNorm over D, in float32, stored in x.dtype."""
    _check_merge_gather_inputs(x, index, weight)
    _check_layernorm_inputs(x, ln_weight, ln_bias, eps)
    x, index, weight = x.contiguous(), index.contiguous(), weight.contiguous()
    ln_weight, ln_bias = ln_weight.contiguous(), ln_bias.contiguous()
    n_rows, n_terms = index.shape
    hidden = x.shape[1]
    out = _output_buffer(x, n_rows, out)
    if out.numel() == 0:
        return out
    # The whole row must fit one block: LayerNorm needs the full row's statistics.
    block_size = triton.next_power_of_2(hidden)
    with on_device_of(x):
        _merge_gather_layernorm_kernel[(n_rows,)](
            x,
            x.stride(0),
            index,
            index.stride(0),
            weight,
            weight.stride(0),
            ln_weight,
            ln_bias,
            out,
            out.stride(0),
            x.shape[0],
            hidden,
            float(eps),
            K=n_terms,
            BLOCK_SIZE=block_size,
            num_warps=_num_warps(block_size),
        )
    return out


def _merge_gather_float32(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weighted gather in float32, [R, D]; skipped entries are never read as data."""
    valid = index >= 0
    # [R, K] -> [R, K, D]; index 0 stands in for skipped entries and is discarded by the where.
    gathered = x[torch.where(valid, index, 0)].float()
    terms = torch.where(valid.unsqueeze(-1), gathered * weight.unsqueeze(-1), 0.0)
    if index.shape[1] == 0:
        return terms.sum(dim=1)
    # Sum term by term (not .sum(dim=1)) so K=1 returns the single term unchanged, -0.0 included.
    out = terms[:, 0]
    for k in range(1, index.shape[1]):
        out = out + terms[:, k]
    return out


def merge_gather_reference(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch weighted row gather (the CPU path and the tests' reference)."""
    _check_merge_gather_inputs(x, index, weight)
    return _merge_gather_float32(x, index, weight).to(x.dtype)


def merge_gather_layernorm_reference(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Plain PyTorch weighted row gather then LayerNorm over D, in float32, returned in x.dtype."""
    _check_merge_gather_inputs(x, index, weight)
    _check_layernorm_inputs(x, ln_weight, ln_bias, eps)
    merged = _merge_gather_float32(x, index, weight)
    normalised = F.layer_norm(merged, (x.shape[1],), ln_weight.float(), ln_bias.float(), eps)
    return normalised.to(x.dtype)
