"""transformers' vision towers, tiny and random, exactly as the library ships their forward.

Each ``build_*`` factory takes an attention implementation name (``"sdpa"`` or ``"eager"``; both run
the per-segment ``torch.split(..., lengths.tolist())`` path of these towers, flash attention needs the
flash-attn package) and a seed, and returns a :class:`tests.towers.Tower`. Models are built with
``Model._from_config(Config(...), attn_implementation=...)``: no weights are downloaded.

Input conventions (read from transformers 5.17 and 5.24, which agree on them):

- Kimi-K2.5 (``Kimi_K25VisionModel(pixel_values [L, 3, p, p], grid_thw [N, 3])``): ``L = sum t*h*w``;
  an image is ``t == 1``, a video chunk has ``1 < t <= pos_emb_time`` frames that attend jointly; h and
  w are multiples of the merge kernel (2); h, w may exceed the learned grid (it is resampled).
- Qwen2-VL, Qwen2.5-VL, GLM-4V (``(hidden_states [L, C*Tp*p*p], grid_thw [N, 3])``): each row is one
  patch of ``temporal_patch_size`` frames, ``L = sum t*h*w`` with t counted in temporal patches;
  h and w are multiples of ``spatial_merge_size`` (2), and patches come in merge-block order (the
  processor's layout; for random pixels only the count matters). Qwen attends per frame (t segments per
  item); Qwen2.5 also attends within windows of ``window_size // merge // patch`` merged tokens a side.
- GLM-4V: images only (``t == 1``). Its position embedding maps each token to a grid row through the
  per-frame segment lengths, so a ``t > 1`` row indexes past the grid; GLM-4.1V's own video path passes
  one ``[1, h, w]`` row per frame, and so do the grids here.

Config fields used are the ones both transformers 5.17 and 5.24 accept (``depth`` / ``num_heads``, not
the ``num_hidden_layers`` alias that only 5.24 maps).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Sequence

import torch

from . import Tower, TowerUnavailable, randomize_weights_, tensors_of

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")

# Shared tiny sizes: head dim 16 (the 2D rotary embeddings need a multiple of 4), patches of 2 pixels.
HIDDEN, HEADS, LAYERS, INTERMEDIATE, OUT_HIDDEN, PATCH, TEMPORAL_PATCH, MERGE = 64, 4, 2, 96, 48, 2, 2, 2
# The config fields Qwen2.5-VL, GLM-4V, Qwen3-VL, Qwen3.5 and GLM-OCR name alike.
TINY_VISION = dict(depth=LAYERS, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, out_hidden_size=OUT_HIDDEN,
                   num_heads=HEADS, in_channels=3, patch_size=PATCH, spatial_merge_size=MERGE,
                   temporal_patch_size=TEMPORAL_PATCH)


def _load(model_name: str, config_class_name: str, model_class_name: str):
    """(config class, model class) from ``transformers.models.<model_name>``'s configuration and modeling
    files (vision classes are not all re-exported by the package), or TowerUnavailable saying what lacks."""
    import transformers

    classes = []
    for kind, class_name in (("configuration", config_class_name), ("modeling", model_class_name)):
        module_name = f"transformers.models.{model_name}.{kind}_{model_name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is None or not module_name.startswith(error.name):
                raise  # the module exists but cannot import: a broken environment fails, it is not skipped
            raise TowerUnavailable(f"transformers {transformers.__version__} has no {module_name}: {error}") from None
        if not hasattr(module, class_name):
            raise TowerUnavailable(f"transformers {transformers.__version__} {module_name} lacks {class_name}")
        classes.append(getattr(module, class_name))
    return classes


def _build(model_class, config, attn_implementation: str, seed: int):
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {ATTENTION_IMPLEMENTATIONS}; got {attn_implementation!r}")
    torch.manual_seed(seed)
    model = model_class._from_config(config, attn_implementation=attn_implementation).to(torch.float32)
    if model.config._attn_implementation != attn_implementation:
        raise AssertionError(f"asked for {attn_implementation}, got {model.config._attn_implementation}")
    return randomize_weights_(model, seed).eval()


def _grid_tensor(grid: Sequence[Sequence[int]]) -> torch.Tensor:
    grid_thw = torch.tensor(grid, dtype=torch.int64)
    if grid_thw.dim() != 2 or grid_thw.size(1) != 3:
        raise ValueError(f"grid rows must be [t, h, w]; got {grid}")
    if bool((grid_thw[:, 1:] % MERGE).any()):
        raise ValueError(f"h and w must be multiples of the merge size {MERGE}; got {grid}")
    return grid_thw


def _image_grid(grid: Sequence[Sequence[int]], tower: str) -> torch.Tensor:
    """``_grid_tensor(grid)`` for a tower that takes images only (every t == 1)."""
    grid_thw = _grid_tensor(grid)
    if bool((grid_thw[:, 0] != 1).any()):
        raise ValueError(f"{tower} takes images only (t == 1); got {grid}")
    return grid_thw


def _qwen_style_inputs(in_channels: int, seed: int, temporal_patch: int = TEMPORAL_PATCH):
    """(hidden_states [L, C*Tp*p*p], grid_thw [N, 3]) for the Qwen / GLM flattened-patch convention."""

    def make_inputs(grid: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        grid_thw = _grid_tensor(grid)
        rows = int(grid_thw.prod(dim=-1).sum())
        generator = torch.Generator().manual_seed(seed + rows)
        pixels = torch.randn(rows, in_channels * temporal_patch * PATCH * PATCH, generator=generator)
        return pixels, grid_thw

    return make_inputs


def build_kimi_k25(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Kimi-K2.5 vision tower (MoonViT3d): images (t == 1) and video chunks (t <= 4)."""
    config_class, model_class = _load("kimi_k25", "Kimi_K25VisionConfig", "Kimi_K25VisionModel")
    config = config_class(
        patch_size=PATCH,
        pos_emb_height=8,
        pos_emb_width=8,
        pos_emb_time=4,
        num_attention_heads=HEADS,
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        merge_kernel_size=[MERGE, MERGE],
    )
    model = _build(model_class, config, attn_implementation, seed)

    def make_inputs(grid: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        grid_thw = _grid_tensor(grid)
        if bool((grid_thw[:, 0] > config.pos_emb_time).any()):
            raise ValueError(f"video chunks have at most {config.pos_emb_time} frames; got {grid}")
        rows = int(grid_thw.prod(dim=-1).sum())
        generator = torch.Generator().manual_seed(seed + rows)
        return torch.randn(rows, 3, PATCH, PATCH, generator=generator), grid_thw

    return Tower(f"kimi_k25[{attn_implementation}]", model, make_inputs, tensors_of)


def build_qwen2_vl(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Qwen2-VL vision tower: per-frame attention, a LayerNorm + MLP patch merger."""
    config_class, model_class = _load("qwen2_vl", "Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel")
    config = config_class(
        depth=LAYERS,
        embed_dim=HIDDEN,
        hidden_size=OUT_HIDDEN,  # Qwen2-VL's hidden_size is the merger's output (the LLM's width)
        mlp_ratio=2,
        num_heads=HEADS,
        in_channels=3,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL_PATCH,
    )
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"qwen2_vl[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


def build_qwen2_5_vl(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Qwen2.5-VL vision tower: window attention (2x2 merged tokens, i.e. 4x4 patches, per
    window) in layer 0, full attention in layer 1, and the window permutation undone after the merger."""
    config_class, model_class = _load("qwen2_5_vl", "Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel")
    config = config_class(
        **TINY_VISION,
        window_size=2 * MERGE * PATCH,  # in pixels: 2 merged tokens a side
        fullatt_block_indexes=[LAYERS - 1],
    )
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"qwen2_5_vl[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


def build_glm4v(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' GLM-4V (GLM-4.1V) vision tower: a learned 8x8 position table resampled per token
    with bicubic ``grid_sample``, RMSNorm blocks, a strided-conv downsample and a gated merger."""
    config_class, model_class = _load("glm4v", "Glm4vVisionConfig", "Glm4vVisionModel")
    config = config_class(
        depth=LAYERS,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        out_hidden_size=OUT_HIDDEN,
        num_heads=HEADS,
        in_channels=3,
        image_size=8 * PATCH,  # an 8x8 learned position table
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL_PATCH,
    )
    model = _build(model_class, config, attn_implementation, seed)
    qwen_inputs = _qwen_style_inputs(3, seed)

    def make_inputs(grid: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        if any(row[0] != 1 for row in grid):
            raise ValueError(f"GLM-4V takes one [1, h, w] row per frame (see the module docstring); got {grid}")
        return qwen_inputs(grid)

    return Tower(f"glm4v[{attn_implementation}]", model, make_inputs, tensors_of)


def build_qwen3_vl(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Qwen3-VL vision tower: a learned 8x8 position table resampled bilinearly per item
    (``fast_pos_embed_interpolate``: ``repeat_interleave`` by per-item counts), per-frame attention and
    "deepstack" mergers after chosen layers (here layer 0), whose features it returns beside the last."""
    config_class, model_class = _load("qwen3_vl", "Qwen3VLVisionConfig", "Qwen3VLVisionModel")
    config = config_class(
        **TINY_VISION,
        num_position_embeddings=64,  # an 8x8 learned position table
        deepstack_visual_indexes=[0],
    )
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"qwen3_vl[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


def build_qwen3_5(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Qwen3.5 vision tower: Qwen3-VL's without the deepstack mergers."""
    config_class, model_class = _load("qwen3_5", "Qwen3_5VisionConfig", "Qwen3_5VisionModel")
    config = config_class(**TINY_VISION, num_position_embeddings=64)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"qwen3_5[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


def build_glm_ocr(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' GLM-OCR vision tower (GLM-4V's layout, per-frame attention, images here)."""
    config_class, model_class = _load("glm_ocr", "GlmOcrVisionConfig", "GlmOcrVisionModel")
    config = config_class(**TINY_VISION, image_size=8 * PATCH)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"glm_ocr[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


def build_qwen3_vl_moe(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Qwen3-VL-MoE vision tower (Qwen3-VL-30B-A3B, 235B-A22B): Qwen3-VL's, a model of its own."""
    config_class, model_class = _load("qwen3_vl_moe", "Qwen3VLMoeVisionConfig", "Qwen3VLMoeVisionModel")
    config = config_class(**TINY_VISION, num_position_embeddings=64, deepstack_visual_indexes=[0])
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"qwen3_vl_moe[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


def build_qwen3_omni_moe(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Qwen3-Omni vision encoder (Qwen3-VL's layout, deepstack mergers)."""
    config_class, model_class = _load("qwen3_omni_moe", "Qwen3OmniMoeVisionEncoderConfig", "Qwen3OmniMoeVisionEncoder")
    config = config_class(**TINY_VISION, num_position_embeddings=64, deepstack_visual_indexes=[0])
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"qwen3_omni_moe[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


def build_glm4v_moe(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' GLM-4.5V / 4.6V vision tower (GLM-4V's)."""
    config_class, model_class = _load("glm4v_moe", "Glm4vMoeVisionConfig", "Glm4vMoeVisionModel")
    config = config_class(depth=LAYERS, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, out_hidden_size=OUT_HIDDEN,
                          num_heads=HEADS, in_channels=3, image_size=8 * PATCH, patch_size=PATCH,
                          spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"glm4v_moe[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


def build_glm_image(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' GLM-Image vision tower: GLM-4V's layout without a merge (merge size 1), one frame per row."""
    config_class, model_class = _load("glm_image", "GlmImageVisionConfig", "GlmImageVisionModel")
    config = config_class(depth=LAYERS, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_heads=HEADS, in_channels=3,
                          image_size=8 * PATCH, patch_size=PATCH, spatial_merge_size=1)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"glm_image[{attn_implementation}]", model, _qwen_style_inputs(3, seed, temporal_patch=1), tensors_of)


def build_ovis2_5(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Ovis2.5 vision tower (SigLIP2-NaViT packing): window-attention layers (Qwen2.5-VL's window
    index) and full-attention layers, one frame per row."""
    config_class, model_class = _load("ovis2_5", "Ovis2_5VisionConfig", "Ovis2_5VisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_channels=3, patch_size=PATCH, spatial_merge_size=MERGE,
                          image_size=8 * PATCH, window_size=2 * MERGE * PATCH,
                          layer_types=["window_attention", "full_attention"], temporal_patch_size=1)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"ovis2_5[{attn_implementation}]", model, _qwen_style_inputs(3, seed, temporal_patch=1), tensors_of)


def build_hunyuan_vl(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' HunYuan-VL vision tower: one patch per row (no temporal patch), images; its layers
    keep a [1, L, D] batch dim, so its packed rows are dim 1, not dim 0."""
    config_class, model_class = _load("hunyuan_vl", "HunYuanVLVisionConfig", "HunYuanVLVisionTransformer")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_channels=3, out_hidden_size=OUT_HIDDEN, patch_size=PATCH,
                          spatial_merge_size=MERGE, max_image_size=8 * PATCH, text_hidden_size=OUT_HIDDEN)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"hunyuan_vl[{attn_implementation}]", model, _qwen_style_inputs(3, seed, temporal_patch=1), tensors_of)


def build_ernie4_5_vl(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Ernie-4.5-VL vision tower: one frame-patch per row, attention per frame ([t, h, w]
    with t frames); the temporal merge is outside the tower."""
    config_class, model_class = _load("ernie4_5_vl_moe", "Ernie4_5_VLMoeVisionConfig",
                                      "Ernie4_5_VLMoeVisionTransformerPretrainedModel")
    config = config_class(depth=LAYERS, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_heads=HEADS,
                          in_channels=3, patch_size=PATCH, spatial_merge_size=MERGE)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"ernie4_5_vl[{attn_implementation}]", model, _qwen_style_inputs(3, seed, temporal_patch=1), tensors_of)


def build_video_llama_3(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' VideoLLaMA3 vision tower: a third input, one merge size per item (1 for images,
    2 for video frames, as its processor sets them); here they alternate."""
    config_class, model_class = _load("video_llama_3", "VideoLlama3VisionConfig", "VideoLlama3VisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_channels=3, patch_size=PATCH)
    model = _build(model_class, config, attn_implementation, seed)
    pixels_and_grid = _qwen_style_inputs(3, seed, temporal_patch=1)

    def make_inputs(grid: Sequence[Sequence[int]]):
        pixels, grid_thw = pixels_and_grid(grid)
        merge_sizes = torch.tensor([1 + index % 2 for index in range(len(grid))], dtype=torch.int64)
        return pixels, grid_thw, merge_sizes

    return Tower(f"video_llama_3[{attn_implementation}]", model, make_inputs, tensors_of)


def build_paddleocr_vl(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' PaddleOCR-VL vision tower (SigLIP-style, NaViT packing): pixel_values [1, L, 3, p, p]
    with one row per patch, images ([1, h, w] rows); the learned square grid is resampled bilinearly by a
    host-made gather of four rows per patch; the 2 x 2 merge is in the projector, outside the tower."""
    config_class, model_class = _load("paddleocr_vl", "PaddleOCRVisionConfig", "PaddleOCRVisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_channels=3, image_size=8 * PATCH, patch_size=PATCH,
                          spatial_merge_size=MERGE)
    model = _build(model_class, config, attn_implementation, seed)

    def make_inputs(grid: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        grid_thw = _grid_tensor(grid)
        rows = int(grid_thw.prod(dim=-1).sum())
        generator = torch.Generator().manual_seed(seed + rows)
        return torch.randn(1, rows, 3, PATCH, PATCH, generator=generator), grid_thw

    return Tower(f"paddleocr_vl[{attn_implementation}]", model, make_inputs, tensors_of)


def build_pixtral(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Pixtral vision tower (Mistral 3, Pixtral, LightOnOCR): pixel_values [N, 3, H, W], a
    batch of images padded to the largest, and image_sizes [N, 2] in pixels; the patch convolution runs
    on the padded batch and each image's patches are cropped out of it and packed into [1, L, D]; 2D
    rotary positions per image; attention under a block-diagonal mask (sdpa, eager). Grid rows are
    [1, h, w] in patches."""
    config_class, model_class = _load("pixtral", "PixtralVisionConfig", "PixtralVisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, head_dim=HIDDEN // HEADS, num_channels=3,
                          image_size=16 * PATCH, patch_size=PATCH)
    model = _build(model_class, config, attn_implementation, seed)

    def make_inputs(grid: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        grid_thw = _image_grid(grid, "Pixtral")
        sizes = grid_thw[:, 1:] * PATCH
        generator = torch.Generator().manual_seed(seed + int(grid_thw.prod(dim=-1).sum()))
        pixels = torch.zeros(len(grid), 3, int(sizes[:, 0].max()), int(sizes[:, 1].max()))
        for image, (height, width) in zip(pixels, sizes.tolist()):  # the processor pads with zeros
            image[:, :height, :width] = torch.randn(3, height, width, generator=generator)
        return pixels, sizes

    return Tower(f"pixtral[{attn_implementation}]", model, make_inputs, tensors_of)


def build_llava_onevision1_5(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' LLaVA-OneVision-1.5 vision tower (RICE-ViT): one patch per row, images; one CLS row is
    inserted before every frame (a split and a ``cat`` with the class embedding) and dropped after the
    layers."""
    config_class, model_class = _load("llava_onevision1_5", "LlavaOnevision15VisionConfig", "LlavaOnevision15VisionModel")
    config = config_class(depth=LAYERS, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_heads=HEADS, in_channels=3,
                          patch_size=PATCH, spatial_merge_size=MERGE, out_hidden_size=OUT_HIDDEN)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"llava_onevision1_5[{attn_implementation}]", model, _qwen_style_inputs(3, seed, temporal_patch=1),
                 tensors_of)


def build_minicpmv4_6(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' MiniCPM-V 4.6 vision tower (SigLIP-NaViT): every patch of every image packed along the
    width of one image, pixel_values [1, 3, p, L * p], and target_sizes [N, 2] (h, w in patches, int32);
    a window merge inside the tower (``insert_layer_id``). Grid rows are [1, h, w]."""
    return _build_minicpm("minicpmv4_6", "MiniCPMV4_6", attn_implementation, seed)


def build_hy_v4_vl(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' HY-V4-VL vision tower: one patch per row, images; its merger reshapes each image to
    [h, w] for a convolution and a newline column, item by item."""
    config_class, model_class = _load("hy_v4_vl", "HYV4VLVisionConfig", "HYV4VLVisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_channels=3, out_hidden_size=OUT_HIDDEN, patch_size=PATCH,
                          spatial_merge_size=MERGE, max_image_size=8 * PATCH)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"hy_v4_vl[{attn_implementation}]", model, _qwen_style_inputs(3, seed, temporal_patch=1), tensors_of)


def build_lfm3_vl(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' LFM3-VL vision tower: Qwen-style rows, grouped key/value heads (4 over 2), a
    convolution layer that reshapes each frame to its [h, w] grid, then a full-attention layer."""
    config_class, model_class = _load("lfm3_vl", "Lfm3VlVisionConfig", "Lfm3VlVisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, in_channels=3, patch_size=PATCH,
                          spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"lfm3_vl[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


# Towers new in transformers 5.25 (skipped on releases without them), probed 2026-12-05.


def _qwen_rows_tower(model_name: str, config_class_name: str, model_class_name: str, attn_implementation: str,
                     seed: int, **config_fields) -> Tower:
    """A tower on Qwen-style rows ([L, C*Tp*p*p], grid_thw [N, 3]) from its tiny config fields."""
    config_class, model_class = _load(model_name, config_class_name, model_class_name)
    model = _build(model_class, config_class(**config_fields), attn_implementation, seed)
    return Tower(f"{model_name}[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


def build_qwen2_5_omni(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Qwen2.5-Omni vision encoder: Qwen2.5-VL's tower (windows of 2 x 2 merged tokens in
    layer 0, full attention in layer 1) and rows; its last_hidden_state stays in window order."""
    return _qwen_rows_tower("qwen2_5_omni", "Qwen2_5OmniVisionEncoderConfig", "Qwen2_5OmniVisionEncoder",
                            attn_implementation, seed, **TINY_VISION, window_size=2 * MERGE * PATCH,
                            fullatt_block_indexes=[LAYERS - 1])


def build_qwen3_5_moe(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Qwen3.5-MoE vision tower (Qwen3.5's tower under another name)."""
    return _qwen_rows_tower("qwen3_5_moe", "Qwen3_5MoeVisionConfig", "Qwen3_5MoeVisionModel", attn_implementation, seed,
                            **TINY_VISION, num_position_embeddings=64)


def build_exaone4_5(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' EXAONE 4.5 vision tower: Qwen2.5-VL's layout and rows (window attention in layer 0,
    full attention in layer 1) with grouped key/value heads (4 query heads over 2)."""
    return _qwen_rows_tower("exaone4_5", "Exaone4_5_VisionConfig", "Exaone4_5_VisionModel", attn_implementation, seed,
                            **TINY_VISION, window_size=2 * MERGE * PATCH, fullatt_block_indexes=[LAYERS - 1],
                            num_key_value_heads=HEADS // 2)


def build_glm5_next(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' GLM-5-Next vision tower: Qwen-style rows, per-frame attention with q/k RMSNorm and
    axial RoPE, a strided-convolution downsample and a clamped-SwiGLU merger."""
    return _qwen_rows_tower("glm5_next", "Glm5NextVisionConfig", "Glm5NextVisionModel", attn_implementation, seed,
                            **TINY_VISION, image_size=8 * PATCH, projection_intermediate_size=INTERMEDIATE)


def build_cosmos3_edge(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Cosmos3-Edge vision tower (SigLIP2 NaViT): pixel_values [L, 3*p*p], one patch per row,
    grid_thw [N, 3]; an 8 x 8 learned position table resized per item (antialiased bilinear, in a loop
    over the grid), per-frame attention."""
    config_class, model_class = _load("cosmos3_edge", "Cosmos3EdgeVisionConfig", "Cosmos3EdgeVisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_channels=3, patch_size=PATCH, num_patches=64,
                          spatial_merge_size=MERGE)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"cosmos3_edge[{attn_implementation}]", model, _qwen_style_inputs(3, seed, temporal_patch=1),
                 tensors_of)


def build_minimax_m3_vl(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' MiniMax-M3-VL vision tower: Qwen-style rows, a Conv3d patch embedding, 3D axial RoPE,
    one attention segment per item (a video chunk of t temporal patches attends jointly); no merger (the
    projector merges). Its layers keep a [1, L, D] batch dim."""
    return _qwen_rows_tower("minimax_m3_vl", "MiniMaxM3VLVisionConfig", "MiniMaxM3VLVisionModel", attn_implementation,
                            seed, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, num_channels=3, image_size=8 * PATCH, patch_size=PATCH,
                            temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE)


def build_qwen4_exp(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Qwen4-Exp vision tower: Qwen3.5's layout (8 x 8 table resampled bilinearly, per-frame
    attention, a merger) with axial 2D RoPE."""
    return _qwen_rows_tower("qwen4_exp", "Qwen4ExpVisionConfig", "Qwen4ExpVisionModel", attn_implementation, seed,
                            **TINY_VISION, num_position_embeddings=64)


def build_cohere_compass(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Cohere Compass vision tower: Qwen3-VL's layout (deepstack merger after layer 0) with
    axial 2D RoPE; images only (its input_modalities)."""
    return _qwen_rows_tower("cohere_compass", "CohereCompassVisionConfig", "CohereCompassVisionModel",
                            attn_implementation, seed, **TINY_VISION, num_position_embeddings=64,
                            deepstack_visual_indexes=[0])


def _build_muse(model_name: str, prefix: str, attn_implementation: str, seed: int) -> Tower:
    config_class, model_class = _load(model_name, f"{prefix}VisionConfig", f"{prefix}VisionModel")
    config = config_class(patch_size=PATCH, pos_emb_height=4, pos_emb_width=4, max_position_embeddings=16,
                          num_attention_heads=HEADS, num_hidden_layers=LAYERS, hidden_size=HIDDEN,
                          intermediate_size=INTERMEDIATE, patch_temporal=TEMPORAL_PATCH, merge_size=MERGE,
                          layer_types=["window_attention", "full_attention"])
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"{model_name}[{attn_implementation}]", model, _qwen_style_inputs(3, seed), tensors_of)


def build_muse_glimmer(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Muse-Glimmer vision tower: Qwen-style rows through a linear patch embedding, a 4 x 4
    learned table resampled per patch (grid_sample), Qwen2.5-VL-style window attention in layer 0, per-frame
    attention in layer 1, a pixel-shuffle gather (2 x 2 blocks) at the end. Images and videos."""
    return _build_muse("muse_glimmer", "MuseGlimmer", attn_implementation, seed)


def build_muse_spark(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Muse-Spark vision tower (Muse-Glimmer's tower under another name)."""
    return _build_muse("muse_spark", "MuseSpark", attn_implementation, seed)


def build_dots3_note(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' dots3.note vision tower: pixel_values [L, 3*p*p], one patch per row, grid_thw [N, 3];
    per-frame attention, axial RoPE, layer 1 a routed MoE (4 experts, top 2)."""
    config_class, model_class = _load("dots3_note", "Dots3NoteVisionConfig", "Dots3NoteVisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_channels=3, patch_size=PATCH, spatial_merge_size=MERGE,
                          moe_intermediate_size=INTERMEDIATE, num_experts_per_tok=2,
                          pyramid_num_routed=[-1] * (LAYERS - 1) + [4],
                          adapter_in_dim=HIDDEN, adapter_out_dim=OUT_HIDDEN, adapter_merge_size=MERGE)
    model = _build(model_class, config, attn_implementation, seed)
    return Tower(f"dots3_note[{attn_implementation}]", model, _qwen_style_inputs(3, seed, temporal_patch=1),
                 tensors_of)


def build_inkling2(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' Inkling-2 vision tower: images; pixel_values [M, m*p, m*p, 3], one row per merged token,
    and image_grid_thw [N, 3] counted in merged tokens (grid rows here are in patches, divided by the merge
    size); one class token inserted before each image."""
    config_class, model_class = _load("inkling2", "Inkling2VisionConfig", "Inkling2VisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_channels=3, patch_size=PATCH, spatial_merge_size=MERGE,
                          posemb_grid_size=8, projection_hidden_dim=INTERMEDIATE, text_hidden_size=OUT_HIDDEN)
    model = _build(model_class, config, attn_implementation, seed)

    def make_inputs(grid: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        grid_thw = _image_grid(grid, "Inkling-2")
        merged = grid_thw // torch.tensor([1, MERGE, MERGE])
        tokens = int(merged.prod(dim=-1).sum())
        generator = torch.Generator().manual_seed(seed + tokens)
        return torch.rand(tokens, MERGE * PATCH, MERGE * PATCH, 3, generator=generator) * 2 - 1, merged

    return Tower(f"inkling2[{attn_implementation}]", model, make_inputs, tensors_of)


def _build_minicpm(model_name: str, prefix: str, attn_implementation: str, seed: int) -> Tower:
    config_class, model_class = _load(model_name, f"{prefix}VisionConfig", f"{prefix}VisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_channels=3, image_size=8 * PATCH, patch_size=PATCH,
                          insert_layer_id=0, window_kernel_size=(2, 2))
    model = _build(model_class, config, attn_implementation, seed)

    def make_inputs(grid: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        grid_thw = _image_grid(grid, model_name)
        rows = int(grid_thw.prod(dim=-1).sum())
        generator = torch.Generator().manual_seed(seed + rows)
        return torch.randn(1, 3, PATCH, rows * PATCH, generator=generator), grid_thw[:, 1:].to(torch.int32)

    return Tower(f"{model_name}[{attn_implementation}]", model, make_inputs, tensors_of)


def build_minicpm_ocr(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' MiniCPM-OCR vision tower (MiniCPM-V 4.6's tower and inputs under another name)."""
    return _build_minicpm("minicpm_ocr", "MiniCPMOcr", attn_implementation, seed)


def build_minicpmv4_7(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' MiniCPM-V 4.7 vision tower (MiniCPM-V 4.6's tower and inputs under another name)."""
    return _build_minicpm("minicpmv4_7", "MiniCPMV4_7", attn_implementation, seed)


def build_radio(attn_implementation: str = "sdpa", seed: int = 0) -> Tower:
    """transformers' C-RADIO (RadioModel) on its packed path: pixel_values [L, 3*p*p], image_grid_hw [N, 2]
    (images only); per image an 8 x 8 position table resized and class / register rows inserted."""
    config_class, model_class = _load("radio", "RadioConfig", "RadioModel")
    if "image_grid_hw" not in inspect.signature(model_class.forward).parameters:  # transformers <= 5.17
        import transformers

        raise TowerUnavailable(f"transformers {transformers.__version__}'s RadioModel has no packed path "
                               "(image_grid_hw)")
    config = config_class(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          mlp_ratio=INTERMEDIATE / HIDDEN, num_channels=3, patch_size=PATCH, image_size=8 * PATCH,
                          max_img_size=8 * PATCH, num_cls_tokens=2, num_registers=1)
    model = _build(model_class, config, attn_implementation, seed)

    def make_inputs(grid: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        grid_thw = _image_grid(grid, "RADIO's packed path")
        rows = int(grid_thw.prod(dim=-1).sum())
        generator = torch.Generator().manual_seed(seed + rows)
        return torch.randn(rows, 3 * PATCH * PATCH, generator=generator), grid_thw[:, 1:].contiguous()

    return Tower(f"radio[{attn_implementation}]", model, make_inputs, tensors_of)



# Towers probed for correctness only (tests/test_foreign_towers.py, test_probed_towers_match_eager): equal to
# eager, not (fully) graphed; the README says why for each.
PROBED_FACTORIES = {
    "llava_onevision1_5": build_llava_onevision1_5,
    "minicpmv4_6": build_minicpmv4_6,
    "hy_v4_vl": build_hy_v4_vl,
    "lfm3_vl": build_lfm3_vl,
    "minicpm_ocr": build_minicpm_ocr,
    "minicpmv4_7": build_minicpmv4_7,
    "dots3_note": build_dots3_note,
    "inkling2": build_inkling2,
    "radio": build_radio,
}


FACTORIES = {
    "kimi_k25": build_kimi_k25,
    "qwen2_vl": build_qwen2_vl,
    "qwen2_5_vl": build_qwen2_5_vl,
    "glm4v": build_glm4v,
    "qwen3_vl": build_qwen3_vl,
    "qwen3_5": build_qwen3_5,
    "glm_ocr": build_glm_ocr,
    "hunyuan_vl": build_hunyuan_vl,
    "ernie4_5_vl": build_ernie4_5_vl,
    "video_llama_3": build_video_llama_3,
    "paddleocr_vl": build_paddleocr_vl,
    "pixtral": build_pixtral,
    "qwen3_vl_moe": build_qwen3_vl_moe,
    "qwen3_omni_moe": build_qwen3_omni_moe,
    "glm4v_moe": build_glm4v_moe,
    "glm_image": build_glm_image,
    "ovis2_5": build_ovis2_5,
    "qwen2_5_omni": build_qwen2_5_omni,
    "qwen3_5_moe": build_qwen3_5_moe,
    "exaone4_5": build_exaone4_5,
    "glm5_next": build_glm5_next,
    "cosmos3_edge": build_cosmos3_edge,
    "minimax_m3_vl": build_minimax_m3_vl,
    "qwen4_exp": build_qwen4_exp,
    "cohere_compass": build_cohere_compass,
    "muse_glimmer": build_muse_glimmer,
    "muse_spark": build_muse_spark,
}
