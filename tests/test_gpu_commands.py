"""The GPU command list (tools/gpu_commands.py) against the READMEs and the scripts' own
parsers, and the check's runner (tools/gpu_check.py) on the CPU."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from effdl.results import RunLog
from tests.script_loading import ROOT, load_script

commands = load_script("tools", "gpu_commands")
check = load_script("tools", "gpu_check")
COMMANDS = commands.COMMANDS
FOLDERS = {"out": "/tmp/gpu-check/out", "run": "/tmp/gpu-check", "cache": "/tmp/gpu-check/cache"}


def words_of(line: str) -> list[str]:
    return shlex.split(line.split("   # ")[0].format(**FOLDERS))


def launcher(words: list[str]) -> list[str]:
    """What starts the script: ``python3`` or ``torchrun`` with its own flags."""
    return words[: next(i for i, w in enumerate(words) if w.endswith(".py"))]


def test_readme_blocks_are_generated_from_the_list():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert commands.render_readme(text) == text, "run: python3 tools/gpu_commands.py --write-readme"


def test_other_readmes_show_their_commands_verbatim():
    for c in COMMANDS:
        if c.readme != "README.md":
            lines = (ROOT / c.readme).read_text(encoding="utf-8").splitlines()
            assert c.command in [line.split("#")[0].strip() for line in lines], c.name


def normalized(line: str) -> tuple[str, ...]:
    """A command without its comment, ``--out`` and the python spelling."""
    words = shlex.split(line.split("#")[0])
    words[0] = "python" if words[0] == "python3" else words[0]
    if "--out" in words:
        i = words.index("--out")
        del words[i : i + 2]
    return tuple(words)


def test_every_gpu_line_of_lm_training_readme_is_listed():
    listed = {normalized(c.command) for c in COMMANDS}
    text = (ROOT / "lm_training" / "README.md").read_text(encoding="utf-8")
    for line in text.splitlines():
        gpu = line.startswith(("python ", "torchrun ")) and "--quick" not in line
        if gpu and "data_deliverables.py" not in line:  # the data answers run on the CPU
            assert normalized(line) in listed, line


def test_names_are_unique_and_dependencies_come_first():
    names = [c.name for c in COMMANDS]
    assert len(set(names)) == len(names)
    for i, c in enumerate(COMMANDS):
        assert c.after is None or c.after in names[:i], c.name


@pytest.mark.parametrize("c", COMMANDS, ids=lambda c: c.name)
def test_short_form_runs_the_same_script(c):
    full, short = words_of(c.command), words_of(c.check)
    assert (ROOT / c.script).is_file()
    assert short[len(launcher(short))] == c.script
    if full[0] == "torchrun":
        assert launcher(short) == ["torchrun", "--nproc-per-node", "2"]
        assert c.min_gpus == 2
    else:
        assert launcher(short) == ["python3"]
        assert c.min_gpus == 1
    if c.headline is not None:
        assert short[short.index("--out") + 1] == FOLDERS["out"], "the log goes to {out}"
    assert 0 < c.limit_s <= 120


class Parsed(Exception):
    """Raised by the patched parser once it has parsed: nothing after the parse runs."""


@pytest.mark.parametrize("c", COMMANDS, ids=lambda c: c.name)
def test_short_form_parses_with_the_scripts_parser(c, monkeypatch, capsys):
    short = words_of(c.check)
    args = short[len(launcher(short)) + 1 :]
    folder, name = c.script.rsplit("/", 1)
    script = load_script(folder, name.removesuffix(".py"))
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [str(ROOT / c.script), *args])
    try:
        script.main()
    except SystemExit:
        pytest.fail(f"{c.name}: {capsys.readouterr().err.strip()}")
    except Parsed:
        return
    pytest.fail(f"{c.name}: main() returned without parsing its arguments")


# -- the runner


def test_argv_runs_python_and_torchrun_with_this_python(tmp_path):
    argv = check.argv_of("python3 a.py --out {out}", {"out": tmp_path})
    assert argv == [sys.executable, "a.py", "--out", str(tmp_path)]
    argv = check.argv_of("torchrun --nproc-per-node 2 a.py", {})
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "a.py"]


def test_child_environment_has_the_repo_and_multicast_off(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = check.child_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"]
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"


def test_headline_is_the_last_matching_record(tmp_path):
    log = RunLog(tmp_path / "sub" / "a.jsonl", task="t")
    log.log("run", {}, {"step_s": 0.5})
    log.log("run_summary", {}, {"step_s": 0.25, "other": 1})
    log.log("run_summary", {}, {"step_s": 0.125})
    log.log("run_summary", {}, {"step_s": None})
    headline = commands.Headline("*_summary", "step_s", "ms", 1e3)
    assert check.read_headline(tmp_path, headline) == 125.0
    assert check.read_headline(tmp_path, commands.Headline("x", "step_s", "ms")) is None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_timeout_kills_the_command_and_what_it_started(tmp_path):
    # The child starts a grandchild in a session of its own, as torchrun starts its ranks.
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    argv = [sys.executable, "-c", code]
    exit_code, seconds = check.run_process(argv, 3, tmp_path / "out.log")
    assert exit_code is None and seconds < 3 + check.KILL_GRACE_S
    grandchild = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)


def test_exit_code_and_output_of_a_finished_command(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('hello'); sys.exit(3)"]
    exit_code, _ = check.run_process(argv, 30, tmp_path / "out.log")
    assert exit_code == 3
    assert (tmp_path / "out.log").read_text() == "hello\n"


def test_skips_for_gpus_budget_dependency_and_optional_modules():
    c = commands.GpuCommand("x", "python3 a.py", "python3 a.py", 60, None, min_gpus=2)
    assert check.skip_reason(c, 1, 480, {}) == "needs 2 GPUs"
    assert check.skip_reason(c, 2, 29, {}).startswith(f"{check.BUDGET_NOTE}: half its limit, 30 s")
    assert check.skip_reason(c, 2, 30, {}) == ""
    after = commands.GpuCommand("y", "python3 a.py", "python3 a.py", 1, None, after="x")
    assert check.skip_reason(after, 1, 480, {}) == "needs x to pass first"
    done = {"x": check.Outcome("x", "failed", 1)}
    assert check.skip_reason(after, 1, 480, done) == "needs x to pass first"
    done = {"x": check.Outcome("x", "ok", 0)}
    assert check.skip_reason(after, 1, 480, done) == ""
    optional = commands.GpuCommand("z", "python3 a.py", "python3 a.py", 1, None,
                                   requires=("no_such_module_here",))  # fmt: skip
    assert check.skip_reason(optional, 1, 480, {}) == "no module no_such_module_here"


FAKE = """import json, sys, time
from pathlib import Path
from effdl.results import RunLog
out, what = Path(sys.argv[2]), sys.argv[3]
if what == "ok":
    RunLog(out / "fake.jsonl", task="fake").log("fake_summary", {}, {"step_s": 0.002})
