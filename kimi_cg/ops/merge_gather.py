"""Weighted row gather as custom ops: ``torch.ops.kimi_cg.merge_gather`` and its LayerNorm fusion.

    x:       [L, D]  float32 / bfloat16 / float16
    index:   [R, K]  int64, -1 = no contribution
    weight:  [R, K]  float32
    returns  [R, D]  x.dtype; out[r] = sum over valid k of weight[r, k] * x[index[r, k]]
    (``merge_gather_layernorm`` then applies LayerNorm(D) with ln_weight, ln_bias, eps)

Implementations, chosen by the device of ``x``:
- CUDA: the Triton kernels in ``kimi_cg.kernels.merge_gather`` (imported on first use, so CPU-only
  installs without triton can still import this module).
- CPU: the plain PyTorch references from the same module, or the Triton kernels when the
  environment variable ``KIMI_CG_TRITON_ON_CPU=1`` is set (with ``TRITON_INTERPRET=1`` this runs
  the kernels through Triton's interpreter; it exists for testing the kernels without a GPU).
- Meta/fake: an empty [R, D] tensor of x's dtype, so dynamo and Inductor can trace calls.
"""

from __future__ import annotations

import os

import torch

_LIBRARY_NAMESPACE = "kimi_cg"

# Read at every call (not at import) so tests can switch it with monkeypatch.setenv.
_TRITON_ON_CPU_ENV = "KIMI_CG_TRITON_ON_CPU"


def use_triton(x: torch.Tensor) -> bool:
    """Whether the kimi_cg ops run their Triton kernels on x's device (CUDA, or CPU when asked)."""
    return x.device.type == "cuda" or os.environ.get(_TRITON_ON_CPU_ENV) == "1"


@torch.library.custom_op(f"{_LIBRARY_NAMESPACE}::merge_gather", mutates_args=())
def merge_gather(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from kimi_cg.kernels.merge_gather import merge_gather as merge_gather_triton

        return merge_gather_triton(x, index, weight)
    from kimi_cg.kernels.merge_gather import merge_gather_reference

    return merge_gather_reference(x, index, weight)


@merge_gather.register_fake
def _(x, index, weight):
    return x.new_empty((index.shape[0], x.shape[1]))


@torch.library.custom_op(f"{_LIBRARY_NAMESPACE}::merge_gather_layernorm", mutates_args=())
def merge_gather_layernorm(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    if use_triton(x):
        from kimi_cg.kernels.merge_gather import merge_gather_layernorm as merge_gather_layernorm_triton

        return merge_gather_layernorm_triton(x, index, weight, ln_weight, ln_bias, eps)
    from kimi_cg.kernels.merge_gather import merge_gather_layernorm_reference

    return merge_gather_layernorm_reference(x, index, weight, ln_weight, ln_bias, eps)


@merge_gather_layernorm.register_fake
def _(x, index, weight, ln_weight, ln_bias, eps):
    return x.new_empty((index.shape[0], x.shape[1]))
