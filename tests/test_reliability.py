"""Runtime reliability on CPU: threads, weight changes, freed models, inference mode, memory budget.

The bucketed runtime runs here without capture (``cuda_graphs=True`` on a CPU model): it shares
the same static buffers and caches as the CUDA-graph path, so every race and staleness bug of the
runtime shows up on CPU too (tests/test_gpu.py repeats the thread test with capture).
"""

from __future__ import annotations

import concurrent.futures
import gc
import random
import threading
import weakref

import pytest
import torch

import kimi_cg
from kimi_cg.models import KimiK25VisionEncoder, KimiVLVisionEncoder, MoonViT3dConfig, MoonVitConfig

OPTIONS = {"cuda_graphs": True, "token_budgets": [256, 1024], "max_items": 4}


def build_2d(seed: int = 0):
    torch.manual_seed(seed)
    return KimiVLVisionEncoder(MoonVitConfig.tiny(attn_implementation="sdpa")).eval()


def build_3d(seed: int = 0):
    torch.manual_seed(seed)
    return KimiK25VisionEncoder(MoonViT3dConfig.tiny()).eval()


def make_inputs(grid, seed: int = 0, dtype=torch.float32):
    grid_tensor = torch.tensor(grid)
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(int(grid_tensor.prod(-1).sum()), 3, 14, 14, generator=generator)
    return pixels.to(dtype), grid_tensor


def assert_close_outputs(got, want, rtol=1e-5, atol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


GRIDS_2D = [[[4, 6]], [[2, 8], [6, 4]], [[8, 8], [2, 2], [4, 10]], [[6, 6]], [[10, 4], [4, 4]], [[12, 2], [2, 12], [4, 4]]]
GRIDS_3D = [[[1, 4, 6]], [[2, 2, 8], [1, 6, 4]], [[4, 4, 4], [1, 2, 2], [3, 4, 2]], [[2, 6, 6]], [[1, 10, 4], [4, 4, 4]]]


# -- threads -------------------------------------------------------------------------------------

@pytest.mark.parametrize("build, grids", [(build_2d, GRIDS_2D), (build_3d, GRIDS_3D)], ids=["2d", "3d"])
def test_concurrent_calls_from_threads_match_eager(build, grids):
    """Replays share static buffers: two threads calling one compiled tower got each other's rows."""
    model = build()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    requests = [(grid, seed) for seed, grid in enumerate(grids * 6)]
    with torch.no_grad():
        want = [model(*make_inputs(grid, seed)) for grid, seed in requests]
        for grid, seed in requests[:len(grids)]:  # trace every item count before the threads start
            compiled(*make_inputs(grid, seed))
    start = threading.Barrier(4)

    def serve(offset):
        start.wait()
        results = {}
        with torch.no_grad():
            for index in range(offset, len(requests), 4):
                grid, seed = requests[index]
                results[index] = compiled(*make_inputs(grid, seed))
        return results

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = {}
        for part in pool.map(serve, range(4)):
            outputs.update(part)
    for index, (grid, _) in enumerate(requests):
        assert_close_outputs(outputs[index], want[index])
    assert kimi_cg.counters["lift_fallbacks"] == 0 and kimi_cg.counters["call_fallbacks"] == 0


def test_a_tower_served_from_worker_threads_is_lifted_like_one_served_from_the_main_thread():
    """torch keeps dynamo config overrides per thread: a tower first called from a worker thread
    must still get kimi_cg's settings (one dynamo graph per item count, no graph break, lifted)."""
    model = build_2d()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)

    def serve():
        with torch.no_grad():
            return [compiled(*make_inputs(grid, seed)) for seed, grid in enumerate(GRIDS_2D[:3])]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        outputs = pool.submit(serve).result()
    with torch.no_grad():
        for (seed, grid), got in zip(enumerate(GRIDS_2D[:3]), outputs):
            assert_close_outputs(got, model(*make_inputs(grid, seed)))
    assert kimi_cg.counters["graph_breaks"] == 0
    assert kimi_cg.counters["lift_fallbacks"] == 0
    assert kimi_cg.counters["host_programs_built"] == kimi_cg.counters["dynamo_graphs"] >= 3
    assert kimi_cg.counters["dynamo_graphs"] <= 4  # items 1 (static, then dynamic), 2, 3


# -- weights that change after compiling ----------------------------------------------------------

