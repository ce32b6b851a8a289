import gzip
import json
import multiprocessing as mp
import os
import warnings

import pytest

from effdl.results import (
    DamagedLastLineWarning,
    ResultsFormatError,
    RunLog,
    append_record,
    find_log,
    load_results,
    make_record,
    read_records,
    results_dir,
)

ENV = {"gpu": None, "torch": "x", "python": "3", "git_sha": "s", "time": "t"}


def test_roundtrip_and_dataframe(tmp_path):
    path = tmp_path / "task" / "a.jsonl"
    for i in range(3):
        append_record(path, make_record("task", f"v{i}", {"bs": i}, {"loss": 1.0 / (i + 1)}, ENV))
    recs = read_records(path)
    assert [r["variant"] for r in recs] == ["v0", "v1", "v2"]
    df = load_results(tmp_path)
    assert list(df["config.bs"]) == [0, 1, 2]
    assert df["metrics.loss"].iloc[2] == pytest.approx(1 / 3)
    assert set(df["source"]) == {"task/a.jsonl"}


def test_nonfinite_and_tensor_values_are_serialised(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "x.jsonl"
    append_record(
        path,
        make_record("t", "v", {"p": tmp_path}, {"a": float("nan"), "b": torch.tensor(2.5)}, ENV),
    )
    rec = read_records(path)[0]
    assert rec["metrics"] == {"a": "nan", "b": 2.5}
    assert rec["config"]["p"] == str(tmp_path)


def test_malformed_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps(make_record("t", "v", {}, {}, ENV))
    path.write_text(good + "\n" + '{"task": "t", "variant"\n' + good + "\n")
    with pytest.raises(ResultsFormatError, match=r"bad\.jsonl:2: not valid JSON"):
        read_records(path)
    with pytest.raises(ResultsFormatError, match=r"bad\.jsonl:2: not valid JSON"):
        load_results(tmp_path)


@pytest.mark.parametrize("tail", ['{"task": "t", "variant"', '{"task": "t", "vari\n', "\x00\x00"])
def test_damaged_last_line_is_skipped_with_a_warning_naming_file_and_line(tmp_path, tail):
    path = tmp_path / "cut.jsonl"
    good = json.dumps(make_record("t", "v", {"i": 1}, {}, ENV))
    path.write_text(good + "\n" + good + "\n" + tail)
    with pytest.warns(DamagedLastLineWarning, match=r"cut\.jsonl:3: not valid JSON.*loaded the 2"):
        df = load_results(tmp_path)
    assert len(df) == 2 and list(df["config.i"]) == [1, 1]


def test_whole_file_loads_without_warning(tmp_path):
    append_record(tmp_path / "ok.jsonl", make_record("t", "v", {}, {}, ENV))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_records(tmp_path / "ok.jsonl")) == 1


def test_short_write_is_truncated_back_leaving_whole_lines(tmp_path, monkeypatch):
    path = tmp_path / "full.jsonl"
    append_record(path, make_record("t", "first", {}, {}, ENV))
    before = path.read_bytes()
    real_write = os.write

    def disk_full(fd, data):  # the kernel writes what fits and returns the count
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(OSError, match=r"short write to .*full\.jsonl") as e:
        append_record(path, make_record("t", "second", {}, {}, ENV))
    monkeypatch.setattr(os, "write", real_write)
    assert e.value.errno == 28  # ENOSPC
    assert path.read_bytes() == before
    append_record(path, make_record("t", "third", {}, {}, ENV))
    assert [r["variant"] for r in read_records(path)] == ["first", "third"]


def test_missing_keys_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"task": "t"}\n')
    with pytest.raises(ResultsFormatError, match=r"bad\.jsonl:1: record lacks keys"):
        read_records(path)
    with pytest.raises(ValueError, match="lacks keys"):
        append_record(path, {"task": "t"})


def test_empty_folder_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run logs"):
        load_results(tmp_path)


def test_runlog_appends_whole_lines(tmp_path):
    log = RunLog(tmp_path / "r.jsonl", task="demo")
    log.log("a", {"k": 1}, {"m": 2})
    log.log("b", {"k": 1}, {"m": 3})
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["task"] == "demo" for line in lines)
    assert json.loads(lines[0])["env"] == log.env


def test_results_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("EFFDL_RESULTS", raising=False)
    assert str(results_dir("fallback")) == "fallback"
    monkeypatch.setenv("EFFDL_RESULTS", str(tmp_path))
    assert results_dir() == tmp_path


