"""NOTE [row locality] on single ops: which programs may run on a bucket's padded rows."""

from __future__ import annotations

import torch
import torch.fx

from kimi_cg.runtime.graphs import InputRule
from kimi_cg.runtime.row_locality import padding_hazard


def _hazard(fn, *inputs):
    gm = torch.fx.symbolic_trace(fn)
    return padding_hazard(gm, [InputRule("rows") for _ in inputs], list(inputs))


def test_complex_views_keep_rows_apart():
    """A RoPE table that reaches a program as rows ([L, D/2] complex64, e.g. computed by a frame that runs
    eagerly) is viewed as real pairs and broadcast over heads: row-local (Kimi-VL's remote code, sdpa path)."""
    def rotate(x, table):  # x [L, H, D/2, 2] real, table [L, D/2] complex
        f = torch.view_as_real(table).unsqueeze(-3)
        return x[..., 0] * f[..., 0] - x[..., 1] * f[..., 1]

    def rotate_complex(x, table):  # x [L, H, D] real
        pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
        return torch.view_as_real(pairs * table.unsqueeze(-2)).flatten(-2)

    table = torch.polar(torch.ones(6, 4), torch.randn(6, 4))
    assert _hazard(rotate, torch.randn(6, 2, 4, 2), table) is None
    assert _hazard(rotate_complex, torch.randn(6, 2, 8), table) is None


def test_complex_views_do_not_hide_an_op_across_rows():
    def mixes(table):
        return torch.view_as_real(table).cumsum(0)

    def flattens_rows(table):
        return torch.view_as_real(table).reshape(-1, 2)[:3]

    table = torch.polar(torch.ones(6, 4), torch.randn(6, 4))
    assert "an op along the row axis" in _hazard(mixes, table)
    assert _hazard(flattens_rows, table) is not None


def test_grouped_key_value_heads_repeated_per_query_head_keep_rows_apart():
    """Grouped key/value heads ([1, H_kv, L, D] -> [1, H, L, D] by repeat_interleave on the head axis, as
    transformers' flash branch needs them and EXAONE 4.5's tower has them) stay row-local; a repeat along
    the rows, or by a tensor of counts, does not."""
    def heads(k):
        return k.repeat_interleave(2, dim=1).sum(-1)

    def heads_function(k):
        return torch.repeat_interleave(k, 2, 1) * 2

    def along_rows(k):
        return k.repeat_interleave(2, dim=2)[:, :, : k.shape[2]]

    def by_counts(k):
        return k.repeat_interleave(torch.tensor([1, 2]), dim=1)

    def without_dim(k):
        return k.repeat_interleave(2)[: k.numel()].view(k.shape)

    k = torch.randn(1, 2, 6, 4)
    assert _hazard(heads, k) is None
    assert _hazard(heads_function, k) is None
    for fn in (along_rows, by_counts, without_dim):
        assert _hazard(fn, k) is not None, fn.__name__
