"""Packed variable-length attention as one custom op: ``torch.ops.kimi_cg.varlen_attention``.

    q, k, v:     [L, H, Dh]   (L = total tokens of all segments, packed back to back)
    cu_seqlens:  [S + 1] int32, cu_seqlens[0] == 0, cu_seqlens[-1] == L, non-decreasing
    max_seqlen:  int, an upper bound on the longest segment (only the CUDA kernels use it)
    scale:       softmax scale, None for 1/sqrt(Dh)
    returns      [L, H, Dh]; token i attends to every token of its own segment (no causal mask)

Implementations, chosen by the device of ``q``:
- CPU: scaled-dot-product attention per segment (the reference semantics).
- CUDA: many short segments (window attention, a bucket's dense segment table) run kimi_cg's
  work-list kernel (NOTE [work list or flash]); one segment inside an exact-size graph runs cuDNN's
  dense attention (NOTE [one segment on cuDNN]); the rest flash-attn's ``flash_attn_varlen_func``
  when that package imports, else ``torch.nn.attention.varlen.varlen_attn`` (torch's flash kernel).
- Meta/fake: an empty tensor shaped like ``q``, so dynamo and Inductor can trace calls.

The op is opaque to Inductor (it schedules around it) and capturable in a CUDA graph as long as
``max_seqlen`` is a fixed upper bound: the CUDA-graph runtime passes the bucket capacity.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_LIBRARY_NAMESPACE = "kimi_cg"


@functools.lru_cache(maxsize=1)
def _flash_attn_varlen_func():
    """flash-attn's varlen kernel, or None when the optional package is absent."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    logger.info("kimi_cg.varlen_attention: using flash-attn's flash_attn_varlen_func on CUDA")
    return flash_attn_varlen_func


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"varlen_attention expects q, k, v of one shape [L, H, Dh]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries; got shape {tuple(cu_seqlens.shape)}")


def varlen_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """Per-segment softmax attention, computed segment by segment with SDPA (the CPU path). ``fused``:
    each segment as a batch of one ([1, H, n, Dh]: SDPA's fused kernels take 4-D inputs only), so CUDA
    runs fp32 on its memory-efficient kernel instead of materialising [H, n, n] scores."""
    check_varlen_inputs(q, k, v, cu_seqlens)
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"cu_seqlens must start at 0, end at L={q.shape[0]} and be non-decreasing; got {bounds}"
        )
    out = torch.empty_like(q)
    for start, end in zip(bounds, bounds[1:]):
        if end == start:
            continue
        # [n, H, Dh] -> [H, n, Dh] for SDPA, and back.
        inputs = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        if fused:
            inputs = [t.unsqueeze(0) for t in inputs]
        segment = F.scaled_dot_product_attention(*inputs, scale=scale)
        out[start:end] = (segment[0] if fused else segment).transpose(0, 1)
    return out


def varlen_attention_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Per-segment attention as one SDPA under a block-diagonal mask made on the device: no host
    read of cu_seqlens, so a CUDA graph can capture it (fp32 on CUDA, which flash kernels do not
    take). The [L, L] mask makes it a path for references and tests, not for serving sizes."""
    check_varlen_inputs(q, k, v, cu_seqlens)
    rows = torch.arange(q.shape[0], device=q.device)
    # Row r belongs to segment i when cu_seqlens[i] <= r < cu_seqlens[i + 1].
    segment = torch.searchsorted(cu_seqlens.to(device=q.device, dtype=torch.int64)[1:].contiguous(), rows, right=True)
    mask = segment[:, None] == segment[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
    return in_fake_layout(out.transpose(0, 1), q)


def in_fake_layout(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``out`` with the strides of the op's fake, ``empty_like(q)``: Inductor asserts that a custom
    op's real output has the strides its fake gave, so a path whose kernel returns another layout
    (SDPA's [H, L, Dh] storage seen as [L, H, Dh]) is copied; a matching one is returned as is."""
    if out.is_contiguous() and q.is_contiguous():
        return out
    like = torch.empty_like(q)
    return out if out.stride() == like.stride() else like.copy_(out)


