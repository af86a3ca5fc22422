"""Options x towers x grids: kimi_cg's bucketed runtime under random options, against eager.

The program fuzzer (tests/program_fuzz.py) draws programs and compiles them under two fixed option
sets; the tower tests use one or two hand-picked sets. Here hypothesis draws the options themselves
(bucket lists, including capacities that are not multiples of a tower's row groups, ``max_items``,
``max_frames``, ``attention_length_classes``, ``exact_size_graphs``) for kimi_cg's reference towers
and transformers' towers and Kimi-VL's remote-code MoonViT in its three attention paths (tiny, fp32,
random weights), then a few calls of random grid batches (the
first batch again at the end: the caches' path), each through the padded path that CUDA graphs
replay (``cuda_graphs=True``, run without capture on the CPU). Every call must equal eager (fp32
rule of kimi_cg.testing, NaN never passes), and no call may reach a fallback that hides an error in
kimi_cg's own code ("lifted program failed", "internal error": results stay right there, but it is a
bug). More examples, another seed:
``KIMI_CG_OPTIONS_FUZZ_EXAMPLES=200 KIMI_CG_OPTIONS_FUZZ_SEED=7 pytest tests/test_options_fuzz.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import kimi_cg
import kimi_cg.testing
from kimi_cg import varlen_registry
from kimi_cg.testing.targets import pixel_inputs
from program_fuzz import _INTERNAL_FALLBACKS as INTERNAL  # reasons that mean kimi_cg's own code failed
from towers import TowerUnavailable
from towers.transformers_towers import FACTORIES
from towers.upstream_moonvit import FLASH_STAND_IN, build_upstream_moonvit

EXAMPLES = int(os.environ.get("KIMI_CG_OPTIONS_FUZZ_EXAMPLES", "6"))
SEED = int(os.environ.get("KIMI_CG_OPTIONS_FUZZ_SEED", "20261205"))


def _reference(name: str):
    from kimi_cg.models import KimiK25VisionEncoder, KimiVLVisionEncoder, MoonViT3dConfig, MoonVitConfig

    torch.manual_seed(0)
    if name == "kimi_vl":
        return KimiVLVisionEncoder(MoonVitConfig.tiny(attn_implementation="sdpa")).eval(), pixel_inputs("cpu", torch.float32), None
    return KimiK25VisionEncoder(MoonViT3dConfig.tiny()).eval(), pixel_inputs("cpu", torch.float32), None


# tower -> (dims of a grid row, share of video items, most frames of one item). transformers 5.17's
# Kimi-K2.5 merger takes one t per batch and GLM-4V one [1, h, w] row per frame: images only there.
TOWERS = {"kimi_vl": (2, 0.0, 1), "kimi_k25": (3, 0.3, 4), "hf_kimi_k25": (3, 0.0, 1), "hf_qwen2_vl": (3, 0.3, 2),
          "hf_qwen2_5_vl": (3, 0.3, 2), "hf_glm4v": (3, 0.0, 1), "upstream_eager": (2, 0.0, 1),
          "upstream_sdpa": (2, 0.0, 1), "upstream_flash_attention_2": (2, 0.0, 1)}
_BUILT: dict[str, tuple] = {}


def _tower(name: str):
    if name not in _BUILT:
        if name.startswith("upstream_"):  # Kimi-VL's remote-code MoonViT, in each attention implementation
            tower = build_upstream_moonvit(name[len("upstream_"):], seed=0)
            _BUILT[name] = (tower.model, tower.make_inputs, tower.extract_outputs)
        elif name.startswith("hf_"):
            try:
                tower = FACTORIES[name[len("hf_"):]]("sdpa", seed=0)
            except TowerUnavailable as reason:
                pytest.skip(str(reason))
            _BUILT[name] = (tower.model, tower.make_inputs, tower.extract_outputs)
        else:
            _BUILT[name] = _reference(name)
    return _BUILT[name]


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(TOWERS)))
    dims, video, frames = TOWERS[name]
    budgets = sorted(set(draw(st.lists(st.sampled_from([16, 24, 40, 64, 96, 100, 128, 256, 512]), min_size=1, max_size=4))))
    options = {"cuda_graphs": True, "token_budgets": budgets,
               "max_items": draw(st.integers(1, 6)), "max_frames": draw(st.integers(1, 4)),
               "attention_length_classes": draw(st.integers(1, 3)), "exact_size_graphs": draw(st.integers(0, 2)),
               "linear_gelu_epilogue": draw(st.booleans()), "table_gathers": draw(st.booleans()),
               "host_block": draw(st.booleans())}
    strategy = kimi_cg.testing.grids(dims=dims, max_items=6, max_side=16, max_patches=512, video_fraction=video,
                                     max_frames=frames, table_size=8, buckets=budgets)
    batches = draw(st.lists(strategy, min_size=2, max_size=3))
    return name, options, batches + [batches[0]]


@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_random_options_match_eager_without_internal_fallbacks(case):
    name, options, batches = case
    model, make_inputs, outputs = _tower(name)
    torch._dynamo.reset()
    kimi_cg.reset()
    registry = dict(varlen_registry._REGISTRY)
    if name == "upstream_flash_attention_2":  # as a user of that path would (restored below: other tests see none)
        kimi_cg.register_varlen_attention(FLASH_STAND_IN, {"max_seqlen_q": "q", "max_seqlen_k": "k"},
                                          segments=("cu_seqlens_q", "cu_seqlens_k"))
    try:
        compiled = torch.compile(model, backend="kimi_cg", options=options)
        with torch.no_grad():
            kimi_cg.testing.assert_matches_eager(model, compiled, make_inputs, batches, outputs=outputs, seed=1)
    finally:
        varlen_registry._REGISTRY.clear()
        varlen_registry._REGISTRY.update(registry)
    hidden = {reason: count for reason, count in kimi_cg.fallbacks.items() if reason.startswith(INTERNAL)}
    assert not hidden, (name, options, batches, hidden, dict(kimi_cg.counters))
