"""swiglu_checkpoint/benchmark.py refuses what it cannot run in one line (exit 2), no records."""

import sys

import pytest

from effdl.cli import run_main
from effdl.results import read_records
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
