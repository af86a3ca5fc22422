"""The work-list varlen attention kernel (kernels/varlen_attention.py) and its host planner, against
per-segment SDPA. Without CUDA the kernel runs on CPU tensors through Triton's interpreter
(TRITON_INTERPRET is set before the kernel module is imported, as in tests/test_kernels.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed; the work-list kernel needs it")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kimi_cg.kernels.varlen_attention import (  # noqa: E402
    BLOCK_M,
    head_dim_split,
    plan_work_list,
    plan_work_list_on_device,
    work_list_attention,
    work_list_capacity,
    work_list_rows,
)
from kimi_cg.ops.varlen_attention import (  # noqa: E402
    prefers_work_list,
    varlen_attention_reference,
    varlen_attention_work_list,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bounds_of(lengths):
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return bounds


def packed(rows, heads, head_dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, heads, head_dim, generator=generator).to(device=DEVICE, dtype=dtype) for _ in range(3)]


def test_plan_covers_each_row_once_and_pads_with_no_op_entries():
    bounds = bounds_of([3, 0, 130, 64, 1])
    work = plan_work_list(bounds, block_m=64, entries=12)
    assert work.dtype == torch.int32 and work.shape == (12, 4)
    assert torch.equal(work_list_rows(work), torch.ones(bounds[-1], dtype=torch.int64))
    real = [tuple(entry) for entry in work.tolist() if entry[1] > entry[0]]
    # Segment [3, 133) in blocks of 64, each attending to the whole segment; the empty segment has none.
    assert real == [(0, 3, 0, 3), (3, 67, 3, 133), (67, 131, 3, 133), (131, 133, 3, 133), (133, 197, 133, 197),
                    (197, 198, 197, 198)]
    assert all(entry == [0, 0, 0, 0] for entry in work.tolist()[len(real):])
    with pytest.raises(ValueError, match="needs 6 work entries"):
        plan_work_list(bounds, block_m=64, entries=5)
    with pytest.raises(ValueError, match="non-decreasing"):
        plan_work_list([0, 5, 3])


def test_padding_rows_attend_to_their_own_block_only():
    """A bucket of 300 rows holding a call of 70 (segments [0, 40), [40, 70)); the trailing segment
    [70, 300) is padding: linear blocks, not one quadratic segment."""
    work = plan_work_list([0, 40, 300], block_m=64, padding_from=70)
    entries = [tuple(entry) for entry in work.tolist()]
    assert entries[:2] == [(0, 40, 0, 40), (40, 70, 40, 70)]
    assert entries[2:] == [(70, 134, 70, 134), (134, 198, 134, 198), (198, 262, 198, 262), (262, 300, 262, 300)]
    assert torch.equal(work_list_rows(work), torch.ones(300, dtype=torch.int64))
    with pytest.raises(ValueError, match="last segment"):
        plan_work_list([0, 40, 300], padding_from=20)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=12), spare=st.integers(0, 200),
       block_m=st.sampled_from([16, 64, 128]))
def test_capacity_bounds_every_call_of_a_bucket(lengths, spare, block_m):
    bounds = bounds_of(lengths)
    capacity_rows = bounds[-1] + spare
    padded = bounds[:-1] + [capacity_rows]  # the last segment extended over the padding rows
    work = plan_work_list(padded, block_m=block_m, padding_from=bounds[-1],
                          entries=work_list_capacity(capacity_rows, len(lengths), block_m))
    assert torch.equal(work_list_rows(work), torch.ones(capacity_rows, dtype=torch.int64))


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=0, max_size=40), spare=st.integers(0, 40),
       block_m=st.sampled_from([16, 64, 128]))
def test_plan_on_the_device_equals_the_host_plan(lengths, spare, block_m):
    """The planner a CUDA graph captures (tensor ops of fixed shapes) plans what the host planner does,
    entry for entry, no-op entries included."""
    bounds = bounds_of(lengths)
    entries = work_list_capacity(bounds[-1], max(len(lengths), 1), block_m) + spare
    want = plan_work_list(bounds, block_m=block_m, entries=entries)
    got = plan_work_list_on_device(torch.tensor(bounds, dtype=torch.int32, device=DEVICE), entries, block_m)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)


def test_many_windows_in_a_padded_table_match_per_segment_sdpa():
    """What a replay of a dense segment table runs (NOTE [segment tables], NOTE [work list or flash]):
    windows of 4 to 64 rows, padding rows in 64-row segments of their own, empty segments at the end;
    NaN in the padding never reaches a window."""
    lengths = [64, 16, 4, 64, 64, 16, 36, 4, 64] * 2  # 664 rows in 18 windows
    bounds = bounds_of(lengths)
    capacity = 1024
    padding = [min(bounds[-1] + 64 * j, capacity) for j in range(1, 12)] + [capacity] * 40
    table = torch.tensor(bounds + padding, dtype=torch.int32)
    assert prefers_work_list(capacity, table.numel() - 1) and not prefers_work_list(capacity, 33)
    q, k, v = packed(capacity, 2, 72, torch.float32, seed=3)
    for tensor in (q, k, v):
        tensor[bounds[-1]:] = float("nan")
    got = varlen_attention_work_list(q, k, v, table.to(DEVICE), scale=0.25)
    real = bounds[-1]
    want = varlen_attention_reference(q[:real], k[:real], v[:real], torch.tensor(bounds), scale=0.25)
    torch.testing.assert_close(got[:real], want, rtol=2e-5, atol=2e-5)


# fp32: the kernel and SDPA both accumulate in float32 in different orders. Low precision: the kernel
# rounds the softmax weights to the input dtype before the second product (as flash kernels do).
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def test_head_dim_split_covers_the_head_dim_with_power_of_two_blocks():
    """NOTE [head-dim split]: 72 = 64 + 16 (8 masked), 80 = 64 + 16, no tail for powers of two."""
    assert head_dim_split(72) == (64, 16) and head_dim_split(80) == (64, 16)
    assert head_dim_split(64) == (64, 0) and head_dim_split(128) == (128, 0)
    assert head_dim_split(8) == (16, 0) and head_dim_split(96) == (64, 32) and head_dim_split(40) == (32, 16)
    for head_dim in range(1, 300):
        main, tail = head_dim_split(head_dim)
        assert main >= 16 and main & (main - 1) == 0 and main <= max(16, head_dim)
        assert tail == 0 or (tail >= 16 and tail & (tail - 1) == 0 and tail < 2 * max(16, head_dim - main))
        assert main + tail >= head_dim
    with pytest.raises(ValueError, match="positive"):
        head_dim_split(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 16, 72, 80, 96])
@pytest.mark.parametrize("block_m, block_n", [(64, 64), (128, 32)])
def test_kernel_matches_per_segment_sdpa(dtype, head_dim, block_m, block_n):
    """Segments of whole key blocks, partial ones and both, with every head-dim split (masked main
    part, masked tail, exact tail, no tail) and two block shapes."""
    lengths = [1, 70, 0, 17, 130, 64, 32]
    bounds = bounds_of(lengths)
    q, k, v = packed(bounds[-1], 2, head_dim, dtype, seed=head_dim)
    work = plan_work_list(bounds, block_m=block_m,
                          entries=work_list_capacity(bounds[-1], len(lengths), block_m)).to(DEVICE)
    got = work_list_attention(q, k, v, work, scale=0.3, block_m=block_m, block_n=block_n)
    want = varlen_attention_reference(q.float(), k.float(), v.float(), torch.tensor(bounds), scale=0.3)
    rtol, atol = TOLERANCES[dtype]
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("options", [{"split_scores": False}, {"min_tail": 32}])
def test_kernel_without_the_split_or_with_a_wider_tail_matches(options):
    """NOTE [head-dim split]: one padded score product, or a tail of 32, give the same attention."""
    lengths = [70, 130, 1]
    bounds = bounds_of(lengths)
    q, k, v = packed(bounds[-1], 2, 72, torch.float32, seed=5)
    work = plan_work_list(bounds, entries=work_list_capacity(bounds[-1], len(lengths))).to(DEVICE)
    got = work_list_attention(q, k, v, work, **options)
    want = varlen_attention_reference(q, k, v, torch.tensor(bounds))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_nan_in_other_segments_and_in_padding_never_reaches_real_rows():
    """NOTE [masked loads, not multiplied ones]: NaN rows of one segment, and NaN padding rows of a
    bucket, leave every other segment's output exact."""
    bounds = [0, 50, 90]
    rows = 160  # a bucket: rows 90..159 are padding
    q, k, v = packed(rows, 2, 16, torch.float32, seed=1)
    for tensor in (q, k, v):
        tensor[50:90] = float("nan")  # the second segment
        tensor[90:] = float("nan")  # the padding
    work = plan_work_list([0, 50, rows], padding_from=90, entries=work_list_capacity(rows, 2)).to(DEVICE)
    got = work_list_attention(q, k, v, work)
    want = varlen_attention_reference(q[:50].float(), k[:50].float(), v[:50].float(), torch.tensor([0, 50]))
    torch.testing.assert_close(got[:50], want, rtol=2e-5, atol=2e-5)


def test_bad_inputs_raise_clear_errors():
    q, k, v = packed(8, 1, 16, torch.float32, seed=0)
    work = plan_work_list([0, 8]).to(DEVICE)
    with pytest.raises(ValueError, match="int32"):
        work_list_attention(q, k, v, work.long())
    with pytest.raises(ValueError, match="one shape"):
        work_list_attention(q, k[:4], v, work)
    with pytest.raises(ValueError, match="float dtype"):
        work_list_attention(q, k.half(), v, work)


def test_attention_bench_runs_on_cpu(tmp_path):
    """scripts/attention_bench.py's smoke mode (Triton's interpreter), so the H200 run does not find a
    broken script."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "attention_bench.py"
    out = tmp_path / "attention.json"
    result = subprocess.run([sys.executable, str(script), "--smoke-test-on-cpu", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    cases = json.loads(out.read_text())["cases"]
    assert {case["case"] for case in cases} == {"images", "windows", "single"}
    for case in cases:  # the interpreted kernel against the per-segment reference, fp32
        diffs = [value for key, value in case.items() if key.endswith("_max_abs_diff")]
        assert diffs and max(diffs) < 1e-4, case
