"""NOTE [table gathers]: per-item reads of module-state tables as host plans and one device gather.

- the stand-in (kimi_cg/runtime/table_rows.py) against the real ops on a real table: every chain's
  gather equals the chain itself (bitwise for movement, float rounding for the bicubic resize);
- the op ``kimi_cg.table_gather`` (reference, the Triton kernel through the interpreter, complex tables);
- TableGatherPass on the reference towers: both tables gathered, no host program reads them, results
  equal eager's, also after the tables change in place (``.data`` writes no state check could miss:
  there is none, the device reads the live table), on the padded bucket path with a poisoned pool.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kimi_cg
from kimi_cg.models import MoonVitConfig, MoonVitPretrainedModel
from kimi_cg.ops.table_gather import table_gather_reference
from kimi_cg.runtime import table_rows as tr


def _gather(table: torch.Tensor, rows: tr.TableRows) -> torch.Tensor:
    """What the device computes for a read whose features are its last dim, in the read's shape."""
    flat = table.reshape(-1, table.shape[-1])
    out = table_gather_reference(flat, tr.table_plan_index(rows, rows.outer), tr.table_plan_weight(rows, rows.outer),
                                 rows.outer)
    return out.view(rows.shape)


def _source(table: torch.Tensor) -> tr.TableRows:
    return tr.table_source(tuple(table.shape[:-1]), table.shape[-1])


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), items=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9),
                                                                           st.integers(1, 3)), min_size=1, max_size=4))
def test_slices_reshapes_repeats_and_cats_gather_exactly(h, w, items):
    table = torch.randn(9, 9, 5, dtype=torch.float32)
    real, stand_in = [], []
    for ih, iw, t in items:
        real.append(table[:ih, :iw].reshape(-1, 5).repeat(t, 1))
        rows = tr.table_getitem(_source(table), (slice(None, ih), slice(None, iw)))
        stand_in.append(tr.table_repeat(tr.table_reshape(rows, -1, 5), t, 1))
    expected, rows = torch.cat(real), tr.table_cat(stand_in)
    assert rows.shape == tuple(expected.shape)
    assert torch.equal(_gather(table, rows), expected)


def test_permutes_unsqueezes_getitems_and_flattens_follow_the_feature_dim():
    table = torch.randn(6, 7, 4)
    real = table.permute(2, 0, 1).unsqueeze(0)[:, :, 1:5, ::2].squeeze(0).permute(1, 2, 0).flatten(end_dim=1)
    rows = tr.table_unsqueeze(tr.table_permute(_source(table), 2, 0, 1), 0)
    assert rows.shape == (1, 4, 6, 7) and rows.axis == 1
    rows = tr.table_getitem(rows, (slice(None), slice(None), slice(1, 5), slice(None, None, 2)))
    rows = tr.table_flatten(tr.table_permute(tr.table_squeeze(rows, 0), 1, 2, 0), end_dim=1)
    assert torch.equal(_gather(table, rows), real)
    # ints drop dims, None adds one, Ellipsis fills; the feature dim's entry must be whole
    real = table[None, 2, ..., :]
    rows = tr.table_getitem(_source(table), (None, 2, Ellipsis, slice(None)))
    assert rows.shape == tuple(real.shape)
    assert torch.equal(_gather(table, rows), real.reshape(rows.shape))
    assert torch.equal(_gather(table, tr.table_transpose(_source(table), 0, 1)), table.transpose(0, 1))


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6), st.sampled_from([0.0, 1.0, -2.5])),
                       min_size=1, max_size=4))
def test_scaled_and_expanded_reads_gather_exactly(chunks):
    """NOTE [sums of table reads]: MoonViT3d's time rows, a slice scaled by a 0-dim flag and broadcast."""
    table = torch.randn(6, 5, dtype=torch.float32)
    real, stand_in = [], []
    for t, patches, factor in chunks:
        flag = torch.tensor(factor)
        real.append((table[:t] * flag).unsqueeze(1).expand(t, patches, 5).flatten(end_dim=1))
        rows = tr.table_scale(tr.table_getitem(_source(table), slice(None, t)), flag)
        stand_in.append(tr.table_flatten(tr.table_expand(tr.table_unsqueeze(rows, 1), t, patches, 5), end_dim=1))
    expected, rows = torch.cat(real), tr.table_cat(stand_in)
    assert rows.shape == tuple(expected.shape)
    assert torch.equal(_gather(table, rows), expected)
    assert tr.table_source((6,), 5).weight is None  # the cached source is never written


