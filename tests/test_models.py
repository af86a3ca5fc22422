"""The reference towers (Kimi-VL MoonViT, Kimi-K2.5 MoonViT3d) against independent computations.

Every expected value here is computed by hand (loops, math, numpy) from the upstream facts, not by
calling the code under test: RoPE pair order and frequencies, bicubic resampling with half-pixel
centres, merger order, the sin-cos time term, attention segmentation, checkpoint keys.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kimi_cg.models import moonvit, moonvit3d
from kimi_cg.models.moonvit import (
    KimiVLMultiModalProjector,
    KimiVLVisionEncoder,
    MoonVitConfig,
    MoonVitPretrainedModel,
)
from kimi_cg.models.moonvit3d import (
    KimiK25MultiModalProjector,
    KimiK25VisionEncoder,
    MoonViT3dConfig,
    MoonViT3dPretrainedModel,
)

TOWERS = {
    "kimi_vl": (MoonVitConfig, MoonVitPretrainedModel),
    "kimi_k25": (MoonViT3dConfig, MoonViT3dPretrainedModel),
}


def _grid(kind: str, hws: list[tuple[int, int]], ts: list[int] | None = None) -> torch.Tensor:
    """grid_hws [N, 2] for the Kimi-VL tower, grid_thws [N, 3] for the Kimi-K2.5 one."""
    if kind == "kimi_vl":
        return torch.tensor(hws)
    ts = ts or [1] * len(hws)
    return torch.tensor([(t, h, w) for t, (h, w) in zip(ts, hws)])


def _num_patches(grid: torch.Tensor) -> int:
    return int(grid.prod(dim=1).sum())


def _tiny_tower(kind: str, seed: int = 0, **overrides):
    config_class, model_class = TOWERS[kind]
    torch.manual_seed(seed)
    return model_class(config_class.tiny(**overrides)).eval()


# --------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------


def _cubic_tap_weights(frac: float, a: float = -0.75) -> list[float]:
    """Keys cubic convolution weights for taps at offsets -1, 0, 1, 2 from floor(src)."""

    def near(d):  # |d| <= 1
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d):  # 1 < |d| < 2
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    return [far(1 + frac), near(frac), near(1 - frac), far(2 - frac)]


def _bicubic_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] resampling matrix: half-pixel centres (align_corners=False), edge taps clamped."""
    matrix = np.zeros((n_out, n_in))
    for dst in range(n_out):
        src = (dst + 0.5) * n_in / n_out - 0.5
        base = math.floor(src)
        for offset, weight in zip(range(-1, 3), _cubic_tap_weights(src - base)):
            matrix[dst, min(max(base + offset, 0), n_in - 1)] += weight
    return matrix


def _bicubic_resize(grid: torch.Tensor, height: int, width: int) -> np.ndarray:
    """[H, W, D] -> [height * width, D], float64."""
    g = grid.detach().double().numpy()
    rows, cols = _bicubic_matrix(g.shape[0], height), _bicubic_matrix(g.shape[1], width)
    return np.einsum("ah,hwd,bw->abd", rows, g, cols).reshape(height * width, -1)


def _sincos_row(frame: int, dim: int) -> np.ndarray:
    half = dim // 2
    omegas = [1.0 / 10000 ** (i / half) for i in range(half)]
    return np.array([math.sin(frame * o) for o in omegas] + [math.cos(frame * o) for o in omegas])


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


