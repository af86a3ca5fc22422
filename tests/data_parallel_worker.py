"""One rank of the data-parallel tests (tests/test_data_parallel.py starts one process per rank).

    python tests/data_parallel_worker.py RANK WORLD_SIZE INIT_FILE OUT_DIR              # gloo, CPU, fp32
    torchrun --nproc-per-node 2 tests/data_parallel_worker.py --nccl OUT_DIR            # NCCL, one GPU per rank, bf16

Each rank builds the same tiny towers (seeded weights), compiles them with kimi_cg, wraps them with
``kimi_cg.data_parallel`` over gloo and runs the same requests: random mixes, fewer items than ranks,
one large item over the largest bucket, video chunks, a packed-output tower, an invalid item that only
one rank gets, ranks handed different requests, and transformers' Qwen2-VL and Kimi-K2.5 towers as
shipped (their packed pooler_output), and PaddleOCR-VL's rows on dim 1. Each output is compared with eager on the whole
request in this process (fp32: 1e-5 relative per item; bf16: kimi_cg.testing's rule, at most 2x
eager bf16's error against an fp32 copy of the tower, plus a rounding floor); the outputs are saved for the parent test to
check that every rank returned the same bytes. Any failure exits non-zero with the traceback.
"""

from __future__ import annotations

import math
import os
import random
import sys

import torch
import torch.distributed as dist

import kimi_cg
from kimi_cg.distributed import DataParallelError
from kimi_cg.testing import compare
from kimi_cg.models import MoonViT3dConfig, MoonViT3dPretrainedModel, MoonVitConfig, MoonVitPretrainedModel
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also under python -P / PYTHONSAFEPATH
from towers.transformers_towers import build_kimi_k25, build_paddleocr_vl, build_qwen2_vl  # noqa: E402  tests/towers (this script's folder)

# The bucketed, padded path on CPU (no capture); an item of 16x16 patches is over the largest bucket.
OPTIONS = {"cuda_graphs": True, "token_budgets": [64, 128], "buckets_per_doubling": 1}


DEVICE, DTYPE = "cpu", torch.float32  # main() switches both for an NCCL run


