"""Tests of the Triton merge-gather kernels (kernels/merge_gather.py), the bicubic resize kernel
(kernels/resize.py) and their custom ops.

Without CUDA the kernels run on CPU tensors through Triton's interpreter: TRITON_INTERPRET must be
set before the kernel module is imported, because @triton.jit picks the interpreter when it
decorates a kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed; the merge-gather kernels need it")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kimi_cg.ops  # noqa: E402,F401  (registers torch.ops.kimi_cg.*)
import torch.nn.functional as F  # noqa: E402

from kimi_cg.kernels import resize as resize_kernel  # noqa: E402
from kimi_cg.kernels.merge_gather import (  # noqa: E402
    merge_gather,
    merge_gather_layernorm,
    merge_gather_layernorm_reference,
    merge_gather_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYERNORM_EPS = 1e-6

HIDDEN_SIZES = [64, 72, 100, 1152]
ROW_COUNTS = [1, 7, 33]
TERM_COUNTS = [1, 2, 3, 4]

# Weighted sums against the reference: both accumulate in float32 in the same order and cast once,
# so they agree to float32 rounding (a GPU may contract a * b + c into one FMA) and, after the
# cast, to one unit in the last place of the output dtype: 2**-7 relative for bfloat16, 2**-10 for
# float16. atol only covers sums that cancel to nearly zero.
MERGE_TOLERANCES = [
    (torch.float32, 1e-6, 1e-5),
    (torch.bfloat16, 1e-5, 8e-3),
    (torch.float16, 1e-5, 1e-3),
]


def _make_inputs(
    n_source_rows: int,
    hidden: int,
    n_rows: int,
    n_terms: int,
    dtype: torch.dtype,
    seed: int,
    skip_fraction: float = 0.25,
    device: str = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [L, D] unit-normal, index [R, K] with about skip_fraction entries -1, weight [R, K] in (0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n_source_rows, hidden, generator=generator).to(dtype)
    index = torch.randint(0, n_source_rows, (n_rows, n_terms), generator=generator)
    skipped = torch.rand(n_rows, n_terms, generator=generator) < skip_fraction
    index = torch.where(skipped, -1, index)
    weight = 1.0 - torch.rand(n_rows, n_terms, generator=generator)
    return x.to(device), index.to(device), weight.to(device)


def _layernorm_params(hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 1)
    ln_weight = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
    ln_bias = 0.1 * torch.randn(hidden, generator=generator)
    return ln_weight.to(dtype).to(DEVICE), ln_bias.to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------------
# Pure gather (K=1, weight 1): bit-exact.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_rows", ROW_COUNTS)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_pure_gather_is_bit_exact(hidden, n_rows, dtype):
    x, index, _ = _make_inputs(40, hidden, n_rows, 1, dtype, seed=hidden * 100 + n_rows, skip_fraction=0.0)
    weight = torch.ones(n_rows, 1, device=DEVICE)

    out = merge_gather(x, index, weight)

    torch.testing.assert_close(out, x[index[:, 0]], atol=0, rtol=0)
    assert torch.equal(out.view(torch.uint8), x[index[:, 0]].view(torch.uint8))  # signed zeros too


def test_pure_gather_keeps_signed_zeros_and_skips_to_zero():
    x = torch.tensor([[-0.0, 1.5, -2.0], [3.0, -0.0, 0.0]], device=DEVICE)
    index = torch.tensor([[1], [-1], [0]], device=DEVICE)
    weight = torch.ones(3, 1, device=DEVICE)

    out = merge_gather(x, index, weight)

    expected = torch.stack([x[1], torch.zeros(3, device=DEVICE), x[0]])
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


# ---------------------------------------------------------------------------------------------
# Weighted merge (temporal mean and general weights) against the PyTorch reference.


@pytest.mark.parametrize("dtype, atol, rtol", MERGE_TOLERANCES)
@pytest.mark.parametrize("n_terms", TERM_COUNTS)
@pytest.mark.parametrize("n_rows", ROW_COUNTS)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_merge_gather_matches_reference(hidden, n_rows, n_terms, dtype, atol, rtol):
    x, index, weight = _make_inputs(50, hidden, n_rows, n_terms, dtype, seed=hidden + 7 * n_rows + n_terms)

    out = merge_gather(x, index, weight)

    assert out.shape == (n_rows, hidden) and out.dtype == dtype
    torch.testing.assert_close(out, merge_gather_reference(x, index, weight), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", MERGE_TOLERANCES)
@pytest.mark.parametrize("frames", [2, 3, 4])
def test_temporal_mean_matches_mean_over_frames(frames, dtype, atol, rtol):
    # Patch p of merged frame-group g is the mean of that patch over the group's frames.
    patches, groups, hidden = 10, 3, 72
    generator = torch.Generator().manual_seed(frames)
    x = torch.randn(groups * frames * patches, hidden, generator=generator).to(dtype).to(DEVICE)
    frame_rows = torch.arange(groups * frames * patches).view(groups, frames, patches)
    index = frame_rows.permute(0, 2, 1).reshape(groups * patches, frames).to(DEVICE)
    weight = torch.full(index.shape, 1.0 / frames, device=DEVICE)

    out = merge_gather(x, index, weight)

    expected = x.float().view(groups, frames, patches, hidden).mean(dim=1).reshape(-1, hidden)
    torch.testing.assert_close(out, expected.to(dtype), atol=atol, rtol=rtol)


def test_rows_with_every_entry_skipped_are_zero():
    x, index, weight = _make_inputs(20, 100, 9, 3, torch.float32, seed=3)
    index[::2] = -1

    out = merge_gather(x, index, weight)

    assert torch.equal(out[::2], torch.zeros_like(out[::2]))
    assert out[1::2].abs().sum() > 0


def test_empty_shapes():
    x, index, weight = _make_inputs(5, 64, 0, 2, torch.float32, seed=0)
    assert merge_gather(x, index, weight).shape == (0, 64)
    x, index, weight = _make_inputs(5, 64, 4, 0, torch.float32, seed=0)
    assert torch.equal(merge_gather(x, index, weight), torch.zeros(4, 64, device=DEVICE))
    torch.testing.assert_close(merge_gather_reference(x, index, weight), torch.zeros(4, 64, device=DEVICE))


def test_non_contiguous_inputs():
    x, index, weight = _make_inputs(30, 200, 11, 3, torch.float32, seed=5)
    x_view = x[:, 50:150]  # row stride 200, 100 columns
    index_view = index.t().contiguous().t()  # column-major [R, K]
    weight_view = weight.t().contiguous().t()

    out = merge_gather(x_view, index_view, weight_view)

    torch.testing.assert_close(out, merge_gather_reference(x_view.contiguous(), index, weight), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Fused LayerNorm.


def _max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return (actual.double() - reference.double()).abs().max().item()


# floor: for float32 the plain run *is* the reference (error 0), so the floor covers a different
# float32 reduction order; for bfloat16 and float16 it is half a unit in the last place at 1.0.
@pytest.mark.parametrize(
    "dtype, floor", [(torch.float32, 1e-5), (torch.bfloat16, 2**-8), (torch.float16, 2**-11)]
)
@pytest.mark.parametrize("n_terms", TERM_COUNTS)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_merge_gather_layernorm_error_rule(hidden, n_terms, dtype, floor):
    n_rows = 7
    x, index, weight = _make_inputs(30, hidden, n_rows, n_terms, dtype, seed=hidden * 3 + n_terms)
    ln_weight, ln_bias = _layernorm_params(hidden, dtype, seed=hidden)

    out = merge_gather_layernorm(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)

    assert out.shape == (n_rows, hidden) and out.dtype == dtype
    reference_fp32 = merge_gather_layernorm_reference(
        x.float(), index, weight, ln_weight.float(), ln_bias.float(), LAYERNORM_EPS
    )
    # Plain PyTorch in the low dtype: gather, then LayerNorm in that dtype.
    plain = torch.nn.functional.layer_norm(
        merge_gather_reference(x, index, weight), (hidden,), ln_weight, ln_bias, LAYERNORM_EPS
    )
    kernel_error = _max_error(out, reference_fp32)
    plain_error = _max_error(plain, reference_fp32)
    assert kernel_error <= 2 * plain_error + floor, (kernel_error, plain_error)


@pytest.mark.parametrize("dtype, atol, rtol", MERGE_TOLERANCES)
@pytest.mark.parametrize("hidden", [64, 100, 1152])
def test_merge_gather_layernorm_matches_reference(hidden, dtype, atol, rtol):
    # Same float32 computation and one cast: one unit in the last place at most, plus the float32
    # difference of the two reduction orders (tiny against a unit-variance output).
    x, index, weight = _make_inputs(30, hidden, 13, 3, dtype, seed=hidden)
    ln_weight, ln_bias = _layernorm_params(hidden, dtype, seed=hidden)

    out = merge_gather_layernorm(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)

    expected = merge_gather_layernorm_reference(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)
    torch.testing.assert_close(out, expected, atol=max(atol, 1e-5), rtol=rtol)


def test_merge_gather_layernorm_of_skipped_row_is_bias():
    # An all-skipped row is zero, so its normalised value is 0 and the output is the bias.
    x, index, weight = _make_inputs(10, 72, 3, 2, torch.float32, seed=1)
    index[1] = -1
    ln_weight, ln_bias = _layernorm_params(72, torch.float32, seed=1)

    out = merge_gather_layernorm(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)

    torch.testing.assert_close(out[1], ln_bias, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Poison: unreferenced rows of x, weights of skipped entries, and the output buffer.


def _poisoned_inputs(hidden: int, dtype: torch.dtype, n_terms: int):
    """x whose unreferenced rows are NaN (and a clean copy with zeros there), index, weight."""
    x, index, weight = _make_inputs(40, hidden, 9, n_terms, dtype, seed=hidden + n_terms, skip_fraction=0.4)
    index[4] = -1
    referenced = torch.zeros(x.shape[0], dtype=torch.bool, device=DEVICE)
    referenced[index[index >= 0]] = True
    assert not referenced.all(), "the test needs unreferenced rows to poison"
    poisoned_x = torch.where(referenced[:, None], x, float("nan"))
    clean_x = torch.where(referenced[:, None], x, 0.0)
    # Skipped entries hold NaN weights too: they must not be read either.
    weight = torch.where(index >= 0, weight, float("nan"))
    return poisoned_x, clean_x, index, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_terms", [1, 3])
@pytest.mark.parametrize("hidden", [64, 100])
def test_unreferenced_nan_rows_are_never_read(hidden, n_terms, dtype):
    poisoned_x, clean_x, index, weight = _poisoned_inputs(hidden, dtype, n_terms)
    ln_weight, ln_bias = _layernorm_params(hidden, dtype, seed=hidden)

    merged = merge_gather(poisoned_x, index, weight)
    normalised = merge_gather_layernorm(poisoned_x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)

    assert not merged.isnan().any()
    assert not normalised.isnan().any()
    clean_weight = torch.nan_to_num(weight, nan=0.0)
    torch.testing.assert_close(merged, merge_gather(clean_x, index, clean_weight), atol=0, rtol=0)
    torch.testing.assert_close(
        normalised,
        merge_gather_layernorm(clean_x, index, clean_weight, ln_weight, ln_bias, LAYERNORM_EPS),
        atol=0,
        rtol=0,
    )
    # The references obey the same rule.
    assert not merge_gather_reference(poisoned_x, index, weight).isnan().any()
    assert not merge_gather_layernorm_reference(
        poisoned_x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS
    ).isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 1152])
def test_poisoned_output_is_fully_overwritten(hidden, dtype):
    x, index, weight = _make_inputs(20, hidden, 8, 2, dtype, seed=hidden)
    index[2] = -1  # a row with no contribution must still be written (as zeros)
    ln_weight, ln_bias = _layernorm_params(hidden, dtype, seed=hidden)
    merged = torch.full((8, hidden), float("nan"), dtype=dtype, device=DEVICE)
    normalised = torch.full((8, hidden), float("nan"), dtype=dtype, device=DEVICE)

    merge_gather(x, index, weight, out=merged)
    merge_gather_layernorm(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS, out=normalised)

    torch.testing.assert_close(merged, merge_gather(x, index, weight), atol=0, rtol=0)
    torch.testing.assert_close(
        normalised, merge_gather_layernorm(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS), atol=0, rtol=0
    )
    assert torch.equal(merged[2], torch.zeros_like(merged[2]))


# ---------------------------------------------------------------------------------------------
# Fuzzing.

_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_TOLERANCE_BY_DTYPE = {dtype: (atol, rtol) for dtype, atol, rtol in MERGE_TOLERANCES}


@settings(deadline=None, max_examples=20)
@given(
    n_source_rows=st.integers(1, 40),
    hidden=st.integers(1, 300),
    n_rows=st.integers(0, 24),
    n_terms=st.integers(0, 4),
    dtype=st.sampled_from(_DTYPES),
    skip_fraction=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_merge_gather_fuzz(n_source_rows, hidden, n_rows, n_terms, dtype, skip_fraction, seed):
    x, index, weight = _make_inputs(n_source_rows, hidden, n_rows, n_terms, dtype, seed, skip_fraction)

    out = merge_gather(x, index, weight)

    atol, rtol = _TOLERANCE_BY_DTYPE[dtype]
    torch.testing.assert_close(out, merge_gather_reference(x, index, weight), atol=atol, rtol=rtol)
    if n_terms >= 1:
        gathered = merge_gather(x, index[:, :1], torch.ones(n_rows, 1, device=DEVICE))
        valid = index[:, :1] >= 0
        expected = torch.where(valid, x[index[:, 0].clamp(min=0)], torch.zeros((), dtype=dtype, device=DEVICE))
        torch.testing.assert_close(gathered, expected, atol=0, rtol=0)


@settings(deadline=None, max_examples=12)
@given(
    hidden=st.integers(2, 300),
    n_rows=st.integers(1, 16),
    n_terms=st.integers(1, 4),
    dtype=st.sampled_from(_DTYPES),
    seed=st.integers(0, 2**16),
)
def test_merge_gather_layernorm_fuzz(hidden, n_rows, n_terms, dtype, seed):
    x, index, weight = _make_inputs(25, hidden, n_rows, n_terms, dtype, seed)
    ln_weight, ln_bias = _layernorm_params(hidden, dtype, seed)

    out = merge_gather_layernorm(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)

    atol, rtol = _TOLERANCE_BY_DTYPE[dtype]
    expected = merge_gather_layernorm_reference(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)
    torch.testing.assert_close(out, expected, atol=max(atol, 1e-5), rtol=rtol)


# ---------------------------------------------------------------------------------------------
# Validation.


def _valid_inputs():
    x, index, weight = _make_inputs(10, 64, 5, 2, torch.float32, seed=0)
    ln_weight, ln_bias = _layernorm_params(64, torch.float32, seed=0)
    return dict(x=x, index=index, weight=weight, ln_weight=ln_weight, ln_bias=ln_bias)


@pytest.mark.parametrize(
    "field, bad_value, message",
    [
        ("x", lambda t: t[0], "x of shape"),
        ("x", lambda t: t.to(torch.int32), "float32, bfloat16 or float16"),
        ("index", lambda t: t[:, 0], "index of shape"),
        ("index", lambda t: t.to(torch.int16), "int64 or int32 index"),
        ("weight", lambda t: t[:, :1], "weight shaped like index"),
        ("weight", lambda t: t.to(torch.float16), "float32 weight"),
        ("weight", lambda t: t.to("meta"), "one device"),
        ("ln_weight", lambda t: t[:-1], "ln_weight of shape"),
        ("ln_bias", lambda t: t.to(torch.int64), "floating ln_bias"),
    ],
)
@pytest.mark.parametrize("function", [merge_gather_layernorm, merge_gather_layernorm_reference])
def test_invalid_inputs_raise_value_error(function, field, bad_value, message):
    inputs = _valid_inputs()
    inputs[field] = bad_value(inputs[field])
    with pytest.raises(ValueError, match=message):
        function(**inputs, eps=LAYERNORM_EPS)
    if not field.startswith("ln_"):
        with pytest.raises(ValueError, match=message):
            merge_gather(inputs["x"], inputs["index"], inputs["weight"])


def test_invalid_out_and_eps_raise_value_error():
    inputs = _valid_inputs()
    with pytest.raises(ValueError, match="out must be"):
        merge_gather(inputs["x"], inputs["index"], inputs["weight"], out=torch.empty(5, 63, device=DEVICE))
    with pytest.raises(ValueError, match="eps > 0"):
        merge_gather_layernorm(**inputs, eps=0.0)


# ---------------------------------------------------------------------------------------------
# Custom ops: torch.ops.kimi_cg.merge_gather and merge_gather_layernorm.


def _cpu_inputs(dtype=torch.float32):
    x, index, weight = _make_inputs(30, 100, 11, 3, dtype, seed=9, device="cpu")
    generator = torch.Generator().manual_seed(10)
    ln_weight = (1.0 + 0.1 * torch.randn(100, generator=generator)).to(dtype)
    ln_bias = (0.1 * torch.randn(100, generator=generator)).to(dtype)
    return x, index, weight, ln_weight, ln_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_on_cpu_use_the_reference(monkeypatch, dtype):
    monkeypatch.delenv("KIMI_CG_TRITON_ON_CPU", raising=False)
    x, index, weight, ln_weight, ln_bias = _cpu_inputs(dtype)

    merged = torch.ops.kimi_cg.merge_gather(x, index, weight)
    normalised = torch.ops.kimi_cg.merge_gather_layernorm(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)

    torch.testing.assert_close(merged, merge_gather_reference(x, index, weight), atol=0, rtol=0)
    torch.testing.assert_close(
        normalised,
        merge_gather_layernorm_reference(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS),
        atol=0,
        rtol=0,
    )


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
)
def test_ops_on_cpu_run_triton_when_asked(monkeypatch):
    monkeypatch.delenv("KIMI_CG_TRITON_ON_CPU", raising=False)
    x, index, weight, ln_weight, ln_bias = _cpu_inputs()
    # The paths differ on an out-of-range index: the reference raises IndexError, the kernels
    # read nothing for it. That tells which one ran.
    index[0, 0] = x.shape[0]
    with pytest.raises(IndexError):
        torch.ops.kimi_cg.merge_gather(x, index, weight)

    monkeypatch.setenv("KIMI_CG_TRITON_ON_CPU", "1")
    merged = torch.ops.kimi_cg.merge_gather(x, index, weight)
    normalised = torch.ops.kimi_cg.merge_gather_layernorm(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)

    in_range_index = torch.where(index < x.shape[0], index, -1)
    torch.testing.assert_close(merged, merge_gather_reference(x, in_range_index, weight), atol=0, rtol=0)
    torch.testing.assert_close(
        normalised,
        merge_gather_layernorm_reference(x, in_range_index, weight, ln_weight, ln_bias, LAYERNORM_EPS),
        atol=1e-6,
        rtol=1e-5,
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ops_on_cuda_match_the_reference():
    x, index, weight, ln_weight, ln_bias = (t.cuda() for t in _cpu_inputs(torch.bfloat16))

    merged = torch.ops.kimi_cg.merge_gather(x, index, weight)
    normalised = torch.ops.kimi_cg.merge_gather_layernorm(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)

    torch.testing.assert_close(merged, merge_gather_reference(x, index, weight), atol=1e-5, rtol=8e-3)
    torch.testing.assert_close(
        normalised,
        merge_gather_layernorm_reference(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS),
        atol=1e-5,
        rtol=8e-3,
    )


def test_ops_fake_impl_shape_and_dtype():
    x, index, weight, ln_weight, ln_bias = _cpu_inputs(torch.bfloat16)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (x, index, weight, ln_weight, ln_bias)]
        merged = torch.ops.kimi_cg.merge_gather(*fake[:3])
        normalised = torch.ops.kimi_cg.merge_gather_layernorm(*fake, LAYERNORM_EPS)
    for result in (merged, normalised):
        assert result.shape == (11, 100) and result.dtype == torch.bfloat16


def test_ops_pass_opcheck(monkeypatch):
    monkeypatch.delenv("KIMI_CG_TRITON_ON_CPU", raising=False)
    x, index, weight, ln_weight, ln_bias = _cpu_inputs()
    torch.library.opcheck(torch.ops.kimi_cg.merge_gather.default, (x, index, weight))
    torch.library.opcheck(
        torch.ops.kimi_cg.merge_gather_layernorm.default, (x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)
    )


def test_ops_compile_fullgraph(monkeypatch):
    monkeypatch.delenv("KIMI_CG_TRITON_ON_CPU", raising=False)
    x, index, weight, ln_weight, ln_bias = _cpu_inputs()

    def merge_then_project(x, index, weight, ln_weight, ln_bias):
        merged = torch.ops.kimi_cg.merge_gather(x, index, weight)
        normalised = torch.ops.kimi_cg.merge_gather_layernorm(x, index, weight, ln_weight, ln_bias, LAYERNORM_EPS)
        return merged * 2 + normalised

    torch._dynamo.reset()
    compiled = torch.compile(merge_then_project, fullgraph=True, backend="eager")
    torch.testing.assert_close(
        compiled(x, index, weight, ln_weight, ln_bias),
        merge_then_project(x, index, weight, ln_weight, ln_bias),
        atol=0,
        rtol=0,
    )


# --- bicubic resize (kernels/resize.py) ---------------------------------------------------------


def _resize_inputs(n, channels, in_h, in_w, seed, dtype=torch.float32, hwc=False):
    """x [N, C, H, W]; hwc: a table stored [H, W, C] viewed as [1, C, H, W] (how towers hold it)."""
    generator = torch.Generator().manual_seed(seed)
    if hwc:
        return torch.randn(in_h, in_w, channels, generator=generator).to(dtype).to(DEVICE).permute(2, 0, 1).unsqueeze(0)
    return torch.randn(n, channels, in_h, in_w, generator=generator).to(dtype).to(DEVICE)


@settings(deadline=None, max_examples=25)
@given(in_h=st.integers(1, 20), in_w=st.integers(1, 20), out_h=st.integers(1, 40), out_w=st.integers(1, 40),
       channels=st.sampled_from([1, 3, 130]), hwc=st.booleans(), seed=st.integers(0, 2**16))
def test_resize_kernel_matches_aten_bicubic_fp32(in_h, in_w, out_h, out_w, channels, hwc, seed):
    x = _resize_inputs(2, channels, in_h, in_w, seed, hwc=hwc)
    got = resize_kernel.bicubic_resize(x, out_h, out_w)
    want = F.interpolate(x, size=(out_h, out_w), mode="bicubic", align_corners=False)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)


# The interpreter runs each program in NumPy: the real table's 1152 channels only on CUDA.
TABLE_CHANNELS = 1152 if DEVICE == "cuda" else 136


def test_resize_kernel_same_size_is_the_identity_and_writes_every_element():
    x = _resize_inputs(1, TABLE_CHANNELS, 64, 64, 0, hwc=True)
    assert torch.equal(resize_kernel.bicubic_resize(x, 64, 64), x.contiguous())
    # The output is torch.empty: an unwritten element would be whatever the allocator held. Fill the
    # caching allocator's blocks with NaN first on CUDA (on CPU fresh memory is compared in full too).
    for size in [(1, 1), (17, 3), (70, 9)]:
        if DEVICE == "cuda":
            torch.full((1, TABLE_CHANNELS, *size), float("nan"), device=DEVICE)
        got = resize_kernel.bicubic_resize(x, *size)
        want = F.interpolate(x, size=size, mode="bicubic", align_corners=False)
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_resize_kernel_low_precision_rounds_once(dtype):
    # float32 arithmetic and one cast: within one unit in the last place of the float32 result.
    x = _resize_inputs(1, TABLE_CHANNELS, 64, 64, 1, dtype=dtype, hwc=True)
    for size in [(32, 32), (2, 64), (30, 44), (70, 9)]:
        got = resize_kernel.bicubic_resize(x, *size)
        exact = F.interpolate(x.float(), size=size, mode="bicubic", align_corners=False)
        assert got.dtype == dtype and not torch.isnan(got).any()
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        torch.testing.assert_close(got.float(), exact, rtol=ulp, atol=1e-4)


def test_resize_kernel_rows_are_the_resized_grid_made_into_rows():
    x = _resize_inputs(1, 130, 64, 64, 3, dtype=torch.bfloat16, hwc=True)
    for size in [(1, 1), (23, 9)]:
        rows = resize_kernel.bicubic_resize_rows(x, *size)
        assert rows.shape == (size[0] * size[1], 130) and rows.is_contiguous()
        assert torch.equal(rows, resize_kernel.bicubic_resize(x, *size).squeeze(0).permute(1, 2, 0).flatten(0, 1))
    with pytest.raises(ValueError, match="one image"):
        resize_kernel.bicubic_resize_rows(torch.randn(2, 3, 8, 8, device=DEVICE), 4, 4)


def test_resize_kernel_bad_inputs_raise():
    with pytest.raises(ValueError, match="expects \\[N, C, H, W\\]"):
        resize_kernel.bicubic_resize(torch.randn(3, 8, 8, device=DEVICE), 4, 4)
    with pytest.raises(ValueError, match="positive sizes"):
        resize_kernel.bicubic_resize(torch.randn(1, 1, 8, 8, device=DEVICE), 0, 4)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        resize_kernel.bicubic_resize(torch.ones(1, 1, 8, 8, dtype=torch.int32, device=DEVICE), 4, 4)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
)
def test_resize_op_runs_the_kernel_when_asked(monkeypatch):
    from kimi_cg.ops.resize import bicubic_resize_on_host, bicubic_resize_rows_on_host

    calls = []
    kernel = resize_kernel.bicubic_resize
    monkeypatch.setattr(resize_kernel, "bicubic_resize", lambda *a: calls.append(a) or kernel(*a))
    x = _resize_inputs(1, 8, 64, 64, 2, hwc=True)
    monkeypatch.delenv("KIMI_CG_TRITON_ON_CPU", raising=False)
    matrices = torch.ops.kimi_cg.bicubic_resize(x, 21, 37)
    assert not calls
    monkeypatch.setenv("KIMI_CG_TRITON_ON_CPU", "1")
    for got in (torch.ops.kimi_cg.bicubic_resize(x, 21, 37), bicubic_resize_on_host(x, 21, 37)):
        torch.testing.assert_close(got, matrices, rtol=1e-5, atol=5e-5)
    assert len(calls) == 2
    # float64 is not a kernel dtype: the matrices take it, as before the kernel existed.
    x64 = x.double()
    torch.testing.assert_close(bicubic_resize_on_host(x64, 21, 37), matrices.double(), rtol=1e-5, atol=5e-5)
    assert len(calls) == 2
    rows_calls = []
    rows_kernel = resize_kernel.bicubic_resize_rows
    monkeypatch.setattr(resize_kernel, "bicubic_resize_rows", lambda *a: rows_calls.append(a) or rows_kernel(*a))
    rows = bicubic_resize_rows_on_host(x, 21, 37)
    assert len(rows_calls) == 1
    torch.testing.assert_close(rows, matrices.squeeze(0).permute(1, 2, 0).flatten(0, 1), rtol=1e-5, atol=5e-5)


@pytest.mark.skipif(
    DEVICE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernel on CPU tensors needs TRITON_INTERPRET=1",
)
def test_compiled_tower_resizes_new_sizes_with_the_kernel(monkeypatch):
    """A compiled MoonViT's host program resizes each new image size with the rows kernel (on CUDA, or
    through the interpreter here) and still equals eager."""
    import kimi_cg
    from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel
    from kimi_cg.testing.targets import pixel_inputs

    calls = []
    # cuDNN runs float32 convolutions in TF32 by default (eager's own error ~1e-3): compare true float32
    # programs (found on an H100: two cuDNN algorithms, both TF32, 7e-4 apart).
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    rows_kernel = resize_kernel.bicubic_resize_rows
    monkeypatch.setattr(resize_kernel, "bicubic_resize_rows", lambda *a: calls.append(a[1:]) or rows_kernel(*a))
    if DEVICE == "cpu":
        monkeypatch.setenv("KIMI_CG_TRITON_ON_CPU", "1")
    kimi_cg.reset()
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny(num_hidden_layers=1)).to(DEVICE).eval()
    # The host resizes where the device does not read the table itself (NOTE [table gathers] off).
    compiled = torch.compile(model, backend="kimi_cg", options={"table_gathers": False})
    make_inputs = pixel_inputs(DEVICE, torch.float32)
    with torch.no_grad():
        for grid in ([[4, 6]], [[6, 10], [2, 4]], [[10, 6], [8, 8]]):
            inputs = make_inputs(grid)
            for got, want in zip(compiled(*inputs), model(*inputs)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # (8, 8) is the table's own size; every other size is resized by the kernel once (cached after).
    assert {(6, 10), (2, 4), (10, 6)} <= set(calls) and (4, 6) in calls
    assert kimi_cg.counters["call_fallbacks"] == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernels_run_on_their_tensors_device_not_the_current_one():
    """Triton launches on the current device: each wrapper makes its tensors' device current. Tensors
    on cuda:1 with cuda:0 current give what the same call gives on cuda:0, bit for bit."""
    from kimi_cg.kernels.varlen_attention import plan_work_list, work_list_attention

    table = _resize_inputs(1, 1152, 64, 64, 4, dtype=torch.bfloat16, hwc=True)
    x, index, weight, ln_weight, ln_bias = (t.cuda(0) for t in _cpu_inputs(torch.bfloat16))
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(200, 2, 72, generator=generator).to("cuda:0", torch.bfloat16) for _ in range(3))
    work = plan_work_list([0, 70, 200]).to("cuda:0")

    def run(device):
        moved = lambda t: t.to(device)  # noqa: E731
        with torch.cuda.device(0):
            results = [resize_kernel.bicubic_resize_rows(moved(table), 33, 47),
                       resize_kernel.bicubic_resize(moved(table), 9, 70),
                       merge_gather(moved(x), moved(index), moved(weight)),
                       merge_gather_layernorm(moved(x), moved(index), moved(weight), moved(ln_weight), moved(ln_bias),
                                              LAYERNORM_EPS),
                       work_list_attention(moved(q), moved(k), moved(v), moved(work))]
        torch.cuda.synchronize(device)
        return [r.cpu() for r in results]

    for on_zero, on_one in zip(run("cuda:0"), run("cuda:1")):
        assert torch.equal(on_zero, on_one)


def test_launch_context_is_a_no_op_on_cpu_tensors():
    # Without CUDA (CI), asking for the current CUDA device would raise: CPU tensors never ask.
    import contextlib

    from kimi_cg.kernels import on_device_of

    assert isinstance(on_device_of(torch.ones(2)), contextlib.nullcontext)