def _change_weights(model, form: str):
    pos_emb = model.vision_tower.patch_embed.pos_emb
    if form == "data_add_pos_emb":
        pos_emb.weight.data.add_(0.5)
    elif form == "data_add_time_buffer":
        pos_emb.time_weight.data.add_(0.5)
    elif form == "no_grad_add_pos_emb":
        with torch.no_grad():
            pos_emb.weight.add_(0.5)
    elif form == "load_state_dict":
        state = {k: v + 0.25 for k, v in model.state_dict().items()}
        model.load_state_dict(state)
    elif form == "load_state_dict_assign":
        state = {k: v + 0.25 for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
    elif form == "data_assign_pos_emb":
        pos_emb.weight.data = pos_emb.weight.data * 2.0
    elif form == "to_bfloat16":
        model.to(torch.bfloat16)
    else:
        raise AssertionError(form)


WEIGHT_CHANGES = [(build_2d, form, True) for form in ("data_add_pos_emb", "no_grad_add_pos_emb", "load_state_dict",
                                                      "load_state_dict_assign", "data_assign_pos_emb", "to_bfloat16")]
WEIGHT_CHANGES += [(build_2d, "data_add_pos_emb", False), (build_2d, "load_state_dict_assign", False)]
WEIGHT_CHANGES += [(build_3d, form, True) for form in ("data_add_pos_emb", "data_add_time_buffer", "load_state_dict_assign",
                                                      "to_bfloat16")]


@pytest.mark.parametrize("build, form, cuda_graphs", WEIGHT_CHANGES,
                         ids=[f"{'3d' if build is build_3d else '2d'}-{form}-{'bucketed' if graphs else 'plain'}"
                              for build, form, graphs in WEIGHT_CHANGES])
def test_weights_changed_after_compiling_are_used(build, form, cuda_graphs):
    model = build()
    compiled = torch.compile(model, backend="kimi_cg", options={**OPTIONS, "cuda_graphs": cuda_graphs})
    grids = GRIDS_3D if build is build_3d else GRIDS_2D
    with torch.no_grad():
        for seed, grid in enumerate(grids[:3]):  # fills the item and batch caches
            compiled(*make_inputs(grid, seed))
        _change_weights(model, form)
        for seed, grid in enumerate(grids[:3]):  # the same grids: every cache would hit
            if form == "to_bfloat16":
                assert_bfloat16_matches(compiled, model, grid, seed)
            else:
                pixels, grid_tensor = make_inputs(grid, seed)
                assert_close_outputs(compiled(pixels, grid_tensor), model(pixels, grid_tensor))


def assert_bfloat16_matches(compiled, model, grid, seed):
    """The bf16 rule: error against an fp32 copy of the (bf16-rounded) model at most 2x eager bf16's."""
    import copy

    reference = copy.deepcopy(model).float()
    pixels, grid_tensor = make_inputs(grid, seed, torch.bfloat16)
    got, eager = compiled(pixels, grid_tensor), model(pixels, grid_tensor)
    want = reference(pixels.float(), grid_tensor)
    for g, e, w in zip(got, eager, want):
        assert g.dtype == torch.bfloat16 and not torch.isnan(g).any()
        got_error = (g.float() - w).abs().max().item()
        eager_error = (e.float() - w).abs().max().item()
        assert got_error <= 2 * eager_error + 1e-3, (got_error, eager_error)


class LearnedTableTower(torch.nn.Module):
    """A learned position table resized bilinearly per item: the resize is an item value the host
    caches (NOTE [per-item metadata cache]), computed from a weight."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(8, 8, 16))
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, grid):
        embeddings = []
        for h, w in grid.tolist():
            resized = torch.nn.functional.interpolate(self.table.permute(2, 0, 1).unsqueeze(0), size=(h, w), mode="bilinear")
            embeddings.append(resized.squeeze(0).permute(1, 2, 0).flatten(0, 1) * 2.0)
        return (self.proj(x + torch.cat(embeddings)),)


@pytest.mark.parametrize("form", ["data_add", "data_copy", "no_grad_add", "load_state_dict_assign", "data_assign"])
@pytest.mark.parametrize("batch_cache_size", [16, 0])
def test_host_cached_values_follow_every_weight_write(form, batch_cache_size):
    torch.manual_seed(0)
    model = LearnedTableTower().eval()
    compiled = torch.compile(model, backend="kimi_cg", options={**OPTIONS, "batch_cache_size": batch_cache_size})
    grids = [[[4, 6]], [[2, 8], [6, 4]], [[4, 6], [2, 8]]]
    requests = [(torch.tensor(g), torch.randn(sum(h * w for h, w in g), 16)) for g in grids]
    with torch.no_grad():
        for grid, x in requests:
            compiled(x, grid)
        assert kimi_cg.counters["metadata_cache_hits"] + kimi_cg.counters["batch_cache_hits"] > 0
        if form == "data_add":
            model.table.data.add_(1.0)
        elif form == "data_copy":
            model.table.data.copy_(torch.randn(8, 8, 16))
        elif form == "no_grad_add":
            model.table.add_(1.0)
        elif form == "load_state_dict_assign":
            model.load_state_dict({k: v + 1.0 for k, v in model.state_dict().items()}, assign=True)
        else:
            model.table.data = model.table.data + 1.0
        for grid, x in requests:
            assert_close_outputs(compiled(x, grid), model(x, grid))


@pytest.mark.parametrize("batch_cache_size, cuda_graphs", [(16, True), (0, False)], ids=["bucketed-16", "plain-0"])
def test_a_model_compiled_after_another_was_freed_gets_its_own_metadata(batch_cache_size, cuda_graphs):
    """The allocator hands a new model the freed model's addresses: a cache keyed on data pointers
    (and version 0) returned the old model's position embeddings."""
    options = {**OPTIONS, "cuda_graphs": cuda_graphs, "batch_cache_size": batch_cache_size}
    grid = [[4, 6], [2, 8]]
    for seed in range(3):
        model = build_2d(seed)
        compiled = torch.compile(model, backend="kimi_cg", options=options)
        with torch.no_grad():
            assert_close_outputs(compiled(*make_inputs(grid)), model(*make_inputs(grid)))
        del model, compiled
        gc.collect()


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["bucketed", "plain"])
def test_a_freed_model_is_not_kept_alive(cuda_graphs):
    model = build_2d()
    compiled = torch.compile(model, backend="kimi_cg", options={**OPTIONS, "cuda_graphs": cuda_graphs})
    with torch.no_grad():
        for seed, grid in enumerate(GRIDS_2D[:3]):
            compiled(*make_inputs(grid, seed))
    weight = weakref.ref(model.vision_tower.encoder.blocks[0].wqkv.weight)
    module = weakref.ref(model)
    del model, compiled
    gc.collect()
    assert module() is None
    assert weight() is None


