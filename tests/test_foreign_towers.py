"""Vision towers nobody on the project wrote, compiled unmodified with backend="kimi_cg", against eager.

The corpus (tests/towers/): transformers' Kimi-K2.5, Qwen2-VL, Qwen2.5-VL (window attention), GLM-4V and Qwen3-VL
vision towers, and MoonViT as its upstream remote code ships it (plain asserts; eager, sdpa and a
flash-attn stand-in op). Every tower is tiny (hidden 64, 2 layers, head dim 16) with random weights and
is called on three grids: one item, two items, two items of other sizes (the same item count again, so
the second trace must not specialise on sizes; video chunks with t > 1 where the tower takes them).
fp32: each output within 1e-5 of eager relative to the output's largest magnitude, and no NaN. Each
call prints its time and kimi_cg.counters (``-rP`` shows them); a failure message includes them too.
Whole module: about 3 minutes on 2 CPU cores.

The last test checks that a kimi_cg compile leaves other torch.compile users alone (their outputs and
the dynamo settings they see), in a fresh interpreter so that nothing earlier in the test run counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kimi_cg
from towers import Tower, TowerUnavailable, relative_error
from towers.transformers_towers import FACTORIES as TRANSFORMERS_FACTORIES
from towers.transformers_towers import PROBED_FACTORIES
from towers.upstream_moonvit import build_upstream_moonvit

RELATIVE_TOLERANCE = 1e-5  # fp32: max |compiled - eager| / max |eager|, per output tensor
SEED = 0

# Three grids per tower: one item; two items; two items again with other sizes (the second trace of an
# item count must not specialise on sizes), there with a video chunk where the tower takes them.
# [t, h, w] rows, h and w even (merge size 2); the learned position grids are 8 x 8, so sizes above 8
# resample upwards. Qwen's t counts temporal patches (each row packs 2 frames).
GRIDS = {
    "kimi_k25": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        # Two 4-frame video chunks: transformers 5.17's temporal merger concatenates per-chunk index
        # rows [h*w/4, t, 4], so eager itself rejects a batch mixing t (5.24 accepts it).
        [[4, 2, 4], [4, 6, 2]],
    ],
    "qwen2_vl": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[2, 2, 4], [1, 10, 4]],  # a video of 2 temporal patches (4 frames) and an image
    ],
    # Windows of 2 x 2 merged tokens (4 x 4 patches): 4 x 6, 6 x 2 and 6 x 4 leave partial windows.
    # Kept small: the tower unrolls a per-window loop in both attention layers' split path.
    "qwen2_5_vl": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[2, 4, 4], [1, 6, 4]],
    ],
    # GLM-4V takes one [1, h, w] row per frame: the last grid is a 2-frame video.
    "glm4v": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[1, 12, 10], [1, 12, 10]],
    ],
    # Qwen3-VL: as Qwen2-VL; the last grid holds a video of 2 temporal patches.
    "qwen3_vl": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[2, 2, 4], [1, 10, 4]],
    ],
    # Qwen3.5 and GLM-OCR (the bucketed test only: no code of their own in kimi_cg, checked for replays).
    "qwen3_5": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[2, 2, 4], [1, 10, 4]],
    ],
    "glm_ocr": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[1, 2, 4], [1, 10, 4]],
    ],
    "hunyuan_vl": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[1, 2, 4], [1, 10, 4]],
    ],
    # Ernie-4.5-VL attends per frame: the last grid has a 2-frame video.
    "ernie4_5_vl": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[2, 4, 4], [1, 6, 2]],
    ],
    # Merge sizes alternate 1, 2 (images, video frames).
    "video_llama_3": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[1, 2, 4], [1, 10, 4]],
    ],
    # PaddleOCR-VL: images, one [1, h, w] row each; sizes above 8 resample its 8 x 8 grid upwards.
    "paddleocr_vl": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[1, 2, 4], [1, 12, 10]],
    ],
    # Pixtral: images in a zero-padded batch; the last grid's images differ in both sides.
    "pixtral": [
        [[1, 4, 6]],
        [[1, 4, 4], [1, 6, 2]],
        [[1, 2, 8], [1, 10, 4]],
    ],
    # Towers of other models that reuse a family's layout (the bucketed test only): images and a video of 2
    # temporal patches where the tower takes them.
    "qwen3_vl_moe": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 2, 4], [1, 10, 4]]],
    "qwen3_omni_moe": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 2, 4], [1, 10, 4]]],
    "glm4v_moe": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[1, 12, 10], [1, 12, 10]]],
    "glm_image": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[1, 2, 4], [1, 10, 4]]],
    # Towers new in transformers 5.25: Qwen-style rows, a video of 2 temporal patches where they take one.
    "qwen2_5_omni": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 4, 4], [1, 6, 4]]],
    "qwen3_5_moe": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 2, 4], [1, 10, 4]]],
    "exaone4_5": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 4, 4], [1, 6, 4]]],
    "glm5_next": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 2, 4], [1, 10, 4]]],
    "cosmos3_edge": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 4, 4], [1, 6, 4]]],
    "minimax_m3_vl": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 4, 4], [1, 6, 4]]],
    "qwen4_exp": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 2, 4], [1, 10, 4]]],
    "cohere_compass": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[1, 2, 4], [1, 10, 4]]],
    "muse_glimmer": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 4, 4], [1, 6, 4]]],
    "muse_spark": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[2, 4, 4], [1, 6, 4]]],
    # Ovis2.5: windows of 2 x 2 merged tokens; 6 x 2 and 10 x 4 leave partial windows.
    "ovis2_5": [[[1, 4, 6]], [[1, 4, 4], [1, 6, 2]], [[1, 8, 8], [1, 10, 4]]],
    # [h, w] rows (Kimi-VL has images only).
    "upstream_moonvit": [
        [[4, 6]],
        [[4, 4], [6, 2]],
        [[2, 8], [10, 4]],
    ],
}

# Towers whose every graph with activations lifts (no lift fallback, no call fallback) on these grids:
# a ratchet, so a change that stops lifting one fails here. Kimi-VL's MoonViT with the flash stand-in
# needs its op registered (test_a_registered_flash_op_takes_max_seqlen_as_an_upper_bound).
NO_LIFT_FALLBACK = {f"{name}-{attn}" for name in ("kimi_k25", "qwen2_vl", "qwen2_5_vl", "glm4v", "qwen3_vl", "upstream_moonvit")
                    for attn in ("sdpa", "eager")} | {"paddleocr_vl-sdpa", "exaone4_5-sdpa", "exaone4_5-eager"}
# Towers known not to lift (README's table says why): correct through dynamo's graph. Checked, so that a
# change that lifts one shows up here and the README is updated.
NOT_LIFTED = {"pixtral-sdpa"}

CASES = [
    pytest.param(TRANSFORMERS_FACTORIES[name], name, attn, id=f"{name}-{attn}")
    for name in ("kimi_k25", "qwen2_vl", "qwen2_5_vl", "glm4v")
    for attn in ("sdpa", "eager")
] + [
    # Qwen3-VL's eager attention is Qwen2-VL's split + loop path: sdpa only, to keep CI short.
    pytest.param(TRANSFORMERS_FACTORIES["qwen3_vl"], "qwen3_vl", "sdpa", id="qwen3_vl-sdpa"),
    # PaddleOCR-VL on sdpa (its flash branch, NOTE [flash path]); its eager attention path is not lifted yet:
    # dynamo cannot guard a data-dependent size there and the frame runs eagerly (correct).
    pytest.param(TRANSFORMERS_FACTORIES["paddleocr_vl"], "paddleocr_vl", "sdpa", id="paddleocr_vl-sdpa"),
    # Pixtral is not lifted (README): it crops each image's patches out of the padded batch's convolution
    # output, data movement per item from several tensors; dynamo's graph runs, equal to eager.
    pytest.param(TRANSFORMERS_FACTORIES["pixtral"], "pixtral", "sdpa", id="pixtral-sdpa"),
] + [
    # EXAONE 4.5 (transformers 5.25): Qwen2.5-VL's windows with grouped key/value heads, repeated per query
    # head on the flash branch (sdpa) and by repeat_kv inside each segment of the split loop (eager).
    pytest.param(TRANSFORMERS_FACTORIES["exaone4_5"], "exaone4_5", attn, id=f"exaone4_5-{attn}")
    for attn in ("sdpa", "eager")
] + [
    pytest.param(build_upstream_moonvit, "upstream_moonvit", attn, id=f"upstream_moonvit-{attn}")
    for attn in ("eager", "sdpa", "flash_attention_2")
]


@pytest.fixture(autouse=True)
def fresh_compiler_per_tower():
    """Each tower starts with an empty dynamo cache and zeroed kimi_cg counters and caches (in this order:
    torch._dynamo.reset() drops the compile callbacks kimi_cg.reset() installs)."""
    torch._dynamo.reset()
    kimi_cg.reset()
    yield
    torch._dynamo.reset()
    kimi_cg.reset()


def build_tower(factory, attn_implementation: str) -> Tower:
    try:
        return factory(attn_implementation, seed=SEED)
    except TowerUnavailable as reason:
        pytest.skip(str(reason))


@pytest.mark.parametrize("factory, tower_name, attn_implementation", CASES)
def test_compiled_tower_matches_eager(factory, tower_name, attn_implementation):
    tower = build_tower(factory, attn_implementation)
    inputs = [tower.make_inputs(grid) for grid in GRIDS[tower_name]]
    # Eager first, on every grid: a failure here is a wrong input, not a compiler bug.
    with torch.no_grad():
        expected = [tower.extract_outputs(tower.model(*args)) for args in inputs]

    compiled = torch.compile(tower.model, backend="kimi_cg")
    for grid, args, want in zip(GRIDS[tower_name], inputs, expected):
        started = time.perf_counter()
        try:
            with torch.no_grad():
                got = tower.extract_outputs(compiled(*args))
        except Exception as error:
            error.add_note(f"{tower.name} grid {grid}: kimi_cg.counters {dict(kimi_cg.counters)}")
            raise
        where = f"{tower.name} grid {grid} ({time.perf_counter() - started:.1f} s): kimi_cg.counters {dict(kimi_cg.counters)}"
        assert len(got) == len(want), f"{len(got)} outputs, eager has {len(want)}; {where}"
        worst = 0.0
        for index, (got_tensor, want_tensor) in enumerate(zip(got, want)):
            assert got_tensor.shape == want_tensor.shape and got_tensor.dtype == want_tensor.dtype, (
                f"output {index}: {tuple(got_tensor.shape)} {got_tensor.dtype}, eager "
                f"{tuple(want_tensor.shape)} {want_tensor.dtype}; {where}"
            )
            assert not torch.isnan(got_tensor).any(), f"output {index} has NaN; {where}"
            error = relative_error(got_tensor, want_tensor)
            assert error <= RELATIVE_TOLERANCE, f"output {index}: relative error {error:.3e}; {where}"
            worst = max(worst, error)
        print(f"{where}: worst relative error {worst:.2e}")  # shown with -rP or -s
    if f"{tower_name}-{attn_implementation}" in NO_LIFT_FALLBACK:
        assert kimi_cg.counters["lift_fallbacks"] == 0 and kimi_cg.counters["call_fallbacks"] == 0, dict(kimi_cg.counters)
        assert kimi_cg.counters["host_programs_built"] > 0
    if f"{tower_name}-{attn_implementation}" in NOT_LIFTED:  # (how it falls back depends on the transformers release)
        assert kimi_cg.counters["device_programs_compiled"] == 0, dict(kimi_cg.counters)


# The bucketed, padded path (what CUDA graphs replay; on CPU the same padding runs without capture):
# every rewrite's padding rule is exercised on real towers. Kimi-K2.5 replays every device call.
BUCKET_OPTIONS = {"cuda_graphs": True, "token_budgets": [32, 64, 128, 256]}
# PaddleOCR-VL's patches come as [1, L, 3, p, p] and HunYuan-VL's layers keep [1, L, D]: their rows are
# on dim 1 (NOTE [rows on dim 1] in kimi_cg/capture.py), padded there.
REPLAYS_EVERY_CALL = {"kimi_k25", "qwen2_vl", "qwen2_5_vl", "glm4v", "qwen3_vl", "qwen3_5", "glm_ocr", "ernie4_5_vl",
                      "video_llama_3", "paddleocr_vl", "hunyuan_vl", "qwen3_vl_moe", "qwen3_omni_moe", "glm4v_moe",
                      "glm_image", "ovis2_5", "qwen2_5_omni", "qwen3_5_moe", "exaone4_5", "glm5_next", "cosmos3_edge",
                      "minimax_m3_vl", "qwen4_exp", "cohere_compass", "muse_glimmer", "muse_spark"}
# Device-program calls (replays or plain runs) per tower call once traced: the pieces around graph
# breaks, not one per layer. Kimi-K2.5 is one piece on torch 2.11 and 2.13 (NOTE [int of a grid comparison],
# NOTE [repeat by a grid value]); Qwen2-VL and GLM-4V are one piece, the whole forward on its flash branch
# (NOTE [flash path] in kimi_cg/attention_substitutes.py).
# Qwen2.5-VL's first calls run its forward eagerly (NOTE [settings ladder]); the frames dynamo traces
# inside that eager run (its blocks, permute_input_for_window_attn) run as dynamo captured them, not as
# device programs (NOTE [calls inside a frame traced again]). Once the forward is traced, every call replays.
DEVICE_CALLS_PER_CALL = {"kimi_k25": 1, "qwen2_vl": 1, "qwen2_5_vl": 1, "glm4v": 1, "qwen3_vl": 1, "qwen3_5": 1, "glm_ocr": 1,
                         "paddleocr_vl": 1, "qwen3_vl_moe": 1, "qwen3_omni_moe": 1, "glm4v_moe": 1, "glm_image": 1,
                         "qwen2_5_omni": 1, "qwen3_5_moe": 1, "exaone4_5": 1, "glm5_next": 1, "cosmos3_edge": 1,
                         "minimax_m3_vl": 1, "qwen4_exp": 1, "cohere_compass": 1, "muse_glimmer": 2, "muse_spark": 2}
# Device programs per piece (a frame dynamo traces, read from the debug dump) that ran: the static first
# trace's and the dynamic one's. Graphs lifted but never called outside a frame's one eager run (Qwen2.5-VL's
# window permutation and blocks, traced on their own while its forward runs eagerly: NOTE [calls inside a
# frame traced again]) build programs that never compile or run and are not counted (NOTE [programs that
# ran]).
PROGRAMS_PER_PIECE = 2


@pytest.mark.parametrize("tower_name", ["kimi_k25", "qwen2_vl", "qwen2_5_vl", "glm4v", "qwen3_vl", "qwen3_5", "glm_ocr",
                                        "hunyuan_vl", "ernie4_5_vl", "video_llama_3", "paddleocr_vl",
                                        "qwen3_vl_moe", "qwen3_omni_moe", "glm4v_moe", "glm_image", "ovis2_5",
                                        "qwen2_5_omni", "qwen3_5_moe", "exaone4_5", "glm5_next", "cosmos3_edge",
                                        "minimax_m3_vl", "qwen4_exp", "cohere_compass", "muse_glimmer", "muse_spark",
                                        "upstream_moonvit"])
def test_bucketed_path_matches_eager(tower_name, tmp_path):
    from kimi_cg.debug.dump import read_index
    from kimi_cg.report import device_programs_per_frame

    factory = TRANSFORMERS_FACTORIES.get(tower_name, build_upstream_moonvit)
    tower = build_tower(factory, "sdpa")
    compiled = torch.compile(tower.model, backend="kimi_cg", options=dict(BUCKET_OPTIONS, debug_dir=str(tmp_path)))
    for grid in GRIDS[tower_name]:
        args = tower.make_inputs(grid)
        device_calls = sum(kimi_cg.counters[k] for k in ("graph_replays", "padded_runs", "eager_fallbacks"))
        fallbacks = {k: kimi_cg.counters[k] for k in ("call_fallbacks", "eager_fallbacks")}
        with torch.no_grad():
            want = tower.extract_outputs(tower.model(*args))
            got = tower.extract_outputs(compiled(*args))
        device_calls = sum(kimi_cg.counters[k] for k in ("graph_replays", "padded_runs", "eager_fallbacks")) - device_calls
        for index, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and not torch.isnan(g).any(), f"output {index} for {grid}"
            error = relative_error(g, w)
            assert error <= RELATIVE_TOLERANCE, f"output {index} for {grid}: {error:.3e}; {dict(kimi_cg.counters)}"
    assert kimi_cg.counters["lift_fallbacks"] == kimi_cg.counters["call_fallbacks"] == 0, dict(kimi_cg.counters)
    assert kimi_cg.counters["flash_path_refusals"] == 0, dict(kimi_cg.counters)  # NOTE [flash path]
    last_call = {k: kimi_cg.counters[k] - n for k, n in fallbacks.items()}  # traced by then
    # transformers 5.17's MiniMax-M3-VL tower attends over the whole packed batch (no per-item segments, no
    # `merge_temporal`): padding rows would reach real ones, so its calls run the plain program (correct).
    replays = tower_name in REPLAYS_EVERY_CALL and (tower_name != "minimax_m3_vl" or hasattr(tower.model, "merge_temporal"))
    if replays:  # no call ran unpadded (the last one, or none at all)
        assert last_call["eager_fallbacks"] == 0, dict(kimi_cg.counters)
        assert kimi_cg.counters["eager_fallbacks"] == 0, dict(kimi_cg.counters)
    if tower_name in DEVICE_CALLS_PER_CALL:  # the last grid's call, traced by then
        assert 1 <= device_calls <= DEVICE_CALLS_PER_CALL[tower_name], (device_calls, dict(kimi_cg.counters))
    programs = device_programs_per_frame(read_index(str(tmp_path)))
    assert programs, "no lifted piece"
    over = {frame: len(keys) for frame, keys in programs.items()
            if len(keys) > PROGRAMS_PER_PIECE}
    assert not over, over


# Towers kimi_cg runs correctly but does not (fully) graph (README: "Probed ... and why"): equal to eager on
# the bucketed path, item counts 1-3, images; nothing asserted about how they ran, so that an improvement
# needs no test change, a regression in correctness fails here.
PROBED_GRIDS = [[[1, 4, 6]], [[1, 8, 6], [1, 4, 4]], [[1, 6, 6], [1, 4, 8], [1, 2, 2]], [[1, 8, 8]], [[1, 4, 6], [1, 6, 4]]]
# transformers 5.17's MiniCPM-V 4.6 merges windows as if every image of a batch had the first one's size
# (eager rejects a mix); one size per batch here.
PROBED_GRIDS_BY_TOWER = {"minicpmv4_6": [[[1, 4, 6]], [[1, 8, 6]] * 2, [[1, 4, 4]] * 3, [[1, 8, 8]], [[1, 6, 4]] * 2]}


@pytest.mark.parametrize("tower_name", sorted(PROBED_FACTORIES))
def test_probed_towers_match_eager(tower_name):
    tower = build_tower(PROBED_FACTORIES[tower_name], "sdpa")
    compiled = torch.compile(tower.model, backend="kimi_cg", options=BUCKET_OPTIONS)
    for grid in PROBED_GRIDS_BY_TOWER.get(tower_name, PROBED_GRIDS):
        args = tower.make_inputs(grid)
        with torch.no_grad():
            want = tower.extract_outputs(tower.model(*args))
            got = tower.extract_outputs(compiled(*args))
        assert len(got) == len(want), grid
        for index, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.dtype == w.dtype, (index, grid)
            assert not torch.isnan(g).any(), (index, grid)
            error = relative_error(g, w)
            assert error <= RELATIVE_TOLERANCE, f"output {index} for {grid}: {error:.3e}; {dict(kimi_cg.counters)}"


@pytest.mark.parametrize("tower_name", ["kimi_k25", "qwen2_vl", "glm4v", "qwen3_vl"])
def test_a_repeated_single_image_runs_an_exact_size_graph(tower_name):
    """NOTE [exact-size graphs] on transformers' towers (grids on the host): from a one-image size's
    third call its calls run a graph of exactly its rows, equal to eager."""
    from kimi_cg.runtime.graphs import graph_sets

    earlier = list(graph_sets())  # (graph sets of earlier tests may still be alive)
    tower = build_tower(TRANSFORMERS_FACTORIES[tower_name], "sdpa")
    compiled = torch.compile(tower.model, backend="kimi_cg", options=BUCKET_OPTIONS)
    for grid in [[[1, 4, 6]]] + [[[1, 8, 6]]] * 4 + [[[1, 4, 6], [1, 8, 6]]]:
        args = tower.make_inputs(grid)
        with torch.no_grad():
            want = tower.extract_outputs(tower.model(*args))
            got = tower.extract_outputs(compiled(*args))
        for g, w in zip(got, want):
            assert g.shape == w.shape and relative_error(g, w) <= RELATIVE_TOLERANCE, grid
    new = [graphs for graphs in graph_sets() if not any(graphs is old for old in earlier)]
    assert [list(graphs.exact) for graphs in new if graphs.exact] == [[48]], dict(kimi_cg.counters)
    assert kimi_cg.counters["eager_fallbacks"] == kimi_cg.counters["call_fallbacks"] == 0, dict(kimi_cg.counters)


def test_a_first_symbolic_call_with_one_merged_row_does_not_fix_later_output_sizes():
    """Found by the H200's bf16 fuzz of Qwen2-VL (and reproduced on CPU): the device program's output
    rows were derived once, at the first call traced with symbolic sizes; that call had one merged row,
    the bias broadcast in the merger assumed it, and later calls on the padded path returned one merged
    row (NOTE [hints of a symbolic run] in kimi_cg/device_program.py)."""
    tower = build_tower(TRANSFORMERS_FACTORIES["qwen2_vl"], "sdpa")
    compiled = torch.compile(tower.model, backend="kimi_cg", options=BUCKET_OPTIONS)
    for grid in ([[2, 2, 2]], [[1, 2, 2]], [[1, 8, 6], [1, 10, 16]], [[1, 2, 2]]):
        args = tower.make_inputs(grid)
        with torch.no_grad():
            want = tower.extract_outputs(tower.model(*args))
            got = tower.extract_outputs(compiled(*args))
        for index, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape, f"output {index} for {grid}: {tuple(g.shape)}, eager {tuple(w.shape)}"
            assert relative_error(g, w) <= RELATIVE_TOLERANCE, f"output {index} for {grid}"
    assert kimi_cg.counters["padded_runs"] + kimi_cg.counters["graph_replays"] >= 3, dict(kimi_cg.counters)


def test_bucketed_qwen2_5_vl_with_inductor_programs_runs_every_call_lifted():
    """Inductor device programs (the CUDA default) on the tower with a size input (seq_len) and a frame
    called with tensors of two widths; strict, so a call that cannot run lifted raises. Each found on
    this tower: a program compiled for the first call's width failed Inductor's size assert at the
    other width, and a second process (warm Inductor cache) failed the cache's guard (NameError)."""
    tower = build_tower(TRANSFORMERS_FACTORIES["qwen2_5_vl"], "sdpa")
    compiled = torch.compile(tower.model, backend="kimi_cg", options=dict(BUCKET_OPTIONS, device_compiler="inductor", strict=True))
    for grid in GRIDS["qwen2_5_vl"] + GRIDS["qwen2_5_vl"][:1]:
        args = tower.make_inputs(grid)
        with torch.no_grad():
            want = tower.extract_outputs(tower.model(*args))
            got = tower.extract_outputs(compiled(*args))
        for index, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and not torch.isnan(g).any(), f"output {index} for {grid}"
            assert relative_error(g, w) <= RELATIVE_TOLERANCE, f"output {index} for {grid}; {dict(kimi_cg.counters)}"
    assert kimi_cg.counters["lift_fallbacks"] == kimi_cg.counters["call_fallbacks"] == 0, dict(kimi_cg.counters)


