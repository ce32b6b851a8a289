"""The NCCL paths on two GPUs (marker ``multigpu``: ``pytest -m multigpu`` on a host with 2 or more
CUDA devices; skipped elsewhere), each against its single-process reference:

- pipeline schedules (GPipe, 1F1B, interleaved), 2 ranks on 2 GPUs and 4 ranks sharing 2 GPUs
  round-robin (rank ``r`` on GPU ``r % 2``, so neighbouring stages are on different GPUs):
  per step, the loss and this rank's gradients equal ``accumulated_backward`` over the same
  micro-batches in one process, in float64;
- tensor-parallel levels (column- and row-parallel linears, the one-collective MLP, the parallel
  LayerNorm, the Transformer block): outputs and gradients equal the single module's, in float64
  (the cases of test_tensor.py);
- DDP (the embedding's gradient averaged whole or row-wise) and FSDP2 through ``wrap_model``:
  per-step losses of a small Llama trained with AdamW equal one process trained on the whole
  batch, in float32, and the row-wise average equals the whole one exactly (the cases of
  test_data_parallel.py, whose gloo twins run on the CPU).

Every run has a deadline (:func:`spawn_within`): a deadlocked or hung rank fails its test instead
of stalling the session. The deadline itself is tested on the CPU (gloo) at the end.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from effdl.parallel import PipelineStage, accumulated_backward, spawn, split_sequential
from tests.parallel.test_data_parallel import (
    FP32_RTOL,
    data_parallel_losses,
    ddp_gradients,
    embedding_rows_gradients,
    global_batches,
)
from tests.parallel.test_pipeline import F64_TOL, batches, build_model, single_threaded
from tests.parallel.test_tensor import BLOCK_KINDS, compare_with_reference

DEADLINE_S = 60.0  # a run takes seconds; the rest is slack for process start-up on a busy host
GPUS = 2


def spawn_within(
    deadline_s: float, fn: Callable[..., Any], world: int, *args: Any, backend: str = "nccl"
) -> list:
    """:func:`effdl.parallel.spawn` with a deadline: if the ranks have not all finished after
    ``deadline_s`` seconds (a deadlock, a hung collective), the rank processes are killed, which
    makes ``spawn`` return, and the test fails saying so."""
    before = set(multiprocessing.active_children())
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["results"] = spawn(fn, world, *args, backend=backend)
        except BaseException as e:  # handed to the test's thread below
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        ranks = [p for p in multiprocessing.active_children() if p not in before]
        for p in ranks:
            p.kill()
        thread.join(30.0)  # spawn sees its ranks dead, reaps them and raises
        pytest.fail(
            f"{fn.__name__} on {world} ranks did not finish within {deadline_s:g} s "
            f"(killed the {len(ranks)} still running)"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["results"]


# -- pipeline schedules -------------------------------------------------------------------------


def pipeline_against_accumulation(
    rank: int,
    world: int,
    schedule: str,
    chunks: int,
    micro_batches: int,
    device_type: str = "cuda",
) -> list[dict]:
    """Two SGD steps (batches of 16 and 8 rows) through a ``world``-rank pipeline on GPU
    ``rank % GPUS``, beside the whole model in this process trained by ``accumulated_backward``
    over the same micro-batches. Per step: both losses, and this rank's gradients of both."""
    single_threaded()
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", rank % GPUS)
        torch.cuda.set_device(device)
    stages = world * chunks
    reference = build_model(stages).to(device)
    pieces = split_sequential(build_model(stages).to(device), stages)
    reference_pieces = split_sequential(reference, stages)
    mine = [pieces[c * world + rank] for c in range(chunks)]
    params = [p for piece in mine for p in piece.parameters()]
    reference_params = [
        p for c in range(chunks) for p in reference_pieces[c * world + rank].parameters()
    ]
    stage = PipelineStage(mine if chunks > 1 else mine[0], rank, world)
    optimizers = [
        torch.optim.SGD(params, lr=0.5, momentum=0.9),
        torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9),
    ]
    steps = []
    for x, y in batches():
        x, y = x.to(device), y.to(device)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = stage.run(x, y, micro_batches, schedule)
        reference_loss = accumulated_backward(reference, x, y, micro_batches)
        steps.append(
            {
                "loss": loss.item(),
                "reference_loss": reference_loss.item(),
                "grads": [p.grad.cpu() for p in params],
                "reference_grads": [p.grad.cpu() for p in reference_params],
            }
        )
        for optimizer in optimizers:
            optimizer.step()
    return steps


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
@pytest.mark.parametrize(
    "schedule, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)], ids=str
)
def test_pipeline_schedules_equal_accumulated_backward(schedule, chunks, world):
    results = spawn_within(
        DEADLINE_S, pipeline_against_accumulation, world, schedule, chunks, 8, "cuda"
    )
    for rank, steps in enumerate(results):
        for step, got in enumerate(steps):
            what = f"rank {rank} step {step}"
            assert got["loss"] == pytest.approx(got["reference_loss"], rel=1e-12), what
            assert len(got["grads"]) == len(got["reference_grads"]) == 2 * chunks, what
            for g, r in zip(got["grads"], got["reference_grads"], strict=True):
                torch.testing.assert_close(g, r, **F64_TOL, msg=what)