def test_rope_rotates_even_pairs_by_column_odd_pairs_by_row():
    head_dim, theta, height, width = 16, 10000.0, 3, 5
    rope = moonvit.Rope2DPosEmb(head_dim, max_height=8, max_width=8, theta_base=theta)
    freqs_cis = rope.get_freqs_cis_by_seqlens(torch.tensor([[height, width]]))
    torch.manual_seed(0)
    q = torch.randn(height * width, 2, head_dim)
    k = torch.randn(height * width, 2, head_dim)
    q_out, k_out = moonvit.apply_rope(q, k, freqs_cis)

    for x, x_out in ((q, q_out), (k, k_out)):
        expected = np.zeros(x.shape)
        xs = x.double().numpy()
        for patch in range(height * width):
            row, col = divmod(patch, width)
            for pair in range(head_dim // 2):
                position = col if pair % 2 == 0 else row
                angle = position * theta ** (-4 * (pair // 2) / head_dim)
                a, b = xs[patch, :, 2 * pair], xs[patch, :, 2 * pair + 1]
                expected[patch, :, 2 * pair] = a * math.cos(angle) - b * math.sin(angle)
                expected[patch, :, 2 * pair + 1] = a * math.sin(angle) + b * math.cos(angle)
        torch.testing.assert_close(x_out.double(), torch.from_numpy(expected), atol=1e-5, rtol=1e-5)


def test_rope_3d_repeats_the_2d_table_per_frame():
    rope = moonvit3d.Rope2DPosEmbRepeated(16, max_height=8, max_width=8)
    freqs = rope.get_freqs_cis(torch.tensor([[3, 2, 4], [1, 4, 2]]))
    table_2d = moonvit.Rope2DPosEmb(16, max_height=8, max_width=8)
    chunk0 = table_2d.get_freqs_cis_by_seqlens(torch.tensor([[2, 4]]))
    chunk1 = table_2d.get_freqs_cis_by_seqlens(torch.tensor([[4, 2]]))
    torch.testing.assert_close(freqs, torch.cat([chunk0, chunk0, chunk0, chunk1]), atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# Position embedding: bicubic grid, time term
# --------------------------------------------------------------------------------------------


def _position_embedding_only(model) -> torch.nn.Module:
    """The patch embedding with a zero conv: its output is the position embedding alone."""
    patch_embed = model.patch_embed
    with torch.no_grad():
        patch_embed.proj.weight.zero_()
        patch_embed.proj.bias.zero_()
    return patch_embed


@pytest.mark.parametrize("kind", ["kimi_vl", "kimi_k25"])
@pytest.mark.parametrize("hws", [[(5, 11)], [(12, 6), (8, 8)], [(2, 14), (7, 3)]])
def test_position_embedding_is_bicubic_with_half_pixel_centres(kind, hws):
    model = _tiny_tower(kind)
    patch_embed = _position_embedding_only(model)
    grid = _grid(kind, hws)
    pixels = torch.randn(_num_patches(grid), 3, 14, 14)
    with torch.no_grad():
        pos = patch_embed(pixels, grid)
    expected = np.concatenate([_bicubic_resize(patch_embed.pos_emb.weight, h, w) for h, w in hws])
    torch.testing.assert_close(pos.double(), torch.from_numpy(expected), atol=1e-5, rtol=1e-5)


def test_time_embedding_added_per_frame_only_to_video_chunks():
    model = _tiny_tower("kimi_k25")
    patch_embed = _position_embedding_only(model)
    dim = model.config.hidden_size
    chunks = [(1, 4, 6), (3, 4, 6), (2, 6, 2), (4, 2, 2)]
    grid = torch.tensor(chunks)
    with torch.no_grad():
        pos = patch_embed(torch.randn(_num_patches(grid), 3, 14, 14), grid).double().numpy()
    expected = []
    for t, h, w in chunks:
        spatial = _bicubic_resize(patch_embed.pos_emb.weight, h, w)
        for frame in range(t):
            expected.append(spatial + (_sincos_row(frame, dim) if t > 1 else 0.0))
    np.testing.assert_allclose(pos, np.concatenate(expected), atol=1e-5, rtol=1e-5)
    # The time term is real: frame 0 of a video gets sin(0)=0 / cos(0)=1, unlike the image.
    assert np.abs(pos[:24] - pos[24:48]).max() > 0.5


def test_time_embedding_is_not_a_checkpoint_entry():
    model = _tiny_tower("kimi_k25")
    buffers = dict(model.named_buffers())
    assert buffers["patch_embed.pos_emb.time_weight"].shape == (4, model.config.hidden_size)
    assert not any("time" in key for key in model.state_dict())


@pytest.mark.parametrize("t", [0, 5])
def test_chunk_frame_count_out_of_range_is_rejected(t):
    model = _tiny_tower("kimi_k25")
    grid = torch.tensor([[t, 2, 2]])
    with pytest.raises(RuntimeError):
        model.patch_embed.pos_emb(torch.zeros(max(t, 1) * 4, model.config.hidden_size), grid)


# --------------------------------------------------------------------------------------------
# Patch merger
# --------------------------------------------------------------------------------------------


def test_merger_groups_windows_row_major():
    height, width, dim = 4, 6, 3
    x = torch.arange(height * width * dim, dtype=torch.float32).view(height * width, dim)
    (merged,) = moonvit.patch_merger(x, torch.tensor([[height, width]]), (2, 2))
    assert merged.shape == (height * width // 4, 4, dim)
    for window_row in range(height // 2):
        for window_col in range(width // 2):
            m = window_row * (width // 2) + window_col
            for kernel_row in range(2):
                for kernel_col in range(2):
                    j = kernel_row * 2 + kernel_col
                    patch = (2 * window_row + kernel_row) * width + 2 * window_col + kernel_col
                    assert torch.equal(merged[m, j], x[patch]), (m, j, patch)


def test_merger_3d_averages_frames_then_groups_windows():
    chunks = [(3, 4, 6), (1, 2, 2), (2, 2, 4)]
    dim = 5
    torch.manual_seed(0)
    x = torch.randn(sum(t * h * w for t, h, w in chunks), dim)
    outputs = moonvit3d.tpool_patch_merger(x, torch.tensor(chunks), (2, 2))
    xs = x.double().numpy()
    start = 0
    for (t, h, w), merged in zip(chunks, outputs):
        expected = np.zeros((h * w // 4, 4, dim))
        for m in range(h * w // 4):
            window_row, window_col = divmod(m, w // 2)
            for j in range(4):
                kernel_row, kernel_col = divmod(j, 2)
                patch = (2 * window_row + kernel_row) * w + 2 * window_col + kernel_col
                expected[m, j] = sum(xs[start + f * h * w + patch] for f in range(t)) / t
        np.testing.assert_allclose(merged.double().numpy(), expected, atol=1e-6, rtol=1e-6)
        start += t * h * w


# --------------------------------------------------------------------------------------------
# Attention segmentation, cu_seqlens, attention implementations
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["kimi_vl", "kimi_k25"])
@pytest.mark.parametrize("attn_implementation", ["flash_attention_2", "sdpa"])
def test_cu_seqlens_one_segment_per_item(kind, attn_implementation, monkeypatch):
    seen = []
    attention = moonvit.ATTENTION_FUNCTIONS[attn_implementation]

    def recording_attention(q, k, v, cu_seqlens):
        seen.append(cu_seqlens.clone())
        return attention(q, k, v, cu_seqlens)

    monkeypatch.setitem(moonvit.ATTENTION_FUNCTIONS, attn_implementation, recording_attention)
    model = _tiny_tower(kind, attn_implementation=attn_implementation)
    grid = _grid(kind, [(4, 6), (2, 2), (6, 4)], ts=[1, 3, 4])
    with torch.no_grad():
        model(torch.randn(_num_patches(grid), 3, 14, 14), grid)
    lengths = [24, 4, 24] if kind == "kimi_vl" else [24, 12, 96]
    expected = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    assert len(seen) == model.config.num_hidden_layers
    for cu_seqlens in seen:
        assert cu_seqlens.dtype == torch.int32
        assert torch.equal(cu_seqlens, expected)


@pytest.mark.parametrize("kind", ["kimi_vl", "kimi_k25"])
@pytest.mark.parametrize("attn_implementation", ["flash_attention_2", "sdpa"])
def test_items_do_not_attend_each_other(kind, attn_implementation):
    model = _tiny_tower(kind, attn_implementation=attn_implementation)
    grid = _grid(kind, [(4, 4), (2, 6)], ts=[2, 1])
    torch.manual_seed(1)
    pixels = torch.randn(_num_patches(grid), 3, 14, 14)
    perturbed = pixels.clone()
    first = int(grid[0].prod())
    perturbed[first:] += torch.randn_like(perturbed[first:])
    with torch.no_grad():
        out = model(pixels, grid)
        out_perturbed = model(perturbed, grid)
    torch.testing.assert_close(out_perturbed[0], out[0], atol=1e-6, rtol=1e-6)
    assert (out_perturbed[1] - out[1]).abs().max() > 1e-2


@pytest.mark.parametrize("attn_implementation", ["flash_attention_2", "sdpa"])
def test_frames_of_a_chunk_attend_jointly(attn_implementation):
    model = _tiny_tower("kimi_k25", attn_implementation=attn_implementation)
    grid = torch.tensor([[2, 2, 4], [1, 4, 4]])  # rows 0-7 frame 0, 8-15 frame 1, 16-31 the image
    torch.manual_seed(2)
    x = torch.randn(32, model.config.hidden_size)
    perturbed = x.clone()
    perturbed[8:16] += torch.randn(8, model.config.hidden_size)  # not a constant: LayerNorm removes those
    with torch.no_grad():
        out = model.encoder(x, grid)
        out_perturbed = model.encoder(perturbed, grid)
    assert (out_perturbed[:8] - out[:8]).abs().max() > 1e-3  # frame 0 sees frame 1
    torch.testing.assert_close(out_perturbed[16:], out[16:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["kimi_vl", "kimi_k25"])
def test_attention_implementations_agree(kind):
    flash = _tiny_tower(kind, attn_implementation="flash_attention_2")
    sdpa = _tiny_tower(kind, seed=1, attn_implementation="sdpa")
    sdpa.load_state_dict(flash.state_dict())
    grid = _grid(kind, [(4, 6), (10, 2), (2, 2)], ts=[1, 4, 2])
    pixels = torch.randn(_num_patches(grid), 3, 14, 14)
    with torch.no_grad():
        for a, b in zip(flash(pixels, grid), sdpa(pixels, grid), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Checkpoint layout and loading
# --------------------------------------------------------------------------------------------


def _expected_tower_shapes(layers: int, hidden: int, intermediate: int, grid: int) -> dict[str, tuple]:
    shapes = {
        "patch_embed.proj.weight": (hidden, 3, 14, 14),
        "patch_embed.proj.bias": (hidden,),
        "patch_embed.pos_emb.weight": (grid, grid, hidden),
        "encoder.final_layernorm.weight": (hidden,),
        "encoder.final_layernorm.bias": (hidden,),
    }
    for i in range(layers):
        block = f"encoder.blocks.{i}"
        for name, out_features, in_features in (
            ("wqkv", 3 * hidden, hidden),
            ("wo", hidden, hidden),
            ("mlp.fc0", intermediate, hidden),
            ("mlp.fc1", hidden, intermediate),
        ):
            shapes[f"{block}.{name}.weight"] = (out_features, in_features)
            shapes[f"{block}.{name}.bias"] = (out_features,)
        for norm in ("norm0", "norm1"):
            shapes[f"{block}.{norm}.weight"] = (hidden,)
            shapes[f"{block}.{norm}.bias"] = (hidden,)
    return shapes


@pytest.mark.parametrize("kind", ["kimi_vl", "kimi_k25"])
def test_released_size_state_dict_keys_and_shapes(kind):
    config_class, model_class = TOWERS[kind]
    with torch.device("meta"):
        model = model_class(config_class())
    got = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert got == _expected_tower_shapes(27, 1152, 4304, 64)


@pytest.mark.parametrize(
    "encoder_class, config_class, text_hidden, projector_shapes",
    [
        (
            KimiVLVisionEncoder,
            MoonVitConfig,
            2048,
            {"pre_norm": (1152,), "linear_1": (4608, 4608), "linear_2": (2048, 4608)},
        ),
        (
            KimiK25VisionEncoder,
            MoonViT3dConfig,
            7168,
            {"pre_norm": (1152,), "proj.0": (4608, 4608), "proj.2": (7168, 4608)},
        ),
    ],
)
def test_released_size_projector_keys(encoder_class, config_class, text_hidden, projector_shapes):
    with torch.device("meta"):
        encoder = encoder_class(config_class())
    prefix = "multi_modal_projector." if encoder_class is KimiVLVisionEncoder else "mm_projector."
    got = {k[len(prefix) :]: tuple(v.shape) for k, v in encoder.state_dict().items() if k.startswith(prefix)}
    expected = {}
    for name, shape in projector_shapes.items():
        expected[f"{name}.weight"] = shape
        expected[f"{name}.bias"] = shape[:1]
    assert got == expected
    assert config_class().text_hidden_size == text_hidden


@pytest.mark.parametrize("kind", ["kimi_vl", "kimi_k25"])
def test_save_and_load_round_trip(kind, tmp_path):
    model = _tiny_tower(kind, attn_implementation="sdpa")
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert loaded.config == model.config
    grid = _grid(kind, [(4, 2), (2, 6)], ts=[3, 1])
    pixels = torch.randn(_num_patches(grid), 3, 14, 14)
    with torch.no_grad():
        for a, b in zip(model(pixels, grid), loaded(pixels, grid), strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["kimi_vl", "kimi_k25"])
def test_load_with_prefix_from_a_full_checkpoint(kind, tmp_path):
    model = _tiny_tower(kind)
    state = {f"vision_tower.{k}": v.contiguous() for k, v in model.state_dict().items()}
    state["language_model.embed_tokens.weight"] = torch.zeros(2, 2)
    save_file(state, os.path.join(tmp_path, "model.safetensors"))
    # A full model's config.json: the tower reads its "vision_config" and ignores unknown fields.
    vision_config = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "init_pos_emb_height": 8,
        "init_pos_emb_width": 8,
        "unknown_field": 1,
    }
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({"vision_config": vision_config, "text_config": {"hidden_size": 7168}}, f)
    loaded = type(model).from_pretrained(tmp_path, prefix="vision_tower.")
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize("kind", ["kimi_vl", "kimi_k25"])
@pytest.mark.parametrize("change", ["missing", "extra"])
def test_strict_load_rejects_missing_or_extra_keys(kind, change, tmp_path):
    model = _tiny_tower(kind)
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if change == "missing":
        del state["encoder.blocks.1.wo.bias"]
    else:
        state["encoder.blocks.1.wo.scale"] = torch.ones(1)
    save_file(state, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(RuntimeError, match="wo"):
        type(model).from_pretrained(tmp_path)


# --------------------------------------------------------------------------------------------
# Projector and tower + projector wrappers
# --------------------------------------------------------------------------------------------


def _projector_by_hand(features: torch.Tensor, norm, linear_1, linear_2, eps: float) -> torch.Tensor:
    """LayerNorm over each patch's D channels, concatenate the window's 4 patches, MLP with erf-GELU."""
    f = features.double()
    mean = f.mean(dim=-1, keepdim=True)
    var = ((f - mean) ** 2).mean(dim=-1, keepdim=True)
    normed = (f - mean) / torch.sqrt(var + eps) * norm.weight.double() + norm.bias.double()
    flat = normed.reshape(f.shape[0], -1)
    hidden = flat @ linear_1.weight.double().T + linear_1.bias.double()
    hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
    return hidden @ linear_2.weight.double().T + linear_2.bias.double()


@pytest.mark.parametrize("kind", ["kimi_vl", "kimi_k25"])
def test_projector_normalises_each_patch_then_mixes_the_window(kind):
    torch.manual_seed(0)
    if kind == "kimi_vl":
        config = MoonVitConfig.tiny()
        projector = KimiVLMultiModalProjector(config)
        linear_1, linear_2 = projector.linear_1, projector.linear_2
    else:
        config = MoonViT3dConfig.tiny()
        projector = KimiK25MultiModalProjector(config)
        linear_1, linear_2 = projector.proj[0], projector.proj[2]
    with torch.no_grad():
        projector.pre_norm.weight.normal_()
        projector.pre_norm.bias.normal_()
    features = torch.randn(7, 4, config.hidden_size) * 3 + 1
    with torch.no_grad():
        out = projector(features)
    expected = _projector_by_hand(features, projector.pre_norm, linear_1, linear_2, 1e-5)
    assert out.shape == (7, config.text_hidden_size)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["kimi_vl", "kimi_k25"])
def test_vision_encoder_returns_one_projected_tensor_per_item(kind):
    torch.manual_seed(0)
    if kind == "kimi_vl":
        encoder = KimiVLVisionEncoder(MoonVitConfig.tiny()).eval()
        projector = encoder.multi_modal_projector
    else:
        encoder = KimiK25VisionEncoder(MoonViT3dConfig.tiny()).eval()
        projector = encoder.mm_projector
    grid = _grid(kind, [(4, 6), (2, 2), (8, 4)], ts=[2, 1, 4])
    pixels = torch.randn(_num_patches(grid), 3, 14, 14)
    with torch.no_grad():
        outputs = encoder(pixels, grid)
        features = encoder.vision_tower(pixels, grid)
    assert [tuple(o.shape) for o in outputs] == [(6, 48), (1, 48), (8, 48)]
    for out, feature in zip(outputs, features, strict=True):
        with torch.no_grad():
            torch.testing.assert_close(out, projector(feature), atol=1e-5, rtol=1e-5)


def test_tiny_presets_and_config_validation():
    config = MoonViT3dConfig.tiny()
    assert isinstance(config, MoonViT3dConfig)
    assert (config.head_dim, config.init_pos_emb_time, config.num_frames_pos_emb) == (16, 4, 4)
    assert MoonViT3dConfig().text_hidden_size == 7168
    with pytest.raises(ValueError):
        MoonViT3dConfig.tiny(attn_implementation="eager")
    with pytest.raises(ValueError):
        MoonViT3dConfig.tiny(init_pos_emb_time=0)
