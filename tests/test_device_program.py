"""Device programs run at sizes other than the ones they were first derived at."""

from __future__ import annotations

import random

import pytest
import sympy
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

    monkeypatch.setattr(device_program, "_output_shape_expressions", fails)
    program = DeviceProgram(torch.fx.symbolic_trace(_static_block), "test:static", "eager")
    x = torch.randn(12, 6)
    assert program.output_rows([x]) == [12] and program.output_shapes([x]) == [(12, 2)]
    assert kimi_cg.counters["device_program_concrete_row_runs"] == 1  # kept for that signature


def _xreplace_values(expressions, symbols, sizes):
    values = {symbol: sympy.Integer(size) for symbol, size in zip(symbols, sizes)}
    return [None if e is None else e.xreplace(values) for e in expressions]


def test_size_expressions_as_python_equal_sympy_substitution():
    """NOTE [size expressions as Python]: the printed functions give what sympy's substitution gives, for
    the operations torch's shape guards use, at many sizes (sizes are never negative: torch's Mod asserts so)."""
    from torch.utils._sympy.functions import FloorDiv, Mod

    from kimi_cg.device_program import python_function

    s0, s1, s2 = sympy.symbols("s0 s1 s2", integer=True)
    expressions = [FloorDiv(s0, 4) * s1, Mod(s0 + 7 * s1, 5), sympy.Max(s0, 2 * s2), sympy.Min(s1, 3) + s2, s0 * s1 - 3 * s2,
                   FloorDiv(s0 + s2, 3), sympy.Integer(7), None]
    conditions = [sympy.Eq(s0, 4 * FloorDiv(s1, 2), evaluate=False), sympy.Ne(Mod(s0, 4), 0), s0 <= 32768, s1 > s2,
                  sympy.And(s0 >= 1, s2 < 9), sympy.Or(s0 < 3, sympy.Eq(s1, s2)), sympy.true]
    rows, tests = python_function(expressions, [s0, s1, s2]), python_function(conditions, [s0, s1, s2])
    assert rows is not None and tests is not None
    rng = random.Random(0)
    for _ in range(500):
        sizes = [rng.randint(0, 40) for _ in range(3)]
        assert list(rows(*sizes)) == [None if v is None else int(v) for v in _xreplace_values(expressions, [s0, s1, s2], sizes)]
        assert [t is True for t in tests(*sizes)] == [v is sympy.true for v in _xreplace_values(conditions, [s0, s1, s2], sizes)]


def test_size_expressions_outside_integer_arithmetic_stay_on_sympy():
    from kimi_cg.device_program import python_function

    s0, s1 = sympy.symbols("s0 s1", integer=True)
    assert python_function([s0 / 2], [s0]) is None  # true division
    assert python_function([sympy.Rational(1, 3) * s0], [s0]) is None
    assert python_function([s0 * sympy.Float(1.5)], [s0]) is None
    assert python_function([sympy.sin(s0)], [s0]) is None  # a name Python does not have here
    assert python_function([s0 + s1], [s0]) is None  # a symbol no input gives
    assert python_function([s0], [sympy.Symbol("lambda")]) is None  # not an argument name
    max_named = sympy.Symbol("max", integer=True)
    assert python_function([sympy.Max(s0, max_named + 1)], [s0, max_named]) is None  # would hide max()


@pytest.mark.parametrize("compiler", ["eager"])
def test_compiled_conditions_and_rows_equal_substitution_on_a_program(compiler):
    """The runs a device program keeps decide and size calls with the printed functions; the same runs with
    sympy's substitution decide alike at every size tried."""
    kimi_cg.reset()
    program = DeviceProgram(torch.fx.symbolic_trace(_merge_then_project), f"test-printed:{compiler}", compiler)
    weight, bias = torch.randn(48, 256), torch.randn(48)
    for rows in (4, 8):
        program.output_rows([torch.randn(rows, 64), weight, bias])
    runs = program._shape_runs
    assert runs and all(run._sizes is not None and run.assumptions._test is not None for run in runs)
    positions = program._size_positions
    for rows in range(1, 400):
        signature = (rows,) * len(positions)
        for run in runs:
            held = run.assumptions.hold(positions, signature)
            test, run.assumptions._test = run.assumptions._test, None
            try:
                assert run.assumptions.hold(positions, signature) == held
                if held:
                    printed = run.at(positions, signature)
                    compiled, run._sizes = run._sizes, None
                    try:
                        assert run.at(positions, signature) == printed
                    finally:
                        run._sizes = compiled
            finally:
                run.assumptions._test = test