@pytest.mark.parametrize("factor", [0.0, 1.0, 3.0])
def test_a_scaled_pairs_read_scales_each_product_once(factor):
    table = torch.randn(7, 5, 3, dtype=torch.float32)
    rows = tr.table_bicubic_pairs(_own_grid(table), 9, 4, *tr.affine_grid(_own_grid(table)))
    kept = rows.row_weight.clone()
    rows = tr.table_flatten(tr.table_permute(tr.table_squeeze(tr.table_scale(rows, factor), 0), 1, 2, 0), end_dim=1)
    real = F.interpolate(table.permute(2, 0, 1).unsqueeze(0), size=(9, 4), mode="bicubic")
    real = real.squeeze(0).permute(1, 2, 0).flatten(end_dim=1) * factor
    torch.testing.assert_close(_gather(table, rows), real, atol=1e-5, rtol=1e-5)
    assert torch.equal(tr._pair_part(7, 9, 0, 5)[1], kept)  # the cached taps are not scaled in place


@pytest.mark.parametrize("step, call", [
    ("an expand that adds a dim", lambda rows: tr.table_expand(rows, 2, 6, 7, 4)),
    ("an expand of the features", lambda rows: tr.table_expand(rows, 6, 7, 8)),
    ("a product with a vector", lambda rows: tr.table_scale(rows, torch.ones(4))),
    ("a product with a complex number", lambda rows: tr.table_scale(rows, torch.tensor(1j))),
    ("a product with a bool", lambda rows: tr.table_scale(rows, True)),
])
def test_expands_and_products_that_are_not_table_reads_are_refused(step, call):
    with pytest.raises(tr.NotATableRead):
        call(tr.table_source((6, 7), 4))


@pytest.mark.parametrize("step, call", [
    ("a slice of the features", lambda rows: tr.table_getitem(rows, (slice(None), slice(None), slice(0, 2)))),
    ("a view that changes the features", lambda rows: tr.table_view(rows, -1, 2)),
    ("a view that infers them", lambda rows: tr.table_view(rows, 42, -1)),
    ("a flatten across them", lambda rows: tr.table_flatten(rows, 1, 2)),
    ("a cat along them", lambda rows: tr.table_cat([rows, rows], dim=2)),
    ("a repeat of them", lambda rows: tr.table_repeat(rows, 1, 1, 2)),
    ("a bicubic resize over them", lambda rows: tr.table_bicubic(rows, 3, 3)),
    ("tensor indexing", lambda rows: tr.table_getitem(rows, torch.tensor([0, 1]))),
])
def test_steps_that_are_not_table_reads_are_refused(step, call):
    with pytest.raises(tr.NotATableRead):
        call(tr.table_source((6, 7), 4))


@settings(max_examples=40, deadline=None)
@given(in_h=st.integers(1, 12), in_w=st.integers(1, 12), h=st.integers(1, 30), w=st.integers(1, 30))
def test_bicubic_read_equals_interpolate(in_h, in_w, h, w):
    table = torch.randn(in_h, in_w, 6, dtype=torch.float32)
    real = F.interpolate(table.permute(2, 0, 1).unsqueeze(0), size=(h, w), mode="bicubic")
    real = real.squeeze(0).permute(1, 2, 0).flatten(end_dim=1)
    rows = tr.table_unsqueeze(tr.table_permute(_source(table), 2, 0, 1), 0)
    rows = tr.table_bicubic(rows, h, w)
    assert rows.index.shape[-1] == 16
    rows = tr.table_flatten(tr.table_permute(tr.table_squeeze(rows, 0), 1, 2, 0), end_dim=1)
    # ATen's float32 taps and weights against ours (float64, rounded once to float32): ~1e-7
    torch.testing.assert_close(_gather(table, rows), real, atol=1e-5, rtol=1e-5)


def _own_grid(table: torch.Tensor) -> tr.TableRows:
    return tr.table_unsqueeze(tr.table_permute(_source(table), 2, 0, 1), 0)


