"""Vision towers the project did not write, for the foreign-tower corpus (tests/test_foreign_towers.py).

- ``transformers_towers``: transformers' own towers (Kimi-K2.5, Qwen2-VL, Qwen2.5-VL, GLM-4V), tiny
  configs, random weights, built with ``Model._from_config``; never downloads anything;
- ``upstream_moonvit``: the project's MoonViT as its upstream remote code ships it (plain ``assert``s,
  three attention implementations, flash attention through an opaque custom op).

Every factory returns a :class:`Tower`: the model (eval, fp32), a function from a grid (a list of
``[t, h, w]`` or ``[h, w]`` rows) to the positional arguments of one call, and a function from the
model's return value to the list of tensors to compare.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn


class TowerUnavailable(Exception):
    """The installed library lacks this tower (or a class or config field it needs)."""


@dataclasses.dataclass(frozen=True)
class Tower:
    name: str
    model: nn.Module
    make_inputs: Callable[[Sequence[Sequence[int]]], tuple]
    extract_outputs: Callable[[Any], list[torch.Tensor]]


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in a return value, depth first: ModelOutput (its non-None fields in order), tuple,
    list, dict."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):  # transformers' ModelOutput is an OrderedDict of its non-None fields
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in tensors_of(item)]
    if value is None:
        return []
    raise TypeError(f"no tensors in a {type(value).__name__}")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want| (NaN when got has NaN: it fails every bound)."""
    scale = want.double().abs().max().item()
    return (got.double() - want.double()).abs().max().item() / max(scale, torch.finfo(torch.float32).tiny)


def randomize_weights_(model: nn.Module, seed: int) -> nn.Module:
    """Give every parameter random values of a scale where attention is sharp and position terms matter.

    Library initialisers (std 0.02) make attention almost uniform, so a wrong segment or a wrong RoPE
    angle moves the output by little; here matrices get std 1/sqrt(fan_in) (unit-scale activations,
    q.k logits of order 1), vectors 1 + 0.1 N(0, 1) for norm scales and 0.1 N(0, 1) otherwise, learned
    position tables std 0.5.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            if "position_embedding" in name or "pos_emb" in name:
                value = 0.5 * noise
            elif parameter.dim() >= 2:
                fan_in = parameter[0].numel()
                value = noise / fan_in**0.5
            elif "norm" in name and name.endswith("weight"):
                value = 1.0 + 0.1 * noise
            else:
                value = 0.1 * noise
            parameter.copy_(value.to(parameter.dtype))
    return model
