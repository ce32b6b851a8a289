"""task2_batching/probes/ultra_host_probe.py (CUDA only): the records it builds from measured
times are those the task-2 report reads; a bad flag or a CPU is refused in one line."""

import pytest

from effdl.results import read_records
from tests.probe_logs import COMMITTED, assert_like_committed, probe_log, refused
from tests.script_loading import load_script

probe = load_script("task2_batching/probes", "ultra_host_probe")
LOG = "ultra_host.jsonl"


class MeasuredTimes:
    """Stands in for the probe's ``Probe``: fixed times of 10 batches per variant."""

    gpu = [0.004] * 10

    def loop(self, **how) -> dict:
        split = {k: [0.001] * 10 for k in ("wait", "inputs", "copy", "fwd")}
        return probe.split_metrics(0.06, self.gpu, split)

    def preloaded(self) -> dict:
        return probe.split_metrics(0.04, self.gpu, {"fwd": [0.002] * 10})


def test_records_from_measured_times_have_the_committed_keys(tmp_path):
    log = probe_log(tmp_path, LOG, "task2_ultra_host")
    probe.log_variants(log, probe.FULL, probe.variants(MeasuredTimes(), None))
    records = assert_like_committed(tmp_path / LOG, f"task2/probes/{LOG}")
    committed = read_records(COMMITTED / "task2/probes" / LOG)
    assert [r["variant"] for r in records] == [r["variant"] for r in committed]
    base = records[0]["metrics"]
    assert base["host_ms"] == pytest.approx(4.0) and base["gpu_ms"] == pytest.approx(4.0)
    assert base["wall_over_gpu"] == pytest.approx(1.5)
    assert records[0]["config"]["batches"] == probe.FULL.batches


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--batches", "0"], "--batches must be >= 1"),
        (["--warmup-batches", "-1"], "--warmup-batches must be >= 0"),
        (["--device", "cpu"], "needs CUDA"),
    ],
)
def test_a_bad_flag_or_a_cpu_is_refused_before_any_log(tmp_path, monkeypatch, capsys, argv, says):
    assert says in refused(probe, argv, tmp_path / "out", monkeypatch, capsys)
