"""Hostile command-line input, as a class: every task script's flags, enumerated from the
ConfigFlags that binds them, each given values a user should not give (zero, negative, huge,
NaN, infinite, unknown choices, missing or mistyped paths, unwritable output folders, random
bytes or a truncated file as data).

A refused value must end the run with exit code 2 and one line on stderr naming the flag (or
the file), no traceback, and no file left in ``--out``. An accepted value must pass the script's
argument validation only (the run itself is not started), except for data files and huge sizes:
those runs go on until their first record, whose numbers must be finite, or are skipped when too
slow; a huge size (10**12 of a batch, a length, a width) must be refused before any allocation.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

import effdl.cli as cli
from effdl.results import RunLog
from tests.log_values import non_finite_in_last_record
from tests.script_loading import ROOT, load_script

TASK_FOLDERS = ("task1_loss_scaling", "task2_batching", "task3_vit_profiling",
                "memory_efficient_gpt2", "swiglu_checkpoint", "lm_training")  # fmt: skip
BASE_ARGV = ["--quick", "--device", "cpu"]
RUN_BUDGET_S = 20  # an accepted data file whose run reaches no record by then is skipped
HUGE_INT = str(10**12)
INT_VALUES = ("0", "-1", HUGE_INT)
FLOAT_VALUES = ("0", "-1", "nan", "inf", "1e308")
TEXT_VALUES = ("bogus", "0", "-1", "nan", HUGE_INT)
# Fields that size an allocation: 10**12 of them must be refused before anything is allocated.
# (Caps such as --max-images or --max-vocab, totals such as --token-budget, chunk sizes and
# offsets may take any size.)
SIZE_FIELDS = frozenset({
    "batch", "batch_size", "micro_batch", "bench_batch", "long_micro_batch_size",
    "timing_batch_sizes", "seq", "sequence_length", "max_length", "hidden", "d_model", "d_ff",
    "bench_width", "vocab_size", "synthetic_vocab", "size", "sizes", "n_samples", "ns",
    "tokens_per_step", "max_tokens", "max_side", "shapes", "configs",
})  # fmt: skip


class Accepted(Exception):
    """The value passed the validation step (or the run reached its first record)."""


class TooSlow(Exception):
    """An accepted data file's run did not reach a record within the budget."""


@dataclass(frozen=True)
class Case:
    script: str
    flag: str
    value: str  # what the user typed, or a name of a prepared path (see Paths)
    kind: str  # "int", "float", "text", "output", "input"
    size_flag: bool = False

    @property
    def runs(self) -> bool:
        """Data file and huge size cases run past the validation, up to the first record (a
        size may be checked against the device's memory once the device is known)."""
        huge = self.size_flag and self.value == HUGE_INT
        return huge or (self.kind == "input" and self.value in ("random-bytes", "truncated"))


def task_scripts() -> list[str]:
    """Every script of the task folders (their probes included) with a ``run_main`` entry."""
    found = []
    for folder in TASK_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "run_main(main)" in path.read_text(encoding="utf-8"):
                found.append(str(path.relative_to(ROOT)))
    return found


def load(script: str) -> ModuleType:
    folder, name = script.rsplit("/", 1)
    return load_script(folder, name.removesuffix(".py"))


def discover(module: ModuleType, script: str, monkeypatch) -> cli.ConfigFlags | None:
    """The ConfigFlags the script parses its command line with (None: it uses none)."""
    seen = []

    def stop(self, args):
        seen.append(self)
        raise Accepted

    with monkeypatch.context() as m:
        m.setattr(cli.ConfigFlags, "resolve", stop)
        m.setattr(sys, "argv", [Path(script).name, *BASE_ARGV])
        with contextlib.suppress(Accepted, SystemExit, cli.UsageError):  # refused here anyway
            module.main()
    return seen[0] if seen else None


def is_size_flag(field: str) -> bool:
    return field in SIZE_FIELDS


def cases_of(script: str, flags: cli.ConfigFlags) -> list[Case]:
    cases = [Case(script, "--seed", v, "text") for v in ("-1", HUGE_INT, "nan")]
    cases += [Case(script, "--out", v, "output") for v in ("a-file", "read-only")]
    for b in flags.bound:
        kw = b.options
        if "action" in kw:  # switches take no value
            continue
        kind_type = kw.get("type")
        if b.output:
            cases += [Case(script, b.flag, v, "output") for v in ("a-file", "read-only")]
        elif kind_type is Path:
            values = ("missing", "empty-folder", "random-bytes", "truncated")
            cases += [Case(script, b.flag, v, "input") for v in values]
        elif kind_type is int or kind_type is cli.int_or_auto:
            cases += [Case(script, b.flag, v, "int", is_size_flag(b.field)) for v in INT_VALUES]
        elif kind_type is float:
            cases += [Case(script, b.flag, v, "float") for v in FLOAT_VALUES]
        else:  # a choice, a string, or a script's own parser
            values = ("bogus",) if "choices" in kw else TEXT_VALUES
            cases += [
                Case(script, b.flag, v, "text", is_size_flag(b.field) and v == HUGE_INT)
                for v in values
            ]
    return cases