def _outputs_compiled_and_eager(tower, compiled, grid):
    args = tower.make_inputs(grid)
    with torch.no_grad():
        want = tower.extract_outputs(tower.model(*args))
        return tower.extract_outputs(compiled(*args)), want


def test_bucketed_qwen2_5_vl_with_many_windows_replays_every_traced_call():
    """Qwen2.5-VL's window boundaries hold a segment per window (16 and more per image here, hundreds at
    real sizes): more than max_items, so before NOTE [segment tables] (kimi_cg/runtime/graphs.py) no
    bucket fit and every call ran the plain program (98 of 118 device calls on the H200, 2026-12-03)."""
    tower = build_tower(TRANSFORMERS_FACTORIES["qwen2_5_vl"], "sdpa")
    # max_items=4: the tiny tower's 16 to 40 windows a call overflow the item table (as real sizes do the default 32)
    compiled = torch.compile(tower.model, backend="kimi_cg", options=dict(BUCKET_OPTIONS, token_budgets=[256, 512], max_items=4))
    grids = [[[1, 16, 16]], [[1, 16, 12], [1, 6, 10]], [[1, 16, 16]], [[1, 12, 16], [1, 10, 6], [2, 4, 8]], [[1, 14, 10]]]
    for index, grid in enumerate(grids):
        before = kimi_cg.counters["eager_fallbacks"]
        got, want = _outputs_compiled_and_eager(tower, compiled, grid)
        for g, w in zip(got, want):
            assert g.shape == w.shape and relative_error(g, w) <= RELATIVE_TOLERANCE, grid
        if index >= 3:  # the forward is traced by then (NOTE [settings ladder]): every call replays
            assert kimi_cg.counters["eager_fallbacks"] == before, dict(kimi_cg.counters)
    assert kimi_cg.counters["segment_tables_made_dense"] >= 1, dict(kimi_cg.counters)
    assert kimi_cg.counters["padded_runs"] >= 2 and kimi_cg.counters["padding_hazards"] == 0, dict(kimi_cg.counters)