# NOTE [work list or flash]
# Flash kernels launch (segments x max_seqlen / 128) query blocks; in a CUDA-graph bucket max_seqlen
# is the bucket's capacity, so a table of hundreds of windows launches hundreds of thousands of empty
# blocks. The work-list kernel (kernels/varlen_attention.py) launches one block per 64 rows of each
# segment, planned on the device from the boundaries (no host read, so it is captured and replayed
# with the boundaries a replay holds). On the H200 (graph-timed, docs/benchmarks.md, 2026-12-04) it ran
# Qwen2.5-VL's windows 22x faster than flash on the bucket and as fast as flash on exact segments, but
# whole images (a few long segments) 1.8x slower than flash on the bucket. So the choice is
# made from shapes alone (the same for every replay of a bucket): many segments of few rows on
# average take the work list, the rest flash. A bucket's item table (max_items + 1 = 33 segments by
# default) stays on flash; a dense table (NOTE [segment tables] in kimi_cg/runtime/graphs.py: a
# segment per 16 rows) takes the work list from buckets of 512 rows up.
WORK_LIST_MIN_SEGMENTS = 64
WORK_LIST_MAX_MEAN_ROWS = 32


def prefers_work_list(rows: int, segments: int) -> bool:
    """NOTE [work list or flash]: whether ``segments`` boundaries over ``rows`` rows run the work list."""
    return segments >= WORK_LIST_MIN_SEGMENTS and rows <= WORK_LIST_MAX_MEAN_ROWS * segments


def varlen_attention_work_list(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Varlen attention through the work-list kernel, planned on ``q``'s device from ``cu_seqlens``
    (Triton; on CPU tensors only under TRITON_INTERPRET=1). ``cu_seqlens[-1]`` must be L."""
    from kimi_cg.kernels.varlen_attention import plan_work_list_on_device, work_list_attention, work_list_capacity

    check_varlen_inputs(q, k, v, cu_seqlens)
    segments = cu_seqlens.numel() - 1
    work = plan_work_list_on_device(cu_seqlens.to(q.device), work_list_capacity(q.shape[0], segments))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return work_list_attention(q, k, v, work, scale)


# NOTE [one segment on cuDNN]
# On the H200 (torch 2.11, cuDNN 9.19; docs/benchmarks.md, 2026-12-04) SDPA's cuDNN backend on one
# dense segment [1, H, L, Dh] takes 0.55-0.71x the time of torch's flash kernel on the same rows, and
# a CUDA graph captures it. But its first call at each new L builds a cuDNN plan (~80 ms, at every
# head dim and size tried), and its packed-segment form builds one per call. So it runs only where a
# size repeats by construction: while the CUDA-graph runtime prepares an exact-size graph of a
# one-item call (NOTE [exact-size graphs] in kimi_cg/runtime/graphs.py), which builds the plan in its
# warm-up runs and then replays the captured kernels. The runtime says so with
# ``dense_single_segment(rows)``; the op then takes cuDNN only for a table of one segment over
# exactly those rows (cu_seqlens [0, L] by the op's contract), in fp16/bf16, at a head dim cuDNN
# takes; anything else, or a cuDNN that refuses the call, runs the paths below.
_DENSE = threading.local()
_CUDNN_REFUSED: set = set()  # (head dim, dtype) cuDNN refused once: not asked again


class dense_single_segment:
    """Context: one-segment attentions over ``rows`` rows may run cuDNN's dense kernel (NOTE [one
    segment on cuDNN]). Only the CUDA-graph runtime's exact-size graphs set it."""

    def __init__(self, rows: int):
        self.rows = rows

    def __enter__(self):
        self.previous = getattr(_DENSE, "rows", None)
        _DENSE.rows = self.rows

    def __exit__(self, *exc):
        _DENSE.rows = self.previous


# Segment-length bounds (NOTE [segment-length classes] in kimi_cg/runtime/graphs.py): the CUDA-graph
# runtime captures a bucket of C rows also at shorter bounds B and replays the one that holds the
# call's longest segment. While it captures or runs such a graph it says so with
# ``longest_segment_bound(C, B)``; flash calls over C rows then take min(max_seqlen, B). Flash with a
# max_seqlen below a segment's length would leave that segment's later rows unwritten, so the bound
# is the runtime's promise; on a CPU table (the tests' padded path) the op checks it and raises.
_BOUND = threading.local()


class longest_segment_bound:
    """Context: every segment of the tables of attentions over ``rows`` rows is at most ``bound``
    rows long (NOTE [segment-length classes]). Only the CUDA-graph runtime sets it."""

    def __init__(self, rows: int, bound: int):
        self.rows, self.bound = rows, bound

    def __enter__(self):
        self.previous = getattr(_BOUND, "value", None)
        _BOUND.value = (self.rows, self.bound)

    def __exit__(self, *exc):
        _BOUND.value = self.previous


