"""Values the argument checks used to pass that then failed deep in the run (a division by
zero, a shape error, an allocation, a folder where a file is): each is refused before any work,
exit code 2 and one line naming the flag on stderr, nothing written in --out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.log_values import non_finite
from tests.script_loading import ROOT

CASES = [
    ("memory_efficient_gpt2/probes/int8_update_speed.py", ["--tensor-numel", "0"], "--tensor-numel must be >= 1"),
    ("swiglu_checkpoint/probes/gemm_kernel_count.py", ["--layers", "0"], "--layers must be >= 1"),
    ("memory_efficient_gpt2/probes/optimizer_equivalence.py", ["--heads", "3"], "--d-model 32 must divide by --heads 3"),
    ("swiglu_checkpoint/gpu_ceilings.py", ["--copy-gib", "1e12"], "--copy-gib: the copy's source and target needs"),
    ("lm_training/speedup_stages.py", ["--trace-dir", "{file}"], "--trace-dir: {file} is a file"),
    (
        "lm_training/speedup_stages.py",
        ["--tokens-per-step", "1"],
        "--tokens-per-step 1 is below --max-length 32: a step must hold the longest document",
    ),
    ("lm_training/train.py", ["--resume", "{empty}"], "--resume: {empty} is not a complete checkpoint"),
    ("memory_efficient_gpt2/tensor_parallel.py", ["--world-size", "3"], "--world-size 3 does not divide --hidden"),
    ("lm_training/train.py", ["--sequence-length", "100000"], "--batch-size 4 --sequence-length 100000: "),
    ("task3_vit_profiling/train.py", ["--n-images", "1"], "change --batch-size, or --n-images"),
    ("lm_training/train.py", ["--resume", "{empty}", "--save", "{empty}"], "--resume: {empty} is not a complete checkpoint"),
]  # fmt: skip


@pytest.mark.parametrize(("script", "flags", "message"), CASES)
def test_a_value_the_run_cannot_use_is_refused_before_any_work(tmp_path, script, flags, message):
    names = {"file": tmp_path / "a-file", "empty": tmp_path / "empty"}
    names["file"].write_text("not a folder\n")
    names["empty"].mkdir()
    out = tmp_path / "out"
    argv = [a.format(**names) for a in flags]
    done = subprocess.run(
        [sys.executable, str(ROOT / script), "--quick", "--device", "cpu", "--out", str(out), *argv],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert message.format(**names) in line
    assert not out.exists() or not any(p.is_file() for p in out.rglob("*"))


def test_a_usage_error_of_several_lines_is_printed_as_one(monkeypatch, capsys):
    """A library's message of several lines, quoted in a UsageError, still ends as one line."""
    import effdl.cli as cli

    def main():
        raise cli.UsageError("--tokenizer: cannot load it (one of:\n(1) a file,\n(2) a class)")

    monkeypatch.setattr(sys, "argv", ["demo.py"])
    with pytest.raises(SystemExit) as e:
        cli.run_main(main)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "demo.py: error: --tokenizer: cannot load it (one of: (1) a file, (2) a class)\n"


def test_a_model_folder_of_another_shape_is_one_line_without_transformers_warnings(tmp_path):
    """transformers warns about a config's token ids before the shape check refuses it: only the
    refusal reaches stderr."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 128,'
        ' "vocab_size": 300}'
    )
    done = subprocess.run(
        [sys.executable, str(ROOT / "memory_efficient_gpt2/train.py"), "--quick", "--device",
         "cpu", "--out", str(tmp_path / "out"), "--model-path", str(folder)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"train.py: error: --model-path: {folder}/config.json describes")


DIVERGED = [
    ("task2_batching/train_pipelines.py", ["--lr", "1e12"], "the brain run diverged (loss nan): lower --lr"),
    ("lm_training/train.py", ["--lr", "1e6"], "training at step 3 diverged (loss nan): lower --lr"),
    ("lm_training/speedup_stages.py", ["--lr", "1e12"], "stage0_baseline at step 1 diverged (loss nan): lower --lr"),
    ("task1_loss_scaling/train_unet.py", ["--lr", "1e12", "--cache", "{tmp}"], "the fp32 run at step 1 diverged (loss nan): lower --lr"),
    ("task1_loss_scaling/lm_precision.py", ["--lr", "1e12"], "the fp32 run at step 1 diverged (loss nan): lower --lr"),
    ("task3_vit_profiling/train.py", ["--lr", "1e12", "--data-cache", "{tmp}"], "training at step 1 diverged (loss nan): lower --lr"),
]  # fmt: skip


@pytest.mark.parametrize(("script", "flags", "message"), DIVERGED)
def test_a_diverged_run_is_refused_naming_the_step_size(tmp_path, script, flags, message):
    """The first step whose loss is not finite ends the run: exit 2, one line naming the flag,
    and the log keeps the steps before it, none with a non-finite loss."""
    out = tmp_path / "out"
    argv = [a.format(tmp=tmp_path / "cache") for a in flags]
    done = subprocess.run(
        [sys.executable, str(ROOT / script), "--quick", "--device", "cpu", *argv,
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]  # after the progress bars
    assert last == f"{Path(script).name}: error: {message}"
    for log in out.rglob("*.jsonl"):
        for line in log.read_text().splitlines():
            bad = non_finite(json.loads(line)["metrics"])
            assert not [k for k in bad if "loss" in k], (log.name, bad)