def test_environment_describes_this_process(monkeypatch):
    import datetime as dt
    import platform
    import subprocess

    torch = pytest.importorskip("torch")
    from effdl.results import environment

    monkeypatch.delenv("EFFDL_GIT_SHA", raising=False)
    env = environment()
    assert env["torch"] == torch.__version__
    assert env["python"] == platform.python_version()
    assert env["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    assert (env["gpu_id"] is None) == (not torch.cuda.is_available())
    assert env["gpu_id"] == environment()["gpu_id"]  # stable within a machine
    taken = dt.datetime.fromisoformat(env["time"])
    assert abs((dt.datetime.now(dt.timezone.utc) - taken).total_seconds()) < 60
    head = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if head:  # a checkout: the sha is HEAD's, marked when the tree has changes
        assert env["git_sha"].removesuffix("-dirty") == head


def test_environment_records_the_nccl_and_allocator_settings_that_are_set(monkeypatch):
    from effdl.results import environment

    monkeypatch.setenv("NCCL_MAX_CTAS", "8")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCLX_UNRELATED", "1")
    settings = environment()["settings"]
    assert settings["NCCL_MAX_CTAS"] == "8"
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "NCCLX_UNRELATED" not in settings


def test_environment_sha_override(monkeypatch):
    from effdl.results import environment

    monkeypatch.setenv("EFFDL_GIT_SHA", "abc123")
    assert environment()["git_sha"] == "abc123"


def test_runlog_create_probes_the_path_and_leaves_no_empty_file(tmp_path):
    path = tmp_path / "deep" / "r.jsonl"
    log = RunLog(path, task="demo", create=True)
    assert path.parent.is_dir() and not path.exists()
    log.log("v", {}, {"x": 1})
    assert len(read_records(path)) == 1
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError):
        RunLog(blocker / "r.jsonl", task="demo", create=True)
    with pytest.raises(OSError):
        RunLog(tmp_path / "deep", task="demo", create=True)  # a folder where the file goes


def test_two_runs_into_one_log_are_told_apart_by_run_id_and_seed(tmp_path):
    path = tmp_path / "r.jsonl"
    for seed in (0, 1):
        RunLog(path, task="demo", seed=seed).log("same_variant", {}, {"loss": 1.0})
    envs = [r["env"] for r in read_records(path)]
    assert [e["seed"] for e in envs] == [0, 1]
    assert envs[0]["run_id"] != envs[1]["run_id"]


def _append_many(args):
    path, writer = args
    for i in range(100):
        record = make_record("t", f"w{writer}", {"i": i, "pad": "x" * 3000}, {}, ENV)
        append_record(path, record)
    return writer


def test_processes_appending_to_one_log_at_once_leave_only_whole_lines(tmp_path):
    """Two runs given the same --out: each record is one O_APPEND write, so none interleave."""
    path = tmp_path / "shared.jsonl"
    with mp.get_context("fork").Pool(4) as pool:
        pool.map(_append_many, [(path, w) for w in range(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = read_records(path)
    assert len(records) == 400
    for w in range(4):
        mine = [r["config"]["i"] for r in records if r["variant"] == f"w{w}"]
        assert mine == list(range(100))


def test_logs_without_records_are_an_error_not_an_empty_table(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="hold no records"):
        load_results(tmp_path)


def test_gzipped_logs_are_read_where_their_plain_name_is_given(tmp_path):
    plain = tmp_path / "a.jsonl"
    append_record(plain, make_record("t", "v", {"x": 1}, {"y": 2.0}, ENV))
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_records(gz) == read_records(plain)
    assert find_log(tmp_path / "b.jsonl") == gz and find_log(plain) == plain
    df = load_results(tmp_path, "b.jsonl")  # the pattern finds the compressed log
    assert list(df["source"]) == ["b.jsonl.gz"]
    assert sorted(load_results(tmp_path)["source"]) == ["a.jsonl", "b.jsonl.gz"]


@pytest.mark.parametrize("name", ["log.jsonl", "log.jsonl.gz"])
def test_a_log_that_is_not_text_is_a_format_error_naming_the_file(tmp_path, name):
    """Random bytes where a run log is expected (or a gzip cut short): ResultsFormatError naming
    the file, from read_records and load_results alike."""
    path = tmp_path / "task" / name
    path.parent.mkdir()
    if name.endswith(".gz"):
        whole = gzip.compress(b'{"a": 1}\n' * 1000)
        path.write_bytes(whole[: len(whole) // 2])
    else:
        path.write_bytes(bytes(range(128, 256)) * 8)
    with pytest.raises(ResultsFormatError, match=rf"{name}: not a JSONL run log"):
        read_records(path)
    with pytest.raises(ResultsFormatError, match=rf"{name}: not a JSONL run log"):
        load_results(tmp_path)


def test_device_name_falls_back_to_the_cpu_never_none():
    import pandas as pd

    from effdl.results import device_name, on_gpu

    assert device_name({"gpu": "NVIDIA H100 80GB HBM3", "cpu": "x86_64"}) == "NVIDIA H100 80GB HBM3"
    assert device_name({"gpu": None, "cpu": "x86_64"}) == "CPU (x86_64)"
    assert device_name({"gpu": None}) == "CPU"
    # a row of load_results: flattened keys, a missing GPU read back as NaN
    row = pd.Series({"env.gpu": float("nan"), "env.cpu": "aarch64"})
    assert device_name(row) == "CPU (aarch64)"
    assert device_name(pd.Series({"env.gpu": "Test GPU", "env.cpu": "x"})) == "Test GPU"
    assert not on_gpu(row) and on_gpu({"gpu": "Test GPU"})
    assert "None" not in device_name({"gpu": None, "cpu": None})
