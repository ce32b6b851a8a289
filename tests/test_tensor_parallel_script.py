"""memory_efficient_gpt2/tensor_parallel.py end to end on the CPU (gloo, 2 ranks): every level's
parallel loss curve equals the single-process reference trained in the same run, and so does the
reference trained on accumulated half batches (the rounding-noise floor of float32 runs).

The script runs as a subprocess, as a user runs it: its ranks are forked, and a fork from this
test process (which other tests leave with OpenMP threads) could hang.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from effdl.results import read_records
from tests.interrupting import interrupt_after, whole_records
from tests.script_loading import ROOT

SCRIPT = ROOT / "memory_efficient_gpt2" / "tensor_parallel.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_parallel_curves_equal_the_reference_in_float64(tmp_path, activation):
    done = run_script(
        "--dtype", "float64", "--world-size", "2", "--steps", "6", "--warmup", "1",
        "--activation", activation, "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = read_records(tmp_path / "tensor_parallel_curves.jsonl")
    by_variant = {r["variant"]: r for r in records}
    assert sorted(by_variant) == sorted(
        f"{level}_{mode}"
        for level in ("mlp", "norm", "block")
        for mode in ("parallel", "reference", "reference_halves")
    )
    for level in ("mlp", "norm", "block"):
        parallel = by_variant[f"{level}_parallel"]
        reference = by_variant[f"{level}_reference"]["metrics"]["losses"]
        assert parallel["config"]["world_size"] == 2
        assert parallel["config"]["activation"] == activation
        assert reference[-1] < reference[0]  # it learns: the curves are not flat
        assert parallel["metrics"]["losses"] == pytest.approx(reference, rel=1e-10, abs=0)
        assert parallel["metrics"]["max_rel_gap_vs_reference"] <= 1e-10
        halves = by_variant[f"{level}_reference_halves"]["metrics"]
        assert halves["losses"] == pytest.approx(reference, rel=1e-10, abs=0)
        assert halves["max_rel_gap_vs_reference"] <= 1e-10  # the order differs, not the math
        assert 0 <= parallel["metrics"]["test_accuracy"] <= 1
        assert parallel["metrics"]["step_ms_median"] > 0


def test_missing_cifar_folder_is_one_line_usage_error(tmp_path):
    done = run_script("--data", str(tmp_path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "--data:" in done.stderr and "data_batch_1 is missing" in done.stderr


def test_an_interrupted_run_keeps_the_runs_it_finished(tmp_path):
    """Ctrl-C while the parallel run trains: exit 130, and the log holds the reference and its
    halves twin, logged as each finished, whole."""
    log = tmp_path / "tensor_parallel_curves.jsonl"
    args = ["--quick", "--level", "mlp", "norm", "--steps", "1000", "--out", str(tmp_path)]
    code, err = interrupt_after(SCRIPT, args, log, records=2, delay=1.0)
    assert code == 130, err
    records = whole_records(log)
    assert [r["variant"] for r in records] == ["mlp_reference", "mlp_reference_halves"]
    assert all(len(r["metrics"]["losses"]) == 1000 for r in records)
    assert records[1]["metrics"]["max_rel_gap_vs_reference"] >= 0
