"""MoonViT3d against transformers' native Kimi-K2.5 vision tower, an implementation nobody here wrote.

Same weights, fp32, tiny sizes. transformers' layout differs from the checkpoint's:

- ``wqkv`` [3D, D] is split into ``attn.q_proj`` / ``k_proj`` / ``v_proj`` (rows ``[0, D)``,
  ``[D, 2D)``, ``[2D, 3D)``: the packed projection is viewed as ``[3, heads, head_dim]``);
- RoPE rotates halves instead of adjacent pairs. Ours rotates channels ``(2c, 2c + 1)`` of a head
  by angle ``c``; theirs rotates ``(c, c + head_dim / 2)`` by angle ``c`` (their cos/sin repeat the
  ``head_dim / 2`` angles twice, the angles ordered ``w0, h0, w1, h1, ...`` like ours). So their
  q/k channel ``c`` must be our channel ``2c`` and their channel ``head_dim / 2 + c`` our ``2c + 1``:
  within each head, rows ``[0, 2, 4, ..., 1, 3, 5, ...]`` of our q and k projections. q.k is a sum
  over channels, so permuting q and k alike leaves the scores unchanged; v is not permuted;
- renames: ``norm0/norm1 -> norm1/norm2``, ``wo -> attn.proj``, ``mlp.fc0/fc1 -> mlp.fc1/fc2``,
  ``pos_emb.weight -> pos_emb.position_embeddings``, ``encoder.blocks -> layers``,
  ``encoder.final_layernorm -> final_layernorm``; projector ``proj.0/proj.2 -> in_proj/out_proj``.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")
kimi_k25 = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
kimi_k25_config = pytest.importorskip("transformers.models.kimi_k25.configuration_kimi_k25")

from kimi_cg.models import moonvit3d  # noqa: E402
from kimi_cg.models.moonvit3d import KimiK25MultiModalProjector, MoonViT3dConfig, MoonViT3dPretrainedModel  # noqa: E402

GRIDS = [
    [[1, 4, 6]],
    [[2, 4, 4]],
    [[1, 10, 8], [3, 2, 6], [4, 6, 2], [2, 12, 4], [1, 2, 2]],
]


def _rotate_half_order(heads: int, head_dim: int) -> torch.Tensor:
    """Rows of our q/k projection, in the order transformers' rotate-half rope expects them."""
    within_head = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return (torch.arange(heads)[:, None] * head_dim + within_head).flatten()


def _to_transformers_state_dict(state: dict[str, torch.Tensor], config: MoonViT3dConfig) -> dict[str, torch.Tensor]:
    hidden = config.hidden_size
    order = _rotate_half_order(config.num_attention_heads, config.head_dim)
    out = {
        "patch_embed.proj.weight": state["patch_embed.proj.weight"],
        "patch_embed.proj.bias": state["patch_embed.proj.bias"],
        "patch_embed.pos_emb.position_embeddings": state["patch_embed.pos_emb.weight"],
    }
    for i in range(config.num_hidden_layers):
        ours, theirs = f"encoder.blocks.{i}", f"layers.{i}"
        for suffix in ("weight", "bias"):
            q, k, v = state[f"{ours}.wqkv.{suffix}"].split(hidden)
            out[f"{theirs}.attn.q_proj.{suffix}"] = q[order]
            out[f"{theirs}.attn.k_proj.{suffix}"] = k[order]
            out[f"{theirs}.attn.v_proj.{suffix}"] = v
            for our_name, their_name in (
                ("norm0", "norm1"),
                ("norm1", "norm2"),
                ("wo", "attn.proj"),
                ("mlp.fc0", "mlp.fc1"),
                ("mlp.fc1", "mlp.fc2"),
            ):
                out[f"{theirs}.{their_name}.{suffix}"] = state[f"{ours}.{our_name}.{suffix}"]
    for suffix in ("weight", "bias"):
        out[f"final_layernorm.{suffix}"] = state[f"encoder.final_layernorm.{suffix}"]
    return out


def _transformers_config(config: MoonViT3dConfig, attn_implementation: str):
    their_config = kimi_k25_config.Kimi_K25VisionConfig(
        patch_size=config.patch_size,
        pos_emb_height=config.init_pos_emb_height,
        pos_emb_width=config.init_pos_emb_width,
        pos_emb_time=config.init_pos_emb_time,
        num_attention_heads=config.num_attention_heads,
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        merge_kernel_size=list(config.merge_kernel_size),
        rope_parameters={"rope_type": "axial", "rope_theta": config.rope_theta},
    )
    their_config._attn_implementation = attn_implementation
    return their_config


