"""NOTE [patch convolution as a matmul]: which convolutions PatchConvPass rewrites, and that the
rewritten graph computes what the convolution did (fp64 to rounding, fp32 and bf16 as eager's
convolution does within tolerance), on the reference towers and through kimi_cg."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kimi_cg
from kimi_cg.canonicalize import PatchConvPass
from kimi_cg.dynamo_settings import DYNAMO_SETTINGS
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel
from test_passes import count

CONVOLUTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TORCH_CONVOLUTIONS = (torch.conv1d, torch.conv2d, torch.conv3d)


def _convolutions(gm) -> int:
    return sum(count(gm, target) for target in TORCH_CONVOLUTIONS)


def _compiled_with_the_pass(fn, dynamic_rows=False):
    """fn compiled with kimi_cg's dynamo settings and PatchConvPass as the whole backend; ``graphs``
    collects (convolutions before, rewritten, convolutions after) per graph dynamo hands it."""
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        before = _convolutions(gm)
        pass_ = PatchConvPass()
        pass_(gm)
        graphs.append((before, pass_.report["rewritten"], _convolutions(gm)))
        return gm.forward

    compiled = torch.compile(fn, backend=backend, fullgraph=True)

    def run(*args):
        if dynamic_rows:  # as kimi_cg traces: the row count symbolic, the module's attributes literals
            torch._dynamo.mark_dynamic(args[0], 0)
        with torch._dynamo.config.patch(**DYNAMO_SETTINGS):
            return compiled(*args)

    torch._dynamo.reset()
    return run, graphs


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("spatial", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("stride", ["kernel", 1, 3])
@pytest.mark.parametrize("dynamic_rows", [False, True])
def test_a_convolution_over_whole_patches_becomes_a_matmul(spatial, with_bias, stride, dynamic_rows):
    torch.manual_seed(spatial)
    kernel = (2, 5, 4)[:spatial]
    weight = torch.randn(6, 3, *kernel, dtype=torch.float64)
    bias = torch.randn(6, dtype=torch.float64) if with_bias else torch.zeros(0)
    step = kernel if stride == "kernel" else stride
    conv = CONVOLUTIONS[spatial]

    def embed(x, weight, bias):
        return conv(x, weight, bias if bias.numel() else None, stride=step).view(x.shape[0], -1) * 2.0

    run, graphs = _compiled_with_the_pass(embed, dynamic_rows)
    for rows in ((7, 3, 12) if dynamic_rows else (7,)):
        x = torch.randn(rows, 3, *kernel, dtype=torch.float64)
        got, want = run(x, weight, bias), embed(x, weight, bias)
        assert got.shape == want.shape and got.stride() == want.stride()
        assert _relative(got, want) <= 1e-13
    assert graphs == [(1, 1, 0)], graphs


@pytest.mark.parametrize("case", ["padding", "groups", "whole_image", "unbatched", "padding_same"])
def test_other_convolutions_keep_their_convolution(case):
    torch.manual_seed(0)
    x = torch.randn(4, 4, 6, 6)
    weight = torch.randn(8, 4, 6, 6)
    calls = {
        "padding": lambda x, weight: F.conv2d(x, weight, padding=1),
        "groups": lambda x, weight: F.conv2d(x, weight[:, :2], groups=2),
        "whole_image": lambda x, weight: F.conv2d(torch.cat([x, x], dim=-1), weight, stride=6),
        "unbatched": lambda x, weight: F.conv2d(x[0], weight),
        "padding_same": lambda x, weight: F.conv2d(x, weight, padding="same"),
    }
    fn = calls[case]
    run, graphs = _compiled_with_the_pass(fn)
    torch.testing.assert_close(run(x, weight), fn(x, weight), rtol=1e-5, atol=1e-5)
    assert graphs == [(1, 0, 1)], graphs


def test_a_strided_channels_last_input_is_flattened_in_logical_order():
    torch.manual_seed(2)
    weight = torch.randn(8, 2, 6, 6, dtype=torch.float64)

    def embed(x, weight):
        return F.conv2d(x[:, 1:3], weight, stride=6)  # channels 1-2 of a channels-last tensor: not contiguous

    x = torch.randn(5, 4, 6, 6, dtype=torch.float64).to(memory_format=torch.channels_last)
    run, graphs = _compiled_with_the_pass(embed)
    got, want = run(x, weight), embed(x, weight)
    assert graphs == [(1, 1, 0)], graphs
    assert got.shape == want.shape and _relative(got, want) <= 1e-13


def test_a_bf16_patch_matmul_is_as_close_to_fp32_as_the_convolution():
    torch.manual_seed(1)
    x = torch.randn(64, 3, 14, 14)
    weight = torch.randn(32, 3, 14, 14) * 0.05
    bias = torch.randn(32)

    def embed(x, weight, bias):
        return F.conv2d(x, weight, bias, stride=14).flatten(1)

    want = embed(x, weight, bias)
    low = [t.bfloat16() for t in (x, weight, bias)]
    run, graphs = _compiled_with_the_pass(embed)
    got = run(*low)
    assert graphs == [(1, 1, 0)], graphs
    eager_error = _relative(embed(*low), want)
    assert _relative(got, want) <= 2 * eager_error + 1e-6


def reference_tower_matches_eager(model, compiled) -> None:
    """Three grid batches (1-3 images) through ``compiled`` give ``model``'s outputs (fp32, 1e-5 relative,
    NaN never passing) with no lift or call fallback."""
    for grid in ([[4, 6]], [[6, 4], [2, 8]], [[4, 4], [8, 2], [2, 2]]):
        grid = torch.tensor(grid)
        pixels = torch.randn(int(grid.prod(-1).sum()), 3, 14, 14)
        with torch.no_grad():
            want, got = model(pixels, grid), compiled(pixels, grid)
        for g, w in zip(got, want):
            assert g.shape == w.shape and not torch.isnan(g).any()
            assert _relative(g, w) <= 1e-5
    assert kimi_cg.counters["lift_fallbacks"] == kimi_cg.counters["call_fallbacks"] == 0, dict(kimi_cg.counters)


def test_the_reference_tower_compiles_its_patch_embedding_as_a_matmul(tmp_path):
    torch.manual_seed(0)
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"debug_dir": str(tmp_path)})
    reference_tower_matches_eager(model, compiled)
    assert kimi_cg.counters["patch_convolutions_as_matmuls"] == kimi_cg.counters["dynamo_graphs"] > 0
    stages = sorted(p.name for p in tmp_path.rglob("*patch_conv*"))
    assert stages, "the debug dump shows no patch_conv stage"


@pytest.mark.parametrize("dtype, rewritten", [(torch.float32, 0), (torch.bfloat16, 1), (torch.float16, 1)])
def test_a_float32_convolution_on_cuda_keeps_cudnn(dtype, rewritten):
    """cuDNN runs float32 convolutions in TF32 by default while float32 matmuls are not, so on CUDA a
    float32 convolution stays one (eager's numbers); half-precision ones become matmuls. The graph's
    example values are fake CUDA tensors: this runs without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    def embed(x, weight, bias):
        return torch.conv2d(x, weight, bias, 14)

    gm = torch.fx.symbolic_trace(embed)
    mode, cuda = FakeTensorMode(), torch.device("cuda")
    shapes = {"x": (8, 3, 14, 14), "weight": (16, 3, 14, 14), "bias": (16,)}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            meta = torch.empty(shapes[node.name], dtype=dtype, device="meta")
            node.meta["example_value"] = FakeTensor(mode, meta, cuda)
    pass_ = PatchConvPass()
    pass_(gm)
    assert pass_.report["rewritten"] == rewritten
    assert _convolutions(gm) == 1 - rewritten
