"""A ViT pipeline's settings: one field per choice the two pipelines make differently, the preset
pair (full, ``--quick``) of each, their flags, and the device-dependent defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from effdl.cli import (
    AUTO,
    ArgumentParser,
    ConfigFlags,
    UsageError,
    base_parser,
    decide_auto,
    int_or_auto,
    require_choices,
    require_fits,
    require_positive,
    require_processes,
)
from effdl.models.vit import PRESETS as MODEL_PRESETS

PIPELINES = ("as_given", "fixed")
DATA_PATHS = ("as_given", "fixed")
AUGMIX_PLACES = (AUTO, "loader", "device")
PRECISIONS = (AUTO, "fp32", "bf16")
CUDNN_MODES = ("deterministic", "benchmark")
VAL_DIVISORS = ("train_batches", "val_images")


@dataclass
class PipelineConfig:
    """One pipeline's settings; the defaults are the pipeline as given. ``"auto"`` fields are
    decided for the device by :func:`for_device`."""

    pipeline: str = "as_given"  # the preset this config started from (logged as the variant)
    data: Path | None = None  # a clothing-dataset-full folder; None: the generated set
    data_cache: Path = Path("runs/cache/task3")
    n_images: int = 5400  # generated set: photos, and their long side in px
    min_side: int = 400
    max_side: int = 3000
    max_images: int | None = None  # the first N rows of images.csv (before the split)
    model: str = "as_given"  # effdl.models.vit preset
    depth: int = 12
    batch_size: int = 256
    lr: float = 3e-5
    data_path: str = "as_given"  # Dataset + transforms
    augmix_on: str = "loader"  # fixed data path: per image in the loader, or per batch on device
    workers: int | str = 0
    pin_memory: bool = False
    non_blocking: bool = False
    precision: str = "fp32"
    sync_every_step: bool = True  # .item() on loss and accuracy after every step
    set_to_none: bool = False
    fused_adam: bool = False  # CUDA only
    val_no_grad: bool = False
    val_divisor: str = "train_batches"
    cudnn: str = "deterministic"
    compile: bool = False
    generate_workers: int | None = None  # processes generating the data set (None: <= 16 CPUs)

    def validate(self) -> None:
        require_choices(self, "pipeline", PIPELINES)
        require_choices(self, "model", MODEL_PRESETS)
        require_choices(self, "data_path", DATA_PATHS)
        require_choices(self, "augmix_on", AUGMIX_PLACES)
        if self.data_path == "as_given" and self.augmix_on == "device":
            raise UsageError(
                f"--augmix-on {self.augmix_on}: the as-given data path applies AugMix in the "
                "loader only; use --data-path fixed"
            )
        require_choices(self, "precision", PRECISIONS)
        require_choices(self, "cudnn", CUDNN_MODES)
        require_choices(self, "val_divisor", VAL_DIVISORS)
        require_positive(self, "n_images", "depth", "batch_size")
        require_positive(self, "min_side", minimum=32)
        require_positive(self, "lr", minimum=0)
        if self.max_side < self.min_side:
            raise UsageError(f"--max-side {self.max_side} is below --min-side {self.min_side}")
        require_fits(
            "--max-side --batch-size",
            3 * self.max_side**2 + self.batch_size * 3 * MODEL_PRESETS[self.model].image_size ** 2,
            "a decoded photo and a batch of model inputs (fp32)",
            bytes_per_element=4,
        )
        if self.max_images is not None:
            require_positive(self, "max_images", minimum=10)
        require_processes(self, "workers")
        require_processes(self, "generate_workers", minimum=1)

    def recorded(self) -> dict:
        """The settings a log record carries (the data location as a string)."""
        fields = {k: v for k, v in vars(self).items() if k not in ("data", "data_cache")}
        return {**fields, "data": None if self.data is None else str(self.data)}


AS_GIVEN = PipelineConfig()
FIXED = replace(
    AS_GIVEN,
    pipeline="fixed",
    model="fixed",
    data_path="fixed",
    augmix_on=AUTO,
    workers=AUTO,
    pin_memory=True,
    non_blocking=True,
    precision=AUTO,
    sync_every_step=False,
    set_to_none=True,
    fused_adam=True,
    val_no_grad=True,
    val_divisor="val_images",
    cudnn="benchmark",
)
QUICK_SIZES = {"n_images": 120, "min_side": 160, "max_side": 400, "depth": 2, "batch_size": 32}
PRESETS = {
    "as_given": (AS_GIVEN, replace(AS_GIVEN, **QUICK_SIZES)),
    "fixed": (FIXED, replace(FIXED, **QUICK_SIZES, workers=2)),
}


def parse_config(
    description: str,
    default_out: str,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[argparse.Namespace, PipelineConfig]:
    """``--pipeline`` picks the preset pair the other flags override; validated config.
    ``extra`` adds a script's own arguments."""
    pre = ArgumentParser(add_help=False)
    pre.add_argument("--pipeline", choices=PIPELINES, default="as_given")
    pipeline = pre.parse_known_args()[0].pipeline
    p = base_parser(description, default_out)
    p.add_argument("--pipeline", choices=PIPELINES, default="as_given",
                   help="the preset the other flags override (help shows its defaults)")  # fmt: skip
    flags = ConfigFlags(p, *PRESETS[pipeline])
    add_flags(flags)
    if extra is not None:
        extra(p)
    args = p.parse_args()
    return args, flags.resolve(args)