def _bounded_max_seqlen(q: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> int:
    """``max_seqlen``, lowered to the runtime's promised bound for attentions over q's rows (NOTE
    [segment-length classes]); on a CPU table the promise is checked."""
    rows, bound = getattr(_BOUND, "value", None) or (None, None)
    if rows != q.shape[0]:
        return max_seqlen
    if cu_seqlens.device.type == "cpu" and cu_seqlens.numel() > 1:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if longest > bound:
            raise RuntimeError(f"kimi_cg internal error: a segment of {longest} rows in a graph whose segments were "
                               f"promised to be at most {bound} rows (NOTE [segment-length classes])")
    return min(max_seqlen, bound)


def _dense_cudnn(q, k, v, cu_seqlens, scale):
    """cuDNN's dense attention over all of q's rows when NOTE [one segment on cuDNN] allows it, else None."""
    head_dim = q.shape[-1]
    if (getattr(_DENSE, "rows", None) != q.shape[0] or cu_seqlens.numel() != 2
            or q.dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 128
            or (head_dim, q.dtype) in _CUDNN_REFUSED):
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), scale=scale
            )
    except torch.OutOfMemoryError:
        raise  # not a refusal: the runtime's memory-pressure handling decides (NOTE [memory pressure])
    except RuntimeError as error:  # no cuDNN kernel for these inputs (its version, layout): flash runs them
        _CUDNN_REFUSED.add((head_dim, q.dtype))
        logger.info("kimi_cg.varlen_attention: cuDNN refused head dim %d %s (%s); flash runs it", head_dim, q.dtype,
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None
    return out[0].transpose(0, 1).contiguous()  # [L, H, Dh], contiguous like the fake's empty_like(q)


@functools.lru_cache(maxsize=1)
def _torch_varlen_takes_scale() -> bool:
    """Whether this torch's ``varlen_attn`` has a ``scale`` argument (later versions do)."""
    from torch.nn.attention.varlen import varlen_attn

    return "scale" in inspect.signature(varlen_attn).parameters


@torch.library.custom_op(f"{_LIBRARY_NAMESPACE}::varlen_attention", mutates_args=())
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:
    return in_fake_layout(_varlen_attention_on_a_path(q, k, v, cu_seqlens, max_seqlen, scale), q)


def _varlen_attention_on_a_path(q, k, v, cu_seqlens, max_seqlen, scale):
    max_seqlen = _bounded_max_seqlen(q, cu_seqlens, max_seqlen)  # NOTE [segment-length classes]
    if q.device.type != "cuda":
        return varlen_attention_reference(q, k, v, cu_seqlens, scale)
    if prefers_work_list(q.shape[0], cu_seqlens.numel() - 1):  # NOTE [work list or flash]
        return varlen_attention_work_list(q, k, v, cu_seqlens, scale)
    if q.dtype not in (torch.float16, torch.bfloat16):
        # Flash kernels take fp16/bf16 only. fp32 on CUDA with the bounds on the host and nothing being
        # captured (an eager fp32 tower, a test's reference) runs segment by segment: SDPA's memory-efficient
        # kernel, no [L, L] mask (a 20,736-row video batch needed 25.6 GiB masked). Otherwise masked SDPA
        # (capturable; a path for references and tests).
        if cu_seqlens.device.type == "cpu" and not torch.cuda.is_current_stream_capturing():
            return varlen_attention_reference(q, k, v, cu_seqlens, scale, fused=True)
        return varlen_attention_masked(q, k, v, cu_seqlens, scale)
    check_varlen_inputs(q, k, v, cu_seqlens)
    dense = _dense_cudnn(q, k, v, cu_seqlens, scale)  # NOTE [one segment on cuDNN]
    if dense is not None:
        return dense
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    flash_varlen = _flash_attn_varlen_func()
    if flash_varlen is not None:
        return flash_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=False, softmax_scale=scale)
    from torch.nn.attention.varlen import varlen_attn

    if scale is None:
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    if _torch_varlen_takes_scale():
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale)
    # softmax(q k^T * scale) == softmax((q * scale * sqrt(Dh)) k^T / sqrt(Dh))
    return varlen_attn(q * (scale * math.sqrt(q.shape[-1])), k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)


@varlen_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale=None):
    return torch.empty_like(q)
