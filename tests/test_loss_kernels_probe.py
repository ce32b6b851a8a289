"""lm_training/probes/loss_kernels.py: the quick run on the CPU measures every variant it is
given against the fp32-upcast reference; bad flags are refused in one line before any log."""

import sys

import pytest

from effdl.results import read_records
from tests.probe_logs import refused
from tests.script_loading import load_script

probe = load_script("lm_training/probes", "loss_kernels")


def test_quick_run_matches_the_upcast_loss(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["loss_kernels.py", "--quick", "--out", str(tmp_path)])
    probe.main()
    records = read_records(tmp_path / "loss_kernels.jsonl")
    assert [r["variant"] for r in records] == probe.QUICK.variants
    for r in records:
        m = r["metrics"]
        assert r["config"]["tokens"] == 64 and r["config"]["kernels"] == "torch"
        assert m["loss_rel_err"] < 1e-5 and m["grad_max_abs_err"] < 1e-3
        assert m["median_ms"] > 0 and m["extra_peak_gib"] is None  # no allocator stats on CPU
        assert m["floor_bytes"] == 3 * 64 * 1000 * 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--variants", "fused"], "--variants: unknown ['fused']"),
        (["--tokens", "0"], "--tokens must be >= 1"),
        (["--iters", "0"], "--iters must be >= 1"),
    ],
)
def test_a_bad_flag_is_refused_before_any_log(tmp_path, monkeypatch, capsys, argv, says):
    assert says in refused(probe, ["--quick", *argv], tmp_path / "out", monkeypatch, capsys)