def add_flags(flags: ConfigFlags) -> None:
    """A flag per :class:`PipelineConfig` field, so every fix can be switched alone."""
    on_off = {"action": argparse.BooleanOptionalAction}
    flags.add(
        "data",
        type=Path,
        help="clothing-dataset-full folder (images.csv, images_original/); none: generated",
    )
    flags.add("data_cache", type=Path, output=True, help="where the generated set is written once")
    flags.add("n_images", type=int, help="generated set: photos")
    flags.add("min_side", type=int, help="generated set: shortest long side, px")
    flags.add("max_side", type=int, help="generated set: longest long side, px")
    flags.add("generate_workers", type=int, help="processes generating the set (none: up to 16)")
    flags.add(
        "max_images", type=int, help="use the first N rows of images.csv (both pipelines alike)"
    )
    flags.add("model", choices=list(MODEL_PRESETS), help="ViT preset (effdl.models.vit)")
    flags.add("depth", type=int, help="transformer blocks")
    flags.add("batch_size", type=int)
    flags.add("lr", type=float, help="Adam learning rate")
    flags.add("data_path", choices=DATA_PATHS, help="Dataset and transforms")
    flags.add(
        "augmix_on",
        choices=AUGMIX_PLACES,
        help="fixed data path: AugMix per image in the loader or per batch on the device "
        "(auto: the device on CUDA, the loader's workers on the CPU)",
    )
    flags.add("workers", type=int_or_auto, help="DataLoader workers; auto = min(16, CPUs)")
    flags.add("pin_memory", help="pinned host batches (CUDA only)", **on_off)
    flags.add("non_blocking", help="asynchronous host-to-device copies", **on_off)
    flags.add("precision", choices=PRECISIONS, help="auto = bf16 autocast on CUDA, fp32 on CPU")
    flags.add("sync_every_step", help=".item() on loss and accuracy every step", **on_off)
    flags.add("set_to_none", help="zero_grad(set_to_none=...)", **on_off)
    flags.add("fused_adam", help="fused Adam kernel (CUDA only)", **on_off)
    flags.add("val_no_grad", help="validation under inference_mode", **on_off)
    flags.add(
        "val_divisor",
        choices=VAL_DIVISORS,
        help="what the reported validation averages are divided by",
    )
    flags.add("cudnn", choices=CUDNN_MODES)
    flags.add("compile", help="torch.compile the model", **on_off)  # fmt: skip


def for_device(cfg: PipelineConfig, device: torch.device) -> PipelineConfig:
    """``cfg`` with its ``"auto"`` fields decided, and CUDA-only options off on the CPU."""
    cuda = device.type == "cuda"
    augmix_on = "device" if cuda and cfg.data_path == "fixed" else "loader"
    return replace(
        cfg,
        workers=decide_auto(cfg.workers, min(16, os.cpu_count() or 1)),
        precision=decide_auto(cfg.precision, "bf16" if cuda else "fp32"),
        augmix_on=decide_auto(cfg.augmix_on, augmix_on),
        pin_memory=cfg.pin_memory and cuda,
        fused_adam=cfg.fused_adam and cuda,
    )
