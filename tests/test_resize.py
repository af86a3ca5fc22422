"""torch.ops.kimi_cg.bicubic_resize against F.interpolate, and SeparableResizePass in the backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kimi_cg
from dumps import last_lifted_graph
from kimi_cg.canonicalize.separable_resize import SeparableResizePass
from kimi_cg.models.moonvit import MoonVitConfig, MoonVitPretrainedModel
from kimi_cg.ops.resize import bicubic_resize

# bf16 rule of the project: no worse than 2x ATen's bf16 error against fp32, plus a rounding floor.
BF16_FLOOR = 4e-3


def _relative(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@settings(deadline=None, max_examples=60)
@example(in_h=59, in_w=2, out_h=117, out_w=2, channels=2, seed=0)  # a float32-scale case (torch 2.11)
@given(in_h=st.integers(1, 64), in_w=st.integers(1, 64), out_h=st.integers(1, 130), out_w=st.integers(1, 130),
       channels=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_matches_aten_bicubic_fp32(in_h, in_w, out_h, out_w, channels, seed):
    x = torch.randn(2, channels, in_h, in_w, generator=torch.Generator().manual_seed(seed))
    want = F.interpolate(x, size=(out_h, out_w), mode="bicubic")
    got = bicubic_resize(x, out_h, out_w)
    assert got.shape == want.shape and got.dtype == want.dtype
    # fp32 rule: ~1e-5 relative over the tensor; element-wise, ATen's float32 arithmetic for positions
    # and weights leaves up to ~1.5e-5 on O(1) values (unit normal inputs reach |x| ~ 4).
    assert _relative(got, want) <= 1e-5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)


def test_same_size_is_identity_and_downsampling_by_two_is_exact_weights():
    x = torch.randn(1, 3, 64, 64)
    assert torch.equal(bicubic_resize(x, 64, 64), x)
    # Half-pixel centres, scale 2: output o samples 2o + 0.5, taps 2o-1..2o+2 with weights
    # (-0.09375, 0.59375, 0.59375, -0.09375) for A = -0.75 (clamped at the borders).
    line = torch.arange(8.0).reshape(1, 1, 1, 8)
    got = bicubic_resize(line, 1, 4)[0, 0, 0]
    taps = torch.tensor([-0.09375, 0.59375, 0.59375, -0.09375])
    padded = torch.tensor([0.0, *range(8), 7.0])  # border clamp
    want = torch.stack([(padded[2 * o: 2 * o + 4] * taps).sum() for o in range(4)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_rule(dtype):
    x = torch.randn(1, 1152, 64, 64)
    for size in [(32, 32), (2, 64), (30, 44), (96, 80)]:
        reference = F.interpolate(x, size=size, mode="bicubic")
        aten = F.interpolate(x.to(dtype), size=size, mode="bicubic")
        got = bicubic_resize(x.to(dtype), *size)
        assert got.dtype == dtype and not torch.isnan(got).any()
        assert _relative(got, reference) <= 2 * _relative(aten, reference) + BF16_FLOOR


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="expects \\[N, C, H, W\\]"):
        bicubic_resize(torch.randn(3, 8, 8), 4, 4)
    with pytest.raises(ValueError, match="positive sizes"):
        bicubic_resize(torch.randn(1, 1, 8, 8), 0, 4)


def test_pass_rewrites_only_the_exact_form():
    def f(x, h: int, w: int):
        a = F.interpolate(x, size=(h, w), mode="bicubic")
        b = F.interpolate(x, size=(h, w), mode="bilinear")
        c = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=True)
        d = F.interpolate(x, scale_factor=2.0, mode="bicubic")
        return a, b, c, d

    gm = torch.fx.symbolic_trace(f, concrete_args={"h": 5, "w": 7})
    x = torch.randn(1, 2, 4, 6)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = x
    SeparableResizePass()(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.kimi_cg.bicubic_resize.default) == 1
    assert targets.count(F.interpolate) == 3
    for got, want in zip(gm(x, 5, 7), f(x, 5, 7)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def test_backend_resizes_position_grids_without_aten_bicubic(tmp_path):
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"debug_dir": str(tmp_path)})
    with torch.no_grad():
        for seed, grid in enumerate([[[4, 6], [2, 8]], [[8, 4], [64, 2]]]):
            grid_tensor = torch.tensor(grid)
            pixels = torch.randn(int(grid_tensor.prod(-1).sum()), 3, 14, 14, generator=torch.Generator().manual_seed(seed))
            got, want = compiled(pixels, grid_tensor), model(pixels, grid_tensor)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    last = last_lifted_graph(tmp_path)
    diff = next(last.glob("*_separable_resize.diff")).read_text().splitlines()  # what the pass changed
    added = "\n".join(line for line in diff if line.startswith("+") and not line[1:].strip().startswith("#"))
    removed = "\n".join(line for line in diff if line.startswith("-") and not line[1:].strip().startswith("#"))
    assert "kimi_cg.bicubic_resize" in added and "interpolate(" in removed and "interpolate(" not in added
    assert kimi_cg.counters["graph_breaks"] == 0


def test_host_programs_call_the_resize_function_not_the_op():
    """NOTE [host calls skip the dispatcher]: the host program (and its per-item values) call the plain
    function; the op's dispatch cost 0.3 ms per new image size on the H200's host. Same values."""
    from kimi_cg.host_program import ItemValue
    from kimi_cg.ops.resize import bicubic_resize_on_host, bicubic_resize_rows_on_host
    from kimi_cg.runtime.runner import live_runners

    x = torch.randn(1, 5, 7, 9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(bicubic_resize_on_host(x, 11, 4), bicubic_resize(x, 11, 4))
    kimi_cg.reset()
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    # The host resizes where the device does not read the table itself (NOTE [table gathers] off).
    compiled = torch.compile(model, backend="kimi_cg", options={"table_gathers": False})
    grid = torch.tensor([[4, 6], [2, 8]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3, 14, 14, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for a, b in zip(compiled(pixels, grid), model(pixels, grid)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    hosts = [runner.host for runner in live_runners() if runner.host is not None]
    assert hosts and sum(host.direct_calls for host in hosts) >= 1
    modules = [module for host in hosts for module in host.gm.modules()]
    graphs = [host.gm.graph for host in hosts] + [m.gm.graph for m in modules if isinstance(m, ItemValue)]
    targets = [node.target for graph in graphs for node in graph.nodes if node.op == "call_function"]
    # MoonViT makes rows of the resized grid (squeeze, permute, flatten): fused into one call.
    assert bicubic_resize_rows_on_host in targets and torch.ops.kimi_cg.bicubic_resize.default not in targets
    assert bicubic_resize_on_host not in targets


class _RowsChain(torch.nn.Module):
    """The resized grid made into rows, with variants the fusion must leave alone."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant

    def forward(self, table, h: int, w: int):
        resized = torch.ops.kimi_cg.bicubic_resize.default(table.permute(2, 0, 1).unsqueeze(0), h, w)
        squeezed = resized.squeeze(0)
        if self.variant == "other_permute":
            return squeezed.permute(2, 1, 0).flatten(0, 1)
        if self.variant == "other_flatten":
            return squeezed.permute(1, 2, 0).flatten(1, 2)
        rows = squeezed.permute([1, 2, 0]).flatten(end_dim=-2) if self.variant == "spelled" else \
            squeezed.permute(1, 2, 0).flatten(0, 1)
        if self.variant == "shared":
            return rows, resized.sum()
        return rows