if what == "fail":
    sys.exit(3)
if what == "hang":
    time.sleep(60)
"""


def test_a_check_runs_records_and_fails_on_a_failure(tmp_path, monkeypatch, capsys):
    (tmp_path / "fake.py").write_text(FAKE)
    fake = f"python3 {tmp_path / 'fake.py'} --out {{out}}"
    step_ms = commands.Headline("*_summary", "step_s", "ms", 1e3)
    listed = [
        commands.GpuCommand("ok", "python3 fake.py", f"{fake} ok", 30, step_ms),
        commands.GpuCommand("fail", "python3 fake.py", f"{fake} fail", 30, step_ms),
        commands.GpuCommand("hang", "python3 fake.py", f"{fake} hang", 1, None),
        commands.GpuCommand("two", "python3 fake.py", f"{fake} ok", 1, None, min_gpus=2),
        commands.GpuCommand("late", "python3 fake.py", f"{fake} ok", 1000, None),
    ]
    monkeypatch.setattr(check, "COMMANDS", listed)
    monkeypatch.setattr(check.torch.cuda, "device_count", lambda: 1)
    assert (
        check.main(["--out", str(tmp_path / "acceptance"), "--budget-s", "100", "--per-gpu", "1"])
        == 1
    )
    (log,) = (tmp_path / "acceptance").glob("*/gpu_check.jsonl")
    records = {r["variant"]: r["metrics"] for r in map(json.loads, log.read_text().splitlines())}
    total = records.pop("total")
    assert {k: r["status"] for k, r in records.items()} == {
        "ok": "ok", "fail": "failed", "hang": "timeout", "two": "skipped", "late": "not-run"
    }  # fmt: skip
    assert records["ok"]["headline"] == 2.0 and records["ok"]["headline_unit"] == "ms"
    assert records["fail"]["exit_code"] == 3 and records["fail"]["headline"] is None
    assert records["two"]["note"] == "needs 2 GPUs"
    assert {k: total[k] for k in ("ok", "failed", "timeout", "skipped", "not-run")} == {
        "ok": 1, "failed": 1, "timeout": 1, "skipped": 1, "not-run": 1
    }  # fmt: skip
    assert total["seconds"] >= records["hang"]["seconds"]
    assert (
        "1 passed, 2 failed or timed out, 1 skipped, 1 not run (budget)" in capsys.readouterr().out
    )


def test_without_a_budget_every_command_runs_and_a_budget_cut_fails_the_check(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "fake.py").write_text(FAKE)
    fake = f"python3 {tmp_path / 'fake.py'} --out {{out}}"
    listed = [commands.GpuCommand("late", "python3 fake.py", f"{fake} ok", 1000, None)]
    monkeypatch.setattr(check, "COMMANDS", listed)
    monkeypatch.setattr(check.torch.cuda, "device_count", lambda: 1)
    assert check.main(["--out", str(tmp_path / "whole"), "--per-gpu", "1"]) == 0
    assert check.main(["--out", str(tmp_path / "cut"), "--per-gpu", "1", "--budget-s", "100"]) == 1
    for out, status in (("whole", "ok"), ("cut", "not-run")):
        (log,) = (tmp_path / out).glob("*/gpu_check.jsonl")
        late, total = map(json.loads, log.read_text().splitlines())
        assert late["metrics"]["status"] == status and total["variant"] == "total"
    assert (
        "0 passed, 0 failed or timed out, 0 skipped, 1 not run (budget)" in capsys.readouterr().out
    )


def test_list_prints_every_command_and_the_sums(capsys):
    assert check.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(c.name in out for c in COMMANDS)
    assert "sum of limits with 1 GPU:" in out and "sum of limits with 2 GPUs:" in out


@pytest.mark.skipif(
    check.torch.cuda.is_available(), reason="the refusal is for a host without CUDA"
)
def test_refuses_to_run_without_a_gpu(tmp_path, capsys):
    assert check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_lanes_get_equal_disjoint_shares_of_the_cpus(monkeypatch):
    monkeypatch.setattr(check.os, "sched_getaffinity", lambda pid: set(range(2, 18)))
    shares = check.lane_cpus(4)
    assert [len(s) for s in shares] == [4, 4, 4, 4]
    assert set().union(*shares) == set(range(2, 18)) and sum(map(len, shares)) == 16
    monkeypatch.setattr(check.os, "sched_getaffinity", lambda pid: {0})
    assert check.lane_cpus(2) == [{0}, {0}]  # fewer CPUs than lanes: they share


def test_records_carry_the_outcome(tmp_path):
    log = RunLog(tmp_path / "gpu_check.jsonl", task="gpu_check")
    outcome = check.Outcome("x", "ok", 0, 1.5, 123.0, "tokens/s")
    check.record(log, outcome, {"command": "python3 a.py", "limit_s": 10, "gpus": 1})
    (rec,) = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert rec["task"] == "gpu_check" and rec["variant"] == "x"
    assert rec["metrics"]["status"] == "ok" and rec["metrics"]["headline"] == 123.0
    assert {"gpu", "gpu_id", "git_sha"} <= set(rec["env"])


def test_makefile_target_runs_the_check_with_the_system_python():
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    (line,) = [line for line in text.splitlines() if line.startswith("gpu-check:")]
    assert "$(STAMP)" not in line
    assert "tools/gpu_check.py" in text


def test_gpu_commands_prints_the_readme_lines():
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_commands.py")],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert run.stdout.splitlines() == [commands.readme_line(c) for c in COMMANDS]


def test_only_takes_several_substrings():
    names = [c.name for c in check.selected(["gpt2-xl-base", "vit-train"])]
    assert names == ["vit-train", "gpt2-xl-baseline"]
    assert len(check.selected(None)) == len(COMMANDS)


LANE_FAKE = """import os, sys, time
from pathlib import Path
out, name = Path(sys.argv[2]), sys.argv[3]
if name == "reader":
    assert (out.parent / "writer" / "done").exists(), "ran before the command it reads from"
