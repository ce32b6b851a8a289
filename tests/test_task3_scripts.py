"""The task-3 training script: presets and flag checks, its metrics against hand-computed ones,
and a --quick epoch of each pipeline end to end on the CPU."""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from effdl.cli import UsageError, run_main
from effdl.data.clothing import (
    DeviceNormalize,
    fixed_transforms,
    generate_clothing_like,
    read_clothing_frame,
)
from effdl.results import read_records
from effdl.vit_pipeline.profiling import agreement
from tests.interrupting import whole_records
from tests.log_values import non_finite
from tests.script_loading import load_script as load_task_script

ROOT = Path(__file__).resolve().parent.parent
TASK3 = ROOT / "task3_vit_profiling"


def load_script(name: str):
    return load_task_script("task3_vit_profiling", name)


train = load_script("train")
vp = train.vp
PRESETS = [preset for pair in vp.PRESETS.values() for preset in pair]


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_are_valid(preset):
    preset.validate()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_size": 0}, "--batch-size must be >= 1, got 0"),
        ({"model": "huge"}, r"--model: unknown \['huge'\]"),
        ({"precision": "fp8"}, r"--precision: unknown \['fp8'\]"),
        ({"workers": -1}, "--workers must be >= 0, got -1"),
        ({"max_images": 4}, "--max-images must be >= 10, got 4"),
        ({"min_side": 500, "max_side": 400}, "--max-side 400 is below --min-side 500"),
        ({"augmix_on": "gpu"}, r"--augmix-on: unknown \['gpu'\]"),
        ({"augmix_on": "device"}, "--augmix-on device: the as-given data path"),
    ],
)
def test_validation_names_the_flag(change, message):
    with pytest.raises(UsageError, match=message):
        dataclasses.replace(vp.AS_GIVEN, **change).validate()


def test_the_presets_differ_in_every_fix():
    same = {
        f.name
        for f in dataclasses.fields(vp.PipelineConfig)
        if getattr(vp.AS_GIVEN, f.name) == getattr(vp.FIXED, f.name)
    }
    settings = {"data", "data_cache", "n_images", "min_side", "max_side", "max_images", "depth",
                "batch_size", "lr", "generate_workers"}  # fmt: skip
    assert same == settings | {"compile"}


def test_auto_fields_and_cuda_only_options_follow_the_device():
    cpu = vp.for_device(vp.FIXED, torch.device("cpu"))
    assert (cpu.precision, cpu.pin_memory, cpu.fused_adam) == ("fp32", False, False)
    assert isinstance(cpu.workers, int) and 1 <= cpu.workers <= 16
    cuda = vp.for_device(vp.FIXED, torch.device("cuda", 0))
    assert (cuda.precision, cuda.pin_memory, cuda.fused_adam) == ("bf16", True, True)
    assert vp.for_device(vp.AS_GIVEN, torch.device("cuda", 0)).workers == 0
    assert (cpu.augmix_on, cuda.augmix_on) == ("loader", "device")
    as_given_path = dataclasses.replace(vp.FIXED, data_path="as_given")
    assert vp.for_device(as_given_path, torch.device("cuda", 0)).augmix_on == "loader"


def test_augmix_moves_from_the_train_transforms_to_the_device():
    device = torch.device("cpu")
    on_device = dataclasses.replace(vp.FIXED, augmix_on="device")
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    normalize = DeviceNormalize(device)
    # validation batches are only normalised; training batches are augmented first
    assert torch.equal(
        vp.input_transform(on_device, device, train=False)(images), normalize(images)
    )
    torch.manual_seed(0)
    augmented = vp.input_transform(on_device, device, train=True)(images)
    assert augmented.shape == images.shape and not torch.equal(augmented, normalize(images))
    for place, has_augmix in (("device", False), ("loader", True)):
        cfg = dataclasses.replace(vp.FIXED, augmix_on=place)
        train_t = fixed_transforms(augmix=cfg.augmix_on == "loader")[0]
        assert any(type(t).__name__ == "AugMix" for t in train_t.transforms) == has_augmix


def phase(losses, accuracies, sizes, wait_s, step_s, wall_s=2.0):
    return vp.PhaseResult(losses, accuracies, sizes, wait_s, step_s, wall_s, None)


