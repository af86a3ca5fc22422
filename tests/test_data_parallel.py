"""kimi_cg.data_parallel: the plan (in process) and two gloo ranks on CPU (separate processes, with a
timeout that fails the test instead of hanging)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kimi_cg
from kimi_cg.distributed import plan_items

WORKER = Path(__file__).with_name("data_parallel_worker.py")
TIMEOUT_S = 420


@settings(deadline=None, max_examples=200)
@given(tokens=st.lists(st.integers(1, 5000), max_size=40), world_size=st.integers(1, 8))
def test_plan_assigns_every_item_once_and_balances(tokens, world_size):
    plan = plan_items(tokens, world_size)
    assigned = sorted(item for share in plan.shares for item in share)
    assert assigned == list(range(len(tokens)))
    assert all(list(share) == sorted(share) for share in plan.shares)  # each share in the request's order
    assert list(plan.loads) == [sum(tokens[i] for i in share) for share in plan.shares]
    if tokens:  # largest first onto the least loaded: no rank ahead of another by more than the largest item
        assert max(plan.loads) - min(plan.loads) <= max(tokens)
    assert plan_items(tokens, world_size) == plan  # every rank computes the same plan


def test_plan_fewer_items_than_ranks_leaves_empty_shares():
    plan = plan_items([100], 4)
    assert plan.shares == ((0,), (), (), ())
    assert plan_items([10, 30, 20], 2).shares == ((1,), (0, 2))


def test_plan_rejects_no_ranks():
    with pytest.raises(ValueError, match="world_size"):
        plan_items([1], 0)


def test_without_a_process_group_the_tower_is_called_directly():
    calls = []
    encode = kimi_cg.data_parallel(lambda pixels, grid: calls.append(grid) or [pixels])
    pixels = torch.zeros(4, 3)
    assert encode(pixels, torch.tensor([[2, 2]]))[0] is pixels
    assert len(calls) == 1


def run_ranks(command: list[list[str]], env: dict) -> None:
    """Start one process per command, fail (never hang) after TIMEOUT_S, fail if any exits non-zero."""
    processes = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for args in command]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        tails = [(process.communicate()[0] or "")[-3000:] for process in processes]
        pytest.fail(f"the ranks did not finish in {TIMEOUT_S} s (a hang?):\n" + "\n---\n".join(tails))
    for index, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"process {index} failed:\n{output[-6000:]}"


def check_rank_results(folder: Path) -> None:
    """Both ranks ran every case, returned the same bytes and plans, and raised together."""
    results = [torch.load(folder / f"rank{rank}.pt") for rank in range(2)]
    assert results[0].keys() == results[1].keys()
    for name, first in results[0].items():
        second = results[1][name]
        if "error" in first:  # every rank raised, naming the same failing ranks
            assert first["errors"].keys() == second["errors"].keys(), name
            continue
        assert first["plan"] == second["plan"], name
        for a, b in zip(first["outputs"], second["outputs"], strict=True):
            assert torch.equal(a, b), f"{name}: the ranks returned different bytes"
    assert {"video_chunks", "packed_output", "transformers_qwen2_vl", "transformers_kimi_k25", "rows_on_dim_1", "packed_on_dim_1"} <= results[0].keys()
    assert all(results[0]["rows_on_dim_1"]["plan"]), "each rank took part of the request"
    assert results[0]["fewer_items_than_ranks"]["plan"] in (((0,), ()), ((), (0,)))
    # The invalid item (index 2, [3, 4]) went to one rank only; that rank's error is reported everywhere.
    failing = results[0]["rank_local_invalid_item"]["errors"]
    assert len(failing) == 1, failing


def worker_env() -> dict:
    # kimi_cg as installed (the worker runs as a script: its folder, not the repository, is on sys.path).
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))


def test_two_gloo_ranks_match_eager_and_each_other(tmp_path):
    env = worker_env()
    init_file = tmp_path / "init"
    run_ranks([[sys.executable, str(WORKER), str(rank), "2", str(init_file), str(tmp_path)] for rank in range(2)], env)
    check_rank_results(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_nccl_ranks_match_eager_in_bf16(tmp_path):
    """The same cases on two GPUs: NCCL for the outputs, gloo for the agreement, CUDA graphs, bf16."""
    env = worker_env()
    run_ranks([[sys.executable, "-P", "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29531",
                str(WORKER), "--nccl", str(tmp_path)]], env)
    check_rank_results(tmp_path)
