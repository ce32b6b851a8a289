"""Measuring a pipeline-parallel run: the time of one activation message, the compute time of a
forward and of a backward, each step's time across ranks, and the bubble: measured, from the
formula, and predicted from the measured per-rank times (:func:`simulate_seconds`)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from effdl.parallel.pipeline import (
    FORWARD,
    SCHEDULES,
    PipelineStage,
    bubble_fraction,
    measured_bubble_fraction,
    simulate_seconds,
)
from effdl.profiling.timing import synchronize


def message_seconds(
    rank: int,
    pair: dist.ProcessGroup,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> float:
    """One-way time of one message of ``shape`` (an activation) between ranks 0 and 1, the
    only callers: half the median round trip of 20 ping-pongs over ``pair`` (their two-rank
    group), after 3 untimed."""
    buf = torch.zeros(shape, dtype=dtype, device=device)
    times = []
    for _ in range(23):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1, group=pair)
            dist.recv(buf, 1, group=pair)
        else:
            dist.recv(buf, 0, group=pair)
            dist.send(buf, 0, group=pair)
        synchronize(device)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[3:])


def action_seconds(stage: PipelineStage) -> tuple[float, float]:
    """Mean compute time of a forward and of a backward in the stage's last run (which must
    have been run with ``record_timings``)."""
    forward = [t.end_s - t.start_s for t in stage.last_stats.timings if t.action.kind == FORWARD]
    backward = [t.end_s - t.start_s for t in stage.last_stats.timings if t.action.kind != FORWARD]
    return statistics.fmean(forward), statistics.fmean(backward)


def slowest_rank_steps(per_rank_steps: list[list[dict]], loss_rank: int) -> list[dict]:
    """Per step: the record of rank ``loss_rank`` (the one that saw the loss) with the step time
    of the last rank to finish (every rank starts a step at the same barrier, and the step is
    over when all are done). ``per_rank_steps[r]``: rank r's ``{"step", "loss", "step_s"}``."""
    return [
        {**per_rank[loss_rank], "step_s": max(r["step_s"] for r in per_rank)}
        for per_rank in zip(*per_rank_steps, strict=True)
    ]


def predicted_bubble(
    schedule: str,
    micro_batches: int,
    chunks: int,
    forward_s: list[float],
    backward_s: list[float],
    message_s: float = 0.0,
) -> float:
    """The bubble that schedule ``schedule`` (a :data:`SCHEDULES` name) leaves with the measured
    per-rank forward and backward times (their imbalance, which the formula leaves out) and a
    message time ``message_s`` on every hop between ranks."""
    stages = len(forward_s)
    makespan = simulate_seconds(
        SCHEDULES[schedule], stages, micro_batches, forward_s, backward_s, chunks, message_s
    )
    per_action = statistics.fmean(f + b for f, b in zip(forward_s, backward_s, strict=True))
    return 1 - micro_batches * chunks * per_action / makespan


def bubble_summary(schedule: str, micro_batches: int, chunks: int, results: list[dict]) -> dict:
    """The bubble of a pipeline run measured (median over the timed steps, overall and per
    rank), from the formula and predicted from the measured times, with and without messages.
    ``results[r]``: rank r's ``busy_s`` and ``wall_s`` per timed step, its median ``forward_s``
    and ``backward_s`` per micro-batch, and (rank 0's) ``message_s``."""
    busy = list(zip(*(r["busy_s"] for r in results), strict=True))
    walls = [max(w) for w in zip(*(r["wall_s"] for r in results), strict=True)]
    measured = [measured_bubble_fraction(b, w) for b, w in zip(busy, walls, strict=True)]
    forward = [r["forward_s"] for r in results]
    backward = [r["backward_s"] for r in results]
    predict = (schedule, micro_batches, chunks, forward, backward)
    return {
        "bubble_measured": statistics.median(measured),
        "bubble_formula": bubble_fraction(len(results), micro_batches, chunks),
        "bubble_predicted": predicted_bubble(*predict),
        "bubble_predicted_with_messages": predicted_bubble(*predict, results[0]["message_s"]),
        "bubble_measured_per_rank": [
            statistics.median(1 - b / w for b, w in zip(r["busy_s"], walls, strict=True))
            for r in results
        ],
    }
