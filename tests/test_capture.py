"""Capture settings: what kimi_cg changes in dynamo, and the torch < 2.13 list-compare shim."""

import operator

import torch

from kimi_cg import capture


def test_dynamo_settings_are_applied_and_idempotent():
    capture.configure_dynamo()
    capture.configure_dynamo()
    assert torch._dynamo.config.capture_scalar_outputs is True
    assert torch._dynamo.config.capture_dynamic_output_shape_ops is True
    assert torch._dynamo.config.recompile_limit >= capture.MIN_RECOMPILE_LIMIT


def test_list_compare_shim_follows_python_semantics():
    calls = []

    def original(op, left, right):
        calls.append((op, left, right))
        return "original"

    shim = capture._list_vs_tuple_aware(original)
    # A list never equals a tuple or torch.Size (upstream MoonViT's position-embedding check).
    assert shim(operator.eq, [64, 64], torch.Size([64, 64])) is False
    assert shim(operator.ne, [64, 64], (64, 64)) is True
    # Same types: element-wise equality as one condition.
    assert shim(operator.eq, (1, 2), (1, 2)) is True
    assert shim(operator.eq, (1, 2), (1, 3)) is False
    assert not calls
    # Orderings and different lengths go to dynamo's own polyfill.
    assert shim(operator.lt, (1, 2), (1, 3)) == "original"
    assert shim(operator.eq, (1, 2), (1, 2, 3)) == "original"
