"""What ``python -m kimi_cg.testing MODULE:FACTORY`` runs: a :class:`Target`, and kimi_cg's own towers as examples.

A factory is any function returning a Target (or a ``(model, make_inputs)`` pair); the command line
passes ``device=`` and ``dtype=`` (strings) when given, so a factory that takes them should.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from hypothesis import strategies as st

from kimi_cg.testing.strategies import grids


@dataclasses.dataclass
class Target:
    """One tower to fuzz: the eager model, its inputs per grid, and optionally the grids to draw
    (default ``grids()``), what of its return value to compare, and the kimi_cg options to compile with."""

    model: torch.nn.Module
    make_inputs: Callable[[list[list[int]]], Any]
    grids: st.SearchStrategy | None = None
    outputs: Callable[[Any], Any] | None = None
    options: dict | None = None

    @classmethod
    def of(cls, value) -> "Target":
        """A factory's return value as a Target: a Target, or a (model, make_inputs[, grids]) tuple."""
        if isinstance(value, Target):
            return value
        if isinstance(value, tuple) and 2 <= len(value) <= 3 and isinstance(value[0], torch.nn.Module) and callable(value[1]):
            return cls(*value)
        raise TypeError(f"a fuzz target factory must return kimi_cg.testing.Target or (model, make_inputs[, grids]); "
                        f"got {type(value).__name__}")


def pixel_inputs(device: str | torch.device, dtype: torch.dtype, patch_size: int = 14, channels: int = 3):
    """``make_inputs`` of a MoonViT-style tower: (patches [L, C, p, p] random normal, grid [N, 2|3] int64
    on the host, as serving engines keep it)."""
    def make_inputs(grid):
        grid_tensor = torch.tensor(grid, dtype=torch.int64)
        rows = int(grid_tensor.prod(dim=-1).sum())
        return torch.randn(rows, channels, patch_size, patch_size).to(device=device, dtype=dtype), grid_tensor
    return make_inputs


def moonvit(device: str = "cpu", dtype: str = "float32", size: str = "tiny", attn_implementation: str = "sdpa") -> Target:
    """Kimi-VL's MoonViT (kimi_cg's reference tower), random weights: images, [h, w] rows."""
    from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel

    config = MoonVitConfig.tiny(attn_implementation=attn_implementation) if size == "tiny" else MoonVitConfig(attn_implementation=attn_implementation)
    return _reference_tower(MoonVitPretrainedModel, config, device, dtype, dims=2)


def moonvit3d(device: str = "cpu", dtype: str = "float32", size: str = "tiny", attn_implementation: str = "sdpa") -> Target:
    """Kimi-K2.5's MoonViT3d, random weights: images and video chunks, [t, h, w] rows."""
    from kimi_cg.models import MoonViT3dConfig, MoonViT3dPretrainedModel

    config = MoonViT3dConfig.tiny(attn_implementation=attn_implementation) if size == "tiny" else MoonViT3dConfig(attn_implementation=attn_implementation)
    return _reference_tower(MoonViT3dPretrainedModel, config, device, dtype, dims=3)


def _reference_tower(model_class, config, device: str, dtype: str, dims: int) -> Target:
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}: float32, bfloat16, float16")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)  # the same weights on every run: a failure reproduces
    model = model_class(config).eval().to(device=device, dtype=torch_dtype)
    torch.random.set_rng_state(generator_state)
    table = config.init_pos_emb_height
    # On CPU 4 items of up to 2048 patches: each item count is one dynamo trace (seconds each).
    strategy = grids(dims=dims, max_items=4 if device == "cpu" else 8, max_side=max(64, table),
                     max_patches=2048 if device == "cpu" else 16384,
                     table_size=table, max_frames=getattr(config, "init_pos_emb_time", 4))
    return Target(model, pixel_inputs(device, torch_dtype, config.patch_size), strategy)