# -- grad modes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("build, grids", [(build_2d, GRIDS_2D), (build_3d, GRIDS_3D)], ids=["2d", "3d"])
def test_inference_mode_and_no_grad_mixed(build, grids):
    model = build()
    with torch.inference_mode():  # eager first: lazily made tables become inference tensors
        model(*make_inputs(grids[0]))
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    for step, (seed, grid) in enumerate(list(enumerate(grids)) * 2):
        mode = torch.inference_mode() if step % 2 == 0 else torch.no_grad()
        with mode:
            got = compiled(*make_inputs(grid, seed))
            want = model(*make_inputs(grid, seed))
        assert_close_outputs(got, want)


def test_backward_through_the_compiled_tower_matches_eager(caplog):
    """kimi_cg's program is inference-only (CUDA graphs, host caches): a call that needs gradients
    runs the captured graph, so backward works and gives eager's gradients."""
    model = build_2d()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    pixels, grid = make_inputs([[4, 6], [2, 8]])
    with torch.enable_grad():
        loss = sum(o.sum() for o in compiled(pixels, grid))
        assert "torch.no_grad()" in caplog.text
        assert kimi_cg.fallbacks["gradients needed (kimi_cg runs inference only)"] == 1
        loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        sum(o.sum() for o in model(pixels, grid)).backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


# -- memory -----------------------------------------------------------------------------------------

def test_a_bucket_that_runs_out_of_memory_is_dropped_and_calls_still_match_eager(monkeypatch):
    """NOTE [memory pressure]: the largest bucket fails to allocate; calls that needed it split or
    run the plain program, smaller buckets keep replaying."""
    from kimi_cg.runtime.graphs import BucketedGraphs

    allocate = BucketedGraphs._allocate

    def allocate_or_fail(self, capacity, inputs):
        if capacity >= 1024:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return allocate(self, capacity, inputs)

    monkeypatch.setattr(BucketedGraphs, "_allocate", allocate_or_fail)
    model = build_2d()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    grids = GRIDS_2D + [[[24, 24]], [[16, 16], [12, 12]]]  # the last two need more than 256 patches
    for seed, grid in enumerate(grids):
        assert_close_outputs(compiled(*make_inputs(grid, seed)), model(*make_inputs(grid, seed)))
    assert kimi_cg.counters["buckets_dropped_for_memory"] == 1
    assert kimi_cg.counters["graph_replays"] + kimi_cg.counters["split_calls"] + kimi_cg.counters["eager_fallbacks"] > 0
    assert kimi_cg.counters["call_fallbacks"] == 0 and kimi_cg.counters["lift_fallbacks"] == 0
    assert kimi_cg.fallbacks["out of memory preparing a bucket"] == 1