def item_error(got: torch.Tensor, want: torch.Tensor, reference: torch.Tensor) -> float:
    """The item's error over what the dtype's rule allows (<= 1 passes)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"shape/dtype {tuple(got.shape)} {got.dtype} != eager {tuple(want.shape)} {want.dtype}")
    if compare.new_non_finite(got, want):
        raise AssertionError("NaN or inf in the data-parallel output where eager is finite")
    rule = compare.rule_for(DTYPE)
    if rule.needs_reference:
        allowed = rule.factor * compare.norm_relative_error(want, reference) + rule.floor
        return compare.norm_relative_error(got, reference) / allowed
    return compare.max_relative_error(got, want) / rule.relative


def pixels_for(grid: list[list[int]], seed: int, row_shape=(3, 14, 14)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    rows = sum(math.prod(row) for row in grid)
    return torch.randn(rows, *row_shape, generator=generator).to(DEVICE, DTYPE), torch.tensor(grid)


def check(name: str, encode, model, grid, seed, results: dict, row_shape=(3, 14, 14), reference_model=None) -> None:
    pixels, grid_tensor = pixels_for(grid, seed, row_shape)
    got = encode(pixels, grid_tensor)
    want = model(pixels, grid_tensor)
    reference = want if reference_model is None else reference_model(pixels.float(), grid_tensor)
    as_list = lambda value: [value] if isinstance(value, torch.Tensor) else list(value)  # noqa: E731
    if type(got) is not type(want) or len(as_list(got)) != len(as_list(want)):
        raise AssertionError(f"{name}: structure {type(got).__name__} != eager {type(want).__name__}")
    errors = [item_error(g, w, r) for g, w, r in zip(as_list(got), as_list(want), as_list(reference))]
    if max(errors) > 1:
        raise AssertionError(f"{name} {grid}: error {max(errors):.3g}x what {compare.rule_for(DTYPE).describe()} "
                             f"allows (per item {errors})")
    results[name] = {"grid": grid, "outputs": [t.cpu() for t in as_list(got)], "plan": encode.last_plan.shares}


def expect_failure(name: str, encode, pixels, grid_tensor, results: dict, fragment: str) -> None:
    try:
        encode(pixels, grid_tensor)
    except DataParallelError as error:
        if fragment not in str(error):
            raise AssertionError(f"{name}: DataParallelError without {fragment!r}: {error}") from error
        results[name] = {"error": str(error), "errors": error.errors}
        return
    raise AssertionError(f"{name}: no DataParallelError")


def _eager_runs(model, inputs) -> bool:
    """Whether the tower itself (eager) accepts these inputs."""
    pixels, grid_tensor = inputs
    try:
        with torch.no_grad():
            model(pixels.to(DEVICE, next(model.parameters()).dtype), grid_tensor.to(DEVICE))
    except RuntimeError:
        return False
    return True


def build(model_class, config):
    """(tower in the run's dtype, an fp32 copy for the low-precision rule or None)."""
    torch.manual_seed(0)
    model = model_class(config).eval().to(DEVICE)
    reference = None
    if DTYPE != torch.float32:
        torch.manual_seed(0)
        reference = model_class(config).eval().to(DEVICE)
        reference.load_state_dict(model.state_dict())
    return model.to(DTYPE), reference


def main(rank: int, world_size: int, init_file: str | None, out_dir: str) -> None:
    global DEVICE, DTYPE
    if init_file is None:  # torchrun: NCCL, one GPU per rank, bf16
        DEVICE, DTYPE = f"cuda:{int(os.environ['LOCAL_RANK'])}", torch.bfloat16
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    torch.set_grad_enabled(False)
    results: dict = {}

    model, reference = build(MoonVitPretrainedModel, MoonVitConfig.tiny())
    encode = kimi_cg.data_parallel(torch.compile(model, backend="kimi_cg", options=OPTIONS))
    rng = random.Random(1234)  # the same requests on every rank
    for case in range(4):
        grid = [[2 * rng.randint(1, 6), 2 * rng.randint(1, 6)] for _ in range(rng.randint(1, 5))]
        check(f"random_{case}", encode, model, grid, case, results, reference_model=reference)
    check("fewer_items_than_ranks", encode, model, [[4, 6]], 10, results, reference_model=reference)
    check("one_large_item", encode, model, [[16, 16], [2, 2], [2, 4]], 11, results, reference_model=reference)
    # Lifted, not falling back: only the item over the largest bucket ran the non-graphed program.
    assert kimi_cg.counters["host_programs_built"] > 0, dict(kimi_cg.counters)
    assert kimi_cg.counters["lift_fallbacks"] == kimi_cg.counters["call_fallbacks"] == 0, dict(kimi_cg.fallbacks)
    assert kimi_cg.counters["eager_fallbacks"] == (1 if 0 in encode.last_plan.shares[rank] else 0), dict(kimi_cg.counters)
    if DEVICE != "cpu":
        assert kimi_cg.counters["graph_replays"] > 0, dict(kimi_cg.counters)

    # An item only one rank gets is invalid (odd rows: the 2x2 merge cannot split it); every rank raises.
    pixels, grid_tensor = pixels_for([[4, 4], [2, 2], [3, 4]], 12)
    expect_failure("rank_local_invalid_item", encode, pixels, grid_tensor, results, "failed on rank(s)")
    # Ranks handed different requests must not exchange (or return) anything.
    pixels, grid_tensor = pixels_for([[4, 4], [2, 2 + 2 * rank]], 13)
    expect_failure("different_requests", encode, pixels, grid_tensor, results, "different requests")
    check("after_failures", encode, model, [[6, 4], [2, 2], [4, 4]], 14, results, reference_model=reference)

    model3d, reference3d = build(MoonViT3dPretrainedModel, MoonViT3dConfig.tiny())
    encode3d = kimi_cg.data_parallel(torch.compile(model3d, backend="kimi_cg", options=OPTIONS))
    check("video_chunks", encode3d, model3d, [[2, 4, 4], [1, 6, 4], [4, 2, 2], [1, 2, 2]], 20, results,
          reference_model=reference3d)
    check("one_video_chunk", encode3d, model3d, [[3, 4, 6]], 21, results, reference_model=reference3d)

    # A tower that returns one packed tensor ([rows, 4, D] over all items, as transformers' K2.5 does).
    packed = lambda pixels, grid: torch.cat(model(pixels, grid))  # noqa: E731
    encode_packed = kimi_cg.data_parallel(packed, item_rows=lambda row: row[0] * row[1] // 4)
    packed_reference = None if reference is None else (lambda pixels, grid: torch.cat(reference(pixels, grid)))
    check("packed_output", encode_packed, packed, [[4, 4], [2, 6], [6, 2]], 30, results, reference_model=packed_reference)

    # transformers' towers as shipped (they return BaseModelOutputWithPooling): the packed pooler_output,
    # item rows from the tower's own merge attributes (Qwen2-VL: spatial_merge_size; Kimi-K2.5:
    # merge_kernel_size, frames pooled). Eager towers: data_parallel is independent of the compiler.
    # Kimi-K2.5 on transformers before 5.24 rejects a batch mixing frame counts (eager raises): there the
    # video chunks share one t.
    for name, build_tower, grids in (("qwen2_vl", build_qwen2_vl, [[[1, 4, 4], [2, 2, 6], [1, 6, 2]]]),
                                     ("kimi_k25", build_kimi_k25, [[[1, 4, 4], [3, 2, 6], [1, 6, 2]],
                                                                   [[3, 4, 4], [3, 2, 6], [3, 6, 2]]])):
        tower = build_tower()
        model = tower.model.to(DEVICE, DTYPE)
        reference_model = build_tower().model.to(DEVICE) if DTYPE != torch.float32 else model  # same seed: same weights
        grid = next(grid for grid in grids if grid is grids[-1] or _eager_runs(model, tower.make_inputs(grid)))
        pixels, grid_tensor = tower.make_inputs(grid)
        # The grid on the tower's device: Kimi-K2.5 builds its merge indices on the grid's device.
        pixels, grid_tensor = pixels.to(DEVICE, DTYPE), grid_tensor.to(DEVICE)
        encode_transformers = kimi_cg.data_parallel(model, output="pooler_output")
        got = encode_transformers(pixels, grid_tensor)
        want = model(pixels, grid_tensor).pooler_output
        reference = reference_model(pixels.float(), grid_tensor).pooler_output
        if item_error(got, want, reference) > 1:
            raise AssertionError(f"transformers {name} {grid}: error {item_error(got, want, reference):.3g}x the rule")
        results[f"transformers_{name}"] = {"grid": grid, "outputs": [got.cpu()], "plan": encode_transformers.last_plan.shares}

    # Rows on dim 1 (NOTE [rows on dim 1]): PaddleOCR-VL's patches [1, L, 3, p, p] and its packed
    # last_hidden_state [1, L, D] (one row per patch: the merge is in the projector), compiled, padded.
    tower = build_paddleocr_vl()
    model = tower.model.to(DEVICE, DTYPE)
    reference_model = build_paddleocr_vl().model.to(DEVICE) if DTYPE != torch.float32 else model
    grid = [[1, 4, 4], [1, 2, 6], [1, 6, 2]]
    pixels, grid_tensor = tower.make_inputs(grid)
    pixels, grid_tensor = pixels.to(DEVICE, DTYPE), grid_tensor.to(DEVICE)
    compiled = torch.compile(model, backend="kimi_cg", options=OPTIONS)
    encode_rows_on_dim_1 = kimi_cg.data_parallel(compiled, output="last_hidden_state", item_rows=math.prod)
    got = encode_rows_on_dim_1(pixels, grid_tensor)
    want = model(pixels, grid_tensor).last_hidden_state
    reference = reference_model(pixels.float(), grid_tensor).last_hidden_state
    if item_error(got, want, reference) > 1:
        raise AssertionError(f"paddleocr_vl {grid}: error {item_error(got, want, reference):.3g}x the rule")
    results["rows_on_dim_1"] = {"grid": grid, "outputs": [got.cpu()], "plan": encode_rows_on_dim_1.last_plan.shares}
    # A tower whose packed output keeps the batch of one as well ([1, L, D]): gathered on dim 1.
    batched = lambda pixels, grid: compiled(pixels, grid).last_hidden_state.unsqueeze(0)  # noqa: E731
    encode_batched = kimi_cg.data_parallel(batched, item_rows=math.prod)
    got = encode_batched(pixels, grid_tensor)
    if item_error(got, want.unsqueeze(0), reference.unsqueeze(0)) > 1:
        raise AssertionError(f"paddleocr_vl {grid}, output [1, L, D]: error beyond the rule")
    results["packed_on_dim_1"] = {"grid": grid, "outputs": [got.cpu()], "plan": encode_batched.last_plan.shares}

    torch.save(results, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    print(f"rank {dist.get_rank()}: {len(results)} cases passed on {DEVICE} in {DTYPE}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--nccl":
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, sys.argv[2])
    else:
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