# Two models other torch.compile users write: per-piece loops over host lists made with .tolist().
# They run under backend="eager" and "inductor" before a kimi_cg compile, after it (compiled before and
# called after, and compiled afresh), and in a worker thread after a kimi_cg compile there; outputs must
# match plain eager, the kimi_cg calls too, and the dynamo settings must read as they did before.
OTHER_COMPILES_SCRIPT = textwrap.dedent(
    """
    import json, threading
    import torch

    FLAGS = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops")

    def flags():
        return {name: getattr(torch._dynamo.config, name) for name in FLAGS}

    class SplitPieces(torch.nn.Module):
        def forward(self, x, lengths):
            pieces = torch.split(x, lengths.tolist())
            return torch.cat([piece.softmax(dim=0) * (index + 1) for index, piece in enumerate(pieces)])

    class ExtendBounds(torch.nn.Module):
        def forward(self, x, lengths):
            bounds = [0]
            bounds.extend(lengths.cumsum(0).tolist())
            return torch.stack([x[start:end].sum(dim=0) for start, end in zip(bounds, bounds[1:])])

    generator = torch.Generator().manual_seed(0)
    CALLS = [
        (torch.randn(9, 5, generator=generator), torch.tensor([2, 3, 4])),
        (torch.randn(11, 5, generator=generator), torch.tensor([6, 1, 4])),
    ]
    MODELS = {"split": SplitPieces(), "extend": ExtendBounds()}
    EXPECTED = {name: [model(*args) for args in CALLS] for name, model in MODELS.items()}

    def run_compiles(tag, report, compiled_store=None):
        for backend in ("eager", "inductor"):
            for name, model in MODELS.items():
                key = f"{tag}/{backend}/{name}"
                try:
                    compiled = torch.compile(model, backend=backend)
                    errors = [
                        (compiled(*args) - want).abs().max().item() / want.abs().max().item()
                        for args, want in zip(CALLS, EXPECTED[name])
                    ]
                    report[key] = {"relative_errors": errors}
                    if compiled_store is not None:
                        compiled_store[(backend, name)] = compiled
                except Exception as error:
                    report[key] = {"exception": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}

    report = {"flags_before": flags()}
    compiled_before = {}
    run_compiles("before", report, compiled_before)

    def kimi_cg_compile_and_call(tag):
        from kimi_cg.models.moonvit import MoonVitConfig, MoonVitPretrainedModel
        tower = MoonVitPretrainedModel(MoonVitConfig.tiny(num_hidden_layers=1)).eval()
        grid = torch.tensor([[4, 6], [2, 2]])
        pixels = torch.randn(int(grid.prod(-1).sum()), 3, 14, 14, generator=generator)
        with torch.no_grad():
            want = torch.cat([t.flatten() for t in tower(pixels, grid)])
            got = torch.cat([t.flatten() for t in torch.compile(tower, backend="kimi_cg")(pixels, grid)])
        report[f"{tag}_kimi_cg_relative_error"] = (got - want).abs().max().item() / want.abs().max().item()

    kimi_cg_compile_and_call("main")
    report["flags_after_kimi_cg"] = flags()

    for (backend, name), compiled in compiled_before.items():  # compiled before, called after
        key = f"cached/{backend}/{name}"
        try:
            report[key] = {"relative_errors": [
                (compiled(*args) - want).abs().max().item() / want.abs().max().item()
                for args, want in zip(CALLS, EXPECTED[name])
            ]}
        except Exception as error:
            report[key] = {"exception": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}

    torch._dynamo.reset()  # fresh traces, under whatever settings are now in force
    run_compiles("after", report)

    def in_thread():  # torch 2.13 keeps dynamo config per thread: a worker starts from the defaults
        try:
            report["flags_in_thread_before_kimi_cg"] = flags()
            kimi_cg_compile_and_call("thread")
            report["flags_in_thread_after_kimi_cg"] = flags()
            torch._dynamo.reset()
            run_compiles("thread", report)
        except Exception as error:
            report["thread_exception"] = f"{type(error).__name__}: {error}"

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join()
    import kimi_cg
    report["kimi_cg_counters"] = dict(kimi_cg.counters)
    print("REPORT " + json.dumps(report))
    """
)


