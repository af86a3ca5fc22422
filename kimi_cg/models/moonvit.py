"""Reference MoonViT vision tower of Kimi-VL (``MoonVitPretrainedModel``) and its projector.

This module is an *input* to the compiler, not part of it: it keeps the eager, host-synchronising
structure of the upstream remote code (moonshotai/Kimi-VL-A3B-Instruct), written afresh from the
facts in ``docs/design.md`` / the design brief, so that kimi_cg is tested on what serving engines
really run:

- ``grid_hws.tolist()`` loops for the position embedding, the RoPE lookup and the patch merger;
- per-image bicubic ``F.interpolate`` of the learned 64x64 position grid, behind upstream's
  comparison of a Python list with a ``torch.Size`` (never equal, so interpolation always runs);
- the RoPE table built lazily on first use and kept as a plain attribute;
- ``cu_seqlens`` from grid tensor ops; ``max_seqlen`` by ``.item()`` on the flash path; a dense
  ``[1, L, L]`` block-diagonal mask built by a Python loop on the sdpa path;
- a patch merger returning a list of per-image tensors.

Deviations from upstream (the only ones): three assertions dynamo cannot trace on data-dependent
values are written as ``torch._check`` calls with the same meaning:
1. the RoPE lookup's ``assert all(1 <= h <= max_h and 1 <= w <= max_w for h, w in shapes)`` is one
   ``torch._check`` per bound and item (a chained comparison would still be a Python ``and``);
2. the RoPE input validation's ``assert x.shape[:-2] == freqs_cis.shape[:-1]``;
3. the flash path's ``assert cu_seqlens[-1] == q.shape[0]`` becomes
   ``torch._check(cu_seqlens[-1].item() == q.shape[0])``.
Upstream's ``eager`` attention (which adds the boolean mask instead of masking) is not provided:
it is an upstream bug, not a reference.

State-dict keys equal upstream's, so a real checkpoint's vision-tower tensors load with
``strict=True``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from kimi_cg.ops import varlen_attention

ATTENTION_IMPLEMENTATIONS = ("flash_attention_2", "sdpa")


@dataclasses.dataclass
class MoonVitConfig:
    """Sizes of the Kimi-VL vision tower; defaults are the released model's."""

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    num_attention_heads: int = 16
    num_hidden_layers: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    merge_kernel_size: tuple[int, int] = (2, 2)
    rope_max_height: int = 512
    rope_max_width: int = 512
    rope_theta: float = 10000.0
    text_hidden_size: int = 2048
    projector_layer_norm_eps: float = 1e-5
    attn_implementation: str = "flash_attention_2"

    def __post_init__(self):
        self.merge_kernel_size = tuple(self.merge_kernel_size)
        if self.attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation must be one of {ATTENTION_IMPLEMENTATIONS}; got {self.attn_implementation!r}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.head_dim % 4:
            raise ValueError(f"2D RoPE needs a head dim divisible by 4; got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def tiny(cls, **overrides) -> "MoonVitConfig":
        """A few-layer preset for fast tests: head dim 16, an 8x8 position grid, a 128x128 RoPE table."""
        values = dict(
            init_pos_emb_height=8,
            init_pos_emb_width=8,
            num_attention_heads=4,
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=96,
            rope_max_height=128,
            rope_max_width=128,
            text_hidden_size=48,
        )
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_dict(cls, values: dict) -> "MoonVitConfig":
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in known})


