import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import effdl.cli as cli
from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    device_from_arg,
    format_table,
    require_choices,
    require_path,
    require_positive,
    require_processes,
    resolve_device,
    seed_arg,
    start_run,
)
from effdl.results import read_records
from effdl.tables import format_measured

ROOT = Path(__file__).resolve().parent.parent


def test_format_table_aligns_union_of_columns():
    text = format_table([{"a": 1, "b": 0.123456}, {"a": 22, "c": "x"}])
    lines = text.splitlines()
    assert lines[0].split() == ["a", "b", "c"]
    assert "0.1235" in lines[2]
    assert len({len(line) for line in lines}) == 1


def test_a_value_not_measured_is_shown_as_a_dash_in_text_and_blank_in_a_table():
    assert format_measured(1.23456) == "1.235" and format_measured(0.5, ".1%") == "50.0%"
    assert format_measured(None) == "-"
    assert format_measured(float("nan")) == "nan"  # a computed NaN is not hidden
    lines = format_table([{"a": 1, "peak": None}, {"a": 2, "peak": 0.5}]).splitlines()
    assert lines[2].split() == ["1"] and lines[3].split() == ["2", "0.5"]


def test_require_path_names_flag_and_expectation(tmp_path):
    with pytest.raises(
        UsageError, match=r"--data: .* does not exist \(expected a folder of jpgs\)"
    ):
        require_path(tmp_path / "nope", "a folder of jpgs", "--data")


def test_device_from_arg_rejects_garbage():
    with pytest.raises(UsageError, match="--device"):
        device_from_arg("tpu:banana")


def test_require_cuda_refuses_a_cpu_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=r"^the probe needs CUDA; this machine has none$"):
        cli.require_cuda("auto", "the probe")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UsageError, match=r"^--device cpu: the probe needs CUDA$"):
        cli.require_cuda("cpu", "the probe")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
def test_resolve_device_gives_cuda_an_index():
    assert resolve_device("cuda").index == torch.cuda.current_device()
    assert resolve_device("auto").index == torch.cuda.current_device()


@dataclass
class DemoConfig:
    batch_size: int = 32
    lr: float = 3e-4
    ks: list[int] = field(default_factory=lambda: [1, 5])
    mode: str = "a"

    def validate(self) -> None:
        require_positive(self, "batch_size", "ks")
        require_positive(self, "lr", minimum=0)
        require_choices(self, "mode", ["a", "b"])


def demo_flags() -> tuple[argparse.ArgumentParser, ConfigFlags]:
    p = base_parser("demo", default_out="runs/demo")
    flags = ConfigFlags(p, DemoConfig(), DemoConfig(batch_size=4, ks=[1]))
    flags.add("batch_size", type=int, help="rows")
    flags.add("lr", type=float)
    flags.add("ks", type=int, nargs="+")
    flags.add("mode")
    return p, flags


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], DemoConfig()),
        (["--quick"], DemoConfig(batch_size=4, ks=[1])),
        # a flag the user gives wins over the quick preset, which only sets defaults
        (["--quick", "--batch-size", "7"], DemoConfig(batch_size=7, ks=[1])),
        (["--lr", "0.1", "--ks", "2", "3"], DemoConfig(lr=0.1, ks=[2, 3])),
    ],
)
def test_config_flags_override_only_given_fields(argv, expected):
    p, flags = demo_flags()
    assert flags.resolve(p.parse_args(argv)) == expected


def test_config_flags_help_shows_both_presets():
    p, _ = demo_flags()
    text = p.format_help()
    assert "rows (default 32; --quick 4)" in text
    assert "(default 0.0003)" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "0"], r"--batch-size must be >= 1, got 0"),
        (["--quick", "--ks", "1", "0"], r"--ks must be >= 1, got 0"),
        (["--lr", "nan"], r"--lr must be >= 0, got nan"),
        (["--mode", "c"], r"--mode: unknown \['c'\]; expected one of \['a', 'b'\]"),
    ],
)
def test_config_flags_validate_once_naming_the_flag(argv, message):
    p, flags = demo_flags()
    with pytest.raises(UsageError, match=message):
        flags.resolve(p.parse_args(argv))