def test_a_registered_flash_op_takes_max_seqlen_as_an_upper_bound(monkeypatch):
    """The upstream flash path passes max_seqlen = (cu[1:] - cu[:-1]).max().item() to an op kimi_cg does
    not know: its pieces run unlifted. Registered with kimi_cg.register_varlen_attention (as a user would
    for an unknown op), max_seqlen becomes the packed length and every piece is lifted."""
    from kimi_cg import varlen_registry
    from towers.upstream_moonvit import FLASH_STAND_IN

    tower = build_tower(build_upstream_moonvit, "flash_attention_2")
    inputs = [tower.make_inputs(grid) for grid in GRIDS["upstream_moonvit"]]

    def compile_and_compare(options=None) -> dict:
        torch._dynamo.reset()
        kimi_cg.reset()
        compiled = torch.compile(tower.model, backend="kimi_cg", options=options)
        with torch.no_grad():
            for args in inputs:
                for got, want in zip(compiled(*args), tower.model(*args), strict=True):
                    assert relative_error(got, want) <= 1e-5
        return dict(kimi_cg.fallbacks)

    monkeypatch.setattr(varlen_registry, "_REGISTRY", dict(varlen_registry._REGISTRY))  # restored after the test
    assert compile_and_compare().get("grid-dependent value reaches a device op", 0) >= 1
    kimi_cg.register_varlen_attention(FLASH_STAND_IN, {"max_seqlen_q": "q", "max_seqlen_k": "k"},
                                      segments=("cu_seqlens_q", "cu_seqlens_k"))
    assert compile_and_compare() == {}
    assert kimi_cg.counters["lift_fallbacks"] == 0 and kimi_cg.counters["host_programs_built"] > 0
    # Bucketed (the CUDA-graph path, padded on CPU): the op's cu_seqlens get the padding segment, so the
    # stand-in (which checks that its boundaries cover every row) runs every call lifted.
    assert compile_and_compare({"cuda_graphs": True, "token_budgets": [64, 128]}) == {}
    assert kimi_cg.counters["call_fallbacks"] == 0


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa", "flash_attention_2"])
def test_upstream_moonvit_replays_every_call_in_each_attention_implementation(attn_implementation, monkeypatch):
    """Kimi-VL's remote-code MoonViT in its three attention paths on the bucketed path: once its pieces
    are traced, every device call runs padded in a bucket (a CUDA-graph replay on the GPU), none runs
    the plain program. Found 2026-12-05: the sdpa and flash paths' RoPE table reaches the layers' piece
    as an input and its `view_as_real` was not known to keep rows apart; the eager path's
    `masked_fill(~mask, -inf)` + softmax attention kept its dense [1, L, L] mask (an unpadded input)."""
    from kimi_cg import varlen_registry
    from towers.upstream_moonvit import FLASH_STAND_IN

    monkeypatch.setattr(varlen_registry, "_REGISTRY", dict(varlen_registry._REGISTRY))  # restored after the test
    kimi_cg.register_varlen_attention(FLASH_STAND_IN, {"max_seqlen_q": "q", "max_seqlen_k": "k"},
                                      segments=("cu_seqlens_q", "cu_seqlens_k"))
    tower = build_tower(build_upstream_moonvit, attn_implementation)
    compiled = torch.compile(tower.model, backend="kimi_cg", options=BUCKET_OPTIONS)
    grids = GRIDS["upstream_moonvit"] + [[[6, 6]], [[2, 2], [4, 8], [6, 4]], [[8, 8], [2, 6]], [[10, 2]]]
    device_calls = ("graph_replays", "padded_runs", "eager_fallbacks")
    for index, grid in enumerate(grids):
        before = kimi_cg.counters["eager_fallbacks"]
        calls_before = sum(kimi_cg.counters[k] for k in device_calls)
        got, want = _outputs_compiled_and_eager(tower, compiled, grid)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and not torch.isnan(g).any(), grid
            assert relative_error(g, w) <= RELATIVE_TOLERANCE, (grid, relative_error(g, w))
        if index >= 3:  # every item count of these grids traced by then
            assert kimi_cg.counters["eager_fallbacks"] == before, (grid, dict(kimi_cg.counters))
            # Three pieces around the RoPE lookup's generator assert; the flash path's per-layer
            # `assert cu_seqlens[-1] == q.shape[0], (...)` breaks nothing (NOTE [asserts with a
            # computed message]; before it, a piece per layer: 29 device calls per call on an H100).
            calls = sum(kimi_cg.counters[k] for k in device_calls) - calls_before
            assert calls <= 3, (grid, calls, dict(kimi_cg.counters))
    assert kimi_cg.counters["lift_fallbacks"] == kimi_cg.counters["call_fallbacks"] == 0, dict(kimi_cg.counters)
    assert kimi_cg.counters["padding_hazards"] == 0 and kimi_cg.counters["padded_runs"] > 0, dict(kimi_cg.counters)