def _distinct_grids(count: int):
    sizes = [(h, w) for h in range(2, 24, 2) for w in range(2, 24, 2)]
    return [[list(sizes[i])] for i in range(count)]


def test_metadata_memory_stays_within_the_process_budget():
    budget = 64 << 10
    kimi_cg.set_memory_budget(metadata_bytes=budget)
    try:
        model = build_2d()
        compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
        with torch.no_grad():
            for seed, grid in enumerate(_distinct_grids(40)):
                assert_close_outputs(compiled(*make_inputs(grid, seed)), model(*make_inputs(grid, seed)))
                report = kimi_cg.memory_report()
                assert report["metadata"]["bytes"] <= budget
        assert report["metadata"]["entries"] > 0
        assert report["metadata"]["evictions"] > 0
        assert set(report) >= {"metadata", "graphs", "programs"}
    finally:
        kimi_cg.set_memory_budget(metadata_bytes=None)


def test_a_models_option_lowers_its_own_share_and_never_changes_another_models():
    kimi_cg.set_memory_budget(metadata_bytes=1 << 20)
    try:
        small = torch.compile(build_2d(0), backend="kimi_cg", options={**OPTIONS, "metadata_cache_bytes": 16 << 10})
        with torch.no_grad():
            for seed, grid in enumerate(_distinct_grids(20)):
                small(*make_inputs(grid, seed))
        report = kimi_cg.memory_report()
        assert report["metadata"]["budget_bytes"] == 1 << 20  # the model's option did not lower the process budget
        assert max(report["metadata"]["by_owner"].values()) <= 16 << 10
        large = torch.compile(build_3d(0), backend="kimi_cg", options={**OPTIONS, "metadata_cache_bytes": 1 << 40})
        with torch.no_grad():
            for seed, grid in enumerate(_distinct_grids(20)):
                large(*make_inputs([[1, *grid[0]]], seed))
        report = kimi_cg.memory_report()
        assert report["metadata"]["budget_bytes"] == 1 << 20  # and another's cannot raise it
        assert report["metadata"]["bytes"] <= 1 << 20
    finally:
        kimi_cg.set_memory_budget(metadata_bytes=None)


# -- invalid requests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("build, bad_grid, grids", [
    (build_2d, [[0, 22]], GRIDS_2D),
    (build_3d, [[1, 22, 0]], GRIDS_3D),
], ids=["2d", "3d"])
def test_an_item_without_pixels_raises_eager_error_and_changes_nothing_after_it(build, bad_grid, grids):
    """Dynamo cannot trace a zero-sized item with unbacked sizes; the call runs eagerly and raises
    eager's error. One such request once demoted the tower to dynamo's default settings for the
    life of the process (every later size retraced and ran with graph breaks)."""
    model = build()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    for seed, grid in enumerate(grids):  # every item count traced, dynamic in the patch count
        compiled(*make_inputs(grid, seed))
    graphs = kimi_cg.counters["dynamo_graphs"]
    with pytest.raises(Exception) as eager_error:
        model(*make_inputs(bad_grid))
    with pytest.raises(type(eager_error.value)):
        compiled(*make_inputs(bad_grid))
    # The failed call runs eagerly; dynamo may compile a nested frame of that eager run on its own.
    assert kimi_cg.counters["dynamo_graphs"] <= graphs + 1
    graphs = kimi_cg.counters["dynamo_graphs"]
    for seed, grid in enumerate(grids, start=10):
        assert_close_outputs(compiled(*make_inputs(grid, seed)), model(*make_inputs(grid, seed)))
    assert kimi_cg.counters["dynamo_setting_fallbacks"] == 0
    assert kimi_cg.counters["dynamo_graphs"] == graphs  # no retrace after the invalid request
    assert kimi_cg.counters["graph_breaks"] == 0


