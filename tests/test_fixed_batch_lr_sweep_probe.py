"""memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py in --quick mode: one reference run per lr
from the same initial weights on the same fixed batch, and each run's fall computed from its
own per-step losses."""

import sys

import pytest

from effdl.cli import run_main
from effdl.results import read_records
from tests.script_loading import load_script

probe = load_script("memory_efficient_gpt2/probes", "fixed_batch_lr_sweep")


def run_probe(tmp_path, monkeypatch, *flags: str) -> list[dict]:
    """The probe in --quick mode with ``flags``; the records it wrote."""
    monkeypatch.setattr(sys, "argv", ["fixed_batch_lr_sweep.py", "--quick", *flags,
                                      "--cache", str(tmp_path / "cache"), "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        run_main(probe.main)
    assert e.value.code == 0
    return read_records(tmp_path / "gpt2_fixed_batch_lr_sweep.jsonl")


def test_one_run_per_lr_from_the_same_weights(tmp_path, monkeypatch):
    records = run_probe(tmp_path, monkeypatch, "--lrs", "1e-3", "3e-3", "--steps", "3")
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


def test_batch_sizes_and_beta2_each_get_a_run_and_the_batch_its_entropies(tmp_path, monkeypatch):
    """The fixed batch of n sequences is the first n of the default one; each run's fall record
    carries its batch's unigram entropy, computed from that batch."""
    records = run_probe(tmp_path, monkeypatch, "--lrs", "1e-3", "--batches", "2", "4",
                        "--beta2s", "0.999", "0.95", "--steps", "2")  # fmt: skip
    floors = {r["config"]["batch"]: r["metrics"] for r in records
              if r["variant"] == "batch_entropy"}  # fmt: skip
    assert set(floors) == {2, 4}
    falls = [r["metrics"] for r in records if r["variant"] == "fall"]
    assert {(f["batch"], f["beta2"]) for f in falls} == {(b, m) for b in (2, 4)
                                                       for m in (0.999, 0.95)}  # fmt: skip
    for f in falls:
        assert f["unigram_entropy"] == floors[f["batch"]]["unigram"]
        assert f["fall_to_unigram"] == pytest.approx(1 - f["unigram_entropy"] / f["first"])
    assert (
        0 < floors[2]["bigram"] < floors[2]["unigram"]
        and floors[2]["targets"] * 2 == floors[4]["targets"]
    )
    steps = [r for r in records if r["variant"] == "reference_adamw"]
    assert {(r["config"]["batch"], r["config"]["beta2"]) for r in steps} == {
        (b, m) for b in (2, 4) for m in (0.999, 0.95)
    }


def test_a_batch_size_the_micro_batch_does_not_divide_is_a_usage_error(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(sys, "argv", ["fixed_batch_lr_sweep.py", "--quick", "--batches", "3",
                                      "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        run_main(probe.main)
    assert e.value.code == 2
    assert "--batches 3" in capsys.readouterr().err
