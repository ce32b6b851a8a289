"""Start a process group: ``spawn`` runs one function on every rank in local processes (tests,
CPU experiments with gloo), ``init_from_env`` joins the group that ``torchrun`` describes."""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_POLL_S = 0.2
_GRACE_S = 2.0
_RENDEZVOUS_ATTEMPTS = 2  # gloo's TCP mesh set-up now and then loses a connection under load


class RankFailedError(RuntimeError):
    """Ranks started by :func:`spawn` raised or died. ``failures`` maps each failed rank to its
    traceback text (or how its process ended); the message lists them in rank order, since the
    rank that failed first is not always the first to report (its peers then fail too)."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = dict(sorted(failures.items()))
        details = "".join(f"\n--- rank {r} ---\n{text}" for r, text in self.failures.items())
        super().__init__(f"rank(s) {', '.join(map(str, self.failures))} failed:{details}")


def _start_method(backend: str) -> str:
    # fork: children need no re-import of torch or of ``fn``'s module (seconds per process).
    # A forked child cannot use CUDA once the parent has touched the driver (even a device
    # count does, and a CPU optimizer step asks whether CUDA is capturing), so NCCL, and any
    # machine with a GPU, get spawn.
    if (
        backend == "gloo"
        and torch.cuda.device_count() == 0
        and "fork" in mp.get_all_start_methods()
    ):
        return "fork"
    return "spawn"


def _run_rank(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    backend: str,
    store_path: str,
    results: Any,
    forked: bool,
) -> None:
    joined = False
    try:
        if forked:
            # The parent's OpenMP thread pool does not survive fork: a child whose parent ran a
            # multi-threaded op hangs in its first parallel region. One intra-op thread per
            # rank never enters one (and ranks sharing a CPU gain little from more).
            torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        joined = True
        # Plain pickle (bytes), not torch's shared-memory reduction: the result must outlive
        # this process.
        outcome = (rank, True, pickle.dumps(fn(rank, world_size, *args)), True)
    except BaseException:
        outcome = (rank, False, traceback.format_exc(), joined)
    results.put(outcome)  # before the group goes down and the peers fail because of it
    if dist.is_initialized():
        dist.destroy_process_group()


def _stop(processes: list) -> None:
    """Terminate the ranks still running (they may be blocked in a collective) and reap all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join()