def test_metrics_against_hand_computed_values():
    tr = phase([2.0, 1.0, 1.0, 0.5], [0.0, 0.25, 0.5, 0.5], [4, 4, 4, 2],
               [3.0, 0.1, 0.2, 0.1], [0.5, 0.5, 0.5, 0.4], wall_s=6.0)  # fmt: skip
    val = phase([1.0, 3.0], [0.5, 1.0], [4, 2], [0.2, 0.0], [0.1, 0.1], wall_s=1.0)
    given = train.epoch_metrics(vp.AS_GIVEN, tr, val)
    assert given["images"] == 20 and given["images_per_s"] == pytest.approx(20 / 7.0)
    assert given["train_loss"] == pytest.approx((8 + 4 + 4 + 1) / 14)
    assert given["train_wait_over_step"] == pytest.approx(0.4 / 1.4)  # the first wait left out
    assert given["peak_mem_gib"] is None  # neither pass measured it (the CPU)
    assert given["val_loss"] == pytest.approx((4 + 6) / 6)
    assert given["val_accuracy"] == pytest.approx((2 + 2) / 6)
    # as given: sums of batch means over the 4 training batches
    assert given["val_loss_reported"] == pytest.approx(4.0 / 4)
    assert given["val_accuracy_reported"] == pytest.approx(1.5 / 4)
    fixed = train.epoch_metrics(vp.FIXED, tr, val)
    assert fixed["val_loss_reported"] == pytest.approx(given["val_loss"])


def test_batch_stats_read_at_once_or_at_the_end_agree():
    torch.manual_seed(0)
    batches = [(torch.rand(()), torch.randn(5, 3), torch.randint(0, 3, (5,))) for _ in range(4)]
    results = []
    for sync in (True, False):
        stats = vp.BatchStats(sync)
        for batch in batches:
            stats.add(*batch)
        results.append(stats.host())
    assert results[0][0] == pytest.approx(results[1][0]) and results[0][1] == results[1][1]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("task3_cache")


def run_script(*args, out: Path, cache: Path, env: dict | None = None):
    argv = [sys.executable, str(TASK3 / "train.py"), "--quick", "--out", str(out),
            "--data-cache", str(cache), *args]  # fmt: skip
    env = {**os.environ, **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)


@pytest.mark.parametrize("pipeline", vp.PIPELINES)
def test_quick_epoch_writes_one_record(pipeline, tmp_path, data_cache):
    res = run_script("--pipeline", pipeline, "--max-images", "40", out=tmp_path, cache=data_cache)
    assert res.returncode == 0, res.stderr
    (record,) = read_records(tmp_path / "vit_pipeline.jsonl")
    config, m = record["config"], record["metrics"]
    assert record["variant"] == pipeline and config["pipeline"] == pipeline
    assert config["model"] == pipeline and config["depth"] == 2 and config["device"] == "cpu"
    assert config["source"] == "clothing_like:120:160-400px"
    assert (m["n_train"], m["n_val"], m["train_batches"], m["val_batches"]) == (32, 8, 1, 1)
    assert m["images_per_s"] == pytest.approx(40 / m["epoch_s"])
    assert m["epoch_s"] == pytest.approx(m["train_s"] + m["val_s"])
    assert m["train_step_s_n"] == 1 and m["train_wait_s"] > 0 and m["train_step_s"] > 0
    assert 0 <= m["val_accuracy"] <= 1 and m["val_loss"] > 0
    # no allocator statistics on the CPU, one batch per pass: not measured, logged as null
    assert m["peak_mem_gib"] is None and m["train_peak_mem_gib"] is None
    assert m["train_wait_over_step"] is None and m["val_wait_over_step"] is None
    assert not non_finite(m)
    table = res.stdout.split("One epoch on")[1]
    assert f"{pipeline}  " in table and "nan" not in table
    (before_validation,) = read_records(tmp_path / "vit_train_epoch.jsonl")
    assert before_validation["config"] == config
    assert before_validation["metrics"] == {
        k: v for k, v in m.items() if k.startswith("train_") or k == "n_train"
    }


def test_quick_epoch_with_augmix_on_the_device(tmp_path, data_cache):
    res = run_script("--pipeline", "fixed", "--augmix-on", "device", "--max-images", "40",
                     out=tmp_path, cache=data_cache)  # fmt: skip
    assert res.returncode == 0, res.stderr
    (record,) = read_records(tmp_path / "vit_pipeline.jsonl")
    assert record["config"]["augmix_on"] == "device" and record["metrics"]["n_train"] == 32


