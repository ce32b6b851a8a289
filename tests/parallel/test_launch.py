"""spawn: forked ranks work after the parent ran multi-threaded ops."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
