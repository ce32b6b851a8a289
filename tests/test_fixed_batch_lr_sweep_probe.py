"""memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py in --quick mode: one reference run per lr
from the same initial weights on the same fixed batch, and each run's fall computed from its
own per-step losses."""

import sys

import pytest

from effdl.cli import run_main
from effdl.results import read_records
from tests.script_loading import load_script

probe = load_script("memory_efficient_gpt2/probes", "fixed_batch_lr_sweep")


def test_one_run_per_lr_from_the_same_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fixed_batch_lr_sweep.py", "--lrs", "1e-3", "3e-3", "--quick",
                                      "--steps", "3", "--cache", str(tmp_path / "cache"),
                                      "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        run_main(probe.main)
    assert e.value.code == 0
    records = read_records(tmp_path / "gpt2_fixed_batch_lr_sweep.jsonl")
    falls = [r for r in records if r["variant"] == "fall"]
    assert [f["metrics"]["lr"] for f in falls] == [1e-3, 3e-3]
    for fall in falls:
        lr = fall["metrics"]["lr"]
        losses = [r["metrics"]["loss"] for r in records
                  if r["variant"] == "reference_adamw" and r["config"]["lr"] == lr]  # fmt: skip
        assert len(losses) == 3 and fall["config"]["data"].startswith("stdlib")
        assert fall["metrics"]["fall"] == pytest.approx(1 - losses[-1] / losses[0])
    firsts = [f["metrics"]["first"] for f in falls]
    assert firsts[0] == pytest.approx(firsts[1])  # same initial weights, same batch
