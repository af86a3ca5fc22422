"""NOTE [flash path] (kimi_cg/attention_substitutes.py): in kimi_cg frames transformers' vision towers on
"sdpa" are traced on their packed flash branch (one varlen attention per layer) instead of the
per-segment split loop, which dynamo unrolls per number of segments. Checked here: the real towers take
it (one graph per item count, no graph break, equal to eager), a flash branch kimi_cg cannot compute
exactly is refused (that call runs eagerly, later calls trace the sdpa branch), and code that does not
ask for the flash branch keeps the SDPA function's own semantics."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import kimi_cg

pytest.importorskip("transformers")

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.utils.generic import is_flash_attention_requested  # noqa: E402

from towers import TowerUnavailable, relative_error  # noqa: E402
from towers.transformers_towers import FACTORIES  # noqa: E402

RELATIVE_TOLERANCE = 1e-5


def assert_matches(got: list[torch.Tensor], want: list[torch.Tensor], where: str) -> None:
    assert len(got) == len(want), where
    for g, w in zip(got, want):
        assert g.shape == w.shape and not torch.isnan(g).any(), where
        assert relative_error(g, w) <= RELATIVE_TOLERANCE, f"{where}: {relative_error(g, w):.3e}"


@pytest.mark.parametrize("tower_name, attn_implementation", [("qwen2_vl", "sdpa"), ("glm4v", "sdpa"), ("qwen2_vl", "eager")])
def test_towers_on_sdpa_trace_one_graph_per_item_count(tower_name, attn_implementation):
    try:
        tower = FACTORIES[tower_name](attn_implementation, seed=0)
    except TowerUnavailable as reason:
        pytest.skip(str(reason))
    compiled = torch.compile(tower.model, backend="kimi_cg")
    graphs = []
    for count in (1, 2, 3):
        args = tower.make_inputs([[1, 4, 4]] * (count - 1) + [[1, 2, 6]])
        before = kimi_cg.counters["dynamo_graphs"]
        with torch.no_grad():
            want = tower.extract_outputs(tower.model(*args))
            got = tower.extract_outputs(compiled(*args))
        assert_matches(got, want, f"{tower.name}, {count} items: {dict(kimi_cg.counters)}")
        graphs.append(kimi_cg.counters["dynamo_graphs"] - before)
    counters = kimi_cg.counters.copy()
    if attn_implementation == "sdpa":
        # One trace per item count, the whole forward in one graph: no settings ladder, no graph break.
        assert graphs == [1, 1, 1], (graphs, counters)
        # Every trace on the flash branch (torch 2.11 traces the forward apart from transformers' wrappers: more)
        assert counters["flash_path_traces"] >= 3 and counters["graph_breaks"] == 0, counters
        assert counters["dynamo_trace_failures"] == 0 and counters["flash_path_refusals"] == 0, counters
    else:  # the model's own eager attention ignores cu_seq_lens_q: never on the flash branch
        assert counters["flash_path_traces"] == 0, counters
    assert counters["lift_fallbacks"] == counters["call_fallbacks"] == 0, counters


class _Config:
    def __init__(self, vision: bool):
        self._attn_implementation = "sdpa"
        if vision:
            self.patch_size = 2


class SegmentAttention(nn.Module):
    """One attention layer over packed segments (cu_seqlens from a grid), written three ways:
    - "flash_by_positions": the flash branch passes no cu_seq_lens_q (flash-attn would derive the
      segments from position_ids), the sdpa branch splits per segment;
    - "always_cu_seq_lens": no flash branch; SDPA gets cu_seq_lens_q and, as eager, ignores it (one
      attention over all rows);
    - "split": the flash branch passes cu_seq_lens_q, the sdpa branch splits (transformers' towers);
    - "flash_by_other_function": the flash branch calls an attention other than transformers' SDPA
      function, which ignores the segments (as a model's own eager attention would)."""

    is_causal = False

    def __init__(self, style: str, vision: bool = True, dim: int = 16, heads: int = 2, kv_heads: int | None = None,
                 forwarded: dict | None = None):
        super().__init__()
        self.style, self.heads, self.config = style, heads, _Config(vision)
        self.kv_heads = kv_heads or heads
        self.num_key_value_groups = heads // self.kv_heads  # transformers' name; read by its SDPA function
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * self.kv_heads * self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.forwarded = forwarded or {}  # keywords a model forwards to its attention function

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        cu_seqlens = nn.functional.pad((grid[:, 0] * grid[:, 1]).cumsum(0, dtype=torch.int32), (1, 0))
        rows = x.shape[0]
        q = self.q(x).reshape(rows, self.heads, -1).transpose(0, 1).unsqueeze(0)
        k, v = self.kv(x).reshape(rows, 2, self.kv_heads, -1).permute(1, 2, 0, 3).unsqueeze(1).unbind(0)
        attention = functools.partial(ALL_ATTENTION_FUNCTIONS["sdpa"], **{
            name: grid if value == "grid" else value for name, value in self.forwarded.items()})
        if self.style == "always_cu_seq_lens":
            out = attention(self, q, k, v, None, scaling=None, is_causal=False, cu_seq_lens_q=cu_seqlens,
                            cu_seq_lens_k=cu_seqlens)[0]
        elif self.style == "flash_by_other_function" and is_flash_attention_requested(self.config):
            out = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        elif self.style != "flash_by_other_function" and is_flash_attention_requested(self.config):
            extra = {} if self.style == "flash_by_positions" else {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens}
            out = attention(self, q, k, v, None, scaling=None, is_causal=False, **extra)[0]
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            splits = [torch.split(t, lengths, dim=2) for t in (q, k, v)]
            out = torch.cat([attention(self, qs, ks, vs, None, scaling=None, is_causal=False)[0]
                             for qs, ks, vs in zip(*splits)], dim=1)
        return self.proj(out.reshape(rows, -1))


def _run(module: nn.Module, grids: list[list[list[int]]], dim: int = 16) -> None:
    torch.manual_seed(0)
    compiled = torch.compile(module, backend="kimi_cg")
    for grid in grids:
        grid_tensor = torch.tensor(grid)
        x = torch.randn(int(grid_tensor.prod(-1).sum()), dim)
        with torch.no_grad():
            assert_matches([compiled(x, grid_tensor)], [module(x, grid_tensor)], f"{grid}: {dict(kimi_cg.counters)}")


def test_a_flash_branch_without_segments_is_refused_then_traced_on_the_sdpa_branch():
    module = SegmentAttention("flash_by_positions").eval()
    _run(module, [[[2, 3], [1, 4]]])
    assert kimi_cg.counters["flash_path_refusals"] == 1, dict(kimi_cg.counters)
    graphs = kimi_cg.counters["dynamo_graphs"]  # the forward ran eagerly (dynamo traced its nested frames)
    _run(module, [[[2, 3], [1, 4]], [[3, 3], [2, 2], [1, 2]]])
    counters = kimi_cg.counters.copy()
    assert counters["flash_path_refusals"] == 1 and counters["dynamo_graphs"] > graphs, counters
    assert counters["flash_path_traces"] == 1, counters  # only the refused trace took the branch


def test_a_flash_branch_computing_attention_another_way_is_refused():
    module = SegmentAttention("flash_by_other_function").eval()
    _run(module, [[[2, 3], [1, 4]], [[2, 3], [1, 4]], [[3, 3], [2, 2], [1, 2]]])
    counters = kimi_cg.counters.copy()
    assert counters["flash_path_refusals"] == 1 and counters["flash_path_traces"] == 1, counters
    assert counters["dynamo_graphs"] >= 2, counters


def test_cu_seq_lens_given_to_sdpa_outside_the_flash_branch_are_ignored_as_eager_does():
    _run(SegmentAttention("always_cu_seq_lens").eval(), [[[2, 3], [1, 4]], [[3, 3], [2, 2], [1, 2]]])
    counters = kimi_cg.counters.copy()
    assert counters["flash_path_traces"] == 0 and counters["flash_path_refusals"] == 0, counters
    assert counters["dynamo_graphs"] >= 1 and counters["lift_fallbacks"] == 0, counters


@pytest.mark.parametrize("vision", [True, False])
def test_only_vision_configs_take_the_flash_branch(vision):
    _run(SegmentAttention("split", vision=vision).eval(), [[[2, 3], [1, 4]], [[3, 3], [2, 2], [1, 2]]])
    counters = kimi_cg.counters.copy()
    # Every trace of a vision config takes the branch. One trace may serve both item counts: the rows and
    # the grid are dynamic from the first trace (NOTE [dynamic first trace]) and nothing here fixes N.
    assert counters["flash_path_traces"] == (counters["dynamo_graphs"] if vision else 0), counters
    assert counters["flash_path_refusals"] == 0 and counters["dynamo_graphs"] >= 1, counters


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_key_value_heads_take_the_flash_branch(kv_heads):
    """Grouped key/value heads (LFM3-VL's tower): keys and values are repeated to the query heads on the
    flash branch, as transformers' own paths lay them out; equal to eager, lifted, never refused."""
    module = SegmentAttention("split", dim=32, heads=4, kv_heads=kv_heads).eval()
    _run(module, [[[2, 3], [1, 4]], [[3, 3], [2, 2], [1, 2]]], dim=32)
    counters = kimi_cg.counters.copy()
    assert counters["flash_path_refusals"] == 0 and counters["flash_path_traces"] == counters["dynamo_graphs"] >= 1, counters
    assert counters["lift_fallbacks"] == counters["call_fallbacks"] == 0, counters


@pytest.mark.parametrize("forwarded, refused", [
    ({"grid_thw": "grid", "cache": None}, False),  # read by neither of transformers' paths / None: ignored
    ({"deterministic": None}, False),  # read by the flash path, None its default
    ({"sliding_window": 2}, True),  # read by the flash path: refused, then traced on the sdpa branch
])
def test_forwarded_keywords_are_ignored_only_where_transformers_ignores_them(forwarded, refused):
    """NOTE [attention keywords]: a keyword transformers' attention functions do not read (a model's
    forwarded ``grid_thw``) leaves the flash branch as it is; one they read must be None. The sdpa branch
    runs the transformers function as written (it ignores ``sliding_window``), equal to eager."""
    module = SegmentAttention("split", forwarded=forwarded).eval()
    _run(module, [[[2, 3], [1, 4]], [[3, 3], [2, 2], [1, 2]]])
    counters = kimi_cg.counters.copy()
    assert (counters["flash_path_refusals"] > 0) == refused, counters