def test_bad_data_path_is_one_line_naming_it(tmp_path):
    res = run_script("--data", str(tmp_path / "nowhere"), out=tmp_path, cache=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--data" in lines[0] and "nowhere does not exist" in lines[0]
    assert not (tmp_path / "vit_pipeline.jsonl").exists()  # a log appears with its first record


@pytest.mark.parametrize(("pipeline", "workers"), [("as_given", "0"), ("fixed", "2")])
def test_an_image_that_cannot_be_decoded_ends_the_run_in_one_line_naming_it(
    pipeline, workers, tmp_path, data_cache
):
    """Random bytes in place of one JPEG, decoded in this process (--workers 0) or in a
    DataLoader worker: exit 2, one line naming the file, no record."""
    small = generate_clothing_like(data_cache / "small_30", 30, workers=1, min_side=48,
                                   max_side=96)  # fmt: skip
    root = shutil.copytree(small, tmp_path / "set")
    names = read_clothing_frame(root)["image"]
    bad = root / "images_original" / f"{names.iloc[len(names) // 2]}.jpg"
    bad.write_bytes(bytes(range(256)) * 8)
    out = tmp_path / "out"
    res = run_script("--pipeline", pipeline, "--data", str(root), "--workers", workers,
                     out=out, cache=data_cache, env={"TQDM_DISABLE": "1"})  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()  # progress bars off: stderr is the error alone
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"train.py: error: {bad}: cannot decode this image (")
    assert not (out / "vit_pipeline.jsonl").exists()