begin = time.time()
time.sleep(0.5 if name == "writer" else 0.3)
out.mkdir(parents=True)
device = os.environ.get("CUDA_VISIBLE_DEVICES", "-")
cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
(out / "done").write_text(f"{device} {begin} {time.time()} {cpus}")
"""


def test_one_gpu_commands_share_the_gpus_in_lanes(tmp_path, monkeypatch):
    (tmp_path / "lane.py").write_text(LANE_FAKE)
    fake = f"python3 {tmp_path / 'lane.py'} --out {{out}}"
    listed = [
        commands.GpuCommand("writer", "python3 a.py", f"{fake} writer", 30, None),
        commands.GpuCommand("reader", "python3 a.py", f"{fake} reader", 30, None, after="writer"),
        *(commands.GpuCommand(f"c{i}", "python3 a.py", f"{fake} c{i}", 30, None) for i in range(3)),
    ]
    monkeypatch.setattr(check, "COMMANDS", listed)
    monkeypatch.setattr(check.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert check.main(["--out", str(tmp_path / "acceptance"), "--per-gpu", "1"]) == 0
    (run_dir,) = (tmp_path / "acceptance").glob("2*")
    lanes = {c.name: (run_dir / c.name / "done").read_text().split()[0] for c in listed}
    assert set(lanes.values()) == {"4", "6"}  # each command saw one GPU, both lanes were used
    (log,) = run_dir.glob("gpu_check.jsonl")
    *records, total = [json.loads(line) for line in log.read_text().splitlines()]
    assert total["variant"] == "total"
    assert {r["variant"]: r["config"]["device"] for r in records} == lanes


def test_commands_share_a_gpu_and_an_exclusive_one_runs_alone(tmp_path, monkeypatch):
    (tmp_path / "lane.py").write_text(LANE_FAKE)
    fake = f"python3 {tmp_path / 'lane.py'} --out {{out}}"
    listed = [
        *(commands.GpuCommand(f"a{i}", "python3 a.py", f"{fake} a{i}", 30, None) for i in range(3)),
        commands.GpuCommand("big", "python3 a.py", f"{fake} big", 30, None, exclusive=True),
        *(commands.GpuCommand(f"b{i}", "python3 a.py", f"{fake} b{i}", 30, None) for i in range(3)),
    ]
    monkeypatch.setattr(check, "COMMANDS", listed)
    monkeypatch.setattr(check.torch.cuda, "device_count", lambda: 1)
    assert check.main(["--out", str(tmp_path / "acceptance"), "--per-gpu", "2"]) == 0
    (run_dir,) = (tmp_path / "acceptance").glob("2*")
    spans, cpus = {}, {}
    for c in listed:
        _, begin, end, on = (run_dir / c.name / "done").read_text().split()
        spans[c.name], cpus[c.name] = (float(begin), float(end)), set(on.split(","))

    def overlap(x: str, y: str) -> bool:
        return spans[x][0] < spans[y][1] and spans[y][0] < spans[x][1]

    others = [n for n in spans if n != "big"]
    assert not any(overlap("big", n) for n in others)  # the exclusive one had the GPU alone
    pairs = [(x, y) for x in others for y in others if x < y and overlap(x, y)]
    assert pairs  # the others shared it
    if len(check.os.sched_getaffinity(0)) >= 2:  # side by side, on CPUs of their own
        assert all(not cpus[x] & cpus[y] for x, y in pairs)
    assert cpus["big"] == set().union(*cpus.values())  # the exclusive one: both shares
    for t in spans.values():  # never more than two at once
        assert sum(s[0] <= t[0] < s[1] for s in spans.values()) <= 2
