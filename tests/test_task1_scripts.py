"""The task-1 scripts refuse bad settings at the edge: exit 2, one line naming the flag, no log."""

import dataclasses
import importlib.util
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from effdl.cli import UsageError, run_main
from effdl.data.images import SyntheticCarvanaConfig, generate_synthetic_carvana
from effdl.data.lm_batches import text_samples
from effdl.data.stdlib_text import stdlib_paragraphs
from effdl.results import read_records
from tests.interrupting import whole_records

ROOT = Path(__file__).resolve().parent.parent
TASK1 = ROOT / "task1_loss_scaling"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"task1_{name}", TASK1 / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


unet = load_script("train_unet")
lm = load_script("lm_precision")


@pytest.mark.parametrize("preset", [unet.FULL, unet.QUICK, lm.FULL, lm.QUICK])
def test_presets_are_valid(preset):
    preset.validate()


@pytest.mark.parametrize(
    ("preset", "change", "message"),
    [
        (unet.QUICK, {"size": 60}, "--size must be a multiple of 8"),
        (unet.QUICK, {"batch_size": 0}, "--batch-size must be >= 1, got 0"),
        (unet.QUICK, {"multi_seed_modes": ["fp8"]}, r"--multi-seed-modes: unknown \['fp8'\]"),
        (unet.QUICK, {"amp_dtype": "fp8"}, r"--amp-dtype: unknown \['fp8'\]"),
        (unet.QUICK, {"workers": 0}, "--workers must be >= 1, got 0"),
        (unet.QUICK, {"n_images": -5}, "--n-images must be >= 1, got -5"),
        (unet.QUICK, {"n_images": 0}, "--n-images must be >= 1, got 0"),
        (unet.QUICK, {"epochs": 0}, "--epochs must be >= 1, got 0"),
        (unet.QUICK, {"growth_interval": 0}, "--growth-interval must be >= 1, got 0"),
        (unet.QUICK, {"static_scale": 0.0}, "--static-scale must be > 0, got 0.0"),
        (lm.QUICK, {"d_model": 60}, "--d-model must be a multiple of 8"),
        (lm.QUICK, {"steps": 1}, "--steps must be >= 2, got 1"),
        (lm.QUICK, {"pipeline": "fast"}, r"--pipeline: unknown \['fast'\]"),
        (lm.QUICK, {"static_scale": float("nan")}, "--static-scale must be > 0, got nan"),
        (lm.QUICK, {"timing_batch_sizes": [4, 0]}, "--timing-batch-sizes must be >= 1, got 0"),
        (lm.QUICK, {"lr": float("nan")}, "--lr must be >= 0, got nan"),
        (lm.QUICK, {"k": -3}, "--k must be >= 0, got -3"),
        (lm.QUICK, {"growth_interval": 0}, "--growth-interval must be >= 1, got 0"),
    ],
)
def test_validation_names_the_flag(preset, change, message):
    with pytest.raises(UsageError, match=message):
        dataclasses.replace(preset, **change).validate()


