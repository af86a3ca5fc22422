"""Pass- and analysis-level tests: ops before and after, match counts, and the cases a pass must
leave alone (in the style of vLLM's compile tests)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import kimi_cg
from kimi_cg import capture
from kimi_cg.aliasing import Aliasing, written_arguments
from kimi_cg.canonicalize import SegmentAttentionPass
from kimi_cg.dynamo_settings import DYNAMO_SETTINGS
from kimi_cg.lift import Category, classify

VARLEN = torch.ops.kimi_cg.varlen_attention.default


def capture_graph(fn, *args) -> torch.fx.GraphModule:
    """The graph dynamo hands a backend for fn, traced with kimi_cg's settings (one graph)."""
    graphs = []

    def keep(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(**DYNAMO_SETTINGS):
        torch.compile(fn, backend=keep, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def count(gm, target) -> int:
    return sum(1 for node in gm.graph.nodes if node.target is target or node.target == target)


def _segments(grid):
    return F.pad((grid[:, 0] * grid[:, 1]).cumsum(0), (1, 0))


def _mask(length, cu, value=True):
    mask = torch.zeros([1, length, length], dtype=torch.bool)
    for i in range(1, len(cu)):
        mask[..., cu[i - 1]:cu[i], cu[i - 1]:cu[i]] = value
    return mask


def block_attention(x, grid):
    mask = _mask(x.shape[0], _segments(grid))
    q = x.view(1, x.shape[0], 2, 4).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, mask)


def scaled_block_attention(x, grid):
    mask = _mask(x.shape[0], _segments(grid))
    q = x.view(1, x.shape[0], 2, 4).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, mask, scale=0.3)


def mask_with_a_false_write(x, grid):
    cu = _segments(grid)
    mask = _mask(x.shape[0], cu)
    mask[..., 0, 1] = False
    q = x.view(1, x.shape[0], 2, 4).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, mask)


def mask_also_read_elsewhere(x, grid):
    mask = _mask(x.shape[0], _segments(grid))
    q = x.view(1, x.shape[0], 2, 4).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, mask), mask[0].sum()


def _inputs():
    grid = torch.tensor([[2, 3], [1, 2]])
    return torch.randn(8, 8), grid


def test_segment_attention_rewrites_a_block_mask_to_the_varlen_op():
    gm = capture_graph(block_attention, *_inputs())
    assert count(gm, F.scaled_dot_product_attention) == 1 and count(gm, operator.setitem) == 2
    SegmentAttentionPass()(gm)
    assert count(gm, F.scaled_dot_product_attention) == 0
    assert count(gm, operator.setitem) == 0 and count(gm, torch.zeros) == 0  # the dense mask is gone
    assert count(gm, VARLEN) == 1


@pytest.mark.parametrize("fn", [scaled_block_attention, mask_with_a_false_write, mask_also_read_elsewhere])
def test_segment_attention_leaves_what_it_cannot_rewrite(fn):
    gm = capture_graph(fn, *_inputs())
    before = count(gm, operator.setitem)
    SegmentAttentionPass()(gm)
    assert count(gm, F.scaled_dot_product_attention) == 1 and count(gm, VARLEN) == 0
    assert count(gm, operator.setitem) == before


def test_written_arguments_cover_torchs_in_place_forms():
    def fn(x, i):
        a = torch.zeros(4)
        a[0] = 1.0                      # setitem
        b = torch.zeros(4)
        b.add_(x)                       # method with a trailing underscore
        c = torch.zeros(4)
        c += x                          # operator.iadd
        d = torch.zeros(4)
        torch.add(x, x, out=d)          # out=
        e = torch.zeros(4)
        e.index_add_(0, i, x)
        f = x * 2                       # functional
        return a, b, c, d, e, f

    gm = capture_graph(fn, torch.randn(4), torch.tensor([0, 1, 2, 3]))
    written = {node.name: [arg.name for arg in written_arguments(node)] for node in gm.graph.nodes if written_arguments(node)}
    assert len(written) == 5, written
    assert not any(name.startswith("mul") for name in written)


def test_views_of_a_written_tensor_share_its_group():
    def fn(x, grid):
        buf = torch.zeros(6, 4)
        early = buf[:2]                 # a view made before the write
        buf[1:3] = x[:2]
        untouched = torch.ones(3)
        return early * 2, untouched + 1

    gm = capture_graph(fn, torch.randn(6, 4), torch.tensor([[1, 2]]))
    aliasing = Aliasing(gm.graph)
    assert len(aliasing.groups) == 1
    names = {node.name for node in aliasing.groups[0].members}
    assert {"buf", "early"} <= names  # dynamo names nodes after the variables
    assert "untouched" not in names and "l_x_" not in names  # the written value's source is only read


def test_a_mask_written_with_grid_values_is_host_even_when_it_looks_constant():
    gm = capture_graph(scaled_block_attention, *_inputs())  # static shapes: zeros([1, 8, 8]) has no inputs
    categories = classify(gm, capture.classify_inputs(gm))
    mask = next(node for node in gm.graph.nodes if node.target is torch.zeros)
    assert categories[mask] is Category.HOST
    writes = [node for node in gm.graph.nodes if node.target is operator.setitem]
    assert writes and all(categories[node] is Category.HOST for node in writes)


def test_register_varlen_attention_checks_argument_names_against_the_schema(monkeypatch):
    from kimi_cg import varlen_registry

    monkeypatch.setattr(varlen_registry, "_REGISTRY", dict(varlen_registry._REGISTRY))
    with pytest.raises(ValueError, match="no argument"):
        kimi_cg.register_varlen_attention(torch.ops.kimi_cg.varlen_attention, {"max_seqlen_q": "q"}, ["cu_seqlens"])
    with pytest.raises(ValueError, match="no argument"):
        kimi_cg.register_varlen_attention(torch.ops.kimi_cg.varlen_attention, {"max_seqlen": "q"}, ["cu"])
    with pytest.raises(ValueError, match="not a torch.library op"):
        kimi_cg.register_varlen_attention(F.scaled_dot_product_attention, {"max_seqlen": "q"}, ["cu_seqlens"])
    with pytest.raises(ValueError, match="bounds must map"):
        kimi_cg.register_varlen_attention("kimi_cg::varlen_attention", {}, ["cu_seqlens"])
    with pytest.raises(ValueError, match="segments must name"):
        kimi_cg.register_varlen_attention("kimi_cg::varlen_attention", {"max_seqlen": "q"}, "cu_seqlens")
    # kimi_cg's own op, by overload, packet or name: max_seqlen (position 4) bounded by q (position 0).
    for target in (torch.ops.kimi_cg.varlen_attention.default, torch.ops.kimi_cg.varlen_attention,
                   "kimi_cg::varlen_attention"):
        assert varlen_registry.registered_bounds(target) == [(4, "max_seqlen", 0, "q")]
        assert varlen_registry.registered_segments(target) == [(3, "cu_seqlens")]
    assert varlen_registry.registered_bounds(torch.ops.aten.add.Tensor) is None
    # An op of an absent package (flash-attn here) may be registered by name; it matches nothing.
    kimi_cg.register_varlen_attention("not_installed::varlen", {"max_len": "q"}, ["cu"])
    assert varlen_registry.registered_bounds("not_installed::varlen") is None
