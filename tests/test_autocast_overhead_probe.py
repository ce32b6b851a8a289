"""task1_loss_scaling/probes/autocast_overhead_probe.py (CUDA only): the records it builds from
measured times are those the task-1 report reads; a bad flag or a CPU is refused in one line."""

from collections import Counter

import pytest

from tests.probe_logs import assert_like_committed, probe_log, refused
from tests.script_loading import load_script

probe = load_script("task1_loss_scaling/probes", "autocast_overhead_probe")
LOG = "autocast_overhead.jsonl"


def test_records_from_measured_times_have_the_committed_keys(tmp_path):
    log = probe_log(tmp_path, LOG, "task1_autocast_overhead")
    cfg = probe.FULL
    for rows in cfg.rows:
        rounds = {
            "torch": [probe.Timing(1.0, 2.0, [1.9, 1.95, 2.1, 2.2])] * cfg.rounds,
            "own": [probe.Timing(1.5, 3.0, [2.9, 2.95, 3.1, 3.2])] * cfg.rounds,
        }
        gc_off = {
            "torch": probe.Timing(1.0, 2.0, [2.0] * 4),
            "own": probe.Timing(1.2, 2.5, [2.5] * 4),
        }
        probe.log_rows(log, cfg, rows, rounds, gc_off)
    probe.log_calls(log, cfg.rows[0], Counter({"linear": 9, "add": 13}))
    records = assert_like_committed(tmp_path / LOG, f"task1/probes/{LOG}")
    ratios = [r["metrics"] for r in records if r["variant"] == "own_over_torch"]
    assert ratios[0] == {"gpu_time_ratio": 1.5, "gc_off_gpu_time_ratio": 1.25}
    assert records[-1]["metrics"] == {"total": 22, "per_function": {"add": 13, "linear": 9}}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--rows", "8", "-1"], "--rows must be >= 1"),
        (["--device", "cpu"], "needs CUDA"),
    ],
)
def test_a_bad_flag_or_a_cpu_is_refused_before_any_log(tmp_path, monkeypatch, capsys, argv, says):
    assert says in refused(probe, argv, tmp_path / "out", monkeypatch, capsys)