@pytest.mark.parametrize("variant, fused", [("plain", 1), ("spelled", 1), ("shared", 0), ("other_permute", 0),
                                            ("other_flatten", 0)])
def test_host_fusion_of_resize_into_rows_takes_only_the_exact_chain(variant, fused):
    from kimi_cg.host_program import call_host_functions
    from kimi_cg.ops.resize import bicubic_resize_rows_on_host

    module = _RowsChain(variant)
    gm = torch.fx.symbolic_trace(module, concrete_args={"h": 5, "w": 3})
    table = torch.randn(7, 9, 6, generator=torch.Generator().manual_seed(0))
    want = module(table, 5, 3)
    call_host_functions(gm)
    targets = [node.target for node in gm.graph.nodes]
    assert targets.count(bicubic_resize_rows_on_host) == fused
    got = gm(table, 5, 3)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a, b)


def test_resize_rows_on_host_is_the_chain_it_replaces():
    from kimi_cg.ops.resize import bicubic_resize_on_host, bicubic_resize_rows_on_host

    x = torch.randn(1, 6, 7, 9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(bicubic_resize_rows_on_host(x, 5, 3), bicubic_resize_on_host(x, 5, 3).squeeze(0).permute(1, 2, 0).flatten(0, 1))
    # Two images: squeeze(0) keeps four dims and permute(1, 2, 0) fails, as in the unfused chain.
    with pytest.raises(RuntimeError, match="permute"):
        bicubic_resize_rows_on_host(torch.randn(2, 6, 7, 9), 5, 3)
