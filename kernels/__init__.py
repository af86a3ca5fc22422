"""Triton kernels, installed as ``kimi_cg.kernels`` (see setup.py's package_dir)."""

from __future__ import annotations

import contextlib

import torch

# The floating dtypes every kernel here reads and writes (accumulating in float32).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def on_device_of(tensor: torch.Tensor):
    """The context to launch a kernel in for ``tensor``: Triton launches on the current CUDA device
    and its current stream, not on the device of the arguments (ATen ops switch devices themselves),
    so a tower on cuda:1 in a process whose current device is cuda:0 needs its device made current.
    A no-op when it already is (the common case: one device per process) and on CPU tensors."""
    if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()
