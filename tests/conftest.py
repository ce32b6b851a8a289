import os

import pytest
import torch

TIMES_ENV = "EFFDL_TEST_TIMES"  # a .jsonl file: each test's duration is logged as it ends


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip without CUDA, ``multigpu`` tests (NCCL across 2 GPUs) with fewer than
    2 devices; neither marker implies the other."""
    gpus = torch.cuda.device_count()
    needs = {
        "gpu": (1, "needs CUDA (run on a machine with a GPU: pytest -m gpu)"),
        "multigpu": (2, "needs 2 CUDA devices (run on a multi-GPU host: pytest -m multigpu)"),
    }
    for item in items:
        for marker, (count, reason) in needs.items():
            if gpus < count and item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _restore_cuda_process_state():
    """Scripts run in-process by GPU tests cap this process's GPU memory
    (``set_per_process_memory_fraction``); the cap would follow into every later test."""
    yield
    # Not is_available(): it starts the CUDA driver in this process, after which gloo ranks
    # that spawn() forks fail at torch's CUDA checks (an optimizer step makes one).
    if torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(1.0, index)
        torch.cuda.empty_cache()


_times_log = None  # the RunLog of $EFFDL_TEST_TIMES, opened at the first finished test


def pytest_runtest_logreport(report):
    """With ``$EFFDL_TEST_TIMES`` set (a .jsonl path), log each test's call time as a run record
    as the test ends, so a run stopped at a time limit still tells which tests took the time."""
    global _times_log
    path = os.environ.get(TIMES_ENV)
    if path and report.when == "call":
        if _times_log is None:
            from effdl.results import RunLog

            _times_log = RunLog(path, task="tests")
        metrics = {"seconds": report.duration, "outcome": report.outcome}
        _times_log.log(report.nodeid, {}, metrics)