class Learnable2DInterpPosEmb(nn.Module):
    """A learned [H, W, D] position grid, bicubically resized to each image's (h, w)."""

    def __init__(self, height: int, width: int, dim: int, interpolation_mode: str = "bicubic"):
        super().__init__()
        self.interpolation_mode = interpolation_mode
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        nn.init.normal_(self.weight)

    def forward(self, x: torch.Tensor, grid_hws: torch.Tensor) -> torch.Tensor:
        pos_embs = []
        for shape in grid_hws.tolist():
            # Upstream compares a list with a torch.Size: never equal, so this branch never fires.
            if shape == self.weight.shape[:-1]:
                pos_embs.append(self.weight.flatten(end_dim=1))
            else:
                grid = self.weight.permute(2, 0, 1).unsqueeze(0)
                resized = F.interpolate(grid, size=shape, mode=self.interpolation_mode)
                pos_embs.append(resized.squeeze(0).permute(1, 2, 0).flatten(end_dim=1))
        return x + torch.cat(pos_embs)


class MoonVisionPatchEmbed(nn.Module):
    def __init__(self, config: MoonVitConfig, in_channels: int = 3):
        super().__init__()
        self.patch_size = config.patch_size
        self.proj = nn.Conv2d(in_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size)
        self.pos_emb = Learnable2DInterpPosEmb(
            config.init_pos_emb_height, config.init_pos_emb_width, config.hidden_size
        )

    def forward(self, pixel_values: torch.Tensor, grid_hws: torch.Tensor) -> torch.Tensor:
        x = self.proj(pixel_values).view(pixel_values.size(0), -1)
        return self.pos_emb(x, grid_hws)


