"""This process's place in an LM training run: rank, number of processes, device, and the
process group (joined when launched by torchrun, a group of one otherwise)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from effdl.cli import UsageError, device_from_arg


@dataclass(frozen=True)
class Dist:
    """This process's place: rank, number of processes, its device."""

    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(parallel: str, device_arg: str) -> Dist:
    """Join the process group when launched by torchrun (NCCL on CUDA, gloo on the CPU).

    ``--parallel ddp|fsdp`` without torchrun runs as a group of one (FSDP2's mixed precision
    then works on a single GPU); ``--parallel none`` under torchrun with several processes is
    refused, since every process would train alone on the same data.
    """
    launched = "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", 1))
    if parallel == "none" and world > 1:
        raise UsageError(f"{world} processes with --parallel none: use --parallel ddp or fsdp")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_arg in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = device_from_arg(device_arg)
    if parallel == "none":
        return Dist(0, 1, device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launched:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def teardown_distributed(finished: bool) -> None:
    """Leave the process group; after a finished run all ranks leave together (a rank that
    exits while another still uses gloo aborts it), after an error without waiting."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """``t`` summed over all ranks, in place (``t`` itself in a run of one process)."""
    if d.world > 1:
        dist.all_reduce(t)
    return t