def _collect(processes: list, results: Any) -> tuple[dict[int, Any], dict[int, str], bool]:
    """Each rank's result or failure, and whether every failure happened while joining the
    group. After the first failure the others get ``_GRACE_S`` to report theirs (usually
    consequences, but the root cause may arrive second)."""
    done: dict[int, Any] = {}
    failures: dict[int, str] = {}
    only_rendezvous = True
    deadline = None
    exited_at: dict[int, float] = {}  # ranks seen exited with code 0, not yet reported
    checked = time.monotonic()  # when the last empty poll was looked at
    while len(done) + len(failures) < len(processes):
        if deadline is not None and time.monotonic() > deadline:
            break
        try:
            rank, ok, payload, joined = results.get(timeout=_POLL_S)
            if ok:
                done[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                only_rendezvous = only_rendezvous and not joined
        except queue.Empty:
            for rank, p in enumerate(processes):
                if rank in done or rank in failures or p.exitcode is None:
                    continue
                # a clean exit's report may still be in the pipe: it gets one more poll
                if p.exitcode != 0 or exited_at.setdefault(rank, time.monotonic()) < checked:
                    failures[rank] = f"process exited with code {p.exitcode} before reporting"
                    only_rendezvous = False
            checked = time.monotonic()
        if failures and deadline is None:
            deadline = time.monotonic() + _GRACE_S
    return done, failures, only_rendezvous


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes that form one process
    group (``backend``, rendezvous through a FileStore in a temporary directory, so no port is
    needed), and return each rank's result in rank order.

    Results must be picklable. If any rank raises or dies, the others are given a moment to
    report, then terminated, and :class:`RankFailedError` is raised with every failed rank's
    traceback. Processes are forked for gloo (fast; the children must then not use CUDA, and
    run with one intra-op thread: ``torch.set_num_threads(1)``) and
    spawned for other backends or once the parent has initialised CUDA; spawned children
    unpickle ``fn`` and ``args``, so ``fn`` must be importable by its module name. Where every
    failure happened while the ranks were joining the group (gloo's TCP mesh set-up now and
    then loses a connection on a loaded machine), all ranks are started once more on a fresh
    store; a rank that had joined may then have begun ``fn`` before being stopped.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    method = _start_method(backend)
    for attempt in range(1, _RENDEZVOUS_ATTEMPTS + 1):
        done, failures, only_rendezvous = _run_once(fn, world_size, args, backend, method)
        if not failures:
            return [done[rank] for rank in range(world_size)]
        if not (only_rendezvous and attempt < _RENDEZVOUS_ATTEMPTS):
            raise RankFailedError(failures)
    raise AssertionError("unreachable")


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple, backend: str, method: str
) -> tuple[dict[int, Any], dict[int, str], bool]:
    """One set of ranks on a fresh store: what :func:`_collect` gathered, ranks reaped."""
    ctx = mp.get_context(method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="effdl-spawn-") as tmp:
        store_path = os.path.join(tmp, "store")
        processes = [
            ctx.Process(
                target=_run_rank,
                args=(fn, rank, world_size, args, backend, store_path, results, method == "fork"),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in processes:
            p.start()
        try:
            outcome = _collect(processes, results)
        except BaseException:
            _stop(processes)
            raise
        if outcome[1]:
            _stop(processes)
        else:
            for p in processes:
                p.join()
    return outcome


def available_cores() -> int:
    """CPUs this process may run on: its affinity set, capped by a cgroup v2 CPU quota (a
    container's ``cpu.max``); ``os.cpu_count()`` counts the host's CPUs and ignores both."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota to honour
    return cores or 1


@dataclass(frozen=True)
class CpuShare:
    """The CPU a local rank was given by :func:`share_cpu`."""

    threads: int  # intra-op threads (torch.set_num_threads)
    cores: tuple[int, ...]  # CPUs all its threads are pinned to; empty when not pinned


def cpu_threads(world: int, threads: int = 0) -> int:
    """Intra-op threads per rank of ``world`` local ranks: ``threads``, or when 0 an equal share
    of :func:`available_cores` (at least 1)."""
    return threads or max(1, available_cores() // world)


def share_cpu(local_rank: int, world: int, threads: int = 0) -> CpuShare:
    """Give local rank ``local_rank`` of ``world`` processes on this host its own part of the
    CPU: :func:`cpu_threads` intra-op threads and, where the affinity set holds ``world``
    blocks of ``available_cores() // world`` CPUs and the threads fit in one, affinity to the
    ``local_rank``-th block for every thread of the process (communication threads included),
    so ranks neither oversubscribe the cores nor run on each other's. Threads below the block
    size leave cores for communication. Call it in the rank's process before its first parallel
    kernel (the OpenMP threads it starts then inherit the affinity). Mutates the process's
    thread count and CPU affinity."""
    n = cpu_threads(world, threads)
    torch.set_num_threads(n)
    block = max(1, available_cores() // world)
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if n > block or len(allowed) < world * block:
        return CpuShare(n, ())
    cores = tuple(allowed[local_rank * block : (local_rank + 1) * block])
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(task), cores)
    return CpuShare(n, cores)


def cpu_share_record(world: int, threads: int = 0) -> dict:
    """What a run log records of the CPU that ``world`` local ranks share: the host's CPUs, the
    usable ones, each rank's intra-op threads and the load average (other work on the host
    skews CPU timings)."""
    return {
        "cpu_cores": os.cpu_count(),
        "cores_available": available_cores(),
        "threads_per_rank": cpu_threads(world, threads),
        "load_avg_1min": os.getloadavg()[0],
    }


def round_robin_device(backend: str, rank: int) -> torch.device:
    """The device of ``rank`` (local to its host): with NCCL the GPU ``rank % device_count``,
    made current (ranks share GPUs round-robin when there are more ranks than GPUs); with any
    other backend the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def init_from_env(backend: str | None = None) -> torch.device:
    """Join the process group described by ``torchrun``'s environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK) and return this rank's device: ``cuda:LOCAL_RANK``
    (made current) with NCCL when CUDA is available, else the CPU with gloo. ``backend``
    overrides the choice of backend only."""
    use_cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"))
    return device