def test_unet_amp_dtype_auto_is_fp16_on_cuda_and_bf16_on_the_cpu():
    resolve = unet.with_device_defaults
    assert resolve(unet.FULL, torch.device("cuda", 0)).amp_dtype == "fp16"
    assert resolve(unet.FULL, torch.device("cpu")).amp_dtype == "bf16"
    given = dataclasses.replace(unet.FULL, amp_dtype="bf16")
    assert resolve(given, torch.device("cuda", 0)) == given


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("train_unet.py", ["--modes", "fp32", "fp8"], "--modes: unknown ['fp8']"),
        ("lm_precision.py", ["--setups", "bogus"], "--setups: unknown ['bogus']"),
    ],
)
def test_bad_flag_exits_2_with_one_line_and_no_log(tmp_path, script, argv, message):
    res = subprocess.run(
        [sys.executable, str(TASK1 / script), "--quick", *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: {message}"), res.stderr
    assert list(tmp_path.iterdir()) == []  # refused before any log was opened


def run_script(module, argv: list[str], out: Path, monkeypatch, capsys) -> tuple[int, list[str]]:
    """``<script> --quick ARGV --out OUT`` in this process, as run_main runs it: (exit code,
    stderr lines)."""
    name = module.__name__.removeprefix("task1_") + ".py"
    monkeypatch.setattr(sys, "argv", [name, "--quick", *argv, "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        run_main(module.main)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_lm_default_data_is_a_seeded_sample_of_the_stdlib_paragraphs(tmp_path):
    """Without --data the LM reads real text: --n-samples paragraphs of the standard library's
    corpus, the same ones for the same seed, other ones for another."""
    every, name = stdlib_paragraphs(tmp_path)
    lines, source = text_samples(None, 300, seed=0, cache_dir=tmp_path)
    assert source == f"{name} paragraphs (300 lines)"
    assert len(lines) == 300 and set(lines) <= set(every)
    assert text_samples(None, 300, seed=0, cache_dir=tmp_path)[0] == lines
    assert text_samples(None, 300, seed=1, cache_dir=tmp_path)[0] != lines


@pytest.mark.parametrize(
    ("module", "argv", "log"),
    [
        (unet, ["--modes", "amp_noscale", "--timing-steps", "0", "--cache", "{tmp}"],
         "unet_steps.jsonl"),
        (lm, ["--setups", "pure_fp16", "--timing-reps", "0", "--n-samples", "300",
              "--d-model", "16"], "lm_precision.jsonl"),
    ],
)  # fmt: skip
def test_low_precision_without_a_scaler_may_diverge(
    module, argv, log, tmp_path, monkeypatch, capsys
):
    """Only fp32 is refused when its loss turns non-finite (the step size is wrong); in low
    precision without a loss scaler a non-finite loss is the result measured."""
    argv = [a.format(tmp=tmp_path / "cache") for a in argv] + ["--lr", "1e12"]
    code, err = run_script(module, argv, tmp_path / "out", monkeypatch, capsys)
    assert code == 0, err[-3:]
    records = read_records(tmp_path / "out" / log)
    losses = [r["metrics"]["loss"] for r in records if "loss" in r["metrics"]]
    assert math.isfinite(losses[0]) and "nan" in losses[1:]


@pytest.fixture(scope="module")
def carvana(tmp_path_factory) -> Path:
    config = SyntheticCarvanaConfig(n_images=6, width=96, height=64, views_per_car=3, seed=3)
    return generate_synthetic_carvana(tmp_path_factory.mktemp("carvana") / "set", config, 1)


def damage(root: Path, where: Path, what: str) -> Path:
    """A copy of the Carvana set at ``root`` under ``where`` with its third pair damaged."""
    copy = shutil.copytree(root, where / "set")
    image = sorted((copy / "train").glob("*.jpg"))[2]
    mask = copy / "train_masks" / f"{image.stem}_mask.gif"
    if what == "truncated_jpeg":
        image.write_bytes(image.read_bytes()[:600])
        return image
    if what == "corrupt_gif":
        mask.write_bytes(b"GIF89a and then nothing")
        return mask
    Image.new("L", (50, 40)).save(mask)
    return mask


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("truncated_jpeg", "{file}: cannot decode this image ("),
        ("corrupt_gif", "{file}: cannot decode this image ("),
        ("other_size", "{file}: mask is 50x40, its image {name} is 96x64 (expected the same size)"),
    ],
)
def test_damaged_carvana_file_is_named_in_one_line(
    carvana, what, message, tmp_path, monkeypatch, capsys
):
    bad = damage(carvana, tmp_path, what)
    name = bad.name.removesuffix("_mask.gif") + ".jpg"
    argv = ["--data", str(tmp_path / "set"), "--cache", str(tmp_path / "cache"), "--workers", "2"]
    code, err = run_script(unet, argv, tmp_path / "out", monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    expected = "train_unet.py: error: --data: " + message.format(file=bad, name=name)
    assert err[0].startswith(expected), err
    assert all(read_records(log) == [] for log in (tmp_path / "out").iterdir())


class Killed(Exception):
    """Stands for a SIGKILL: nothing after it runs."""


def test_a_killed_lm_run_keeps_every_checked_step_on_disk(tmp_path, monkeypatch, capsys):
    step, calls = lm.scaled_step, []

    def dies_after_the_first_window(*args, **kwargs):
        calls.append(1)
        if len(calls) > lm.CHECK_EVERY + 2:
            raise Killed
        return step(*args, **kwargs)

    monkeypatch.setattr(lm, "scaled_step", dies_after_the_first_window)
    with pytest.raises(Killed):
        run_script(
            lm,
            ["--n-samples", "300", "--d-model", "16", "--setups", "fp32"],
            tmp_path,
            monkeypatch,
            capsys,
        )
    records = read_records(tmp_path / "lm_precision.jsonl")
    steps = [r["metrics"]["step"] for r in records if r["config"]["kind"] == "step"]
    assert steps == list(range(lm.CHECK_EVERY))
    assert all(r["config"]["kind"] in ("step", "eval") for r in records)


def test_an_interrupted_lm_run_keeps_the_record_of_each_finished_run(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the second run's second step: exit 130, and the log holds the first run's steps
    and its held-out record, written as it ended (its ``final`` record needs every run)."""
    step, calls = lm.scaled_step, []

    def interrupted_in_the_second_run(*args, **kwargs):
        calls.append(1)
        if len(calls) == lm.QUICK.steps + 2:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(lm, "scaled_step", interrupted_in_the_second_run)
    argv = ["--n-samples", "300", "--d-model", "16", "--setups", "fp32", "amp_dynamic"]
    code, err = run_script(lm, argv, tmp_path, monkeypatch, capsys)
    assert code == 130 and err[-1].endswith("lm_precision.py: interrupted"), err
    records = whole_records(tmp_path / "lm_precision.jsonl")
    evals = [r["metrics"]["step"] for r in records if r["config"]["kind"] == "eval"]
    assert evals == list(range(lm.QUICK.eval_every - 1, lm.QUICK.steps - 1, lm.QUICK.eval_every))
    records = [r for r in records if r["config"]["kind"] != "eval"]
    assert [r["config"]["kind"] for r in records] == ["step"] * lm.QUICK.steps + ["run"]
    assert {r["variant"] for r in records} == {"fp32"}
    run = records[-1]["metrics"]
    assert run["steps_done"] == lm.QUICK.steps and not run["diverged"]
    assert math.isfinite(run["heldout_loss"]) and 0 <= run["heldout_accuracy"] <= 1


def test_every_setup_runs_under_each_seed_and_the_reference_reruns_set_the_noise(
    tmp_path, monkeypatch, capsys
):
    argv = ["--n-samples", "300", "--d-model", "16", "--seeds", "2", "--timing-reps", "0",
            "--setups", "fp32", "torch_autocast_torch_scaler"]  # fmt: skip
    code, err = run_script(lm, argv, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    finals = [
        r for r in read_records(tmp_path / "lm_precision.jsonl") if r["config"]["kind"] == "final"
    ]
    runs = {(r["variant"], r["config"]["seed"], r["config"]["role"]): r["metrics"] for r in finals}
    assert set(runs) == {(s, seed, role) for s in ("fp32", lm.REFERENCE)
                         for seed, role in ((0, "main"), (1, "rerun"))}  # fmt: skip
    main, rerun = runs[(lm.REFERENCE, 0, "main")], runs[(lm.REFERENCE, 1, "rerun")]
    noise = abs(rerun["heldout_loss"] - main["heldout_loss"])
    assert all(m["noise_heldout_loss_gap"] == noise for m in runs.values())
    assert main["heldout_loss"] != rerun["heldout_loss"]  # another init, the same batches
