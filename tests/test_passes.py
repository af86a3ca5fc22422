"""Pass- and analysis-level tests: ops before and after, match counts, and the cases a pass must
leave alone (in the style of vLLM's compile tests)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import kimi_cg
from kimi_cg import capture
from kimi_cg.capture import example_value
from kimi_cg.aliasing import Aliasing, written_arguments
from kimi_cg.canonicalize import SegmentAttentionPass
from kimi_cg.dynamo_settings import DYNAMO_SETTINGS
from kimi_cg.lift import Category, classify

VARLEN = torch.ops.kimi_cg.varlen_attention.default


def capture_graph(fn, *args, dynamic=None) -> torch.fx.GraphModule:
    """The graph dynamo hands a backend for fn, traced with kimi_cg's settings (one graph)."""
    graphs = []

    def keep(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(**DYNAMO_SETTINGS):
        torch.compile(fn, backend=keep, fullgraph=True, dynamic=dynamic)(*args)
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


@pytest.mark.parametrize("fn", [block_attention, scaled_block_attention])
def test_segment_attention_rewrites_a_block_mask_to_the_varlen_op(fn):
    x, grid = _inputs()
    gm = capture_graph(fn, x, grid)
    assert count(gm, F.scaled_dot_product_attention) == 1 and count(gm, operator.setitem) == 2
    SegmentAttentionPass()(gm)
    assert count(gm, F.scaled_dot_product_attention) == 0
    assert count(gm, operator.setitem) == 0 and count(gm, torch.zeros) == 0  # the dense mask is gone
    assert count(gm, VARLEN) == 1
    torch.testing.assert_close(only_output(gm(x, grid)), fn(x, grid), rtol=1e-5, atol=1e-6)


def only_output(result):
    return result[0] if isinstance(result, (tuple, list)) else result


@pytest.mark.parametrize("fn", [mask_with_a_false_write, mask_also_read_elsewhere])
def test_segment_attention_leaves_what_it_cannot_rewrite(fn):
    gm = capture_graph(fn, *_inputs())
    before = count(gm, operator.setitem)
    SegmentAttentionPass()(gm)
    assert count(gm, F.scaled_dot_product_attention) == 1 and count(gm, VARLEN) == 0
    assert count(gm, operator.setitem) == before


# Explicit attention under the block mask (the eager path of MoonViT's remote code): q, k, v [H, L, D].
def _explicit(x, grid, masked_scores, scale=0.25, softmax_dtype=None):
    mask = _mask(x.shape[0], _segments(grid))
    q = x.view(x.shape[0], 2, 4).transpose(0, 1)
    scores = (q @ q.transpose(-2, -1)) * scale
    weights = torch.softmax(masked_scores(scores, mask), dim=-1, dtype=softmax_dtype)
    return (weights.to(q.dtype) @ q).transpose(0, 1).reshape(x.shape[0], -1)


def explicit_masked_fill(x, grid):
    return _explicit(x, grid, lambda s, m: s.masked_fill(~m, float("-inf")), softmax_dtype=torch.float32)


def explicit_where(x, grid):
    return _explicit(x, grid, lambda s, m: torch.where(m, s, float("-inf")))


def explicit_logical_not_lowest(x, grid):
    return _explicit(x, grid, lambda s, m: s.masked_fill(m.logical_not(), torch.finfo(torch.float32).min), scale=1.0)


def explicit_eq_zero_divided(x, grid):
    mask = _mask(x.shape[0], _segments(grid))
    q = x.view(x.shape[0], 2, 4).transpose(0, 1)
    scores = (q @ q.transpose(-2, -1)) / 3.0
    weights = torch.softmax(scores.masked_fill(mask == 0, float("-inf")), dim=-1)
    return weights @ q


def explicit_additive_bool_mask(x, grid):  # the remote code's eager bug: +1 inside a segment, every key kept
    return _explicit(x, grid, lambda s, m: s + m)


def explicit_finite_fill(x, grid):  # -1e4 leaves exp(-1e4 - max) > 0 possible for very negative scores: not a removal
    return _explicit(x, grid, lambda s, m: s.masked_fill(~m, -1e4))


def explicit_mask_kept_as_is(x, grid):  # the kept entries are where the mask is False: the complement, not the blocks
    return _explicit(x, grid, lambda s, m: s.masked_fill(m, float("-inf")))


def explicit_negation_read_twice(x, grid):
    mask = _mask(x.shape[0], _segments(grid))
    q = x.view(x.shape[0], 2, 4).transpose(0, 1)
    outside = ~mask
    weights = torch.softmax((q @ q.transpose(-2, -1)).masked_fill(outside, float("-inf")), dim=-1)
    return weights @ q, outside.sum()


def explicit_weights_returned(x, grid):  # the attention probabilities are an output too: the mask stays
    mask = _mask(x.shape[0], _segments(grid))
    q = x.view(x.shape[0], 2, 4).transpose(0, 1)
    weights = torch.softmax((q @ q.transpose(-2, -1)).masked_fill(~mask, float("-inf")), dim=-1)
    return weights @ q, weights


@pytest.mark.parametrize("fn", [explicit_masked_fill, explicit_where, explicit_logical_not_lowest, explicit_eq_zero_divided])
def test_segment_attention_rewrites_explicit_attention_under_a_block_mask(fn):
    x, grid = _inputs()
    gm = capture_graph(fn, x, grid)
    SegmentAttentionPass()(gm)
    assert count(gm, VARLEN) == 1
    assert count(gm, operator.setitem) == 0 and count(gm, torch.zeros) == 0  # the dense mask is gone
    assert not any(node.target in (torch.softmax, "softmax") for node in gm.graph.nodes)
    torch.testing.assert_close(only_output(gm(x, grid)), fn(x, grid), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [explicit_additive_bool_mask, explicit_finite_fill, explicit_mask_kept_as_is,
                                explicit_negation_read_twice, explicit_weights_returned])
def test_segment_attention_leaves_explicit_attention_that_is_not_block_masked(fn):
    x, grid = _inputs()
    gm = capture_graph(fn, x, grid)
    SegmentAttentionPass()(gm)
    assert count(gm, VARLEN) == 0 and count(gm, operator.setitem) == 2
    want, got = fn(x, grid), gm(x, grid)
    for g, w in zip(got if isinstance(got, (tuple, list)) else [got], want if isinstance(want, tuple) else [want]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# Attention as a loop over per-segment pieces (transformers' sdpa and eager paths): q, k, v [1, H, L, D].
def _qkv(x):
    q = x.view(1, x.shape[0], 2, 4).transpose(1, 2)
    return q, (q * 0.5).flip(-1), q + 1.0


def _pieces(x, grid):
    lengths = grid if isinstance(grid, list) else (grid[:, 0] * grid[:, 1]).tolist()
    return zip(*[torch.split(t, lengths, dim=2) for t in _qkv(x)])


def loop_sdpa(x, lengths):
    """(SDPA on a piece of data-dependent length fails in dynamo itself: the lengths are Python ints,
    as in a frame resumed after a graph break at ``.tolist()``.)"""
    outs = [F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=0.3, is_causal=False).transpose(1, 2)
            for q, k, v in _pieces(x, lengths)]
    return torch.cat(outs, dim=1).reshape(x.shape[0], -1)


def loop_eager(x, grid):
    outs = []
    for q, k, v in _pieces(x, grid):
        weights = torch.matmul(q, k.transpose(2, 3)) * 0.5
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        weights = F.dropout(weights, p=0.0, training=False)
        outs.append(torch.matmul(weights, v).transpose(1, 2).contiguous())
    return torch.cat(outs, dim=1).reshape(x.shape[0], -1)


def _repeat_kv(t, groups):
    """transformers' repeat_kv, as its towers write it."""
    batch, heads, rows, width = t.shape
    return t[:, :, None, :, :].expand(batch, heads, groups, rows, width).reshape(batch, heads * groups, rows, width)


def _grouped_pieces(x, grid, value_heads=1):
    """q with 2 heads, k with 1 and v with ``value_heads``, cut per segment."""
    lengths = (grid[:, 0] * grid[:, 1]).tolist()
    q = x.view(1, x.shape[0], 2, 4).transpose(1, 2)
    k = (x[:, :4] * 0.5).reshape(1, x.shape[0], 1, 4).transpose(1, 2)
    v = (x[:, 8 - 4 * value_heads:] + 1.0).reshape(1, x.shape[0], value_heads, 4).transpose(1, 2)
    return zip(*[torch.split(t, lengths, dim=2) for t in (q, k, v)])


def loop_eager_grouped(x, grid):
    """The eager loop with grouped key/value heads (EXAONE 4.5's tower): one k / v head for 2 query heads."""
    outs = []
    for q, k, v in _grouped_pieces(x, grid):
        weights = torch.matmul(q, _repeat_kv(k, 2).transpose(2, 3)) * 0.5
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append(torch.matmul(weights, _repeat_kv(v, 2)).transpose(1, 2).contiguous())
    return torch.cat(outs, dim=1).reshape(x.shape[0], -1)


def loop_grouped_keys_only(x, grid):
    """Keys grouped, values not: a valid attention, but not one varlen call with one head layout."""
    outs = []
    for q, k, v in _grouped_pieces(x, grid, value_heads=2):
        weights = (torch.matmul(q, _repeat_kv(k, 2).transpose(2, 3)) * 0.5).softmax(-1)
        outs.append(torch.matmul(weights, v))
    return torch.cat(outs, dim=2)


def loop_causal(x, lengths):
    return torch.cat([F.scaled_dot_product_attention(q, k, v, is_causal=True) for q, k, v in _pieces(x, lengths)], dim=2)


def loop_scales_differ(x, grid):
    outs = []
    for i, (q, k, v) in enumerate(_pieces(x, grid)):
        outs.append(torch.matmul((torch.matmul(q, k.transpose(2, 3)) * (0.3 + i)).softmax(-1), v))
    return torch.cat(outs, dim=2)


def loop_joined_on_heads(x, grid):
    return torch.cat([torch.matmul(torch.matmul(q, k.transpose(2, 3)).softmax(-1), v) for q, k, v in _pieces(x, grid)], dim=1)


def loop_weights_also_returned(x, grid):
    outs, weights = [], []
    for q, k, v in _pieces(x, grid):
        w = torch.matmul(q, k.transpose(-1, -2)).softmax(dim=-1)
        weights.append(w.sum())
        outs.append(torch.matmul(w, v))
    return torch.cat(outs, dim=2), sum(weights)


def loop_pieces_crossed(x, grid):
    pieces = list(_pieces(x, grid))
    outs = [torch.matmul(torch.matmul(pieces[i][0], pieces[i][1].transpose(2, 3)).softmax(-1), pieces[-1 - i][2])
            for i in range(len(pieces))]
    return torch.cat(outs, dim=2)


def _loop_inputs(grid=((2, 3), (1, 2), (1, 1)), as_lengths=False):
    grid = torch.tensor(grid)
    x = torch.randn(int((grid[:, 0] * grid[:, 1]).sum()), 8)
    return (x, (grid[:, 0] * grid[:, 1]).tolist()) if as_lengths else (x, grid)


def _lengths_given(fn) -> bool:
    return fn in (loop_sdpa, loop_causal)


def run_graph(gm, x, grid):
    """Call a captured graph on (x, grid); with the lengths given as ints, dynamo's graph takes x's size
    and each length as its own input (named l_lengths_<i>_)."""
    args = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = example_value(node)
        if isinstance(value, torch.Tensor):
            args.append(x if value.is_floating_point() else grid)
        elif node.name.startswith("l_lengths_"):
            args.append(grid[int(node.name.split("_")[2])])
        else:
            args.append(x.shape[0])
    return gm(*args)


@pytest.mark.parametrize("fn", [loop_sdpa, loop_eager, loop_eager_grouped])
def test_segment_attention_rewrites_an_attention_loop_over_split_pieces(fn):
    x, grid = _loop_inputs(as_lengths=_lengths_given(fn))
    gm = capture_graph(fn, x, grid, dynamic=True if _lengths_given(fn) else None)
    SegmentAttentionPass()(gm)
    assert count(gm, VARLEN) == 1
    assert count(gm, F.scaled_dot_product_attention) == count(gm, torch.matmul) == count(gm, torch.functional.split) == 0
    torch.testing.assert_close(only_output(run_graph(gm, x, grid)), fn(x, grid), rtol=1e-5, atol=1e-6)
    # The host checks the sizes cover the rows: a grid that does not match the rows is an error, not a wrong answer.
    if not _lengths_given(fn):
        # (torch 2.11 fails the graph's own reshape first: also an error.)
        with pytest.raises(Exception, match="sum to|segments do not cover|Runtime assertion|is invalid for input of size"):
            gm(torch.randn(x.shape[0] + 2, 8), grid)


@pytest.mark.parametrize("fn", [loop_causal, loop_scales_differ, loop_joined_on_heads, loop_weights_also_returned,
                                loop_pieces_crossed, loop_grouped_keys_only])
def test_segment_attention_leaves_loops_that_are_not_one_varlen_attention(fn):
    x, grid = _loop_inputs(((1, 3), (3, 1)), as_lengths=_lengths_given(fn))  # equal lengths: a cat on heads runs
    gm = capture_graph(fn, x, grid, dynamic=True if _lengths_given(fn) else None)
    expected = fn(x, grid)
    SegmentAttentionPass()(gm)
    assert count(gm, VARLEN) == 0
    got = run_graph(gm, x, grid)
    for g, e in zip(got if isinstance(got, (tuple, list)) else [got], expected if isinstance(expected, tuple) else [expected]):
        torch.testing.assert_close(g, e)


class LoopAttentionTower(torch.nn.Module):
    """A tiny packed tower whose attention is a per-segment loop, in either of the two written forms."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.proj_in, self.proj_out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, grid):
        h = self.proj_in(x)
        return self.proj_out(self.form(h, grid) + h)


@pytest.mark.parametrize("form", [loop_eager, loop_eager_grouped])
def test_a_tower_with_an_attention_loop_is_lifted_and_matches_eager(form):
    torch._dynamo.reset()
    kimi_cg.reset()
    model = LoopAttentionTower(form).eval()
    compiled = torch.compile(model, backend="kimi_cg")
    for grid in [((2, 3), (1, 2)), ((1, 5), (2, 2)), ((3, 1), (1, 1)), ((2, 2), (2, 4))]:
        x, grid = _loop_inputs(grid)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, grid), model(x, grid), rtol=1e-5, atol=1e-6)
    assert kimi_cg.counters["lift_fallbacks"] == 0 and kimi_cg.counters["call_fallbacks"] == 0
    assert kimi_cg.counters["host_programs_built"] > 0
    torch._dynamo.reset()
    kimi_cg.reset()


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


class _Rewrite(kimi_cg.canonicalize.GraphPass):
    """Replaces torch.relu with torch.tanh when told to; otherwise changes nothing."""

    def __init__(self, rewrite):
        super().__init__()
        self.rewrite = rewrite

    def run(self, gm):
        for node in gm.graph.nodes:
            if self.rewrite and node.target is torch.relu:
                node.target = torch.tanh
        return {}


@pytest.mark.parametrize("rewrite", [False, True])
def test_a_pass_recompiles_the_module_only_when_it_changed_the_graph(monkeypatch, rewrite):
    gm = torch.fx.symbolic_trace(lambda x, y: torch.relu(x + y) * 2)
    recompiles = []
    original = torch.fx.GraphModule.recompile
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", lambda self: recompiles.append(1) or original(self))
    x, y = torch.randn(5), torch.randn(5)
    _Rewrite(rewrite)(gm)
    assert len(recompiles) == int(rewrite)
    torch.testing.assert_close(gm(x, y), (torch.tanh if rewrite else torch.relu)(x + y) * 2, rtol=0, atol=0)


def test_the_fingerprint_sees_every_kind_of_change():
    from kimi_cg.canonicalize.base import _same, graph_fingerprint

    gm = torch.fx.symbolic_trace(lambda x: torch.sum(x.view(2, 3), dim=1, keepdim=False))
    nodes = list(gm.graph.nodes)
    before = graph_fingerprint(gm.graph)
    assert _same(graph_fingerprint(gm.graph), before)
    view, total = nodes[1], nodes[2]
    view.args = (view.args[0], 3, 2)  # an argument's value
    assert not _same(graph_fingerprint(gm.graph), before)
    view.args = (view.args[0], 2, 3)
    assert _same(graph_fingerprint(gm.graph), before)
    total.kwargs = {**total.kwargs, "keepdim": True}  # a keyword
    assert not _same(graph_fingerprint(gm.graph), before)
    total.kwargs = {**total.kwargs, "keepdim": False}
    with gm.graph.inserting_after(view):  # a new node
        extra = gm.graph.call_function(torch.neg, (view,))
    assert not _same(graph_fingerprint(gm.graph), before)
    gm.graph.erase_node(extra)
    assert _same(graph_fingerprint(gm.graph), before)
    # Values that have no plain ``==`` count as changed unless they are the same object.
    assert not _same((torch.ones(3),), (torch.ones(3),))
    shared = torch.ones(3)
    assert _same((shared, [1, 2.5, "a", None, slice(1, 2)]), (shared, [1, 2.5, "a", None, slice(1, 2)]))
    assert not _same((1,), (True,)) and not _same([1], (1,))
