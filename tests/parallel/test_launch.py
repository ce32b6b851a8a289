"""spawn: forked ranks after the parent ran multi-threaded ops; rendezvous retried, failures not.
share_cpu: each local rank its threads and its own block of cores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from effdl.parallel import launch
from effdl.parallel.launch import (
    CpuShare,
    RankFailedError,
    available_cores,
    cpu_threads,
    share_cpu,
    spawn,
)
from tests.script_loading import ROOT

PARENT_THEN_RANKS = textwrap.dedent(
    """
    import torch
    from effdl.parallel.launch import spawn

    def rank_matmul(rank, world):
        a = torch.randn(512, 512)
        return float((a @ a).sum() * 0) + torch.get_num_threads()

    if __name__ == "__main__":
        torch.set_num_threads(2)
        a = torch.randn(1024, 1024)
        (a @ a).sum()  # the parent's OpenMP pool starts
        print(spawn(rank_matmul, 2))
    """
)


def test_forked_ranks_run_after_the_parent_used_threads() -> None:
    res = subprocess.run(
        [sys.executable, "-c", PARENT_THEN_RANKS],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[1.0, 1.0]"  # each rank: one intra-op thread


def _sum_of_ranks(rank: int, world: int) -> int:
    t = torch.tensor([rank])
    dist.all_reduce(t)
    return int(t)


def _fails_in_fn(rank: int, world: int, marker: str) -> None:
    with open(marker, "a") as f:
        f.write(f"{rank}\n")
    raise ValueError("boom")


def test_a_failed_rendezvous_is_retried_once_on_a_fresh_store(tmp_path, monkeypatch) -> None:
    marker = tmp_path / "first_attempt_failed"
    join = dist.init_process_group

    def flaky_join(*args, **kwargs):  # rank 0's first attempt loses its connection
        if kwargs.get("rank") == 0 and not marker.exists():
            marker.touch()
            raise RuntimeError("Gloo connectFullMesh failed: Connection closed by peer")
        return join(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", flaky_join)  # forked ranks inherit it
    assert spawn(_sum_of_ranks, 2) == [1, 1]
    assert marker.exists()


def test_a_failure_inside_fn_is_not_retried(tmp_path) -> None:
    marker = tmp_path / "calls"
    with pytest.raises(RankFailedError, match="boom"):
        spawn(_fails_in_fn, 2, str(marker))
    assert sorted(marker.read_text().split()) == ["0", "1"]  # one attempt per rank


def _share_and_affinity(rank: int, world: int) -> tuple[CpuShare, list[int], int]:
    share = share_cpu(rank, world, threads=1)
    return share, sorted(os.sched_getaffinity(0)), torch.get_num_threads()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_share_cpu_pins_each_rank_to_its_own_block_of_cores() -> None:
    world = 2
    block = available_cores() // world
    if block < 1:
        pytest.skip("fewer cores than ranks")
    shares = spawn(_share_and_affinity, world)
    for share, affinity, threads in shares:
        assert share.threads == threads == 1
        assert len(share.cores) == block and list(share.cores) == affinity
    assert not set(shares[0][0].cores) & set(shares[1][0].cores)


def test_cpu_threads_is_the_flag_or_an_equal_share() -> None:
    assert cpu_threads(4, threads=3) == 3
    assert cpu_threads(4) == max(1, available_cores() // 4)
    assert cpu_threads(10**6) == 1


def test_available_cores_honours_a_cgroup_quota(monkeypatch) -> None:
    class Quota:  # cpu.max of a container limited to 1.5 CPUs
        def __init__(self, path: str) -> None:
            assert path == "/sys/fs/cgroup/cpu.max"

        def read_text(self) -> str:
            return "150000 100000\n"

    monkeypatch.setattr(launch, "Path", Quota)
    assert available_cores() == 1
