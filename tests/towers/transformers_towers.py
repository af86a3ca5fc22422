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
        grid_thw = _grid_tensor(grid)
        if bool((grid_thw[:, 0] != 1).any()):
            raise ValueError(f"Pixtral takes images only (t == 1); got {grid}")
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
    config_class, model_class = _load("minicpmv4_6", "MiniCPMV4_6VisionConfig", "MiniCPMV4_6VisionModel")
    config = config_class(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_channels=3, image_size=8 * PATCH, patch_size=PATCH,
                          insert_layer_id=0, window_kernel_size=(2, 2))
    model = _build(model_class, config, attn_implementation, seed)

    def make_inputs(grid: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        grid_thw = _grid_tensor(grid)
        if bool((grid_thw[:, 0] != 1).any()):
            raise ValueError(f"MiniCPM-V takes images only (t == 1); got {grid}")
        rows = int(grid_thw.prod(dim=-1).sum())
        generator = torch.Generator().manual_seed(seed + rows)
        pixels = torch.randn(1, 3, PATCH, rows * PATCH, generator=generator)
        return pixels, grid_thw[:, 1:].to(torch.int32)

    return Tower(f"minicpmv4_6[{attn_implementation}]", model, make_inputs, tensors_of)


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


# Towers probed for correctness only (tests/test_foreign_towers.py, test_probed_towers_match_eager): equal to
# eager, not (fully) graphed; the README says why for each.
PROBED_FACTORIES = {
    "llava_onevision1_5": build_llava_onevision1_5,
    "minicpmv4_6": build_minicpmv4_6,
    "hy_v4_vl": build_hy_v4_vl,
    "lfm3_vl": build_lfm3_vl,
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
}