class Paths:
    """The prepared paths a case's value names."""

    def __init__(self, root: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.file = root / "a-file.txt"
        self.file.write_text("not a folder\n")
        self.read_only = root / "read-only"
        self.read_only.mkdir()
        self.read_only.chmod(0o500)
        self.empty = root / "empty-folder"
        self.empty.mkdir()
        self.random = root / "random.bin"
        self.random.write_bytes(random.Random(0).randbytes(4096))
        whole = root / "whole.parquet"
        pq.write_table(pa.table({"text": [f"line {i} of some text" for i in range(200)]}), whole)
        self.truncated = root / "truncated.parquet"
        self.truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])

    def value(self, case: Case) -> str:
        named = {
            "a-file": self.file,
            "read-only": self.read_only / "out",
            "missing": self.root / "missing" / "nothing-here",
            "empty-folder": self.empty,
            "random-bytes": self.random,
            "truncated": self.truncated,
        }
        return str(named.get(case.value, case.value))


@dataclass
class Outcome:
    code: int | None  # None: accepted
    stderr: str
    crash: BaseException | None = None
    skipped: bool = False


def run_case(module, case: Case, argv: list[str], monkeypatch, capsys) -> Outcome:
    resolve = cli.ConfigFlags.resolve
    record = RunLog.log

    def validate_only(self, args):
        resolve(self, args)
        raise Accepted

    def first_record(self, variant, config, metrics):
        record(self, variant, config, metrics)
        bad = non_finite_in_last_record(self.path)
        if bad:
            raise AssertionError(f"accepted, then logged non-finite {bad}")
        raise Accepted

    def too_slow(signum, frame):
        raise TooSlow

    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(sys, "argv", [Path(case.script).name, *argv])
        if case.runs:
            m.setattr(RunLog, "log", first_record)
            old = signal.signal(signal.SIGALRM, too_slow)
            signal.alarm(RUN_BUDGET_S)
        else:
            m.setattr(cli.ConfigFlags, "resolve", validate_only)
        try:
            cli.run_main(module.main)
        except SystemExit as e:
            return Outcome(e.code, capsys.readouterr().err)
        except Accepted:
            return Outcome(None, capsys.readouterr().err)
        except TooSlow:
            return Outcome(None, capsys.readouterr().err, skipped=True)
        except Exception as e:
            return Outcome(-1, capsys.readouterr().err, crash=e)
        finally:
            if case.runs:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
    return Outcome(0, capsys.readouterr().err)


def problem(case: Case, shown: str, outcome: Outcome, out: Path) -> str | None:
    """What is wrong with ``outcome``, or None."""
    if outcome.crash is not None:
        return f"traceback: {type(outcome.crash).__name__}: {outcome.crash}"
    if outcome.code is None:  # accepted, or skipped as too slow
        if case.size_flag and case.value == HUGE_INT:
            return "accepted 10**12 for a size: must be refused before allocating"
        if case.kind == "float" and case.value in ("nan", "inf"):
            return f"accepted {case.value}"
        return None
    if outcome.code == 0:
        return None if case.runs else "ran to the end in validation mode"
    lines = outcome.stderr.strip().splitlines()
    if outcome.code != 2:
        return f"exit code {outcome.code}: {lines[-1:] or ''}"
    if "Traceback" in outcome.stderr or len(lines) != 1:
        return f"{len(lines)} lines on stderr: {lines[:3]}"
    if case.flag not in lines[0] and shown not in lines[0]:
        return f"does not name {case.flag}: {lines[0]}"
    left = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    if left:
        return f"left {left[:3]} behind"
    return None


def refused_anyway(script: str, module: ModuleType, tmp_path: Path) -> bool:
    """Whether ``script`` refuses to run here even without a hostile value (say, an optional
    package is missing): then a data file case's refusal need not name the flag."""

    def stop(*args, **kwargs):
        raise Accepted

    argv = [*BASE_ARGV, "--out", str(tmp_path / "plain")]
    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stderr(io.StringIO()) as err:
        m.setattr(sys, "argv", [Path(script).name, *argv])
        m.setattr(RunLog, "log", stop)
        try:
            cli.run_main(module.main)
        except SystemExit as e:
            return e.code == 2 and bool(err.getvalue().strip())
        except Accepted:
            return False
    return False


