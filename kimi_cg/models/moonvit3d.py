"""Reference MoonViT3d vision tower of Kimi-K2.5 (images and video chunks) and its projector.

Like ``moonvit.py`` this is an *input* to the compiler, not part of it. It keeps the eager,
host-synchronising structure of the upstream remote code (moonshotai/Kimi-K2.5), written afresh
from the facts in the design brief, and reuses the Kimi-VL building blocks of ``moonvit.py``:

- ``grid_thws.tolist()`` loops for the position embedding, the RoPE lookup and the patch merger;
- per-chunk bicubic ``F.interpolate`` of the learned position grid behind the list-against-
  ``torch.Size`` comparison that never holds, the 2D grid repeated over the chunk's ``t`` frames
  and, only when ``t > 1``, a fixed sin-cos time embedding;
- the 2D RoPE table built lazily and kept as a plain attribute, repeated ``t`` times (no temporal
  rotation);
- ``cu_seqlens`` from grid tensor ops with one segment of ``t * h * w`` tokens per chunk (the frames
  of a chunk attend to each other); ``max_seqlen`` by ``.item()`` on the flash path, a dense
  block-diagonal mask on the sdpa path (both from ``moonvit.py``);
- a temporal-mean patch merger returning a list of per-chunk tensors.

Input layout: ``pixel_values`` is ``[L, 3, p, p]`` with ``L = sum(t * h * w)``; the patches of a
chunk are frame-major (frame 0's ``h * w`` patches in raster order, then frame 1's, ...). An image is
a chunk with ``t == 1``.

Deviations from upstream (the only ones): as in ``moonvit.py``, assertions on values read from
``grid_thws`` are ``torch._check`` calls with the same meaning, one per bound (``1 <= t <=
init_pos_emb_time`` here, ``1 <= h, w <= rope max`` in the RoPE lookup), so that dynamo can trace
them on unbacked values; and upstream's ``if t == 1`` branch of the position embedding (a Python
branch on a grid value, which dynamo cannot trace) is computed branch-free with the same numbers:
the time rows are multiplied by ``(grid_thws[i, 0] > 1)``, so images add exact zeros.

State-dict keys equal the Kimi-VL tower's (``patch_embed.proj``, ``patch_embed.pos_emb.weight``,
``encoder.blocks.{i}.*``, ``encoder.final_layernorm``); the time table is a non-persistent buffer.
The projector's keys follow the Kimi-K2.5 checkpoint (``mm_projector.pre_norm``,
``mm_projector.proj.0``, ``mm_projector.proj.2``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from kimi_cg.models.moonvit import (
    Learnable2DInterpPosEmb,
    MoonVitConfig,
    MoonVitEncoderLayer,
    Rope2DPosEmb,
    _PretrainedMixin,
)


@dataclasses.dataclass
class MoonViT3dConfig(MoonVitConfig):
    """Sizes of the Kimi-K2.5 vision tower; defaults are the released model's.

    Adds to ``MoonVitConfig``: ``init_pos_emb_time``, the length of the time-embedding table (the
    most frames a video chunk may have; upstream's config name), and the Kimi-K2.5 text hidden size
    as the projector's output width. ``tiny()`` and ``from_dict()`` are inherited.
    """

    init_pos_emb_time: int = 4
    text_hidden_size: int = 7168

    def __post_init__(self):
        super().__post_init__()
        if self.init_pos_emb_time < 1:
            raise ValueError(f"init_pos_emb_time must be >= 1; got {self.init_pos_emb_time}")

    @property
    def num_frames_pos_emb(self) -> int:
        """The most frames a chunk may have (the rows of the time-embedding table)."""
        return self.init_pos_emb_time


def sincos_time_embedding(num_frames: int, dim: int) -> torch.Tensor:
    """The fixed 1D sin-cos table [num_frames, dim], fp32.

    Row ``f``: ``sin(f * omega_i)`` in the first ``dim / 2`` channels, ``cos(f * omega_i)`` in the
    last ``dim / 2``, with ``omega_i = 1 / 10000 ** (i / (dim / 2))``. Computed in float64 and rounded
    once, so the table does not depend on the order of the float32 operations.
    """
    if dim % 2:
        raise ValueError(f"the sin-cos time embedding needs an even dim; got {dim}")
    half = dim // 2
    omega = 1.0 / 10000.0 ** (torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(torch.arange(num_frames, dtype=torch.float64), omega)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class Learnable2DInterpPosEmbDividedFixed(Learnable2DInterpPosEmb):
    """The learned [H, W, D] grid resized per chunk, repeated over frames, plus a fixed time term.

    ``weight`` (and its initialisation) is the Kimi-VL module's; ``time_weight`` is the
    non-persistent ``[init_pos_emb_time, D]`` sin-cos table added frame by frame to video chunks.
    """

    def __init__(self, height: int, width: int, num_frames: int, dim: int, interpolation_mode: str = "bicubic"):
        super().__init__(height, width, dim, interpolation_mode)
        self.num_frames = num_frames
        self.register_buffer("time_weight", sincos_time_embedding(num_frames, dim), persistent=False)

    def forward(self, x: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        pos_embs = []
        for index, (t, h, w) in enumerate(grid_thws.tolist()):
            torch._check(t >= 1)  # upstream: assert t <= num_frames
            torch._check(t <= self.num_frames)
            shape = [h, w]
            # Upstream compares a list with a torch.Size: never equal, so this branch never fires.
            if shape == self.weight.shape[:-1]:
                pos_emb_2d = self.weight.flatten(end_dim=1)
            else:
                grid = self.weight.permute(2, 0, 1).unsqueeze(0)
                resized = F.interpolate(grid, size=shape, mode=self.interpolation_mode)
                pos_emb_2d = resized.squeeze(0).permute(1, 2, 0).flatten(end_dim=1)
            # Upstream: `if t == 1: plain 2D term else: 2D term repeated + time rows`. A Python branch on
            # a grid value cannot be traced, so the time rows are scaled by (t > 1) read from the grid
            # tensor: images add exact zeros, i.e. the same numbers as upstream's branch.
            is_video = (grid_thws[index, 0] > 1).to(self.time_weight.dtype)
            # [t, h*w, D]: frame f of the chunk gets time row f on every patch.
            time_rows = (self.time_weight[:t] * is_video).unsqueeze(1)
            pos_emb_3d = pos_emb_2d.unsqueeze(0).repeat(t, 1, 1) + time_rows
            pos_embs.append(pos_emb_3d.flatten(end_dim=1))
        return x + torch.cat(pos_embs)


class MoonVision3dPatchEmbed(nn.Module):
    """Conv patch embedding (one 14x14 patch per row of pixel_values) plus the 3D position term."""

    def __init__(self, config: MoonViT3dConfig, in_channels: int = 3):
        super().__init__()
        self.patch_size = config.patch_size
        self.proj = nn.Conv2d(in_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size)
        self.pos_emb = Learnable2DInterpPosEmbDividedFixed(
            config.init_pos_emb_height, config.init_pos_emb_width, config.init_pos_emb_time, config.hidden_size
        )

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        x = self.proj(pixel_values).view(pixel_values.size(0), -1)
        return self.pos_emb(x, grid_thws)


class Rope2DPosEmbRepeated(Rope2DPosEmb):
    """The Kimi-VL 2D RoPE table, looked up per chunk and repeated for each of its ``t`` frames."""

    def get_freqs_cis(self, grid_thws: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        if self.freqs_cis is None:
            self.freqs_cis = self._precompute_freqs_cis(device if device is not None else grid_thws.device)
        shapes = grid_thws.tolist()
        for _, h, w in shapes:  # upstream: assert all(1 <= h <= max_h and 1 <= w <= max_w ...)
            torch._check(h >= 1)
            torch._check(h <= self.max_height)
            torch._check(w >= 1)
            torch._check(w <= self.max_width)
        return torch.cat(
            [self.freqs_cis[:h, :w].reshape(-1, self.dim // 2).repeat(t, 1) for t, h, w in shapes], dim=0
        )


class MoonViT3dEncoder(nn.Module):
    """The Kimi-VL blocks over chunks: one attention segment of t*h*w tokens per chunk."""

    def __init__(self, config: MoonViT3dConfig):
        super().__init__()
        self.rope_2d = Rope2DPosEmbRepeated(
            config.head_dim, config.rope_max_height, config.rope_max_width, config.rope_theta
        )
        self.blocks = nn.ModuleList(MoonVitEncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, x: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        rope_freqs_cis = self.rope_2d.get_freqs_cis(grid_thws, device=x.device)
        chunk_lengths = grid_thws[:, 0] * grid_thws[:, 1] * grid_thws[:, 2]
        lengths = torch.cat([torch.zeros(1, device=grid_thws.device, dtype=grid_thws.dtype), chunk_lengths])
        cu_seqlens = lengths.cumsum(dim=0, dtype=torch.int32)
        for block in self.blocks:
            x = block(x, cu_seqlens, rope_freqs_cis)
        return self.final_layernorm(x)


def tpool_patch_merger(
    x: torch.Tensor, grid_thws: torch.Tensor, merge_kernel_size: Sequence[int]
) -> list[torch.Tensor]:
    """Split packed patches per chunk, average over frames, group each kh x kw window.

    ``[t*h*w, D] -> [h*w/(kh*kw), kh*kw, D]``: windows in raster order, the kh*kw patches of a window
    row-major; entry ``[m, j]`` is the mean over the chunk's frames of one patch.
    """
    kernel_h, kernel_w = merge_kernel_size
    dim = x.size(-1)
    outputs = []
    start = 0
    for t, h, w in grid_thws.tolist():
        seq = x[start : start + t * h * w]
        frames = seq.view(t, h // kernel_h, kernel_h, w // kernel_w, kernel_w, dim)
        windows = frames.mean(dim=0).permute(0, 2, 1, 3, 4)
        outputs.append(windows.contiguous().view((h // kernel_h) * (w // kernel_w), kernel_h * kernel_w, -1))
        start += t * h * w
    return outputs


class MoonViT3dPretrainedModel(_PretrainedMixin, nn.Module):
    """Kimi-K2.5's vision tower: (pixel_values [L, 3, p, p], grid_thws [N, 3]) -> N x [h*w/4, 4, D]."""

    config_class = MoonViT3dConfig

    def __init__(self, config: MoonViT3dConfig):
        super().__init__()
        self.config = config
        self.merge_kernel_size = config.merge_kernel_size
        self.patch_embed = MoonVision3dPatchEmbed(config)
        self.encoder = MoonViT3dEncoder(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[torch.Tensor]:
        x = self.patch_embed(pixel_values, grid_thws)
        x = self.encoder(x, grid_thws)
        return tpool_patch_merger(x, grid_thws, self.merge_kernel_size)


class KimiK25MultiModalProjector(nn.Module):
    """LayerNorm each merged patch, concatenate the kh*kw of a window, then Linear-GELU-Linear.

    The layers sit in ``proj`` (a Sequential) so that the keys are the checkpoint's
    ``pre_norm.*``, ``proj.0.*`` and ``proj.2.*``. GELU is the exact (erf) one.
    """

    def __init__(self, config: MoonViT3dConfig):
        super().__init__()
        kernel_h, kernel_w = config.merge_kernel_size
        self.hidden_size = config.hidden_size * kernel_h * kernel_w
        self.pre_norm = nn.LayerNorm(config.hidden_size, eps=config.projector_layer_norm_eps)
        self.proj = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size),
            nn.GELU(),
            nn.Linear(self.hidden_size, config.text_hidden_size),
        )

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pre_norm(image_features).view(-1, self.hidden_size))


class KimiK25VisionEncoder(nn.Module):
    """Tower plus projector as a serving engine runs them: N x [h*w/4, text_hidden] per call."""

    def __init__(self, config: MoonViT3dConfig):
        super().__init__()
        self.vision_tower = MoonViT3dPretrainedModel(config)
        self.mm_projector = KimiK25MultiModalProjector(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[torch.Tensor]:
        features = self.vision_tower(pixel_values, grid_thws)
        projected = self.mm_projector(torch.cat(features))
        return list(projected.split([f.shape[0] for f in features]))