def test_config_flags_refuse_a_field_the_config_lacks():
    p = base_parser("demo", default_out="runs/demo")
    with pytest.raises(ValueError, match="no field 'bogus'"):
        ConfigFlags(p, DemoConfig()).add("bogus")


def test_start_run_opens_logs_and_picks_the_cpu_under_quick(tmp_path):
    args = base_parser("demo", default_out="x").parse_args(
        ["--quick", "--out", str(tmp_path / "o"), "--seed", "5"]
    )
    run = start_run(args, "demo", ["a.jsonl", "b.jsonl"])
    assert run.device == torch.device("cpu")
    assert set(run.logs) == {"a", "b"} and run.log is run.logs["a"]
    assert (tmp_path / "o").is_dir() and not list((tmp_path / "o").iterdir())  # no empty logs
    assert torch.initial_seed() == 5
    run.log.log("v", {}, {"m": 1})
    run.logs["b"].log("w", {}, {"m": 2})
    (a,), (b,) = read_records(tmp_path / "o" / "a.jsonl"), read_records(tmp_path / "o" / "b.jsonl")
    assert a["task"] == "demo" and a["env"]["seed"] == 5
    assert a["env"]["run_id"] == b["env"]["run_id"] == run.run_id


def _existing_file(tmp_path):
    (tmp_path / "file").write_text("x")
    return tmp_path / "file", r"file/a\.jsonl \((File exists|Not a directory)\)"


def _log_path_is_a_folder(tmp_path):
    (tmp_path / "o" / "a.jsonl").mkdir(parents=True)
    return tmp_path / "o", r"o/a\.jsonl \(Is a directory\)"


def _under_proc(tmp_path):
    return Path("/proc/effdl-out"), r"/proc/effdl-out/a\.jsonl \(No such file or directory\)"


@pytest.mark.parametrize("where", [_existing_file, _log_path_is_a_folder, _under_proc])
def test_start_run_refuses_an_unwritable_out_before_any_work(tmp_path, where):
    out, message = where(tmp_path)
    args = base_parser("demo", default_out="x").parse_args(["--out", str(out)])
    with pytest.raises(UsageError, match=rf"--out: cannot write .*{message}"):
        start_run(args, "demo", "a.jsonl")


def test_run_id_carries_the_process_id(tmp_path):
    """Two processes started in the same second get different run ids."""
    args = base_parser("demo", default_out="x").parse_args(["--out", str(tmp_path)])
    assert f"-{os.getpid()}-" in start_run(args, "demo", "a.jsonl").run_id


