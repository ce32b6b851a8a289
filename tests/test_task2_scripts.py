import pytest

from effdl.profiling.epoch import EpochTiming
from tests.script_loading import load_script as load_task_script


def load_script(name: str):
    return load_task_script("task2_batching", name)


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
