"""MoonViT (Kimi-VL's vision tower) as its upstream remote code ships it, built on the project's modules.

The project's reference tower (``kimi_cg/models/moonvit.py``) deviates from upstream in two ways so that
dynamo can trace it; this variant undoes both, so the corpus also covers the code users really load:

1. the three data-dependent checks are plain Python ``assert``s again, not ``torch._check``:
   - the RoPE lookup's ``assert all(1 <= h <= max_h and 1 <= w <= max_w for h, w in shapes)`` over the
     ``grid_hws.tolist()`` list (a generator that short-circuits on grid values);
   - the RoPE input validation's ``assert x.shape[:-2] == freqs_cis.shape[:-1]`` (the packed length
     against the sum of per-image slices);
   - the flash path's ``assert cu_seqlens[-1] == q.shape[0]`` (a tensor compared with an int, i.e. a
     branch on tensor data);
2. three attention implementations, selected by ``config.attn_implementation``:
   - ``"eager"``: ``softmax(q k^T * scale + mask) v`` under a dense block-diagonal mask;
   - ``"sdpa"``: a dense ``[1, L, L]`` bool mask built by a Python loop of slice assignments whose bounds
     are tensor elements of ``cu_seqlens``, then ``F.scaled_dot_product_attention``;
   - ``"flash_attention_2"``: ``max_seqlen = (cu[1:] - cu[:-1]).max().item()`` in every layer, then an
     opaque varlen kernel. flash-attn is not importable here (no CUDA), so the kernel is a stand-in
     custom op, ``torch.ops.kimi_cg_test.flash_attn_varlen_fwd``, with flash-attn's varlen signature:
     per-segment SDPA on the CPU, torch's varlen flash kernel on CUDA (like flash-attn's kernel, it
     reads ``cu_seqlens`` on the device only, so a CUDA graph can capture it). It is deliberately not
     the project's own ``kimi_cg::varlen_attention``: a compiler must not rely on the model calling
     its op.

Everything else (patch embedding with the per-image bicubic position grid, the packed-qkv pre-LN
blocks, the per-image patch merger) is the project's code, reused by subclassing; state-dict keys
equal upstream's. Upstream's ``assert q.dtype in (bf16, fp16)`` on the flash path is left out: these
towers run in fp32 on the CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from kimi_cg.models import moonvit

from . import Tower, randomize_weights_, tensors_of

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")

FLASH_STAND_IN = "kimi_cg_test::flash_attn_varlen_fwd"


# --- the flash-attn stand-in -------------------------------------------------------------------


def _flash_attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
) -> torch.Tensor:
    """flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal) on
    [total, H, Dh] tensors.

    On the CPU it runs per segment with SDPA and refuses what the real kernel cannot do or would get
    silently wrong: non-int32 bounds, a segment longer than its max_seqlen (flash sizes its grid by
    max_seqlen and never visits the rows beyond), bounds that do not cover the packed rows. On CUDA in fp16 /
    bf16 it is torch's varlen flash kernel, which, like flash-attn's, never reads the bounds on the host
    (those checks would be host syncs, which the real op does not make and a CUDA graph cannot capture);
    fp32 on CUDA (a test's fp32 reference; flash-attn refuses it) takes the per-segment path.
    """
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32; got {cu_seqlens_q.dtype}, {cu_seqlens_k.dtype}")
    if dropout_p != 0.0:
        raise ValueError("the stand-in computes inference attention only (dropout_p must be 0)")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):  # fp32 (a test's reference): the loop below
        return _torch_varlen_flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(bounds_q) != len(bounds_k) or bounds_q[0] != 0 or bounds_k[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and have one length; got {bounds_q}, {bounds_k}")
    if bounds_q[-1] != q.shape[0] or bounds_k[-1] != k.shape[0]:
        raise ValueError(f"cu_seqlens end at {bounds_q[-1]}, {bounds_k[-1]}; q, k hold {q.shape[0]}, {k.shape[0]} rows")
    out = torch.zeros_like(q)
    for start_q, end_q, start_k, end_k in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        if end_q - start_q > max_seqlen_q or end_k - start_k > max_seqlen_k:
            raise ValueError(
                f"segment of {end_q - start_q} x {end_k - start_k} rows exceeds max_seqlen {max_seqlen_q} x {max_seqlen_k}"
            )
        if end_q == start_q:
            continue
        segment = F.scaled_dot_product_attention(
            q[start_q:end_q].transpose(0, 1),
            k[start_k:end_k].transpose(0, 1),
            v[start_k:end_k].transpose(0, 1),
            is_causal=causal,
            scale=softmax_scale,
        )
        out[start_q:end_q] = segment.transpose(0, 1)
    return out


def _torch_varlen_flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                       window_size=(-1, 0) if causal else (-1, -1))


def _flash_attn_varlen_fwd_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False
):
    return torch.empty_like(q)


def _register_flash_stand_in() -> None:
    """Define the op once per process (this module may be imported under more than one name)."""
    namespace, name = FLASH_STAND_IN.split("::")
    if hasattr(getattr(torch.ops, namespace), name):
        return
    op = torch.library.custom_op(FLASH_STAND_IN, _flash_attn_varlen_fwd, mutates_args=())
    op.register_fake(_flash_attn_varlen_fwd_fake)


_register_flash_stand_in()


# --- upstream's attention functions ------------------------------------------------------------


def _block_diagonal_mask(seq_length: int, cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[1, L, L] bool, True inside each segment, built as upstream does: a Python loop of slice
    assignments whose bounds are (0-d tensor) elements of cu_seqlens."""
    mask = torch.zeros([1, seq_length, seq_length], device=device, dtype=torch.bool)
    for i in range(1, len(cu_seqlens)):
        start, end = cu_seqlens[i - 1], cu_seqlens[i]
        mask[..., start:end, start:end] = True
    return mask


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[L, H, Dh] -> [L, H * Dh]: explicit softmax attention under the block-diagonal mask.

    Upstream adds the bool mask to the scores (``scores += mask``: +1 inside a segment, +0 across),
    which lets every token attend to every other image: an upstream bug. Here the mask masks
    (-inf across segments), so eager, sdpa and flash agree.
    """
    seq_length = q.shape[0]
    mask = _block_diagonal_mask(seq_length, cu_seqlens, q.device)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, L, Dh]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (weights @ v).transpose(0, 1).reshape(seq_length, -1)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[L, H, Dh] -> [L, H * Dh]: SDPA under the dense block-diagonal bool mask."""
    seq_length = q.shape[0]
    mask = _block_diagonal_mask(seq_length, cu_seqlens, q.device)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, dropout_p=0.0)
    return out.transpose(0, 1).reshape(seq_length, -1)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[L, H, Dh] -> [L, H * Dh]: the varlen kernel, with max_seqlen read back to the host per call."""
    assert q.dim() == k.dim() == v.dim() == 3, (q.shape, k.shape, v.shape)
    assert cu_seqlens[-1] == q.shape[0], (cu_seqlens[-1], q.shape[0])
    assert cu_seqlens[-1] == k.shape[0] == v.shape[0], (cu_seqlens[-1], k.shape[0], v.shape[0])
    max_seqlen_q = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
    max_seqlen_k = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
    out = torch.ops.kimi_cg_test.flash_attn_varlen_fwd(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen_q, max_seqlen_k, causal=False
    )
    return out.flatten(start_dim=-2)


ATTENTION_FUNCTIONS = {"eager": eager_attention, "sdpa": sdpa_attention, "flash_attention_2": flash_attention}


# --- RoPE with upstream's assertions -----------------------------------------------------------


def _check_rope_input(x: torch.Tensor, freqs_cis: torch.Tensor) -> None:
    assert x.ndim == freqs_cis.ndim + 1, (x.shape, freqs_cis.shape)
    assert x.shape[:-2] == freqs_cis.shape[:-1], (x.shape, freqs_cis.shape)
    assert x.shape[-1] == 2 * freqs_cis.shape[-1], (x.shape, freqs_cis.shape)
    assert freqs_cis.dtype == torch.complex64, freqs_cis.dtype


def apply_rope(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate adjacent channel pairs of q, k ([L, H, Dh]) by freqs_cis ([L, Dh / 2] complex64), in fp32."""
    _check_rope_input(xq, freqs_cis)
    _check_rope_input(xk, freqs_cis)
    freqs_cis = freqs_cis.unsqueeze(-2)  # broadcast over heads
    rotated = []
    for x in (xq, xk):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rotated.append(torch.view_as_real(pairs * freqs_cis).flatten(-2).type_as(x))
    return rotated[0], rotated[1]