@pytest.fixture(scope="module")
def towers():
    """Ours (both attention paths) and theirs (sdpa and eager), sharing one set of random weights."""
    torch.manual_seed(0)
    config = MoonViT3dConfig.tiny(num_hidden_layers=3)
    ours = {}
    for attn_implementation in ("flash_attention_2", "sdpa"):
        ours[attn_implementation] = MoonViT3dPretrainedModel(
            MoonViT3dConfig.tiny(num_hidden_layers=3, attn_implementation=attn_implementation)
        ).eval()
    # Non-trivial LayerNorm parameters, so that a swapped norm would show.
    with torch.no_grad():
        for name, param in ours["flash_attention_2"].named_parameters():
            if "norm" in name:
                param.normal_(mean=1.0 if name.endswith("weight") else 0.0, std=0.2)
    ours["sdpa"].load_state_dict(ours["flash_attention_2"].state_dict())
    their_state = _to_transformers_state_dict(ours["flash_attention_2"].state_dict(), config)
    theirs = {}
    for attn_implementation in ("sdpa", "eager"):
        model = kimi_k25.Kimi_K25VisionModel(_transformers_config(config, attn_implementation)).eval()
        model.load_state_dict(their_state, strict=True)
        theirs[attn_implementation] = model
    return config, ours, theirs


def _assert_relative_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-5):
    assert actual.shape == expected.shape
    error = (actual - expected).abs().max() / expected.abs().max()
    assert error <= tolerance, f"relative error {error:.3g}"


def _inputs(grid: list[list[int]], seed: int):
    grid_thws = torch.tensor(grid)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid_thws.prod(dim=1).sum()), 3, 14, 14, generator=generator), grid_thws


@pytest.mark.parametrize("grid", GRIDS)
def test_position_embedding_matches_transformers(towers, grid):
    _, ours, theirs = towers
    pixels, grid_thws = _inputs(grid, seed=1)
    with torch.no_grad():
        expected = theirs["sdpa"].patch_embed(pixels, grid_thws)
        actual = ours["sdpa"].patch_embed(pixels, grid_thws)
    _assert_relative_close(actual, expected)


@pytest.mark.parametrize("grid", GRIDS)
def test_temporal_merger_matches_transformers(towers, grid):
    config, _, theirs = towers
    if not hasattr(theirs["sdpa"], "temporal_merge"):
        pytest.skip("this transformers' Kimi-K2.5 has no temporal_merge method (before 5.24: the tower test covers it)")
    grid_thws = torch.tensor(grid)
    x = torch.randn(int(grid_thws.prod(dim=1).sum()), config.hidden_size)
    expected = theirs["sdpa"].temporal_merge(x, grid_thws, *config.merge_kernel_size)
    actual = torch.cat(moonvit3d.tpool_patch_merger(x, grid_thws, config.merge_kernel_size))
    _assert_relative_close(actual, expected, tolerance=1e-6)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("our_attention", ["flash_attention_2", "sdpa"])
@pytest.mark.parametrize("their_attention", ["sdpa", "eager"])
def test_tower_matches_transformers(towers, grid, our_attention, their_attention):
    _, ours, theirs = towers
    pixels, grid_thws = _inputs(grid, seed=2)
    model = ours[our_attention]
    with torch.no_grad():
        try:
            expected = theirs[their_attention](pixels, grid_thws)
        except RuntimeError as error:  # transformers before 5.24 rejects a batch mixing frame counts
            if len({t for t, _, _ in grid}) == 1:
                raise
            pytest.skip(f"this transformers' Kimi-K2.5 rejects a batch mixing frame counts: {str(error)[:120]}")
        hidden = model.encoder(model.patch_embed(pixels, grid_thws), grid_thws)
        merged = model(pixels, grid_thws)
    _assert_relative_close(hidden, expected.last_hidden_state)
    _assert_relative_close(torch.cat(merged), expected.pooler_output)
    merged_per_chunk = [(h // 2) * (w // 2) for _, h, w in grid]
    assert [m.shape[0] for m in merged] == merged_per_chunk


def test_projector_matches_transformers():
    config = MoonViT3dConfig.tiny()
    torch.manual_seed(3)
    ours = KimiK25MultiModalProjector(config).eval()
    with torch.no_grad():
        ours.pre_norm.weight.normal_(mean=1.0, std=0.2)
        ours.pre_norm.bias.normal_(std=0.2)
    their_config = types.SimpleNamespace(
        vision_config=types.SimpleNamespace(hidden_size=config.hidden_size, merge_kernel_size=config.merge_kernel_size),
        text_config=types.SimpleNamespace(hidden_size=config.text_hidden_size),
        projection_hidden_size=config.hidden_size,
        projection_layer_norm_eps=config.projector_layer_norm_eps,
    )
    theirs = kimi_k25.Kimi_K25MultimodalProjection(their_config).eval()
    state = ours.state_dict()
    theirs.load_state_dict(
        {
            "pre_norm.weight": state["pre_norm.weight"],
            "pre_norm.bias": state["pre_norm.bias"],
            "in_proj.weight": state["proj.0.weight"],
            "in_proj.bias": state["proj.0.bias"],
            "out_proj.weight": state["proj.2.weight"],
            "out_proj.bias": state["proj.2.bias"],
        },
        strict=True,
    )
    features = torch.randn(9, 4, config.hidden_size)
    with torch.no_grad():
        _assert_relative_close(ours(features), theirs(features).squeeze(1))
