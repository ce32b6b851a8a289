import importlib.util
import sys
from pathlib import Path

import pytest

from effdl.profiling.epoch import EpochTiming

TASK2 = Path(__file__).resolve().parent.parent / "task2_batching"


def load_script(name: str):
    """A task-2 script as a module (it imports its sibling pipeline_runs.py by name)."""
    sys.path.insert(0, str(TASK2))
    try:
        spec = importlib.util.spec_from_file_location(f"task2_{name}", TASK2 / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TASK2))
    return module


def test_epoch_is_set_against_the_run_yardstick_and_the_adjacent_one():
    mock_epoch = load_script("mock_epoch")
    timing = EpochTiming(
        batch_s=[0.5, 0.25, 0.25],
        epoch_s=1.5,
        real_tokens=3000,
        slots=4000,
        widths=[10, 20, 30],
        peak_mem_gib=float("nan"),
        first_batch_s=0.1,
        wait_s=0.2,
        launch_s=0.3,
    )
    m = mock_epoch.epoch_metrics(timing, dense_tps=3000.0, adjacent_tps=6000.0)
    # ideal: 3000 real tokens at 3000 tok/s = 1 s (run yardstick), at 6000 tok/s = 0.5 s (adjacent)
    assert m["ideal_s"] == pytest.approx(1.0)
    assert m["compute_over_ideal"] == pytest.approx(1.0)  # compute = 0.5 + 0.25 + 0.25 s
    assert m["epoch_over_ideal"] == pytest.approx(1.5)
    assert m["dense_tokens_per_s_adjacent"] == 6000.0
    assert m["compute_over_ideal_adjacent"] == pytest.approx(2.0)
    assert m["epoch_over_ideal_adjacent"] == pytest.approx(3.0)
    assert m["padding_fraction"] == pytest.approx(0.25)
