"""What the probe tests share: a probe's records against the committed log its report reads
(same variants, and per variant the same config and metrics keys: the report picks rows and
columns by them), and a refused command line."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

from effdl.cli import run_main
from effdl.results import RunLog, read_records
from tests.script_loading import ROOT

COMMITTED = ROOT / "reports" / "results"
HAND_MADE = "converted_from"  # the key that marked a record typed from a probe's printout


def variant_keys(records: list[dict]) -> dict[str, set[tuple[frozenset, frozenset]]]:
    """Per variant, the (config keys, metrics keys) of its records."""
    keys: dict[str, set[tuple[frozenset, frozenset]]] = {}
    for r in records:
        config = frozenset(r["config"]) - {HAND_MADE}
        keys.setdefault(r["variant"], set()).add((config, frozenset(r["metrics"])))
    return keys


def assert_like_committed(written: Path, committed: str, variants_of=None) -> list[dict]:
    """The records of ``written`` have the variants of the committed log ``committed`` (under
    reports/results/; or of its records that ``variants_of`` keeps) and the same keys; their
    env is the library's (git sha, GPU tag, time), with nothing typed by hand."""
    records = read_records(written)
    reference = read_records(COMMITTED / committed)
    if variants_of is not None:
        reference = [r for r in reference if variants_of(r)]
    written_keys, reference_keys = variant_keys(records), variant_keys(reference)
    assert set(reference_keys) <= set(written_keys)
    for variant, keys in reference_keys.items():
        assert written_keys[variant] == keys, variant
    for r in records:
        assert HAND_MADE not in r["config"]
        assert {"gpu", "gpu_id", "git_sha", "time", "run_id", "seed"} <= set(r["env"])
        assert r["env"]["git_sha"] and r["env"]["time"]
    return records


def probe_log(tmp_path: Path, name: str, task: str) -> RunLog:
    """The run log ``name`` in ``tmp_path``, as the probe's ``start_run`` opens it."""
    return RunLog(tmp_path / name, task=task, create=True, run_id="test", seed=0)


def refused(module: ModuleType, argv: list[str], out: Path, monkeypatch, capsys) -> str:
    """Run ``module.main`` on ``argv`` (with ``--out out``): it must exit 2 with one line on
    stderr and leave no file in ``out``; returns that line."""
    monkeypatch.setattr(sys, "argv", ["probe.py", "--out", str(out), *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(module.main)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert not out.exists() or not any(p.is_file() for p in out.rglob("*"))
    return err[0]
