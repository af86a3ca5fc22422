"""How ``F.interpolate`` is traced in kimi_cg frames: by its output's shape, not its arithmetic.

NOTE [resize traced by shape]
Towers resize a learned position table to every item's size (MoonViT, as Kimi-VL's remote code ships it:
bicubic ``F.interpolate`` of a 64 x 64 grid per item of ``grid_hws.tolist()``). Dynamo records the call as one
node; to learn its output's size it runs the call on fake tensors, and the upsample ops' Python
decompositions (registered at their Autograd / CompositeImplicitAutograd keys, so they run before a
fake tensor's meta kernel is consulted) do the whole interpolation symbolically: index arithmetic and
clamps on the item's unbacked height and width, some 60 fake ops each adding symbolic expressions.
On the real Kimi-VL config that was ~0.3 s of dynamo's time per item, a quarter of an 8-item trace
(2026-12-06, torch 2.13, a 2-core CPU host: scripts/trace_bench.py), paid per item at every new item count.

What that run yields is only the output's metadata, which is known without it: the input's batch
and channel dims, then the requested size, in the input's dtype, on its device, in the memory format
the decompositions give (``suggest_memory_format`` of the input), with the size checks the meta kernel
makes (every output dim positive) kept as ``torch._check``s. So while a kimi_cg frame traces, a call on
fake tensors with no tracing mode above the fake one (dynamo's fake propagation, which records nothing)
gets that tensor directly. Any trace that records ops (a proxy or functional mode: AOT, Inductor's
lowering of a device program), every compile other than kimi_cg's, and every call on real tensors run
the decomposition as before, so no graph and no value changes. A call that asks for scale factors
instead of a size also runs it as before.

These are Python kernels wrapped around torch's own, installed process-wide once by
``kimi_cg.dynamo_settings.install()``. Counted: ``resizes_traced_by_shape``;
tests/test_resize_shapes.py checks the metadata against the decompositions' for every wrapped op.
"""

from __future__ import annotations

import torch

from kimi_cg.counters import counters

# ``aten`` upsample ops whose overloads take ``(input, output_size, ...)``; spatial dims by name.
OPS = ("upsample_nearest1d", "upsample_linear1d", "upsample_nearest2d", "upsample_bilinear2d", "upsample_bicubic2d",
       "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "upsample_nearest3d", "upsample_trilinear3d")
_KEYS = (torch._C.DispatchKey.Autograd, torch._C.DispatchKey.CompositeImplicitAutograd)
_wrapped: dict = {}  # (op, key) -> torch's kernel


def _traced_by_shape(input, output_size) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    from kimi_cg import dynamo_settings

    if not (dynamo_settings.active() and isinstance(input, FakeTensor) and output_size):
        return False
    modes = torch._C._TorchDispatchModeKey
    return (torch._C._get_dispatch_mode(modes.PROXY) is None
            and torch._C._get_dispatch_mode(modes.FUNCTIONAL) is None)


def output_like(input: torch.Tensor, output_size) -> torch.Tensor:
    """An empty tensor with the metadata an upsample of ``input`` to ``output_size`` has."""
    spatial = input.dim() - 2
    torch._check(len(output_size) == spatial, lambda: f"expected {spatial} output sizes, got {list(output_size)}")
    for size in output_size:
        torch._check(size > 0, lambda: f"output sizes must be greater than 0, got {list(output_size)}")
    memory_format = torch._prims_common.suggest_memory_format(input)
    return torch.empty((*input.shape[:2], *output_size), dtype=input.dtype, device=input.device,
                       memory_format=memory_format)


def _wrap(op, kernel):
    def resize(input, output_size, *args, **kwargs):
        if _traced_by_shape(input, output_size):
            counters["resizes_traced_by_shape"] += 1
            return output_like(input, output_size)
        return kernel(input, output_size, *args, **kwargs)

    resize.__name__ = resize.__qualname__ = f"{op.__name__.replace('.', '_')}_traced_by_shape"
    return resize


def install() -> None:
    """Wrap torch's Python kernels of the upsample ops (NOTE [resize traced by shape]); idempotent."""
    for name in OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in ("default", "vec"):
            op = getattr(packet, overload, None)
            if op is None:
                continue
            for key in _KEYS:
                kernel = op.py_kernels.get(key)
                if kernel is None or (op, key) in _wrapped:
                    continue
                _wrapped[(op, key)] = kernel
                op.py_kernels[key] = _wrap(op, kernel)
                op._dispatch_cache.clear()


def uninstall() -> None:
    """Put torch's kernels back (tests)."""
    for (op, key), kernel in list(_wrapped.items()):
        op.py_kernels[key] = kernel
        op._dispatch_cache.clear()
    _wrapped.clear()
