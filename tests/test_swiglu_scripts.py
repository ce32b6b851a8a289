"""swiglu_checkpoint/benchmark.py refuses what it cannot run in one line (exit 2), no records."""

import sys

import pytest

from effdl.cli import run_main
from effdl.results import read_records
from tests.log_values import non_finite
from tests.script_loading import load_script

benchmark = load_script("swiglu_checkpoint", "benchmark")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "--rounds must be >= 1, got 0"),
        (["--device", "meta"], "--device meta: expected cpu or cuda"),
        (
            ["--device", "cpu", "--variants", "level0", "level0_triton"],
            "--variants level0_triton: these force a CUDA backend; on the cpu level0 is the "
            "PyTorch path",
        ),
        (
            ["--device", "cpu", "--variants", "level0_jiterator"],
            "--variants level0_jiterator: these force a CUDA backend",
        ),
    ],
)
def test_refused_in_one_line_without_records(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--quick", *argv, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        run_main(benchmark.main)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"benchmark.py: error: {message}"), err
    assert all(read_records(log) == [] for log in tmp_path.iterdir())


def test_cpu_defaults_leave_the_cuda_backends_out():
    cfg = benchmark.QUICK
    variants = benchmark.runnable_variants(cfg, benchmark.torch.device("cpu"), given=False)
    assert variants and not set(variants) & set(benchmark.FORCED_BACKEND)


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize(
    ("variant", "gemms"),
    [("reference", 9), ("checkpoint", 11), ("level0", 9), ("level1", 11), ("level2", 9)],
)
def test_counted_gemms_per_layer_and_step(variant, gemms, residual):
    # 3 forward + 6 backward; checkpoint and level 1 re-run xW and xV, checkpoint's early stop
    # leaves gU out
    cpu = benchmark.torch.device("cpu")
    for dtype in (benchmark.torch.float64, benchmark.torch.float32):
        assert benchmark.counted_gemms(variant, dtype, cpu, residual) == gemms
    assert benchmark.GEMMS[variant] == gemms


def test_gemm_counts_refuse_a_table_that_differs_from_the_count(monkeypatch):
    monkeypatch.setitem(benchmark.GEMMS, "checkpoint", 12)
    cpu = benchmark.torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"'checkpoint': \(11\.0, 12\)"):
        benchmark.gemm_counts(["reference", "checkpoint"], benchmark.torch.float64, cpu, True)


def test_run_experiments_logs_counted_gemms_and_returns_the_assignment_units(tmp_path):
    import argparse
    import dataclasses

    args = argparse.Namespace(device="cpu", seed=0, out=tmp_path, quick=True)
    run = benchmark.start_run(args, task="swiglu", logs="benchmark.jsonl")
    shape = benchmark.Shape(2, 8, 16, 48, 2)
    variants = ["reference", "checkpoint", "level0", "level1"]
    cfg = dataclasses.replace(benchmark.QUICK, shapes=[shape], dtypes=["fp32"], variants=variants)
    table = benchmark.run_experiments(cfg, run, variants, quick=True)

    assert list(table["variant"]) == variants
    levels = table["checkpoint_level"]
    assert levels.isna().tolist() == [True, True, False, False] and levels[2:].tolist() == [0, 1]
    for column in ("forward_time, s", "backward_time, s", "step_time, s", "peak_memory, GB"):
        assert column in table
    assert (table["step_time, s"] > 0).all()
    unit = 2 * shape.tokens * shape.hidden_dim * shape.intermediate_size * shape.num_layers
    records = {r["variant"]: r for r in read_records(tmp_path / "benchmark.jsonl")}
    for variant, gemms in [("reference", 9), ("checkpoint", 11), ("level0", 9), ("level1", 11)]:
        metrics = records[variant]["metrics"]
        assert metrics["gemms_per_layer"] == gemms
        assert metrics["gemm_flops"] == gemms * unit
        assert metrics["peak_gib"] is None  # no allocator statistics on the CPU: not measured
    assert table["peak_memory, GB"].isna().all()
    (summary,) = [r["metrics"] for r in records.values() if r["variant"] == "summary"]
    assert summary["l0/ref mem"] is None and summary["l1/ckpt mem"] is None
    assert summary["l0/ref time"] > 0
    for r in records.values():
        assert not non_finite(r["metrics"]), r["variant"]
