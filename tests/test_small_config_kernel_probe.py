"""swiglu_checkpoint/probes/small_config_kernel_probe.py (CUDA only): the records it builds from
measured times are those the SwiGLU report reads; a bad flag or a CPU is refused in one line."""

import pytest

from tests.probe_logs import assert_like_committed, probe_log, refused
from tests.script_loading import load_script

probe = load_script("swiglu_checkpoint/probes", "small_config_kernel_probe")
LOG = "small_config_kernels.jsonl"


def test_records_from_measured_times_have_the_committed_keys(tmp_path):
    log = probe_log(tmp_path, LOG, "swiglu")
    cfg = probe.FULL
    kernels = {f"kernel_{j}": 100.0 - j for j in range(10)}  # longest first, as profiled
    for shape in cfg.configs:
        wall = {k: [2.0 + j, 1.0 + j] for j, k in enumerate(probe.KINDS)}
        probe.log_config(log, cfg, shape, wall, {k: kernels for k in probe.KINDS})
    records = assert_like_committed(tmp_path / LOG, f"swiglu/probes/{LOG}")
    assert len(records) == len(probe.CONFIGS) * len(probe.KINDS)
    level0 = records[1]["metrics"]
    assert level0["wall_over_reference"] == pytest.approx(2.5 / 1.5)
    assert level0["gpu_kernel_ms_per_step"] == pytest.approx(sum(kernels.values()) / 1e3)
    assert list(level0["top_kernels_us"]) == [f"kernel_{j}" for j in range(probe.TOP_KERNELS)]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--profiled-steps", "nan"], "--profiled-steps"),
        (["--device", "cpu"], "needs CUDA"),
    ],
)
def test_a_bad_flag_or_a_cpu_is_refused_before_any_log(tmp_path, monkeypatch, capsys, argv, says):
    assert says in refused(probe, argv, tmp_path / "out", monkeypatch, capsys)
