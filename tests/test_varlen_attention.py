"""Tests of ``torch.ops.kimi_cg.varlen_attention`` (kimi_cg/ops/varlen_attention.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import kimi_cg.ops  # noqa: F401  (registers torch.ops.kimi_cg.*)
from kimi_cg.ops.varlen_attention import varlen_attention_reference

HEADS, HEAD_DIM = 3, 24

SEGMENTATIONS = {
    "single": [13],
    "single_token": [1],
    "all_length_one": [1, 1, 1, 1],
    "mixed": [3, 1, 7, 1, 5],
    "with_empty": [4, 0, 6],
    "long_and_short": [33, 2],
}


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _make_qkv(total: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(total, HEADS, HEAD_DIM, generator=generator).to(dtype).to(device) for _ in range(3))


def _naive_attention(q, k, v, cu_seqlens, compute_dtype: torch.dtype) -> torch.Tensor:
    """softmax(Q K^T * scale) V per segment, written out, in compute_dtype."""
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * scale
        probabilities = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probabilities, v[start:end])
    return out


def _max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return (actual.double() - reference.double()).abs().max().item()


# The dtype rule: error against the float64 reference at most 2x that of the naive attention
# computed in the same dtype, plus a floor of a fraction of a unit in the last place at 1.0.
@pytest.mark.parametrize("dtype, floor", [(torch.float32, 1e-6), (torch.bfloat16, 2**-9)])
@pytest.mark.parametrize("segmentation", list(SEGMENTATIONS))
def test_cpu_op_matches_naive_attention(segmentation, dtype, floor):
    lengths = SEGMENTATIONS[segmentation]
    cu_seqlens = _cu_seqlens(lengths)
    q, k, v = _make_qkv(sum(lengths), dtype, seed=len(lengths))

    out = torch.ops.kimi_cg.varlen_attention(q, k, v, cu_seqlens, max(lengths))

    assert out.shape == q.shape and out.dtype == dtype
    reference = _naive_attention(q, k, v, cu_seqlens, torch.float64)
    plain = _naive_attention(q, k, v, cu_seqlens, dtype)
    assert _max_error(out, reference) <= 2 * _max_error(plain, reference) + floor


def test_tokens_attend_only_inside_their_segment():
    # Changing one segment's keys and values must leave every other segment's output unchanged.
    lengths = [3, 4, 2]
    cu_seqlens = _cu_seqlens(lengths)
    q, k, v = _make_qkv(sum(lengths), torch.float32, seed=0)
    out = torch.ops.kimi_cg.varlen_attention(q, k, v, cu_seqlens, 4)

    k2, v2 = k.clone(), v.clone()
    k2[3:7] += 1.0
    v2[3:7] -= 2.0
    out2 = torch.ops.kimi_cg.varlen_attention(q, k2, v2, cu_seqlens, 4)

    torch.testing.assert_close(out2[:3], out[:3], atol=0, rtol=0)
    torch.testing.assert_close(out2[7:], out[7:], atol=0, rtol=0)
    assert not torch.allclose(out2[3:7], out[3:7])


def test_length_one_segment_returns_its_value():
    # A token alone in its segment has softmax weight 1 on itself.
    q, k, v = _make_qkv(3, torch.float32, seed=1)
    out = torch.ops.kimi_cg.varlen_attention(q, k, v, _cu_seqlens([1, 1, 1]), 1)
    torch.testing.assert_close(out, v, atol=1e-6, rtol=1e-6)


def _valid_inputs():
    q, k, v = _make_qkv(6, torch.float32, seed=2)
    return [q, k, v, _cu_seqlens([2, 4])]


@pytest.mark.parametrize(
    "position, bad_value, message",
    [
        (0, lambda t: t[:, 0], "one shape"),
        (1, lambda t: t[:5], "one shape"),
        (2, lambda t: t[..., :8], "one shape"),
        (3, lambda t: t.view(1, -1), "1-D with at least 2 entries"),
        (3, lambda t: t[:1], "1-D with at least 2 entries"),
        (3, lambda t: t + 1, "start at 0"),
        (3, lambda t: torch.tensor([0, 2, 5], dtype=torch.int32), "end at L=6"),
        (3, lambda t: torch.tensor([0, 4, 2, 6], dtype=torch.int32), "non-decreasing"),
    ],
)
def test_invalid_inputs_raise_value_error(position, bad_value, message):
    inputs = _valid_inputs()
    inputs[position] = bad_value(inputs[position])
    with pytest.raises(ValueError, match=message):
        torch.ops.kimi_cg.varlen_attention(*inputs, 6)
    with pytest.raises(ValueError, match=message):
        varlen_attention_reference(*inputs)


def test_opcheck():
    q, k, v = _make_qkv(9, torch.float32, seed=3)
    torch.library.opcheck(torch.ops.kimi_cg.varlen_attention.default, (q, k, v, _cu_seqlens([4, 5]), 5))


def test_compile_fullgraph_uses_fake_impl():
    lengths = [5, 1, 3]
    cu_seqlens = _cu_seqlens(lengths)
    q, k, v = _make_qkv(sum(lengths), torch.float32, seed=4)

    def attention_block(q, k, v, cu_seqlens):
        out = torch.ops.kimi_cg.varlen_attention(q * 0.5, k, v, cu_seqlens, 5)
        return out.flatten(1) + 1.0

    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True, backend="eager")
    result = compiled(q, k, v, cu_seqlens)

    assert result.shape == (sum(lengths), HEADS * HEAD_DIM)
    torch.testing.assert_close(result, attention_block(q, k, v, cu_seqlens), atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("segmentation", ["single", "mixed", "all_length_one", "long_and_short"])
def test_cuda_op_matches_cpu_op(segmentation):
    # The CUDA kernels take half precision only; compare in bfloat16 with the dtype rule against
    # the float64 reference, so both paths are held to the same standard.
    lengths = SEGMENTATIONS[segmentation]
    cu_seqlens = _cu_seqlens(lengths)
    q, k, v = _make_qkv(sum(lengths), torch.bfloat16, seed=5)
    true_max = max(lengths)

    cpu_out = torch.ops.kimi_cg.varlen_attention(q, k, v, cu_seqlens, true_max)
    cuda_inputs = [t.cuda() for t in (q, k, v, cu_seqlens)]
    cuda_out = torch.ops.kimi_cg.varlen_attention(*cuda_inputs, true_max)
    # The CUDA-graph runtime passes its bucket capacity, not the true maximum.
    cuda_out_upper_bound = torch.ops.kimi_cg.varlen_attention(*cuda_inputs, true_max + 61)

    assert cuda_out.device.type == "cuda" and cuda_out.shape == q.shape and cuda_out.dtype == q.dtype
    reference = _naive_attention(q, k, v, cu_seqlens, torch.float64)
    plain_error = _max_error(_naive_attention(q, k, v, cu_seqlens, torch.bfloat16), reference)
    assert _max_error(cuda_out.cpu(), reference) <= 2 * plain_error + 2**-9
    # Two units in the last place of bfloat16 (2**-7 relative each), near zero an absolute 2**-7.
    torch.testing.assert_close(cuda_out.cpu(), cpu_out, atol=2**-7, rtol=2**-6)
    torch.testing.assert_close(cuda_out_upper_bound, cuda_out, atol=2**-7, rtol=2**-6)


@pytest.mark.parametrize("lengths", [[5], [3, 0, 7, 1], [1, 1, 1], [16, 4, 9]])
def test_masked_path_matches_per_segment_reference(lengths):
    """fp32 on CUDA runs the block-diagonal masked SDPA (no host read, capturable); same numbers."""
    from kimi_cg.ops.varlen_attention import varlen_attention_masked, varlen_attention_reference

    generator = torch.Generator().manual_seed(len(lengths))
    total = sum(lengths)
    q, k, v = (torch.randn(total, 2, 8, generator=generator) for _ in range(3))
    cu_seqlens = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32)
    torch.testing.assert_close(varlen_attention_masked(q, k, v, cu_seqlens), varlen_attention_reference(q, k, v, cu_seqlens),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_with_host_bounds_runs_per_segment_in_bounded_memory():
    """fp32 on CUDA with cu_seqlens on the host, outside a capture: segment by segment (no [L, L] mask).
    A MoonViT3d batch of 6,912 + 13,824 rows needed 25.6 GiB on the masked path (an H100 ran out);
    per segment it stays far below, and a small case equals the masked path."""
    from kimi_cg.ops.varlen_attention import varlen_attention_masked

    generator = torch.Generator().manual_seed(11)
    small = torch.tensor([0, 5, 5, 17, 40], dtype=torch.int32)
    q, k, v = (torch.randn(40, 4, 72, generator=generator).cuda() for _ in range(3))
    torch.testing.assert_close(torch.ops.kimi_cg.varlen_attention(q, k, v, small, 23),
                               varlen_attention_masked(q, k, v, small.cuda()), rtol=1e-5, atol=1e-5)
    bounds = torch.tensor([0, 6912, 20736], dtype=torch.int32)
    q, k, v = (torch.randn(20736, 16, 72, device="cuda") for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = torch.ops.kimi_cg.varlen_attention(q, k, v, bounds, 13824)
    torch.cuda.synchronize()
    assert out.shape == q.shape and bool(torch.isfinite(out).all())
    assert torch.cuda.max_memory_allocated() - before < (2 << 30)


def _q_layouts(rows: int, heads: int, head_dim: int, generator: torch.Generator, device: str = "cpu",
               dtype: torch.dtype = torch.float32):
    """q, k, v as towers hand them to attention: contiguous, sliced out of one packed qkv, and
    [H, L, Dh] storage seen as [L, H, Dh] (dense, not contiguous)."""

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    contiguous = [randn(rows, heads, head_dim) for _ in range(3)]
    packed = randn(rows, 3, heads, head_dim).unbind(1)
    heads_first = [randn(heads, rows, head_dim).transpose(0, 1) for _ in range(3)]
    return {"contiguous": contiguous, "packed qkv": list(packed), "heads first": heads_first}


@pytest.mark.parametrize("path", ["reference", "masked"])
def test_every_path_returns_the_layout_the_fake_says(path):
    """The op's fake returns empty_like(q); Inductor asserts a custom op's real output has exactly
    those strides, so every path must return them (the masked path returned [H, L, Dh] storage seen
    as [L, H, Dh]: on CUDA in fp32 every captured call failed Inductor's stride assert and fell back)."""
    from kimi_cg.ops.varlen_attention import varlen_attention_masked

    run = {"reference": varlen_attention_reference, "masked": varlen_attention_masked}[path]
    generator = torch.Generator().manual_seed(3)
    cu_seqlens = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    for layout, (q, k, v) in _q_layouts(12, 2, 8, generator).items():
        out = run(q, k, v, cu_seqlens)
        assert out.shape == q.shape and out.stride() == torch.empty_like(q).stride(), (layout, out.stride())
        want = varlen_attention_reference(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA paths")
@pytest.mark.parametrize("dtype, rows, segments", [(torch.float32, 40, 3), (torch.bfloat16, 40, 3), (torch.bfloat16, 2048, 40)])
def test_cuda_op_returns_the_layout_the_fake_says(dtype, rows, segments):
    """fp32 (masked SDPA), bf16 few segments (flash), bf16 many segments (the work list)."""
    generator = torch.Generator().manual_seed(rows)
    bounds = sorted(torch.randint(0, rows, (segments - 1,), generator=generator).tolist())
    cu_seqlens = torch.tensor([0, *bounds, rows], dtype=torch.int32, device="cuda")
    for layout, (q, k, v) in _q_layouts(rows, 4, 64, generator, "cuda", dtype).items():
        out = torch.ops.kimi_cg.varlen_attention(q, k, v, cu_seqlens, rows)
        assert out.stride() == torch.empty_like(q).stride(), (layout, out.stride())
        want = varlen_attention_reference(*(t.float().cpu() for t in (q, k, v)), cu_seqlens.cpu())
        torch.testing.assert_close(out.float().cpu(), want, rtol=2e-2, atol=2e-2)


def test_one_segment_takes_cudnn_only_inside_an_exact_size_context(monkeypatch):
    """NOTE [one segment on cuDNN]: the gate, checked without a GPU (the dense call is stubbed): only
    a two-entry table over exactly the context's rows, half precision, a head dim cuDNN takes."""
    import sys

    module = sys.modules["kimi_cg.ops.varlen_attention"]  # (the package's name for the op shadows the module)
    calls = []
    monkeypatch.setattr(module.F, "scaled_dot_product_attention",
                        lambda q, k, v, scale=None: calls.append(q.shape) or torch.zeros_like(q))
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(24, 2, 8, generator=generator).bfloat16() for _ in range(3))  # [L, H, Dh]: head dim 8
    one, two = _cu_seqlens([24]), _cu_seqlens([10, 14])
    assert module._dense_cudnn(q, k, v, one, None) is None  # no context
    with module.dense_single_segment(23):
        assert module._dense_cudnn(q, k, v, one, None) is None  # other rows
    with module.dense_single_segment(24):
        assert module._dense_cudnn(q, k, v, two, None) is None  # two segments
        assert module._dense_cudnn(q.float(), k.float(), v.float(), one, None) is None  # fp32
        odd = [t.reshape(24, 4, 4) for t in (q, k, v)]
        assert module._dense_cudnn(*odd, one, None) is None  # head dim 4: not a multiple of 8
        with module.dense_single_segment(-1):
            assert module._dense_cudnn(q, k, v, one, None) is None  # an inner context rules
        out = module._dense_cudnn(q, k, v, one, 0.5)
    assert calls == [(1, 2, 24, 8)] and out.shape == q.shape and out.is_contiguous()
    assert module._dense_cudnn(q, k, v, one, None) is None  # the context is gone

    def refuse(*args, **kwargs):
        raise RuntimeError("No available kernel")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(module, "_CUDNN_REFUSED", set())
    with module.dense_single_segment(24):
        monkeypatch.setattr(module.F, "scaled_dot_product_attention", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):  # not a refusal: memory pressure is the runtime's to handle
            module._dense_cudnn(q, k, v, one, None)
        monkeypatch.setattr(module.F, "scaled_dot_product_attention", refuse)
        assert module._dense_cudnn(q, k, v, one, None) is None  # refused: flash runs it, and cuDNN is not asked again
        assert module._CUDNN_REFUSED == {(8, torch.bfloat16)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, heads, head_dim", [(17, 16, 72), (1000, 16, 72), (3500, 16, 80), (1024, 12, 128)])
def test_cuda_one_segment_on_cudnn_matches_the_reference(rows, heads, head_dim):
    import sys

    module = sys.modules["kimi_cg.ops.varlen_attention"]
    generator = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(rows, heads, head_dim, generator=generator).bfloat16() for _ in range(3))
    cu_seqlens = _cu_seqlens([rows])
    reference = _naive_attention(q, k, v, cu_seqlens, torch.float64)
    plain_error = _max_error(_naive_attention(q, k, v, cu_seqlens, torch.bfloat16), reference)
    with module.dense_single_segment(rows):
        dense = module._dense_cudnn(q.cuda(), k.cuda(), v.cuda(), cu_seqlens.cuda(), None)
        through_op = torch.ops.kimi_cg.varlen_attention(q.cuda(), k.cuda(), v.cuda(), cu_seqlens.cuda(), rows)
    assert dense is not None and dense.is_contiguous() and dense.shape == q.shape
    assert _max_error(dense.cpu(), reference) <= 2 * plain_error + 2**-9
    assert torch.equal(through_op, dense)
