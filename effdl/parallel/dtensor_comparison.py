"""Forward+backward time of effdl's tensor-parallel MLP against torch's DTensor one
(``ColwiseParallel``/``RowwiseParallel`` via ``parallelize_module``), built from the same weights
on every rank of the default process group."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from effdl.parallel.tensor import ParallelMLP
from effdl.profiling.timing import TimingStats, synchronize


def time_parallel_mlps(
    device: torch.device,
    widths: Sequence[int],
    *,
    batch: int,
    dtype: torch.dtype,
    iters: int,
    rounds: int,
    warmup_rounds: int,
    seed: int,
) -> list[dict]:
    """Forward+backward of ``width -> 4 width -> width`` MLPs (ReLU) for each of ``widths``:
    ours (ParallelMLP) and DTensor's from the same weights, on a (``batch``, width) input.

    Each round starts all ranks together (synchronize, barrier) and times ``iters`` iterations
    of one model by the wall clock until its GPU work is done, so the time holds both ranks'
    host work and the waits in the collectives (GPU events on one rank would book the other
    rank's lateness to whichever model's collective absorbs it). Rounds alternate the models;
    the first ``warmup_rounds`` are untimed. One row per model and width: ``impl``, ``width``,
    ``fwd_bwd_ms_*`` (this rank's clock, per iteration) and ``max_abs_output_diff``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    rows = []
    for width in widths:
        torch.manual_seed(seed)
        full = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
        full = full.to(device, dtype)
        ours = ParallelMLP.from_linears(full[0], full[1], full[2])
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        theirs = parallelize_module(copy.deepcopy(full), mesh, plan)
        x = torch.randn(batch, width, device=device, dtype=dtype)
        models = {"ours": ours, "dtensor": theirs}
        times: dict[str, list[float]] = {name: [] for name in models}
        for rnd in range(warmup_rounds + rounds):
            for name, model in models.items():
                synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    model.zero_grad(set_to_none=True)
                    model(x).sum().backward()
                synchronize(device)
                if rnd >= warmup_rounds:
                    times[name].append((time.perf_counter() - start) / iters)
        gap = (ours(x) - theirs(x)).abs().max().item()
        for name, seconds in times.items():
            stats = TimingStats.from_times(seconds).as_dict()
            ms = {f"fwd_bwd_ms_{k}": v * 1e3 for k, v in stats.items() if k != "n"}
            rows.append({"impl": name, "width": width, **ms, "max_abs_output_diff": gap})
    return rows