@settings(max_examples=40, deadline=None)
@given(in_h=st.integers(1, 12), in_w=st.integers(1, 12), h=st.integers(1, 30), w=st.integers(1, 30),
       transposed=st.booleans())
def test_bicubic_pairs_of_the_own_grid_equal_interpolate_and_the_listed_plan(in_h, in_w, h, w, transposed):
    table = torch.randn(in_h, in_w, 6, dtype=torch.float32)
    grid = table.permute(2, 0, 1).unsqueeze(0)
    rows = _own_grid(table)
    if transposed:  # the table's grid read column-major: still affine (row step 1, column step in_w)
        grid, rows = grid.transpose(2, 3), tr.table_transpose(rows, 2, 3)
    steps = tr.affine_grid(rows)  # a step along a dim of size 1 is never used: 0
    if transposed:
        assert steps == (0, 1 if in_w > 1 else 0, in_w if in_h > 1 else 0)
    else:
        assert steps == (0, in_w if in_h > 1 else 0, 1 if in_w > 1 else 0)
    pairs = tr.table_bicubic_pairs(rows, h, w, *steps)
    assert pairs.outer == 4 and pairs.index.shape[-1] == 8 and pairs.index.dtype == torch.int32
    real = F.interpolate(grid, size=(h, w), mode="bicubic")
    flat = lambda r: tr.table_flatten(tr.table_permute(tr.table_squeeze(r, 0), 1, 2, 0), end_dim=1)  # noqa: E731
    torch.testing.assert_close(_gather(table, flat(pairs)), real.squeeze(0).permute(1, 2, 0).flatten(end_dim=1),
                               atol=1e-5, rtol=1e-5)
    # the same terms listed: the pairs' sums and float32 products, term for term
    listed = tr.listed_terms(flat(pairs))
    assert listed.outer == 0 and listed.index.shape[-1] == 16
    assert torch.equal(_gather(table, listed), _gather(table, flat(pairs)))
    dense = tr.table_bicubic(rows, h, w)
    assert torch.equal(tr.listed_terms(pairs).index, dense.index)
    # a gather built for listed terms gets them; one built for pairs never gets a listed plan
    assert torch.equal(tr.table_plan_index(flat(pairs), 0), tr.table_plan_index(listed))
    with pytest.raises(tr.NotATableRead, match="outer"):
        tr.table_plan_index(listed, 4)


def _same_read(kept, built: tr.TableRows) -> None:
    """``kept`` (a PairGrid / PairRows, or what a step made of it) is ``built`` bit for bit."""
    made = tr.concrete(kept)
    assert (made.axis, made.dim, made.outer, made.shape) == (built.axis, built.dim, built.outer, built.shape)
    assert made.index.dtype == built.index.dtype == torch.int32 and made.weight.dtype == torch.float32
    assert torch.equal(made.index, built.index)
    assert torch.equal(made.weight.view(torch.int32), tr.weights(built).view(torch.int32))