def test_an_interrupt_during_validation_keeps_the_training_record(
    tmp_path, data_cache, monkeypatch
):
    """Ctrl-C in the validation pass: exit 130, and the training pass's record, written before
    validation started, is whole in vit_train_epoch.jsonl; the epoch's record never started."""
    run_phase = vp.run_phase

    def interrupted_in_validation(trainer, loader, train):
        if not train:
            raise KeyboardInterrupt
        return run_phase(trainer, loader, train=train)

    monkeypatch.setattr(vp, "run_phase", interrupted_in_validation)
    monkeypatch.setattr(sys, "argv", ["train.py", "--quick", "--max-images", "40", "--data-cache",
                                      str(data_cache), "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        run_main(train.main)
    assert e.value.code == 130
    (record,) = whole_records(tmp_path / "vit_train_epoch.jsonl")
    m = record["metrics"]
    assert record["variant"] == "as_given" and (m["n_train"], m["train_batches"]) == (32, 1)
    assert m["train_loss"] > 0 and 0 <= m["train_accuracy"] <= 1 and m["train_s"] > 0
    assert not (tmp_path / "vit_pipeline.jsonl").exists()


def test_an_interrupt_during_training_keeps_the_batches_trained(tmp_path, data_cache, monkeypatch):
    """Ctrl-C in the third training step: exit 130, and vit_train_epoch.jsonl holds one whole
    record of the two batches finished, marked interrupted; the epoch's record never started."""
    build_trainer = vp.build_trainer

    def stopping_at_third_step(*args, **kwargs):
        trainer, steps = build_trainer(*args, **kwargs), []
        step = trainer.train_step

        def train_step(x, y):
            steps.append(1)
            if len(steps) == 3:
                raise KeyboardInterrupt
            return step(x, y)

        trainer.train_step = train_step
        return trainer

    monkeypatch.setattr(vp, "build_trainer", stopping_at_third_step)
    monkeypatch.setattr(sys, "argv", ["train.py", "--quick", "--max-images", "40", "--batch-size",
                                      "8", "--data-cache", str(data_cache), "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        run_main(train.main)
    assert e.value.code == 130
    (record,) = whole_records(tmp_path / "vit_train_epoch.jsonl")
    m = record["metrics"]
    assert record["config"]["interrupted"] is True
    assert (m["n_train"], m["train_batches"]) == (16, 2) and m["train_loss"] > 0
    assert not (tmp_path / "vit_pipeline.jsonl").exists()


def test_a_folder_without_the_csv_is_a_usage_error(tmp_path):
    (tmp_path / "images_original").mkdir()
    with pytest.raises(UsageError, match=r"^--data: .*images.csv is missing"):
        vp.prepare_data(dataclasses.replace(vp.AS_GIVEN, data=tmp_path))


def test_a_last_training_batch_of_one_is_refused_before_training(tmp_path, data_cache):
    cfg = dataclasses.replace(vp.PRESETS["as_given"][1], data_cache=data_cache, max_images=40)
    data = vp.prepare_data(cfg)
    with pytest.raises(UsageError, match="batch of 1"):
        vp.make_loaders(dataclasses.replace(cfg, batch_size=31), data)


def steps_under_sync_check(preset: "vp.PipelineConfig", batch_images: torch.Tensor, n: int = 3):
    """``n`` training steps of ``preset`` (2 blocks) on CUDA after a first, unchecked one (lazy
    initialisation), with any host-device synchronisation raising."""
    device = torch.device("cuda")
    cfg = vp.for_device(dataclasses.replace(preset, depth=2, batch_size=8), device)
    trainer = vp.build_trainer(cfg, device, num_classes=20)
    labels = torch.randint(0, 20, (8,))
    batch = (
        (batch_images.pin_memory(), labels.pin_memory())
        if cfg.pin_memory
        else (batch_images, labels)
    )
    stats = vp.BatchStats(cfg.sync_every_step)
    trainer.model.train()

    def step():
        x, y = trainer.to_device(batch)
        stats.add(*trainer.train_step(x, y), y)

    step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(n):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


@pytest.mark.gpu
def test_the_fixed_training_step_never_waits_for_the_gpu():
    steps_under_sync_check(vp.FIXED, torch.randint(0, 256, (8, 3, 224, 224), dtype=torch.uint8))


@pytest.mark.gpu
def test_the_training_step_as_given_waits_for_the_gpu():
    with pytest.raises(RuntimeError, match="synchroniz"):
        steps_under_sync_check(vp.AS_GIVEN, torch.rand(8, 3, 224, 224))


def test_quick_profile_writes_every_record_kind(tmp_path, data_cache):
    argv = [sys.executable, str(TASK3 / "profile_model.py"), "--quick", "--pipeline", "fixed",
            "--max-images", "40", "--data-cache", str(data_cache), "--out", str(tmp_path),
            "--wait", "0", "--warmup", "0", "--active", "1", "--overhead-rounds", "1", "--overhead-seconds", "0",
            "--overhead-steps", "1", "--batch-size", "4", "--compare-batch-size", "6",
            "--shallow-depth", "2", "--sample-every", "2", "3", "--compare-sample-every", "3"]  # fmt: skip
    res = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    records = read_records(tmp_path / "vit_profile_ops.jsonl")
    kinds = {r["config"]["kind"] for r in records}
    assert kinds == {"module", "op", "range", "layer_compare", "layer_agreement", "overhead"}
    ranges = {
        r["metrics"]["range"]: r["metrics"] for r in records if r["config"]["kind"] == "range"
    }
    assert set(ranges) == {"step", "data_wait", "to_device", "train_step", "batch_stats"}
    parts = sum(ranges[n]["cpu_ms_per_iter"] for n in ranges if n != "step")
    assert parts <= ranges["step"]["cpu_ms_per_iter"] * 1.01  # the ranges nest in the iteration
    compared = [r for r in records if r["config"]["kind"] == "layer_compare"]
    comparisons = ("same_iterations", "separate_passes", "same_iterations_sampled")
    for comparison in comparisons:
        rows = {r["metrics"]["path"]: r["metrics"] for r in compared
                if r["config"]["comparison"] == comparison}  # fmt: skip
        assert {"transformer", "mlp_head"} <= set(rows), comparison
        every = {r["config"]["sample_every"] for r in compared
                 if r["config"]["comparison"] == comparison}  # fmt: skip
        assert every == {3 if comparison.endswith("_sampled") else 1}
        # on the CPU there are no kernels: both references are the range's host time
        assert all(r["torch_fwd_ms"] > 0 for r in rows.values())
        assert all(r["torch_key_averages_ms"] == pytest.approx(r["torch_fwd_ms"])
                   for r in rows.values())  # fmt: skip
    assert {r["config"]["resident_batch"] for r in compared} == {6}  # two loader batches
    agreements = {
        r["config"]["comparison"]: r["metrics"]
        for r in records
        if r["config"]["kind"] == "layer_agreement"
    }
    assert set(agreements) == set(comparisons)
    for comparison, agreed in agreements.items():
        rows = [r["metrics"] for r in compared if r["config"]["comparison"] == comparison]
        slow = [r for r in rows if r["torch_fwd_ms"] > 1.0]
        assert agreed["modules_over_min_kernels"] == len(slow)
        assert agreed["within_kernels"] == sum(abs(r["ratio"] - 1) <= 0.1 for r in slow)
        assert agreed["modules_over_min_key_averages"] == agreed["modules_over_min_kernels"]
    overheads = [r for r in records if r["config"]["kind"] == "overhead"]
    # each resident batch: every module, the shallow profile, every module sampled
    hooks = {(r["config"]["resident_batch"], r["config"]["max_depth"], r["config"]["sample_every"])
             for r in overheads}  # fmt: skip
    hookings = ((None, 1), (2, 1), (None, 2), (None, 3))
    assert hooks == {(b, d, n) for b in (4, 6) for d, n in hookings}
    hooked = {
        (r["config"]["max_depth"], r["config"]["sample_every"]): r["metrics"] for r in overheads
    }
    assert 0 < hooked[2, 1]["modules_hooked"] < hooked[None, 1]["modules_hooked"]
    assert hooked[None, 3]["modules_hooked"] == hooked[None, 1]["modules_hooked"]
    assert hooked[None, 3]["modules_per_step"] == -(-hooked[None, 1]["modules_hooked"] // 3)
    for r in overheads:  # one pair of steps per round, or one rotation of the sampled modules
        assert r["metrics"]["pairs"] == r["config"]["sample_every"] * r["metrics"]["rounds"]
        assert r["metrics"]["register_ms_median"] >= 0
        assert r["metrics"]["bare_step_ms_median"] > 0
        assert len(r["metrics"]["round_overheads"]) == r["metrics"]["rounds"]
    for name in ("fixed_ops.txt", "fixed_torch_trace.json", "fixed_layers_trace.json"):
        assert (tmp_path / name).stat().st_size > 0


def test_an_interrupted_profile_keeps_the_comparisons_it_finished(
    tmp_path, data_cache, monkeypatch
):
    """Ctrl-C while the second layer comparison is computed: exit 130, and the log holds the
    first comparison's records, written as it was measured, whole."""
    profile_model, calls = load_script("profile_model"), []

    def interrupted(ref, records):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return layer_comparison(ref, records)

    layer_comparison = profile_model.layer_comparison
    monkeypatch.setattr(profile_model, "layer_comparison", interrupted)
    monkeypatch.setattr(sys, "argv", ["profile_model.py", "--quick", "--pipeline", "fixed",
                        "--max-images", "40", "--data-cache", str(data_cache), "--out",
                        str(tmp_path), "--wait", "0", "--warmup", "0", "--active", "1",
                        "--batch-size", "4"])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        run_main(profile_model.main)
    assert e.value.code == 130
    records = whole_records(tmp_path / "vit_profile_ops.jsonl")
    kinds = [r["config"]["kind"] for r in records]
    assert {"module", "op", "range", "layer_compare", "layer_agreement"} == set(kinds)
    assert kinds[-1] == "layer_agreement" and "overhead" not in kinds
    compared = {r["config"]["comparison"] for r in records if "comparison" in r["config"]}
    assert compared == {"same_iterations"}


def test_layer_agreement_counts_modules_over_1_ms_within_10_percent():
    rows = [
        {
            "torch_fwd_ms": 2.0,
            "ratio": 1.05,
            "torch_key_averages_ms": 2.2,
            "key_averages_ratio": 0.95,
        },
        {
            "torch_fwd_ms": 3.0,
            "ratio": 0.80,
            "torch_key_averages_ms": 0.9,
            "key_averages_ratio": 2.7,
        },
        {
            "torch_fwd_ms": 0.5,
            "ratio": 3.00,
            "torch_key_averages_ms": None,
            "key_averages_ratio": None,
        },
    ]
    agreed = agreement(rows)
    assert (agreed["modules_over_min_kernels"], agreed["within_kernels"]) == (2, 1)
    assert agreed["share_within_kernels"] == 0.5
    assert (agreed["modules_over_min_key_averages"], agreed["share_within_key_averages"]) == (
        1,
        1.0,
    )