# -- tensor parallelism -------------------------------------------------------------------------


@pytest.mark.multigpu
def test_tensor_parallel_levels_equal_the_single_module():
    kinds = ["mlp", "gathered", "norm", *BLOCK_KINDS]
    for rank_pairs in spawn_within(DEADLINE_S, compare_with_reference, GPUS, kinds, "cuda"):
        assert len(rank_pairs) == 20 + 2 * 14  # output, input grad, every parameter's grad
        for what, got, expected in rank_pairs:
            torch.testing.assert_close(got, expected, **F64_TOL, msg=what)


# -- data parallelism ---------------------------------------------------------------------------


@pytest.mark.multigpu
@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "ddp-rows"])
def test_data_parallel_training_equals_one_process_on_the_whole_batch(parallel):
    for rank, got in enumerate(
        spawn_within(DEADLINE_S, data_parallel_losses, GPUS, parallel, "cuda")
    ):
        assert got["reference"][-1] < 0.8 * got["reference"][0]
        torch.testing.assert_close(
            got["losses"], got["reference"], rtol=FP32_RTOL, atol=0, msg=f"rank {rank}"
        )


@pytest.mark.multigpu
def test_gradient_sync_keeps_ddp_gradients_local_until_the_last_micro_batch():
    got = spawn_within(DEADLINE_S, ddp_gradients, GPUS, "cuda")
    for rank_got in got:
        assert rank_got["settings"] == (True, False)
        torch.testing.assert_close(rank_got["ddp_0"], rank_got["plain_0"])
        torch.testing.assert_close(
            rank_got["ddp_1"], (got[0]["plain_1"] + got[1]["plain_1"]) / 2, rtol=1e-5, atol=1e-7
        )
    assert not torch.allclose(got[0]["ddp_0"], got[1]["ddp_0"])


@pytest.mark.multigpu
def test_ddp_averages_the_embedding_row_wise_to_the_dense_mean():
    got = spawn_within(DEADLINE_S, embedding_rows_gradients, GPUS, "cuda")
    looked_up = global_batches(torch.device("cpu"))[0][0].unique()
    for rank_got in got:
        assert rank_got["gathers"] == 1
        torch.testing.assert_close(rank_got["rows"], rank_got["dense"], rtol=0, atol=0)
        touched = rank_got["table"].abs().sum(1) > 0
        assert touched.nonzero().flatten().tolist() == looked_up.tolist()


# -- the deadline, on the CPU -------------------------------------------------------------------


def deadlocked(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    dist.recv(torch.zeros(1), src=(rank + 1) % world)  # every rank waits; none sends


def test_a_deadlocked_run_fails_at_its_deadline_and_leaves_no_rank_behind():
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(
        pytest.fail.Exception, match=r"did not finish within 2 s \(killed the 2 still running\)"
    ):
        spawn_within(2.0, deadlocked, 2, backend="gloo")
    assert time.monotonic() - start < 15.0
    assert set(multiprocessing.active_children()) <= before
