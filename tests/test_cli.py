import subprocess
import sys
from pathlib import Path

import pytest

from effdl.cli import UsageError, device_from_arg, format_table, require_path
from effdl.results import read_records

ROOT = Path(__file__).resolve().parent.parent


def test_format_table_aligns_union_of_columns():
    text = format_table([{"a": 1, "b": 0.123456}, {"a": 22, "c": "x"}])
    lines = text.splitlines()
    assert lines[0].split() == ["a", "b", "c"]
    assert "0.1235" in lines[2]
    assert len({len(line) for line in lines}) == 1


def test_require_path_names_flag_and_expectation(tmp_path):
    with pytest.raises(
        UsageError, match=r"--data: .* does not exist \(expected a folder of jpgs\)"
    ):
        require_path(tmp_path / "nope", "a folder of jpgs", "--data")


def test_device_from_arg_rejects_garbage():
    with pytest.raises(UsageError, match="--device"):
        device_from_arg("tpu:banana")


def run_script(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "swiglu_checkpoint" / "gpu_ceilings.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_example_script_quick_run_writes_log(tmp_path):
    res = run_script(
        "--quick", "--device", "cpu", "--dtypes", "fp32", "--sizes", "64", "--out", str(tmp_path)
    )
    assert res.returncode == 0, res.stderr
    recs = read_records(tmp_path / "ceilings.jsonl")
    assert [r["variant"] for r in recs] == ["matmul_fp32", "copy"]
    assert recs[0]["metrics"]["tflops"] > 0
    assert "TFLOP/s" in res.stdout.splitlines()[-2] or "TFLOP/s" in res.stdout


def test_example_script_bad_argument_is_one_line_without_traceback(tmp_path):
    res = run_script("--quick", "--dtypes", "fp8", "--out", str(tmp_path))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0
    assert "--dtypes" in res.stderr and "fp8" in res.stderr
    assert not (tmp_path / "ceilings.jsonl").exists()
