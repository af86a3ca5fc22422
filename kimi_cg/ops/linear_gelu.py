"""A linear layer followed by tanh GELU as one op: ``torch.ops.kimi_cg.linear_gelu_tanh``.

    x:       [..., K]  float32 / bfloat16 / float16
    weight:  [N, K]    x.dtype
    bias:    [N]       x.dtype
    returns  [..., N]  x.dtype, contiguous; gelu(linear(x, weight, bias), approximate="tanh")

Implementations, chosen by the device and dtype of ``x`` (NOTE [linear + GELU epilogue] in
canonicalize/linear_gelu.py says why):
- CUDA, bfloat16 / float16: ``torch._addmm_activation(bias, x2d, weight.t(), use_gelu=True)``, which
  cuBLASLt runs as one GEMM whose epilogue adds the bias and applies the tanh GELU to the float32
  accumulator before rounding once (torch applies the same tanh GELU after the GEMM on its other path).
- Everything else: ``F.gelu(F.linear(x, weight, bias), approximate="tanh")``, the composition itself.
- Meta/fake: an empty contiguous [..., N] tensor of x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_EPILOGUE_DTYPES = (torch.bfloat16, torch.float16)


def epilogue_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether the call runs as one cuBLASLt GEMM with the GELU in its epilogue."""
    return (x.device.type == "cuda" and x.dtype in _EPILOGUE_DTYPES and weight.dtype == x.dtype
            and bias.dtype == x.dtype and x.dim() >= 1 and weight.dim() == 2 and bias.dim() == 1)


@torch.library.custom_op("kimi_cg::linear_gelu_tanh", mutates_args=())
def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if epilogue_takes(x, weight, bias) and x.numel() > 0:
        rows = x.reshape(-1, x.shape[-1])
        out = torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.gelu(F.linear(x, weight, bias), approximate="tanh").contiguous()


@linear_gelu_tanh.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