def test_other_compiles_unaffected_by_kimi_cg():
    result = subprocess.run(
        [sys.executable, "-P", "-c", OTHER_COMPILES_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, f"exit {result.returncode}; stderr tail:\n{result.stderr[-3000:]}"
    report = json.loads(lines[-1][len("REPORT ") :])

    problems = []
    if report.get("thread_exception"):
        problems.append(f"worker thread: {report['thread_exception']}")
    for key, outcome in sorted(report.items()):
        if not isinstance(outcome, dict) or "relative_errors" not in outcome and "exception" not in outcome:
            continue
        if "exception" in outcome:
            problems.append(f"{key}: {outcome['exception']}")
        elif not all(error <= RELATIVE_TOLERANCE for error in outcome["relative_errors"]):  # NaN fails
            problems.append(f"{key}: relative errors {outcome['relative_errors']}")
    for where in ("main", "thread"):
        error = report.get(f"{where}_kimi_cg_relative_error")
        if error is None or not error <= RELATIVE_TOLERANCE:  # None: the thread died first; NaN fails too
            problems.append(f"the kimi_cg compile itself ({where} thread): relative error {error}")
    for when in ("flags_after_kimi_cg", "flags_in_thread_before_kimi_cg", "flags_in_thread_after_kimi_cg"):
        if report.get(when) != report["flags_before"]:
            problems.append(f"dynamo settings {when}: {report.get(when)}, before kimi_cg: {report['flags_before']}")
    assert not problems, "other torch.compile users are affected:\n" + "\n".join(problems) + (
        f"\nkimi_cg.counters {report.get('kimi_cg_counters')}"
    )


# NOTE [attention substitutes]: kimi_cg traces transformers' SDPA attention function differently in its
# own frames. Another backend compiling the same tower, before and after a kimi_cg compile registered
# the substitute, must record the same graphs (the same ops, SDPA included) and the same outputs.
SAME_GRAPHS_SCRIPT = textwrap.dedent(
    """
    import collections, json, sys
    import torch
    sys.path.insert(0, "tests")
    from towers.transformers_towers import FACTORIES

    tower = FACTORIES["kimi_k25"]("sdpa", seed=0)
    args = tower.make_inputs([[1, 4, 4], [1, 6, 2]])

    def other_backend_ops():
        graphs = []
        def keep(gm, example_inputs):
            graphs.append(gm)
            return gm.forward
        torch._dynamo.reset()
        with torch.no_grad():
            out = tower.extract_outputs(torch.compile(tower.model, backend=keep)(*args))
        ops = collections.Counter(str(node.target) for gm in graphs for node in gm.graph.nodes if node.op.startswith("call"))
        return ops, out

    before, out_before = other_backend_ops()
    torch._dynamo.reset()
    with torch.no_grad():
        tower.extract_outputs(torch.compile(tower.model, backend="kimi_cg")(*args))
    after, out_after = other_backend_ops()
    print("REPORT " + json.dumps({
        "sdpa_before": sum(n for op, n in before.items() if "scaled_dot_product_attention" in op),
        "same_ops": before == after,
        "difference": str((before - after) + (after - before))[:2000],
        "same_outputs": all(torch.equal(a, b) for a, b in zip(out_before, out_after)),
    }))
    """
)


def test_other_backends_trace_transformers_attention_as_written():
    result = subprocess.run([sys.executable, "-P", "-c", SAME_GRAPHS_SCRIPT], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[1])
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    if result.returncode != 0 and "TowerUnavailable" in result.stderr:
        pytest.skip(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 0 and lines, f"exit {result.returncode}; stderr tail:\n{result.stderr[-3000:]}"
    report = json.loads(lines[-1][len("REPORT "):])
    assert report["sdpa_before"] > 0, report  # the other backend does trace SDPA calls
    assert report["same_ops"] and report["same_outputs"], report


def test_kimi_k25_generate_with_the_compiled_tower_equals_eager():
    """scripts/kimi_k25_generate.py: the full transformers Kimi-K2.5 model, its vision tower compiled with
    one line, greedy generate() on images and video chunks: identical tokens, logits within 1e-5."""
    pytest.importorskip("transformers.models.kimi_k25")
    result = subprocess.run([sys.executable, "scripts/kimi_k25_generate.py", "--device", "cpu"], capture_output=True,
                            text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # A prompt eager itself fails on (transformers 5.17's video merge) must fail the same way compiled.
    same = result.stdout.count("tokens identical") + result.stdout.count("the compiled model raises the same")
    assert same == 4 and "OK: generate()" in result.stdout, result.stdout


def test_family_bench_runs_on_cpu(tmp_path):
    """scripts/family_bench.py (the H200 per-family fuzz and benchmark) on tiny configs: it runs end to end,
    fuzzes, times eager and kimi_cg, records a speed-up per system and each family's relative to the
    reference MoonViT's; the remote-code MoonViT's flash family registers its op."""
    pytest.importorskip("transformers.models.kimi_k25")
    out = tmp_path / "families.json"
    result = subprocess.run([sys.executable, "scripts/family_bench.py", "--smoke-test-on-cpu", "--families",
                             "moonvit,kimi_k25,moonvit_upstream_flash", "--systems", "eager,kimi_cg", "--fuzz-examples", "2", "--repeats", "2", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())
    for family in results["families"].values():
        assert family["fuzz"]["examples"] == 2 and family["fuzz"]["counters"].get("lift_fallbacks", 0) == 0
        assert family["kimi_cg"]["W1_speedup"] > 0 and family["kimi_cg"]["W4_fresh"]["calls"] > 0
    assert set(results["W4_fresh_speedup_vs_moonvit"]) == {"kimi_k25", "moonvit_upstream_flash"}  # the target


def test_kimi_k25_pieces_keep_their_padding_rules_in_bf16():
    """NOTE [dynamic first trace]: marking every frame's integer arguments dynamic (e65492b) gave
    Kimi-K2.5's piece after get_vision_frame_index (a per-frame index into its time table) a program
    that could not run padded: one padding hazard in this fuzz on the H200 and here in bf16. Only a
    tower's entry is marked now; every piece replays the padded path."""
    import copy

    import kimi_cg.testing

    tower = build_tower(TRANSFORMERS_FACTORIES["kimi_k25"], "sdpa")
    model = copy.deepcopy(tower.model).to(torch.bfloat16)

    def make_inputs(grid):
        pixels, grid_thw = tower.make_inputs(grid)
        return pixels.bfloat16(), grid_thw

    compiled = torch.compile(model, backend="kimi_cg", options={"cuda_graphs": True})
    strategy = kimi_cg.testing.grids(dims=3, max_items=4, max_side=16, max_patches=1024, video_fraction=0.0, max_frames=1)
    kimi_cg.testing.assert_matches_eager(model, compiled, make_inputs, strategy, reference=tower.model,
                                         outputs=tower.extract_outputs, max_examples=24)
    counters = dict(kimi_cg.counters)
    assert counters.get("padding_hazards", 0) == 0 and counters.get("padded_runs", 0) >= 24, counters
    assert counters.get("traces_with_dynamic_rows", 0) >= 1, counters  # the entry frame is marked
