"""memory_efficient_gpt2/baseline.py in --quick mode: each model timed at every micro-batch size,
then its best, in train.py's log; a bad --model-path refused before the log is opened."""

import sys

import pytest

from effdl.cli import run_main
from effdl.results import read_records
from tests.script_loading import load_script

baseline = load_script("memory_efficient_gpt2", "baseline")


def run_baseline(argv, out, monkeypatch, capsys) -> tuple[int, list[str]]:
    """``baseline.py --quick ARGV --out OUT`` in this process: (exit code, stderr lines)."""
    monkeypatch.setattr(sys, "argv", ["baseline.py", "--quick", *argv, "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        run_main(baseline.main)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_both_models_at_every_micro_batch_then_their_best(tmp_path, monkeypatch, capsys):
    code, _ = run_baseline(["--micro-batches", "1", "2"], tmp_path, monkeypatch, capsys)
    assert code == 0
    records = read_records(tmp_path / "gpt2.jsonl")
    assert [r["variant"] for r in records] == ["baseline"] * 2 + ["baseline_best"] + [
        "baseline_own"
    ] * 2 + ["baseline_own_best"]
    hf, own = records[0]["config"], records[3]["config"]
    assert (hf["weights"], own["weights"], own["amp"]) == ("fp32", "bf16", "none")
    assert [r["config"]["micro_batch"] for r in records[:2]] == [1, 2]
    best = records[2]["metrics"]
    assert best["seq_per_s"] == max(r["metrics"]["seq_per_s"] for r in records[:2])
    assert best["peak_gib"] is None  # no GPU: not measured, logged as null


def test_a_micro_batch_that_ran_out_of_memory_has_no_speed(tmp_path, monkeypatch, capsys):
    """An OOM measures nothing: its table row shows no speed (not nan) and the best is taken
    from the sizes that ran."""
    import effdl.gpt2_offload.baseline as lib

    timed = lib.time_fwd_bwd
    monkeypatch.setattr(lib, "time_fwd_bwd", lambda model, loss_of, cfg, mb, device: (
        None if mb == 2 else timed(model, loss_of, cfg, mb, device)))  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["baseline.py", "--quick", "--micro-batches", "1", "2",
                                      "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        run_main(baseline.main)
    assert e.value.code == 0
    printed = capsys.readouterr().out
    assert printed.count("OOM") == 2 and "nan" not in printed
    bests = [r for r in read_records(tmp_path / "gpt2.jsonl") if r["variant"].endswith("_best")]
    assert [r["metrics"]["micro_batch"] for r in bests] == [1, 1]


def test_a_bad_model_folder_is_refused_before_the_log(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "empty"
    folder.mkdir()
    code, err = run_baseline(["--model-path", str(folder)], tmp_path / "out", monkeypatch, capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"baseline.py: error: --model-path: {folder} has no config.json")
    assert not (tmp_path / "out").exists()