@pytest.mark.parametrize(
    ("text", "message"),
    [("-1", r"must be in \[0, 2\*\*32 - 1\], got -1"),
     ("4294967296", r"must be in \[0, 2\*\*32 - 1\], got 4294967296"),
     ("1e20", "expected an integer, got '1e20'")],
)  # fmt: skip
def test_seed_out_of_range_is_refused(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        seed_arg(text)
    assert seed_arg("4294967295") == 2**32 - 1


def run_script(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "swiglu_checkpoint" / "gpu_ceilings.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_example_script_quick_run_writes_log(tmp_path):
    """The quick preset (3 timed calls, a 1/16 GiB copy), the given flags over it, and records
    whose numbers agree with their own timings."""
    res = run_script(
        "--quick", "--device", "cpu", "--dtypes", "fp32", "--sizes", "64", "--out", str(tmp_path)
    )
    assert res.returncode == 0, res.stderr
    matmul, copy = read_records(tmp_path / "ceilings.jsonl")
    assert (matmul["variant"], copy["variant"]) == ("matmul_fp32", "copy")
    assert matmul["config"] == {"op": "matmul", "dtype": "fp32", "n": 64, "device": "cpu"}
    assert matmul["metrics"]["time_s_n"] == copy["metrics"]["time_s_n"] == 3
    flops = 2 * 64**3
    assert matmul["metrics"]["tflops"] == pytest.approx(
        flops / matmul["metrics"]["time_s_median"] / 1e12
    )
    assert copy["config"]["bytes"] == 2**30 // 16
    assert copy["metrics"]["gb_per_s"] == pytest.approx(
        2 * 2**30 // 16 / copy["metrics"]["time_s_median"] / 1e9
    )
    table = res.stdout[res.stdout.index("Ceilings on") :]
    assert "matmul fp32" in table and "d2d copy (r+w)" in table


def test_example_script_bad_argument_is_one_line_without_traceback(tmp_path):
    res = run_script("--quick", "--dtypes", "fp8", "--out", str(tmp_path))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0
    assert "--dtypes" in res.stderr and "fp8" in res.stderr
    assert not (tmp_path / "ceilings.jsonl").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--seed", "-1"], "argument --seed: must be in [0, 2**32 - 1], got -1"),
     (["--out", "/proc/effdl-out"], "--out: cannot write /proc/effdl-out/ceilings.jsonl")],
)  # fmt: skip
def test_example_script_refuses_bad_seed_and_out_before_any_work(tmp_path, flags, message):
    res = run_script("--quick", "--device", "cpu", "--out", str(tmp_path), *flags)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and not res.stdout.strip()
    *usage, last = res.stderr.strip().splitlines()
    assert message in last
    assert all(u.startswith(("usage:", " ")) for u in usage)  # only argparse's usage before it
    assert not (tmp_path / "ceilings.jsonl").exists()


def test_require_memory_names_the_flag_and_what_needs_it():
    from effdl.cli import UsageError, require_memory

    require_memory("--n 1", 1.0, "cpu")  # a byte fits
    with pytest.raises(UsageError, match=r"^--n 9: the batch needs at least .* GiB, the host has "):
        require_memory("--n 9", 2.0**70, "cpu", what="the batch")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (10**12, r"^--workers 1000000000000: at most \d+ processes or threads on this machine"),
        (-1, r"^--workers must be >= 0, got -1$"),
        (2.5, r"^--workers: expected an integer, got 2.5$"),
    ],
)
def test_require_processes_caps_a_count_by_the_cores(value, message):
    @dataclass
    class Demo:
        workers: object = 0

    with pytest.raises(UsageError, match=message):
        require_processes(Demo(value), "workers")
    for fine in (0, None, "auto", cli.process_cap(), [1, 2]):
        require_processes(Demo(fine), "workers")
    assert cli.process_cap() >= cli.MIN_PROCESS_CAP


@pytest.mark.parametrize(
    ("script", "flag"),
    [
        ("memory_efficient_gpt2/pipeline_parallel.py", "--stages"),
        ("memory_efficient_gpt2/tensor_parallel.py", "--world-size"),
        ("task2_batching/train_pipelines.py", "--workers"),
    ],
)
def test_a_process_count_past_the_cap_is_refused_before_any_process_starts(tmp_path, script, flag):
    """A thousand ranks or loader workers is a fork bomb: refused in one line, nothing written."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / script), "--quick", "--device", "cpu", "--out", str(out),
         flag, "1000"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"{flag} 1000: at most" in line
    assert not out.exists()


def test_a_failed_check_is_one_line_on_stderr_and_exit_code_1(monkeypatch, capsys):
    from effdl.cli import check_failed, run_main

    monkeypatch.setattr(sys, "argv", ["script.py"])
    with pytest.raises(SystemExit) as e:
        run_main(lambda: check_failed("the gap\n  is 0.2 nats"))
    assert e.value.code == 1
    assert capsys.readouterr() == ("", "script.py: failed: the gap is 0.2 nats\n")


def test_running_out_of_device_memory_is_one_line_and_exit_code_1(monkeypatch, capsys):
    from effdl.cli import run_main

    def outgrows():
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB"
            "\nof which 1.5 GiB is free."
        )

    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as e:
        run_main(outgrows)
    assert e.value.code == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "train.py: error: out of device memory (CUDA out of memory. Tried to allocate 2.00 GiB); "
        "a smaller batch, sequence or "
        "model fits"
    ]