def _step(draw, rows):
    """A random step for a read of ``rows``' rank: (name, function of a read)."""
    ndim = rows.ndim
    kind = draw(st.sampled_from(["permute", "unsqueeze", "squeeze", "flatten", "reshape", "view", "contiguous",
                                 "getitem", "transpose", "repeat"]))
    if kind == "permute":
        dims = draw(st.permutations(range(ndim)))
        return kind, lambda r: tr.table_permute(r, *dims)
    if kind == "transpose":
        a, b = draw(st.integers(-ndim, ndim - 1)), draw(st.integers(-ndim, ndim - 1))
        return kind, lambda r: tr.table_transpose(r, a, b)
    if kind == "unsqueeze":
        dim = draw(st.integers(-ndim - 1, ndim))
        return kind, lambda r: tr.table_unsqueeze(r, dim)
    if kind == "squeeze":
        dim = draw(st.integers(-ndim, ndim - 1))
        return kind, lambda r: tr.table_squeeze(r, dim)
    if kind == "flatten":
        start, end = draw(st.integers(0, ndim - 1)), draw(st.integers(0, ndim - 1))
        return kind, lambda r: tr.table_flatten(r, start, end)
    if kind in ("reshape", "view"):
        count = math.prod(s for d, s in enumerate(rows.shape) if d != rows.axis)
        first = draw(st.sampled_from([d for d in range(1, count + 1) if count % d == 0]))
        sizes = draw(st.sampled_from([(first, count // first), (-1,), (first, -1), (1, count), (count + 1,)]))
        function = tr.table_view if kind == "view" else tr.table_reshape
        return kind, lambda r: function(r, *sizes, rows.dim)
    if kind == "getitem":
        dim = draw(st.integers(0, ndim - 1))
        return kind, lambda r: tr.table_getitem(r, (slice(None),) * dim + (slice(0, 1),))
    if kind == "repeat":  # unit sizes keep a PairGrid as it is; others tile the plan
        sizes = [1 if d == rows.axis else draw(st.integers(1, 3)) for d in range(ndim)]
        return kind, lambda r: tr.table_repeat(r, *sizes)
    return kind, tr.table_identity


@settings(max_examples=80, deadline=None)
@given(shape=st.lists(st.integers(0, 4), min_size=1, max_size=4), data=st.data())
def test_tiled_equals_repeat(shape, data):
    tensor = torch.randint(-5, 100, shape, dtype=torch.int32)
    sizes = tuple(data.draw(st.lists(st.integers(0, 3), min_size=len(shape), max_size=len(shape)), label="sizes"))
    assert torch.equal(tr.tiled(tensor, sizes), tensor.repeat(*sizes))
    weights = torch.randn(shape).transpose(0, -1)  # strided input too
    assert torch.equal(tr.tiled(weights, sizes[::-1]), weights.repeat(*sizes[::-1]))


@settings(max_examples=120, deadline=None)
@given(data=st.data(), in_h=st.integers(1, 9), in_w=st.integers(1, 9))
def test_pairs_kept_by_side_equal_the_built_plan_after_any_steps(data, in_h, in_w):
    """NOTE [pairs kept by side]: a PairGrid through any chain of steps (those it keeps and those
    that build the plan), and cats of such reads, equal the same steps on the built plan, bit for
    bit; a step that fails fails the same way on both."""
    table = torch.randn(in_h, in_w, 3)
    own = _own_grid(table)
    steps = tr.affine_grid(own)

    def item():
        h, w = data.draw(st.integers(1, 7), label="h"), data.draw(st.integers(1, 7), label="w")
        kept = tr.table_bicubic_pairs(own, h, w, *steps)
        assert isinstance(kept, tr.PairGrid)
        return kept, tr.concrete(kept)

    kept, built = item()
    _same_read(kept, built)
    for _ in range(data.draw(st.integers(0, 6), label="steps")):
        name, function = _step(data.draw, built)
        outcomes = []
        for read in (kept, built):
            try:
                outcomes.append(function(read))
            except (tr.NotATableRead, IndexError, RuntimeError) as error:
                outcomes.append(type(error))
        if isinstance(outcomes[1], type):
            assert outcomes[0] is outcomes[1], name
            continue
        assert not isinstance(outcomes[0], type), (name, outcomes[0])
        kept, built = outcomes
        _same_read(kept, built)
        assert tr.table_storage_offset(kept) == tr.table_storage_offset(built)
        if built.axis == built.ndim - 1:
            for outer in (built.outer, 0):
                assert torch.equal(tr.table_plan_index(kept, outer), tr.table_plan_index(built, outer))
                assert torch.equal(tr.table_plan_weight(kept, outer), tr.table_plan_weight(built, outer))
    # MoonViT's cat: items flattened to [h * w, 1] reads one after another (nested cats too), with
    # a built item or a listed read among them now and then
    flat = lambda r: tr.table_flatten(tr.table_permute(tr.table_squeeze(r, 0), 1, 2, 0), end_dim=1)  # noqa: E731
    parts = [item() for _ in range(data.draw(st.integers(1, 5), label="items"))]
    kept_parts, built_parts = [flat(k) for k, _ in parts], [flat(b) for _, b in parts]
    if len(kept_parts) > 2 and data.draw(st.booleans(), label="nested"):
        kept_parts = [tr.table_cat(kept_parts[:2])] + kept_parts[2:]
    mixed = data.draw(st.sampled_from(["none", "built", "listed"]), label="mixed")
    if mixed == "built":
        kept_parts[-1] = built_parts[-1]
    elif mixed == "listed":
        plain = tr.table_reshape(tr.table_getitem(_source(table), (slice(None, 1), slice(None, 2))), -1, 3)
        kept_parts, built_parts = kept_parts + [plain], built_parts + [plain]
    kept, built = tr.table_cat(kept_parts), tr.table_cat(built_parts)
    assert isinstance(kept, tr.PairRows) == (mixed == "none")
    _same_read(kept, built)
    for outer in {built.outer, 0}:
        assert torch.equal(tr.table_plan_index(kept, outer), tr.table_plan_index(built, outer))
        assert torch.equal(tr.table_plan_weight(kept, outer), tr.table_plan_weight(built, outer))
    assert tr.table_storage_offset(kept) == tr.table_storage_offset(built)
    settled = tr.settled((kept, [kept_parts[0]], 3))
    assert isinstance(settled[0], tr.TableRows) and isinstance(settled[1][0], tr.TableRows) and settled[2] == 3
    _same_read(settled[0], built)
    torch.testing.assert_close(_gather(table, kept), _gather(table, built), rtol=0, atol=0)
    # grids [h, w, 1] of one height side by side (a cat along w): not one image after another
    h = data.draw(st.integers(1, 4), label="side by side h")
    grid = lambda w: tr.table_permute(tr.table_squeeze(tr.table_bicubic_pairs(own, h, w, *steps), 0), 1, 2, 0)  # noqa: E731
    sides = [grid(w) for w in data.draw(st.lists(st.integers(1, 4), min_size=2, max_size=3), label="widths")]
    for dim in (0, 1):
        if dim == 0 and len({side.shape[1] for side in sides}) > 1:
            continue
        kept, built = tr.table_cat(sides, dim=dim), tr.table_cat([tr.concrete(side) for side in sides], dim=dim)
        assert isinstance(kept, tr.PairRows) == (h == 1 if dim == 1 else all(side.shape[1] == 1 for side in sides))
        _same_read(kept, built)


def test_affine_grid_finds_the_steps_of_a_grid_read_and_refuses_others():
    table = torch.randn(6, 7, 3)
    assert tr.affine_grid(_own_grid(table)) == (0, 7, 1)
    assert tr.affine_grid(tr.table_transpose(_own_grid(table), 2, 3)) == (0, 1, 7)
    sliced = tr.table_getitem(_own_grid(table), (slice(None), slice(None), slice(2, 5), slice(1, None, 2)))
    assert tr.affine_grid(sliced) == (2 * 7 + 1, 7, 2)
    halves = tr.table_cat([tr.table_getitem(_own_grid(table), (slice(None), slice(None), slice(3, 6))),
                           tr.table_getitem(_own_grid(table), (slice(None), slice(None), slice(0, 3)))], dim=2)
    assert tr.affine_grid(halves) is None  # rows 3-5 then 0-2: not one step
    assert tr.affine_grid(tr.table_bicubic(_own_grid(table), 4, 4)) is None  # 16 weighted terms per row
    two = tr.table_cat([_own_grid(table), _own_grid(table)], dim=0)
    assert tr.affine_grid(two) is None  # two images


def test_cats_of_pairs_stay_pairs_and_mixed_cats_list_their_terms():
    table = torch.randn(5, 6, 4)
    grid = table.permute(2, 0, 1).unsqueeze(0)
    steps = tr.affine_grid(_own_grid(table))

    def item(h, w):
        rows = tr.table_bicubic_pairs(_own_grid(table), h, w, *steps)
        real = F.interpolate(grid, size=(h, w), mode="bicubic")
        return tr.table_reshape(tr.table_permute(rows, 0, 2, 3, 1), -1, 4), real.permute(0, 2, 3, 1).reshape(-1, 4)

    (a, real_a), (b, real_b) = item(3, 9), item(7, 2)
    both = tr.table_cat([a, b])
    assert both.outer == 4 == tr.cat_outer([4, 4])
    torch.testing.assert_close(_gather(table, both), torch.cat([real_a, real_b]), atol=1e-5, rtol=1e-5)
    plain = tr.table_reshape(tr.table_getitem(_source(table), (slice(None, 2), slice(None, 3))), -1, 4)
    mixed = tr.table_cat([a, plain])
    assert mixed.outer == 0 == tr.cat_outer([4, 0]) and mixed.index.shape[-1] == 16
    torch.testing.assert_close(_gather(table, mixed), torch.cat([real_a, table[:2, :3].reshape(-1, 4)]),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(_gather(table, mixed)[-6:], table[:2, :3].reshape(-1, 4))  # a plain read stays exact


def test_table_gather_op_on_a_complex_table_returns_exact_pairs():
    table = torch.randn(12, 5, dtype=torch.complex64)
    index = torch.tensor([[3], [0], [11], [-1]])
    out = torch.ops.kimi_cg.table_gather(table, index, torch.ones(4, 1))
    assert out.shape == (4, 5, 2) and out.dtype == torch.float32
    assert torch.equal(out[:3], torch.view_as_real(table[index[:3, 0]]))
    assert torch.equal(out[3], torch.zeros(5, 2))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_gather_kernel_matches_the_reference(monkeypatch, dtype):
    monkeypatch.setenv("KIMI_CG_TRITON_ON_CPU", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(50, 72, generator=generator).to(dtype)
    index = torch.randint(-1, 50, (33, 16), generator=generator)
    weight = torch.randn(33, 16, generator=generator)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    for outer, index_dtype in ((0, torch.int64), (0, torch.int32), (4, torch.int32), (3, torch.int64)):
        part = index if not outer else index[:, :outer + 4].clamp(max=24)  # pairs: sums stay in the table
        expected = table_gather_reference(table, part.to(index_dtype), weight[:, :part.shape[1]], outer)
        out = torch.ops.kimi_cg.table_gather(table.to(device), part.to(index_dtype).to(device),
                                             weight[:, :part.shape[1]].to(device), outer).cpu()
        torch.testing.assert_close(out, expected, **tolerance)
        if outer:  # the reference's pairs are the listed terms' gather
            rows = tr.TableRows(part.to(torch.int32).view(33, 1, -1), weight[:, :part.shape[1]].view(33, 1, -1),
                                1, 72, outer)
            listed = tr.listed_terms(rows)
            assert torch.equal(expected, table_gather_reference(table, listed.index.view(33, -1),
                                                                listed.weight.view(33, -1)))
    with pytest.raises(ValueError, match="outer"):
        torch.ops.kimi_cg.table_gather(table.to(device), index.to(device), weight.to(device), 16)


GRIDS = [[[8, 6], [4, 4]], [[6, 10]], [[4, 8], [10, 6], [2, 2]], [[8, 6], [4, 4]], [[16, 14], [2, 4]]]


def _run(model, compiled, grid, seed):
    grid = torch.tensor(grid)
    x = torch.randn(int(grid.prod(-1).sum()), 3, 14, 14, generator=torch.Generator().manual_seed(seed))
    return model(x, grid), compiled(x, grid)


def _flat(value):
    return value if isinstance(value, torch.Tensor) else torch.cat([v.reshape(-1, v.shape[-1]) for v in value])


# the plain program, and the padded bucket path in a NaN-poisoned pool
PATHS = [{}, {"cuda_graphs": True, "token_budgets": [128, 512], "poison_graph_pool": True}]


def _with_table_gathers(model, options):
    torch.manual_seed(0)
    kimi_cg.reset()
    model = model().eval()
    return model, torch.compile(model, backend="kimi_cg", options={"strict": True, "table_gathers": True, **options})


@pytest.mark.parametrize("options", PATHS)
def test_reference_tower_reads_its_tables_on_the_device(options):
    model, compiled = _with_table_gathers(lambda: MoonVitPretrainedModel(MoonVitConfig.tiny()), options)
    with torch.no_grad():
        for seed, grid in enumerate(GRIDS):
            expected, out = _run(model, compiled, grid, seed)
            torch.testing.assert_close(_flat(out), _flat(expected), atol=1e-5, rtol=1e-5)
        # A weight loader's write through .data bumps no version counter: the device reads the table
        # itself, so the next call sees it.
        model.patch_embed.pos_emb.weight.data.mul_(2.0)
        model.encoder.rope_2d.freqs_cis.data.mul_(0.5)
        expected, out = _run(model, compiled, GRIDS[0], 0)
        torch.testing.assert_close(_flat(out), _flat(expected), atol=1e-5, rtol=1e-5)
    assert kimi_cg.counters["table_gathers"] >= 2
    assert kimi_cg.counters["table_gather_pairs"] >= 1  # the position grid's resize: 4 row by 4 column taps
    assert kimi_cg.counters["state_content_checks"] == 0  # no host program reads a table


@pytest.mark.parametrize("options", PATHS)
def test_video_tower_reads_its_tables_on_the_device(options):
    """MoonViT3d (Kimi-K2.5): images and video chunks; its RoPE rows per frame are a table read."""
    from kimi_cg.models import MoonViT3dConfig, MoonViT3dPretrainedModel

    model, compiled = _with_table_gathers(lambda: MoonViT3dPretrainedModel(MoonViT3dConfig.tiny()), options)
    grids = [[[1, 8, 6], [1, 4, 4]], [[3, 4, 6]], [[1, 6, 10], [2, 4, 8]], [[1, 8, 6], [1, 4, 4]], [[4, 2, 2]]]
    with torch.no_grad():
        for seed, grid in enumerate(grids):
            expected, out = _run(model, compiled, grid, seed)
            torch.testing.assert_close(_flat(out), _flat(expected), atol=1e-5, rtol=1e-5)
        # The device reads every table itself (NOTE [sums of table reads]): a write through .data shows.
        model.patch_embed.pos_emb.weight.data.mul_(2.0)
        model.patch_embed.pos_emb.time_weight.data.mul_(-1.5)
        expected, out = _run(model, compiled, grids[2], 2)
        torch.testing.assert_close(_flat(out), _flat(expected), atol=1e-5, rtol=1e-5)
    # RoPE, the position grid (its resize as pairs) and the time rows, per dynamo graph
    assert kimi_cg.counters["table_gathers"] >= 3
    assert kimi_cg.counters["table_gather_pairs"] >= 1
    assert kimi_cg.counters["table_sums_split"] >= 1
    assert kimi_cg.counters["state_content_checks"] == 0  # no host program reads a table


class _SumOfReads(torch.nn.Module):
    """Per item a slice of one table plus a slice of another scaled by a flag from the grid and broadcast
    (MoonViT3d's form, NOTE [sums of table reads]); ``twice``: each term joined twice, a form not split."""

    def __init__(self, twice: bool = False, dim: int = 6):
        super().__init__()
        self.grid_table = torch.nn.Parameter(torch.randn(9, 9, dim))
        self.register_buffer("rows_table", torch.randn(9, dim))
        self.proj = torch.nn.Linear(dim, dim)
        self.twice = twice

    def forward(self, x, grid):
        terms = []
        for i, (h, w) in enumerate(grid.tolist()):
            flag = (grid[i, 0] > 2).to(self.rows_table.dtype)
            term = (self.grid_table[:h, :w] + (self.rows_table[:h] * flag).unsqueeze(1)).flatten(end_dim=1)
            terms += [term, term] if self.twice else [term]
        pos = torch.cat(terms)
        return self.proj(x + (pos[: x.shape[0]] if self.twice else pos))


@pytest.mark.parametrize("options", PATHS)
@pytest.mark.parametrize("twice", [False, True])
def test_a_sum_of_two_table_reads_is_split_and_gathered(options, twice):
    model, compiled = _with_table_gathers(lambda: _SumOfReads(twice), options)
    with torch.no_grad():
        for seed, grid in enumerate([[[3, 4], [1, 5]], [[2, 2]], [[4, 1], [5, 3], [2, 6]], [[9, 9]]]):
            grid = torch.tensor(grid)
            x = torch.randn(int(grid.prod(-1).sum()), 6, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(compiled(x, grid), model(x, grid), atol=1e-5, rtol=1e-5)
    if twice:  # a term joined twice is left alone, read on the host (and checked there)
        assert kimi_cg.counters["table_sums_split"] == 0 and kimi_cg.counters["state_content_checks"] > 0
    else:
        assert kimi_cg.counters["table_sums_split"] >= 1 and kimi_cg.counters["table_gathers"] >= 2
        assert kimi_cg.counters["state_content_checks"] == 0


def test_the_option_off_computes_the_tables_on_the_host():
    torch.manual_seed(0)
    kimi_cg.reset()
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    compiled = torch.compile(model, backend="kimi_cg", options={"strict": True, "table_gathers": False})
    with torch.no_grad():
        for seed, grid in enumerate(GRIDS[:3]):
            expected, out = _run(model, compiled, grid, seed)
            torch.testing.assert_close(_flat(out), _flat(expected), atol=1e-5, rtol=1e-5)
    assert kimi_cg.counters["table_gathers"] == 0
    assert kimi_cg.counters["state_content_checks"] > 0


def test_the_graph_that_builds_the_rope_table_runs_once_without_buckets():
    """NOTE [a graph that builds module state]: the first call's graph makes the RoPE table (returned
    to be stored on the module); it runs the plain program (no buckets), every call equal to eager."""
    from kimi_cg.runtime.runner import live_runners

    torch.manual_seed(0)
    kimi_cg.reset()
    torch._dynamo.reset()
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).eval()
    assert model.encoder.rope_2d.freqs_cis is None
    before = set(live_runners())  # other tests' runners may still be alive
    compiled = torch.compile(model, backend="kimi_cg", options={"strict": True, "cuda_graphs": True,
                                                                "token_budgets": [128, 512], "table_gathers": True})
    with torch.no_grad():
        for seed, grid in enumerate(GRIDS):
            grid = torch.tensor(grid)
            x = torch.randn(int(grid.prod(-1).sum()), 3, 14, 14, generator=torch.Generator().manual_seed(seed))
            out = compiled(x, grid)  # first: the compiled call makes the table
            torch.testing.assert_close(_flat(out), _flat(model(x, grid)), atol=1e-5, rtol=1e-5)
    runners = [r for r in live_runners() if r not in before]
    builders = [r for r in runners if r.graphs_for is None]
    assert len(builders) == 1 and len(runners) > 1
    # (the program the later graphs share: tests/test_dumps.py's index test)
    assert builders[0].device.key not in {r.device.key for r in runners if r.graphs_for is not None}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs CUDA")
@pytest.mark.parametrize("host_block", [False, True])
def test_plans_staged_through_pinned_memory_on_cuda(monkeypatch, host_block):
    """NOTE [pinned staging]: plans of 64 KB or more (2,048+ rows of pairs) go to the device through the
    runner's pinned slots, also for a split call ([[48, 48]] * 2 is over the largest bucket) and for calls
    queued back to back without a sync (each slot is rewritten only after its copy finished); equal to
    eager. With the host_block option, replays take them through their buckets' host copies instead
    (NOTE [host block]): also equal, the split call's parts still staged."""
    from kimi_cg.runtime.staging import pinned_staging

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    kimi_cg.reset()
    model = MoonVitPretrainedModel(MoonVitConfig.tiny()).cuda().eval()
    staged_before = pinned_staging.staged_copies
    compiled = torch.compile(model, backend="kimi_cg", options={"strict": True, "token_budgets": [256, 1024, 4096],
                                                                "poison_graph_pool": True, "table_gathers": True,
                                                                "host_block": host_block})
    grids = [[[48, 48]], [[48, 48]], [[20, 30], [28, 26]], [[16, 16]], [[46, 50], [30, 26], [8, 8]], [[64, 60]],
             [[50, 46]], [[48, 48], [24, 28]], [[48, 48], [48, 48]]]
    inputs = []
    for seed, grid in enumerate(grids):
        grid = torch.tensor(grid)
        inputs.append((torch.randn(int(grid.prod(-1).sum()), 3, 14, 14,
                                   generator=torch.Generator().manual_seed(seed)).cuda(), grid))
    with torch.no_grad():
        expected = [model(*args) for args in inputs]
        for _ in range(2):  # the second time back to back: nothing waits for the device between calls
            outs = [compiled(*args) for args in inputs]
            for out, want in zip(outs, expected):
                torch.testing.assert_close(_flat(out), _flat(want), atol=1e-5, rtol=1e-5)
    assert kimi_cg.counters["table_gathers"] >= 2 and kimi_cg.counters["call_fallbacks"] == 0
    assert pinned_staging.staged_copies > staged_before
    assert (kimi_cg.counters["host_block_copies"] > 0) == host_block and kimi_cg.counters["split_calls"] >= 2