class UpstreamRope2DPosEmb(moonvit.Rope2DPosEmb):
    """The 2D RoPE table, looked up per image after upstream's generator assertion."""

    def _build_table(self, device: torch.device) -> torch.Tensor:
        """[max_h, max_w, dim / 2] complex64: pair 2i turns by column * f_i, pair 2i + 1 by row * f_i,
        with f_i = theta ** (-4 i / dim)."""
        frequencies = self.theta_base ** -(torch.arange(0, self.dim, 4, device=device)[: self.dim // 4].float() / self.dim)
        rows = torch.arange(self.max_height, device=device).float()
        cols = torch.arange(self.max_width, device=device).float()
        col_angles = torch.outer(cols, frequencies)[None, :, :].expand(self.max_height, -1, -1)
        row_angles = torch.outer(rows, frequencies)[:, None, :].expand(-1, self.max_width, -1)
        angles = torch.stack([col_angles, row_angles], dim=-1).reshape(self.max_height, self.max_width, -1)
        return torch.polar(torch.ones_like(angles), angles)

    def get_freqs_cis_by_seqlens(self, grid_hws: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        if self.freqs_cis is None:  # built on first use and kept as a plain attribute, as upstream does
            self.freqs_cis = self._build_table(device if device is not None else grid_hws.device)
        shapes = grid_hws.tolist()
        assert all(1 <= h <= self.max_height and 1 <= w <= self.max_width for h, w in shapes), (
            shapes,
            self.max_height,
            self.max_width,
        )
        return torch.cat([self.freqs_cis[:h, :w].reshape(-1, self.dim // 2) for h, w in shapes], dim=0)


# --- the tower ---------------------------------------------------------------------------------


@dataclasses.dataclass
class UpstreamMoonVitConfig(moonvit.MoonVitConfig):
    """The project's MoonViT sizes plus upstream's three attention implementations."""

    attn_implementation: str = "flash_attention_2"

    def __post_init__(self):
        requested = self.attn_implementation
        if requested not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation must be one of {ATTENTION_IMPLEMENTATIONS}; got {requested!r}")
        # The project's config validates the other fields but knows only two implementations.
        self.attn_implementation = "sdpa"
        super().__post_init__()
        self.attn_implementation = requested


class UpstreamMoonVitEncoderLayer(moonvit.MoonVitEncoderLayer):
    """The project's block (same parameters) with upstream's RoPE checks and attention choice."""

    def attention_qkvpacked(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rope_freqs_cis: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x)
        q, k, v = qkv.view(*qkv.shape[:-1], 3, self.num_heads, self.head_dim).unbind(dim=-3)
        q, k = apply_rope(q, k, rope_freqs_cis)
        return self.wo(ATTENTION_FUNCTIONS[self.attn_implementation](q, k, v, cu_seqlens))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, rope_freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention_qkvpacked(self.norm0(x), cu_seqlens, rope_freqs_cis)
        return x + self.mlp(self.norm1(x))


class UpstreamMoonVitEncoder(moonvit.MoonVitEncoder):
    def __init__(self, config: UpstreamMoonVitConfig):
        nn.Module.__init__(self)  # the parent would build its own RoPE and blocks only to be replaced
        self.rope_2d = UpstreamRope2DPosEmb(config.head_dim, config.rope_max_height, config.rope_max_width, config.rope_theta)
        self.blocks = nn.ModuleList(UpstreamMoonVitEncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size)
    # forward: the parent's (RoPE lookup, cu_seqlens from the grid, the blocks, the final LayerNorm).


class UpstreamMoonVitPretrainedModel(moonvit.MoonVitPretrainedModel):
    """(pixel_values [L, 3, p, p], grid_hws [N, 2]) -> N x [h*w/4, 4, D], upstream's code path."""

    config_class = UpstreamMoonVitConfig

    def __init__(self, config: UpstreamMoonVitConfig):
        nn.Module.__init__(self)
        self.config = config
        self.merge_kernel_size = config.merge_kernel_size
        self.patch_embed = moonvit.MoonVisionPatchEmbed(config)
        self.encoder = UpstreamMoonVitEncoder(config)

    def forward(self, pixel_values: torch.Tensor, grid_hws: torch.Tensor) -> list[torch.Tensor]:
        x = self.patch_embed(pixel_values, grid_hws)
        x = self.encoder(x, grid_hws)
        return moonvit.patch_merger(x, grid_hws, self.merge_kernel_size)


def build_upstream_moonvit(attn_implementation: str = "flash_attention_2", seed: int = 0) -> Tower:
    """A 2-layer, head-dim-16 upstream MoonViT with random weights; grids are [h, w] rows (even h, w)."""
    config = UpstreamMoonVitConfig(
        patch_size=14,
        init_pos_emb_height=8,
        init_pos_emb_width=8,
        num_attention_heads=4,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        rope_max_height=64,
        rope_max_width=64,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    model = randomize_weights_(UpstreamMoonVitPretrainedModel(config), seed).eval()

    def make_inputs(grid: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        grid_hws = torch.tensor(grid, dtype=torch.int64)
        if grid_hws.dim() != 2 or grid_hws.size(1) != 2 or bool((grid_hws % 2).any()):
            raise ValueError(f"grid rows must be [h, w] with even h and w; got {grid}")
        rows = int(grid_hws.prod(dim=-1).sum())
        generator = torch.Generator().manual_seed(seed + rows)
        return torch.randn(rows, 3, config.patch_size, config.patch_size, generator=generator), grid_hws

    return Tower(f"upstream_moonvit[{attn_implementation}]", model, make_inputs, tensors_of)
