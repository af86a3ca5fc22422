"""NOTE [host block] in kimi_cg/runtime/graphs.py: a bucket's host-made inputs are packed on the host
and unpacked, padded, on the device by ``kimi_cg.kernels.unpack``.

Random blocks (one to five inputs of every kind the block takes, widths 2 / 4 / 8 bytes, buckets
over several kernel blocks) written call after call with values of random sizes, some left out (a
value of another dtype, or one on another device): the Triton kernel (through the interpreter without
CUDA) and its PyTorch reference leave every static buffer equal, bit for bit, to an expectation
written from the padding rules directly, and never touch an input the call did not write.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kimi_cg.kernels.unpack as unpack_kernel
from kimi_cg.runtime.graphs import PADDING_SEGMENT_ROWS, InputRule, _HostBlock

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(DEVICE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")

_DTYPES = {"rows": (torch.int64, torch.int32, torch.bfloat16, torch.float32),
           "plan_index": (torch.int32, torch.int64), "plan_weight": (torch.float32, torch.float64),
           "cu_seqlens": (torch.int32, torch.int64)}


def _block(generator: torch.Generator, capacity: int):
    """(static buffers as allocated, rules, positions): random inputs of the block's kinds."""
    kinds = list(_DTYPES)
    count = int(torch.randint(1, 6, (), generator=generator))
    static, rules = [], []
    for _ in range(count):
        kind = kinds[int(torch.randint(0, len(kinds), (), generator=generator))]
        choices = _DTYPES[kind]
        dtype = choices[int(torch.randint(0, len(choices), (), generator=generator))]
        if kind == "rows":
            shape = (capacity, *((int(torch.randint(1, 4, (), generator=generator)),) * int(torch.randint(0, 3, (), generator=generator))))
            static.append(torch.zeros(shape, dtype=dtype, device=DEVICE))
        elif kind == "cu_seqlens":
            slots = int(torch.randint(1, 9, (), generator=generator))
            buffer = torch.full((slots + 1,), capacity, dtype=dtype, device=DEVICE)
            buffer[0] = 0
            static.append(buffer)
        else:
            frames = int(torch.randint(1, 9, (), generator=generator))
            static.append(torch.full((capacity, frames), -1 if kind == "plan_index" else 0, dtype=dtype, device=DEVICE))
        rules.append(InputRule(kind, host=True))
    return static, rules, list(range(count))


def _value(generator: torch.Generator, static: torch.Tensor, kind: str, patches: int) -> torch.Tensor:
    if kind == "cu_seqlens":
        count = int(torch.randint(2, static.shape[0] + 1, (), generator=generator))
        cuts = sorted(torch.randint(0, patches + 1, (count - 2,), generator=generator).tolist())
        return torch.tensor([0, *cuts, patches], dtype=static.dtype)
    rows = int(torch.randint(0, static.shape[0] + 1, (), generator=generator))
    if kind == "rows":
        shape = (rows, *static.shape[1:])
    else:
        shape = (rows, int(torch.randint(1, static.shape[1] + 1, (), generator=generator)))
    if static.dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(static.dtype)
    return torch.randint(-1, 1 << 20, shape, generator=generator).to(static.dtype)


def _expected(static: torch.Tensor, kind: str, value: torch.Tensor, patches: int, capacity: int) -> torch.Tensor:
    """What ``BucketedGraphs._fill`` writes (NOTE [padding rules], NOTE [segment tables])."""
    out = torch.empty_like(static, device="cpu")
    if kind == "rows":
        out.zero_()
        out[:value.shape[0]] = value
    elif kind == "cu_seqlens":
        count = value.shape[0]
        out[:count] = value
        for j in range(count, out.shape[0]):
            out[j] = min(patches + PADDING_SEGMENT_ROWS * (j - count + 1), capacity)
        if count < out.shape[0]:
            out[-1] = capacity
    else:
        out.fill_(-1 if kind == "plan_index" else 0)
        out[:value.shape[0], :value.shape[1]] = value
    return out


@pytest.mark.parametrize("implementation", [pytest.param("kernel", marks=needs_kernel), "reference"])
@pytest.mark.parametrize("seed", range(6))
def test_unpacked_inputs_equal_the_padding_rules_call_after_call(implementation, seed, monkeypatch):
    generator = torch.Generator().manual_seed(seed)
    capacity = int(torch.randint(1, 3000, (), generator=generator))
    static, rules, positions = _block(generator, capacity)
    block = _HostBlock(static, positions, rules, capacity)
    if implementation == "kernel":  # the CPU runs the reference unless told otherwise
        monkeypatch.setattr(unpack_kernel, "unpack_reference",
                            lambda *args: unpack_kernel.unpack(*args, max(row[2] for row in args[0].tolist())))
    elif DEVICE == "cuda":
        monkeypatch.setattr(unpack_kernel, "unpack", lambda *args: unpack_kernel.unpack_reference(*args[:-1]))
    want = [value.cpu().clone() for value in static]
    for call in range(8):
        patches = int(torch.randint(0, capacity + 1, (), generator=generator))
        values, left = [], set()
        for position in positions:
            value = _value(generator, static[position], rules[position].kind, patches)
            if torch.randint(0, 5, (), generator=generator) == 0:  # taken by _fill instead: never touched here
                value = value.to(torch.float16 if not value.dtype.is_floating_point else torch.int16)
                left.add(position)
            values.append(value)
        for position in positions:  # what _fill would have written there: a sentinel the unpack keeps
            if position in left:
                static[position].copy_(torch.full_like(static[position], 7))
        written = block.write(values, patches)
        assert sorted(written) == [p for p in positions if p not in left]
        block.unpack()
        for position in positions:
            kind = rules[position].kind
            if position in left:
                want[position] = torch.full_like(want[position], 7)
            else:
                want[position] = _expected(static[position], kind, values[position], patches, capacity)
            got = static[position].cpu()
            assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got, want[position]), (call, position, kind)
        assert block.header_clear == (not written)


def test_a_call_with_nothing_to_write_clears_the_device_header_once():
    """A call whose values all go to ``_fill`` leaves the unpack nothing to write: its header marks no
    input written (copied once; later such calls copy nothing)."""
    generator = torch.Generator().manual_seed(0)
    static = [torch.full((40, 3), -1, dtype=torch.int32, device=DEVICE)]
    block = _HostBlock(static, [0], [InputRule("plan_index", host=True)], 40)
    assert block.write([torch.randint(0, 9, (5, 2), generator=generator, dtype=torch.int32)], 5) == [0]
    assert not block.header_clear
    assert block.write([torch.zeros(5, 2, dtype=torch.int64)], 5) == [] and block.header_clear
    static[0].fill_(3)  # _fill's write
    block.unpack()
    assert torch.equal(static[0].cpu(), torch.full((40, 3), 3, dtype=torch.int32))
    stages = [stage.buffer.clone() for stage in block.stages]
    assert block.write([torch.zeros(5, 2, dtype=torch.int64)], 5) == []
    assert all(torch.equal(stage.buffer, before) for stage, before in zip(block.stages, stages))
