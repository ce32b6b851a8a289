"""The task-1 scripts refuse bad settings at the edge: exit 2, one line naming the flag, no log."""

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from effdl.cli import UsageError

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
        (lm.QUICK, {"d_model": 60}, "--d-model must be a multiple of 8"),
        (lm.QUICK, {"steps": 1}, "--steps must be >= 2, got 1"),
        (lm.QUICK, {"pipeline": "fast"}, r"--pipeline: unknown \['fast'\]"),
        (lm.QUICK, {"static_scale": float("nan")}, "--static-scale must be > 0, got nan"),
        (lm.QUICK, {"timing_batch_sizes": [4, 0]}, "--timing-batch-sizes must be >= 1, got 0"),
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
