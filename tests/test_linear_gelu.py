"""NOTE [linear + GELU epilogue]: which linear + GELU pairs LinearGeluPass fuses, that the fused op
computes what the pair did (the composition itself off CUDA; within eager bf16's error on CUDA, where
cuBLASLt's epilogue applies the tanh GELU), on the reference tower and through kimi_cg."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kimi_cg
from kimi_cg.canonicalize import LinearGeluPass
from kimi_cg.dynamo_settings import DYNAMO_SETTINGS
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel
from test_passes import count
from test_patch_conv import _relative, reference_tower_matches_eager

FUSED = torch.ops.kimi_cg.linear_gelu_tanh.default


def _compiled_with_the_pass(fn, dynamic_rows=False):
    """fn compiled with kimi_cg's dynamo settings and LinearGeluPass as the whole backend; ``graphs``
    collects (fused ops, GELUs left) per graph dynamo hands it."""
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        LinearGeluPass()(gm)
        graphs.append((count(gm, FUSED), count(gm, torch._C._nn.gelu)))
        return gm.forward

    compiled = torch.compile(fn, backend=backend, fullgraph=True)

    def run(*args):
        if dynamic_rows:
            torch._dynamo.mark_dynamic(args[0], 0)
        with torch._dynamo.config.patch(**DYNAMO_SETTINGS):
            return compiled(*args)

    torch._dynamo.reset()
    return run, graphs


class _Mlp(nn.Module):
    def __init__(self, approximate="tanh", bias=True, module_gelu=False):
        super().__init__()
        self.fc0, self.fc1 = nn.Linear(8, 24, bias=bias), nn.Linear(24, 8)
        self.act = nn.GELU(approximate=approximate) if module_gelu else None
        self.approximate = approximate

    def forward(self, x):
        h = self.fc0(x)
        h = self.act(h) if self.act is not None else F.gelu(h, approximate=self.approximate)
        return self.fc1(h)


@pytest.mark.parametrize("module_gelu", [False, True])
@pytest.mark.parametrize("dynamic_rows", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_and_its_tanh_gelu_become_one_op_with_eagers_values(module_gelu, dynamic_rows, dtype):
    torch.manual_seed(0)
    mlp = _Mlp(module_gelu=module_gelu).to(dtype)
    x = torch.randn(6, 5, 8, dtype=dtype)
    run, graphs = _compiled_with_the_pass(mlp, dynamic_rows)
    with torch.no_grad():
        got, want = run(x), mlp(x)
    assert graphs == [(1, 0)], graphs
    assert torch.equal(got, want)  # off CUDA the op is the composition itself


class _TwoUses(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(8, 24)

    def forward(self, x):
        h = self.fc0(x)
        return F.gelu(h, approximate="tanh") + h


@pytest.mark.parametrize("case", ["exact gelu", "no bias", "linear used twice"])
def test_other_pairs_keep_their_linear_and_gelu(case):
    torch.manual_seed(1)
    module = {"exact gelu": lambda: _Mlp(approximate="none"), "no bias": lambda: _Mlp(bias=False),
              "linear used twice": _TwoUses}[case]()
    x = torch.randn(7, 8)
    run, graphs = _compiled_with_the_pass(module)
    with torch.no_grad():
        got, want = run(x), module(x)
    assert graphs == [(0, 1)], graphs
    assert torch.equal(got, want)


def test_a_pair_under_autocast_keeps_its_linear_and_gelu():
    """Autocast runs the linear in bf16 on fp32 inputs; the custom op would run in fp32 and change the
    output's dtype, so the pair is left as written."""
    torch.manual_seed(4)
    mlp = _Mlp()

    def under_autocast(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mlp(x)

    x = torch.randn(5, 8)
    run, graphs = _compiled_with_the_pass(under_autocast)
    with torch.no_grad():
        got, want = run(x), under_autocast(x)
    assert graphs == [(0, 1)], graphs
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


def test_the_op_off_cuda_is_the_composition_and_its_fake_is_contiguous():
    torch.manual_seed(2)
    x = torch.randn(3, 4, 16).transpose(0, 1)  # not contiguous
    weight, bias = torch.randn(10, 16), torch.randn(10)
    got = torch.ops.kimi_cg.linear_gelu_tanh(x, weight, bias)
    assert torch.equal(got, F.gelu(F.linear(x, weight, bias), approximate="tanh"))
    assert got.is_contiguous() and got.shape == (4, 3, 10)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.kimi_cg.linear_gelu_tanh(mode.from_tensor(x), mode.from_tensor(weight), mode.from_tensor(bias))
    assert fake.shape == got.shape and fake.stride() == got.stride() and fake.dtype == got.dtype


@pytest.mark.parametrize("enabled", [True, False])
def test_the_reference_tower_fuses_each_mlp_under_kimi_cg(tmp_path, enabled):
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg",
                             options={"debug_dir": str(tmp_path), "linear_gelu_epilogue": enabled,
                                      "cuda_graphs": True})  # the bucketed path: rows padded
    reference_tower_matches_eager(model, compiled)
    assert kimi_cg.counters["eager_fallbacks"] == 0, dict(kimi_cg.counters)
    graphs = kimi_cg.counters["dynamo_graphs"]
    fused = kimi_cg.counters["linear_gelu_epilogues"]
    if enabled:
        assert graphs > 0 and fused == len(model.encoder.blocks) * graphs, dict(kimi_cg.counters)
        assert sorted(tmp_path.rglob("*linear_gelu*")), "the debug dump shows no linear_gelu stage"
    else:
        assert fused == 0 and not sorted(tmp_path.rglob("*linear_gelu*"))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 1024, 3000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cuda_epilogue_is_as_close_to_fp32_as_eager(rows, dtype):
    torch.manual_seed(3)
    x = torch.randn(rows, 1152, device="cuda")
    weight = torch.randn(4304, 1152, device="cuda") / 1152 ** 0.5
    bias = torch.randn(4304, device="cuda")
    want = F.gelu(F.linear(x.double(), weight.double(), bias.double()), approximate="tanh")
    low = [t.to(dtype) for t in (x, weight, bias)]
    got = torch.ops.kimi_cg.linear_gelu_tanh(*low)
    eager = F.gelu(F.linear(*low), approximate="tanh")
    assert got.dtype == dtype and got.shape == eager.shape and got.is_contiguous()
    assert not torch.isnan(got).any()
    assert _relative(got, want) <= 2 * _relative(eager, want) + 1e-6


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cuda_epilogue_applies_the_tanh_gelu_not_the_exact_one(dtype):
    """With x = 0 the op returns GELU(bias) per row: where the tanh and the exact GELU round to
    different values (the bias in [-3.5, -1.5]), the op must be nearer the tanh one. cuBLASLt evaluates
    its float32 GELU its own way: in fp16 at the far negative tail (GELU(-3.5) = -0.0008, where
    1 + tanh(u) cancels) it was 7 fp16 rounding steps from torch's (an H100, 2026-12-06), so each
    value is held to one rounding step of the largest value in the range, not of itself."""
    bias = torch.linspace(-3.5, -1.5, 4096, device="cuda", dtype=torch.float64)
    x = torch.zeros(64, 256, device="cuda", dtype=dtype)
    weight = torch.randn(4096, 256, device="cuda").to(dtype)
    got = torch.ops.kimi_cg.linear_gelu_tanh(x, weight, bias.to(dtype)).double()
    b = bias.to(dtype).double()
    tanh = F.gelu(b, approximate="tanh").to(dtype).double()
    exact = F.gelu(b).to(dtype).double()
    differ = tanh != exact
    assert differ.sum() > 100  # the two GELUs are told apart in this dtype
    step = torch.finfo(dtype).eps * tanh.abs().max()
    assert ((got - tanh).abs() <= step).all(), float((got - tanh).abs().max() / step)
    to_tanh, to_exact = (got[:, differ] - tanh[differ]).abs().mean(), (got[:, differ] - exact[differ]).abs().mean()
    assert to_tanh < to_exact / 4, (to_tanh, to_exact)