def test_hostile_flag_values_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    paths = Paths(tmp_path / "paths")
    root_can_write = os.access(paths.read_only, os.W_OK)
    scripts, bound, all_cases, modules = [], 0, [], {}
    for script in task_scripts():
        module = load(script)
        flags = discover(module, script, monkeypatch)
        if flags is None:
            assert "/probes/" in script, f"{script} does not bind its flags with ConfigFlags"
            continue
        scripts.append(script)
        modules[script] = module
        bound += len(flags.bound)
        all_cases += cases_of(script, flags)
    if root_can_write:  # root writes a read-only folder anyway
        all_cases = [c for c in all_cases if c.value != "read-only"]
    cases = sorted(
        all_cases, key=lambda c: c.runs
    )  # runs last: they may leave threads and caches behind

    failures, refused, accepted, skipped = [], 0, 0, 0
    for i, case in enumerate(cases):
        out = tmp_path / "outs" / str(i)
        shown = paths.value(case)
        argv = [*BASE_ARGV, "--out", str(out), case.flag, shown]
        if case.flag == "--out":
            argv = [*BASE_ARGV, "--out", shown]
            out = Path(shown)
        outcome = run_case(modules[case.script], case, argv, monkeypatch, capsys)
        trouble = problem(case, shown, outcome, out)
        if (
            trouble
            and case.runs
            and outcome.code == 2
            and refused_anyway(case.script, modules[case.script], tmp_path)
        ):
            trouble, outcome.skipped = None, True  # this machine lacks what the script needs
        if trouble:
            failures.append(f"{case.script} {case.flag} {case.value}: {trouble}"[:300])
        refused += outcome.code == 2
        accepted += outcome.code is None and not outcome.skipped
        skipped += outcome.skipped
    with capsys.disabled():
        print(f"\nflag fuzz: {len(scripts)} scripts, {bound} flags, {len(cases)} cases tried "
              f"({refused} refused, {accepted} accepted, "
              f"{skipped} skipped: too slow, or the script cannot run here)")  # fmt: skip
    assert not failures, "\n".join(failures)
    assert len(scripts) >= 20 and bound >= 300 and len(cases) >= 1000
    assert refused >= len(cases) // 2


def test_the_parser_errors_are_one_line(capsys):
    p = cli.base_parser("demo", default_out="runs/demo")
    p.add_argument("--mode", choices=["a", "b"])
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--mode", "c"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "error: argument --mode: invalid choice: 'c'" in line


def test_config_flags_refuse_nan_and_inf_naming_the_flag():
    @dataclass
    class Demo:
        lr: float = 1e-3
        sizes: tuple = (1,)

    p = argparse.ArgumentParser()
    flags = cli.ConfigFlags(p, Demo())
    flags.add("lr", type=float)
    flags.add("sizes", type=float, nargs="+")
    for argv, message in ((["--lr", "nan"], "--lr: expected a finite number, got nan"),
                          (["--sizes", "1", "inf"], "--sizes: expected a finite number, got inf")):  # fmt: skip
        with pytest.raises(cli.UsageError, match=message):
            flags.resolve(p.parse_args(argv))
    assert [b.flag for b in flags.bound] == ["--lr", "--sizes"]


def test_the_first_record_check_finds_non_finite_numbers_however_written(tmp_path):
    """JSON's NaN and Infinity, the strings a run log writes for them, in any case and nested in
    lists and mappings: each is found by its path; names and finite numbers as text are not."""
    log = tmp_path / "synthetic.jsonl"
    lines = {
        '{"loss": NaN, "step": 1}': {"loss"},
        '{"loss": Infinity, "grad_norm": -Infinity}': {"loss", "grad_norm"},
        '{"loss": "nan", "val_loss": "NaN", "scale": "inf", "norm": "-inf"}': {
            "loss", "val_loss", "scale", "norm"
        },
        '{"curve": [1.5, "nan", 2.0], "split": {"forward": "Infinity", "ok": 0.5}}': {
            "curve[1]", "split.forward"
        },
        '{"loss": 1.25, "name": "banana", "what": "information", "text": "1e3", "done": true,'
        ' "peak": null}': set(),
    }  # fmt: skip
    record = '{{"task": "t", "variant": "v", "config": {{}}, "metrics": {}}}\n'.format
    for line, expected in lines.items():
        log.write_text(record('{"loss": "nan"}') + record(line))  # only the last one is read
        assert set(non_finite_in_last_record(log)) == expected, line