BAD_INPUTS = {
    "patches_of_another_size": lambda: (torch.randn(24, 3, 28, 28), torch.tensor([[4, 6]])),
    "no_pixel_rows_for_a_grid": lambda: (torch.randn(0, 3, 14, 14), torch.tensor([[4, 6]])),
    "float_grid": lambda: (torch.randn(24, 3, 14, 14), torch.tensor([[4.0, 6.0]])),
    "rows_do_not_match_grid": lambda: (torch.randn(20, 3, 14, 14), torch.tensor([[4, 6]])),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_are_answered_with_eager_error_and_the_next_call_is_right(name):
    model = build_2d()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    for seed, grid in enumerate(GRIDS_2D[:4]):
        compiled(*make_inputs(grid, seed))
    with pytest.raises(Exception) as eager_error:
        model(*BAD_INPUTS[name]())
    with pytest.raises(Exception) as error:
        compiled(*BAD_INPUTS[name]())
    assert isinstance(error.value, type(eager_error.value))  # eager's class (or InvalidInputError also of it)
    assert str(eager_error.value).splitlines()[0] in str(error.value) or isinstance(error.value, kimi_cg.InvalidInputError)
    for seed, grid in enumerate(GRIDS_2D[:4], start=20):
        assert_close_outputs(compiled(*make_inputs(grid, seed)), model(*make_inputs(grid, seed)))
    assert kimi_cg.counters["dynamo_setting_fallbacks"] == 0


def test_a_compiled_call_from_a_forward_hook_of_the_same_model():
    model = build_2d()
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    seen = []

    def hook(module, args, output):
        if not seen:  # once: the hook's own call runs the hook again
            seen.append(None)
            seen[0] = compiled(*make_inputs([[2, 8]], 7))

    compiled(*make_inputs([[4, 6]]))
    handle = model.register_forward_hook(hook)
    try:
        got = compiled(*make_inputs([[4, 6]], 3))
    finally:
        handle.remove()
    assert_close_outputs(got, model(*make_inputs([[4, 6]], 3)))
    assert_close_outputs(seen[0], model(*make_inputs([[2, 8]], 7)))


def test_metadata_store_keeps_every_group_within_its_limit_and_batches_within_their_fraction():
    from kimi_cg.runtime.memory import MetadataStore

    store = MetadataStore(budget=1000)
    block = lambda: torch.zeros(100, dtype=torch.uint8)  # noqa: E731 - 100 bytes each
    for i in range(10):
        store.put(("item", i), block(), owner="a", share=1 << 20)
    assert store.report()["bytes"] == 1000 and store.get(("item", 0)) is not None
    store.put(("batch", "full"), block(), owner="a", share=1 << 20, pool="batch")
    assert store.get(("batch", "full")) is None  # a batch never evicts an item: not kept
    assert all(store.get(("item", i)) is not None for i in range(10))
    for i in range(4):  # room for four batches once four items are gone
        store.pop(("item", i))
    for i in range(8):  # batches may take half the budget: they evict each other
        store.put(("batch", i), block(), owner="a", share=1 << 20, pool="batch")
    report = store.report()
    assert report["by_pool"]["batch"] <= 400 and report["bytes"] <= 1000
    assert store.get(("batch", 7)) is not None and store.get(("batch", 0)) is None
    store.put(("item", 0), block(), owner="a", share=1 << 20)  # an item evicts the oldest batch first
    assert store.get(("batch", 4)) is None and store.get(("batch", 5)) is not None
    assert all(store.get(("item", i)) is not None for i in (0, *range(4, 10)))
    store.put(("item", "b"), block(), owner="b", share=150)
    store.put(("item", "b2"), block(), owner="b", share=150)  # owner b's share holds one entry
    assert store.get(("item", "b")) is None and store.get(("item", "b2")) is not None
    store.put(("item", "huge"), torch.zeros(2000, dtype=torch.uint8), owner="a", share=1 << 20)
    assert store.get(("item", "huge")) is None  # larger than the budget: not kept, nothing evicted for it
    store.set_budget(300)
    assert store.report()["bytes"] <= 300


def test_a_cycle_of_distinct_batches_keeps_every_item_value_that_fits():
    """Found on the H200: W4's stream run twice (40 requests of ~5 items, item values ~0.7 GB, batches
    ~0.4 GB, budget 1 GB) missed every item value on its second pass, because batches evicted the
    oldest items and an LRU over a cycle longer than it holds misses every time."""
    from kimi_cg.runtime.memory import MetadataStore

    store = MetadataStore(budget=1000)
    block = lambda: torch.zeros(20, dtype=torch.uint8)  # noqa: E731
    rng = random.Random(0)
    requests = [[rng.randrange(40) for _ in range(4)] for _ in range(30)]  # at most 40 distinct items: 800 bytes
    for second_pass in (False, True):
        for number, items in enumerate(requests):
            for item in items:
                if store.get(("item", item)) is None:
                    assert not second_pass, f"item {item} of request {number} was evicted"
                    store.put(("item", item), block(), owner="a", share=1 << 20)
            store.put(("batch", number), torch.zeros(80, dtype=torch.uint8), owner="a", share=1 << 20, pool="batch")
    items = {item for request in requests for item in request}
    assert store.report()["by_pool"]["batch"] <= 1000 - 20 * len(items) and len(items) > 30
