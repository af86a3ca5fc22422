"""Device programs run at sizes other than the ones they were first derived at."""

from __future__ import annotations

import pytest
import torch
import torch.fx

import kimi_cg
from kimi_cg.device_program import DeviceProgram


def _merge_then_project(x, weight, bias):
    # A patch merger: four rows of 64 become one of 256, then a projection. Broadcasting the bias asks
    # whether the row count is 1: a symbolic run at a 4-row input guards on (rows // 4) == 1 and gives
    # the sum the bias's size, a literal 1.
    return x.view(-1, 256) @ weight.t() + bias, x * 2


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_output_rows_derived_at_a_one_row_call_hold_for_other_sizes(compiler):
    """Found on Qwen2-VL's tower (H200 and CPU): the first call traced with symbolic sizes had one merged
    row, the symbolic run specialised the merger's rows to 1, and every later call on the padded path
    returned one merged row."""
    kimi_cg.reset()
    gm = torch.fx.symbolic_trace(_merge_then_project)
    program = DeviceProgram(gm, f"test:{compiler}", compiler)
    weight, bias = torch.randn(48, 256), torch.randn(48)
    for rows in (4, 208, 4, 8, 1024):
        x = torch.randn(rows, 64)
        assert program.output_rows([x, weight, bias]) == [rows // 4, rows]
        merged, doubled = program(x, weight, bias)
        assert merged.shape == (rows // 4, 48) and doubled.shape == (rows, 64)
        torch.testing.assert_close(merged, torch.nn.functional.linear(x.view(-1, 256), weight, bias))
    # One run for the one-row size, one for the rest (and Inductor compiles once per run): never a run per size.
    assert 1 <= kimi_cg.counters["device_program_respecializations"] <= (1 if compiler == "eager" else 2)


def _static_block(x):
    # dynamo's static first trace keeps literal sizes: the attention's qkv reshape of a 12-row call.
    return (x.reshape(12, 3, 2, -1).sum(1).reshape(12, -1),)


def test_rows_of_a_graph_that_cannot_run_symbolically_come_from_the_call_itself(monkeypatch):
    """On the H200 (torch 2.11) the symbolic run of Qwen2.5-VL's static block graph failed at its literal
    reshape ([3740, 3, 16, -1] on 3840*s rows) and every call of that graph fell back to dynamo's captured
    graph (28 per first forward). Whatever makes a symbolic run fail, the rows at the call's own sizes are
    what the bucket needs. (The failure depends on the torch version; here the symbolic run is made to fail.)"""
    import kimi_cg.device_program as device_program

    kimi_cg.reset()

    def fails(*args, **kwargs):
        raise RuntimeError("shape '[12, 3, 2, -1]' is invalid for input of size 12*s0")

    monkeypatch.setattr(device_program, "_output_row_expressions", fails)
    program = DeviceProgram(torch.fx.symbolic_trace(_static_block), "test:static", "eager")
    x = torch.randn(12, 6)
    assert program.output_rows([x]) == [12] and program.output_rows([x]) == [12]
    assert kimi_cg.counters["device_program_concrete_row_runs"] == 1  # kept for that signature