class Rope2DPosEmb(nn.Module):
    """2D rotary embedding over a [max_h, max_w] patch grid.

    For head dim ``dim`` there are ``dim // 4`` frequencies ``theta ** -(4 i / dim)``; complex pair
    ``2 i`` rotates by the patch's column (x, width) times frequency i and pair ``2 i + 1`` by its row
    (y, height). The [max_h, max_w, dim // 2] complex64 table is built on first use and kept as a
    plain attribute, as upstream does.
    """

    def __init__(self, dim: int, max_height: int, max_width: int, theta_base: float = 10000.0):
        super().__init__()
        self.dim = dim
        self.max_height = max_height
        self.max_width = max_width
        self.theta_base = theta_base
        self.freqs_cis = None

    def _precompute_freqs_cis(self, device: torch.device) -> torch.Tensor:
        positions = torch.arange(self.max_height * self.max_width, device=device).float()
        cols = positions % self.max_width
        rows = torch.div(positions, self.max_width, rounding_mode="floor")
        exponents = torch.arange(0, self.dim, 4, device=device)[: self.dim // 4].float() / self.dim
        freqs = 1.0 / (self.theta_base**exponents)
        col_cis = torch.polar(torch.ones(cols.numel(), freqs.numel(), device=device), torch.outer(cols, freqs))
        row_cis = torch.polar(torch.ones(rows.numel(), freqs.numel(), device=device), torch.outer(rows, freqs))
        # [max_h * max_w, dim // 4, 2] with (col, row) in the last axis, then [max_h, max_w, dim // 2].
        table = torch.stack([col_cis, row_cis], dim=-1)
        return table.reshape(self.max_height, self.max_width, -1)

    def get_freqs_cis_by_seqlens(self, grid_hws: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        # Built where the activations live (the grid may stay on the host, as serving engines keep it).
        if self.freqs_cis is None:
            self.freqs_cis = self._precompute_freqs_cis(device if device is not None else grid_hws.device)
        shapes = grid_hws.tolist()
        for h, w in shapes:  # upstream: assert all(1 <= h <= max_h and 1 <= w <= max_w ...)
            torch._check(h >= 1)
            torch._check(h <= self.max_height)
            torch._check(w >= 1)
            torch._check(w <= self.max_width)
        return torch.cat([self.freqs_cis[:h, :w].reshape(-1, self.dim // 2) for h, w in shapes], dim=0)


def apply_rope(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate adjacent channel pairs of q and k ([L, H, Dh]) by freqs_cis ([L, Dh / 2]), in fp32."""
    for x in (xq, xk):
        if x.ndim != freqs_cis.ndim + 1:
            raise ValueError(f"rope: {tuple(x.shape)} against {tuple(freqs_cis.shape)}")
        torch._check(x.shape[:-2] == freqs_cis.shape[:-1])  # upstream: assert
        if x.shape[-1] != 2 * freqs_cis.shape[-1]:
            raise ValueError(f"rope: head dim {x.shape[-1]} against {freqs_cis.shape[-1]} frequencies")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"rope: unsupported dtype {x.dtype}")
    freqs_cis = freqs_cis.unsqueeze(-2)
    xq_complex = torch.view_as_complex(xq.float().view(*xq.shape[:-1], -1, 2))
    xk_complex = torch.view_as_complex(xk.float().view(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_complex * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_complex * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Varlen attention over [L, H, Dh] with the segment bounds in cu_seqlens; returns [L, H * Dh]."""
    if q.dim() != 3:
        raise ValueError(f"flash attention expects [L, H, Dh]; got {tuple(q.shape)}")
    torch._check(cu_seqlens[-1].item() == q.shape[0])  # upstream: assert cu_seqlens[-1] == q.shape[0]
    max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
    out = torch.ops.kimi_cg.varlen_attention(q, k, v, cu_seqlens, max_seqlen)
    return out.flatten(start_dim=-2)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Dense SDPA under a block-diagonal boolean mask built segment by segment; returns [L, H * Dh]."""
    seq_length = q.shape[0]
    mask = torch.zeros([1, seq_length, seq_length], device=q.device, dtype=torch.bool)
    for i in range(1, len(cu_seqlens)):
        start, end = cu_seqlens[i - 1], cu_seqlens[i]
        mask[..., start:end, start:end] = True
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, dropout_p=0.0)
    return out.transpose(0, 1).reshape(seq_length, -1)


ATTENTION_FUNCTIONS = {"flash_attention_2": flash_attention, "sdpa": sdpa_attention}


class MLP2(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden)
        self.fc1 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class MoonVitEncoderLayer(nn.Module):
    """Pre-LN block: packed-qkv attention with 2D RoPE, then a gelu-tanh MLP."""

    def __init__(self, config: MoonVitConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.attn_implementation = config.attn_implementation
        self.norm0 = nn.LayerNorm(config.hidden_size)
        self.norm1 = nn.LayerNorm(config.hidden_size)
        self.mlp = MLP2(config.hidden_size, config.intermediate_size)
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)

    def attention_qkvpacked(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rope_freqs_cis: torch.Tensor):
        qkv = self.wqkv(x)
        qkv = qkv.view(*qkv.shape[:-1], 3, self.num_heads, self.head_dim)
        q, k, v = torch.unbind(qkv, dim=-3)
        q, k = apply_rope(q, k, rope_freqs_cis)
        attn_out = ATTENTION_FUNCTIONS[self.attn_implementation](q, k, v, cu_seqlens)
        return self.wo(attn_out)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rope_freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention_qkvpacked(self.norm0(x), cu_seqlens, rope_freqs_cis)
        return x + self.mlp(self.norm1(x))


class MoonVitEncoder(nn.Module):
    def __init__(self, config: MoonVitConfig):
        super().__init__()
        self.rope_2d = Rope2DPosEmb(
            config.head_dim, config.rope_max_height, config.rope_max_width, config.rope_theta
        )
        self.blocks = nn.ModuleList(MoonVitEncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, x: torch.Tensor, grid_hws: torch.Tensor) -> torch.Tensor:
        rope_freqs_cis = self.rope_2d.get_freqs_cis_by_seqlens(grid_hws, device=x.device)
        lengths = torch.cat([torch.zeros(1, device=grid_hws.device, dtype=grid_hws.dtype), grid_hws[:, 0] * grid_hws[:, 1]])
        cu_seqlens = lengths.cumsum(dim=0, dtype=torch.int32)
        for block in self.blocks:
            x = block(x, cu_seqlens, rope_freqs_cis)
        return self.final_layernorm(x)


def patch_merger(x: torch.Tensor, grid_hws: torch.Tensor, merge_kernel_size: Sequence[int]) -> list[torch.Tensor]:
    """Split packed patches per image and group each kh x kw window: [h*w, D] -> [h*w/(kh*kw), kh*kw, D]."""
    kernel_h, kernel_w = merge_kernel_size
    dim = x.size(-1)
    outputs = []
    start = 0
    for h, w in grid_hws.tolist():
        seq = x[start : start + h * w]
        windows = seq.view(h // kernel_h, kernel_h, w // kernel_w, kernel_w, dim).permute(0, 2, 1, 3, 4)
        outputs.append(windows.contiguous().view((h // kernel_h) * (w // kernel_w), kernel_h * kernel_w, -1))
        start += h * w
    return outputs


class _PretrainedMixin:
    """``from_pretrained(local_dir)``: config.json plus safetensors files in a folder (no hub)."""

    config_class: type

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, prefix: str = "", strict: bool = True, **config_overrides):
        from safetensors.torch import load_file

        path = os.fspath(path)
        config_values = {}
        config_path = os.path.join(path, "config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                config_values = json.load(f)
            config_values = config_values.get("vision_config", config_values)
        config_values.update(config_overrides)
        model = cls(cls.config_class.from_dict(config_values))
        files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        state = {}
        for name in files:
            for key, tensor in load_file(os.path.join(path, name)).items():
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = tensor
        model.load_state_dict(state, strict=strict)
        return model

    def save_pretrained(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(self.config), f, indent=2)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, os.path.join(path, "model.safetensors"))


class MoonVitPretrainedModel(_PretrainedMixin, nn.Module):
    """Kimi-VL's vision tower: (pixel_values [L, 3, p, p], grid_hws [N, 2]) -> N x [h*w/4, 4, D]."""

    config_class = MoonVitConfig

    def __init__(self, config: MoonVitConfig):
        super().__init__()
        self.config = config
        self.merge_kernel_size = config.merge_kernel_size
        self.patch_embed = MoonVisionPatchEmbed(config)
        self.encoder = MoonVitEncoder(config)

    def forward(self, pixel_values: torch.Tensor, grid_hws: torch.Tensor) -> list[torch.Tensor]:
        x = self.patch_embed(pixel_values, grid_hws)
        x = self.encoder(x, grid_hws)
        return patch_merger(x, grid_hws, self.merge_kernel_size)


class KimiVLMultiModalProjector(nn.Module):
    """LayerNorm each merged patch, concatenate the kh*kw of a window, then Linear-GELU-Linear."""

    def __init__(self, config: MoonVitConfig):
        super().__init__()
        kernel_h, kernel_w = config.merge_kernel_size
        self.hidden_size = config.hidden_size * kernel_h * kernel_w
        self.pre_norm = nn.LayerNorm(config.hidden_size, eps=config.projector_layer_norm_eps)
        self.linear_1 = nn.Linear(self.hidden_size, self.hidden_size)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(self.hidden_size, config.text_hidden_size)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        x = self.pre_norm(image_features).view(-1, self.hidden_size)
        return self.linear_2(self.act(self.linear_1(x)))


class KimiVLVisionEncoder(nn.Module):
    """Tower plus projector as a serving engine runs them: N x [h*w/4, text_hidden] per call."""

    def __init__(self, config: MoonVitConfig):
        super().__init__()
        self.vision_tower = MoonVitPretrainedModel(config)
        self.multi_modal_projector = KimiVLMultiModalProjector(config)

    def forward(self, pixel_values: torch.Tensor, grid_hws: torch.Tensor) -> list[torch.Tensor]:
        features = self.vision_tower(pixel_values, grid_hws)
        projected = self.multi_modal_projector(torch.cat(features))
        return list(projected.split([f.shape[0] for f in features]))
