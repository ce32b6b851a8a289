"""What train.py and profile_model.py share: the ViT training pipeline as given and as fixed.

One config, :class:`PipelineConfig`, has a field per choice the two pipelines make differently,
so a preset pair (full, ``--quick``) per pipeline is the whole difference, and every fix can be
switched on or off alone from the command line (an ablation is one flag). As given:

1. data path: CSV re-read for the label map, pandas ``.loc`` per item, full-resolution JPEG
   decode, Resize -> CenterCrop -> RandomResizedCrop (effdl.data.clothing);
2. loader: ``num_workers=0`` (decoding on the training thread), pageable memory, blocking copies;
3. model: dims 255, heads never split, attention pre-norm never applied, explicit softmax
   (effdl.models.vit);
4. fp32 (no autocast) and ``cudnn.deterministic = True``;
5. a host-device sync per step: ``.item()`` on loss and accuracy;
6. validation without ``no_grad`` (autograd graph built, activations kept) and its averages
   divided by the training loader's length;
plus ``zero_grad()`` zeroing in place (``set_to_none=False``, the default of the torch the course
wrote against) and a for-each Adam.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    require_choices,
    require_path,
    require_positive,
)
from effdl.data.clothing import (
    AsGivenClothingDataset,
    ClothingDataset,
    ClothingLayoutError,
    DeviceNormalize,
    as_given_transforms,
    class_names,
    fixed_transforms,
    generate_clothing_like,
    read_clothing_frame,
    split_frame,
)
from effdl.models.vit import PRESETS as MODEL_PRESETS
from effdl.models.vit import ViT
from effdl.ops.batched_augmix import BatchedAugMix
from effdl.profiling.timing import RegionTimer, peak_memory

AUTO = "auto"
PIPELINES = ("as_given", "fixed")
DATA_PATHS = ("as_given", "fixed")
AUGMIX_PLACES = (AUTO, "loader", "device")
PRECISIONS = (AUTO, "fp32", "bf16")
CUDNN_MODES = ("deterministic", "benchmark")
VAL_DIVISORS = ("train_batches", "val_images")
SPLIT_SEED = 0  # the split is a property of the data, the same for every run and pipeline


def int_or_auto(text: str) -> int | str:
    """An argparse type: ``auto`` or an integer."""
    return text if text == AUTO else int(text)


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
        if self.max_images is not None:
            require_positive(self, "max_images", minimum=10)
        if self.workers != AUTO:
            require_positive(self, "workers", minimum=0)
        if self.generate_workers is not None:
            require_positive(self, "generate_workers")

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
    pre = argparse.ArgumentParser(add_help=False)
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
    on_off = {"action": argparse.BooleanOptionalAction}
    flags.add(
        "data",
        type=Path,
        help="clothing-dataset-full folder (images.csv, images_original/); none: generated",
    )
    flags.add("data_cache", type=Path, help="where the generated set is written once")
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
    return replace(
        cfg,
        workers=min(16, os.cpu_count() or 1) if cfg.workers == AUTO else cfg.workers,
        precision=("bf16" if cuda else "fp32") if cfg.precision == AUTO else cfg.precision,
        augmix_on=(
            ("device" if cuda and cfg.data_path == "fixed" else "loader")
            if cfg.augmix_on == AUTO
            else cfg.augmix_on
        ),
        pin_memory=cfg.pin_memory and cuda,
        fused_adam=cfg.fused_adam and cuda,
    )


# ---- data ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClothingData:
    """The rows a run uses, where their images are, the label map, and what the data is."""

    root: Path
    frame: pd.DataFrame
    classes: list[str]
    source: str


def prepare_data(cfg: PipelineConfig) -> ClothingData:
    """``--data`` checked, or the generated set (made once under ``--data-cache``); the first
    ``--max-images`` rows. The label map comes from all rows, as the dataset as given makes it."""
    if cfg.data is not None:
        require_path(cfg.data, "a clothing-dataset-full folder", "--data")
        root, source = cfg.data, f"clothing:{cfg.data}"
    else:
        name = f"clothing_like_{cfg.n_images}_{cfg.min_side}-{cfg.max_side}px"
        root = cfg.data_cache / name
        start = time.perf_counter()
        generate_clothing_like(root, cfg.n_images, workers=cfg.generate_workers,
                               min_side=cfg.min_side, max_side=cfg.max_side)  # fmt: skip
        print(f"Clothing-like set: {root} ({time.perf_counter() - start:.1f} s)")
        source = f"clothing_like:{cfg.n_images}:{cfg.min_side}-{cfg.max_side}px"
    try:
        frame = read_clothing_frame(root)
    except ClothingLayoutError as e:
        raise UsageError(f"--data: {e}") from None
    classes = class_names(frame)
    if cfg.max_images is not None:
        frame = frame.head(cfg.max_images)
    return ClothingData(root, frame, classes, source)


def make_loaders(cfg: PipelineConfig, data: ClothingData) -> tuple[DataLoader, DataLoader]:
    """(train, val) loaders of the 80/20 split through ``cfg.data_path``'s Dataset."""
    train_frame, val_frame = split_frame(data.frame, seed=SPLIT_SEED)
    if len(train_frame) % cfg.batch_size == 1:
        raise UsageError(
            f"--batch-size {cfg.batch_size}: the last of {len(train_frame)} training images would "
            "be a batch of 1, which BatchNorm1d refuses; change --batch-size or --max-images"
        )
    if cfg.data_path == "as_given":
        train_t, val_t = as_given_transforms()
        train = AsGivenClothingDataset(data.root, train_frame, train_t)
        val = AsGivenClothingDataset(data.root, val_frame, val_t)
    else:
        train_t, val_t = fixed_transforms(augmix=cfg.augmix_on == "loader")
        train = ClothingDataset(data.root, train_frame, data.classes, train_t)
        val = ClothingDataset(data.root, val_frame, data.classes, val_t)
    options = {"batch_size": cfg.batch_size, "num_workers": cfg.workers,
               "pin_memory": cfg.pin_memory}  # fmt: skip
    if cfg.workers > 0:
        options["prefetch_factor"] = 4
    return DataLoader(train, shuffle=True, **options), DataLoader(val, **options)


def input_transform(
    cfg: PipelineConfig, device: torch.device, train: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a batch on the device goes through before the model: nothing for the float batches
    of the data path as given; for the fixed one, AugMix on training batches when it runs on the
    device (draws from a generator on the device: no host sync), then uint8 -> normalised
    float."""
    if cfg.data_path == "as_given":
        return lambda x: x
    normalize = DeviceNormalize(device)
    if not (train and cfg.augmix_on == "device"):
        return normalize
    augmix = BatchedAugMix(generator=torch.Generator(device).manual_seed(torch.initial_seed()))
    return lambda x: normalize(augmix(x))


# ---- model and step --------------------------------------------------------------------------


@dataclass
class Trainer:
    """The model, optimizer and per-batch work of one pipeline on one device."""

    cfg: PipelineConfig
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    prepare_train: Callable[[torch.Tensor], torch.Tensor]
    prepare_eval: Callable[[torch.Tensor], torch.Tensor]
    n_params: int

    def to_device(
        self, batch: tuple[torch.Tensor, torch.Tensor], train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on the device, images as the model takes them (augmented when ``train``
        and AugMix runs on the device)."""
        images, labels = batch
        non_blocking = self.cfg.non_blocking
        prepare = self.prepare_train if train else self.prepare_eval
        x = prepare(images.to(self.device, non_blocking=non_blocking))
        return x, labels.to(self.device, non_blocking=non_blocking)

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.precision == "bf16")  # fmt: skip

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on (x, y); returns (loss, logits), detached."""
        self.optimizer.zero_grad(set_to_none=self.cfg.set_to_none)
        with self.autocast():
            logits = self.model(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        self.optimizer.step()
        return loss.detach(), logits.detach()

    def eval_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self.autocast():
            logits = self.model(x)
            return F.cross_entropy(logits, y).detach(), logits.detach()


def build_trainer(cfg: PipelineConfig, device: torch.device, num_classes: int) -> Trainer:
    """The ViT preset at ``cfg.depth`` on ``device``, Adam, cuDNN flags set (process-wide)."""
    torch.backends.cudnn.deterministic = cfg.cudnn == "deterministic"
    torch.backends.cudnn.benchmark = cfg.cudnn == "benchmark"
    vit_cfg = replace(MODEL_PRESETS[cfg.model], depth=cfg.depth, num_classes=num_classes)
    model = ViT(vit_cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=cfg.fused_adam or None)
    compiled = torch.compile(model) if cfg.compile else model
    return Trainer(cfg, device, compiled, optimizer, input_transform(cfg, device, train=True),
                   input_transform(cfg, device, train=False), n_params)  # fmt: skip


# ---- one pass over a loader ------------------------------------------------------------------


class BatchStats:
    """Per-batch mean loss and accuracy. With ``sync_every_step`` each is read to the host at
    once (``.item()``: a host-device sync per step, as given); else they stay on the device and
    are read in one transfer by :meth:`host`."""

    def __init__(self, sync_every_step: bool) -> None:
        self.sync = sync_every_step
        self.losses: list = []
        self.accuracies: list = []
        self.sizes: list[int] = []

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        accuracy = (logits.argmax(-1) == labels).float().mean()
        if self.sync:
            self.losses.append(loss.item())
            self.accuracies.append(accuracy.item())
        else:
            self.losses.append(loss.float())
            self.accuracies.append(accuracy)
        self.sizes.append(len(labels))

    def host(self) -> tuple[list[float], list[float]]:
        if self.sync or not self.losses:
            return self.losses, self.accuracies
        both = torch.stack([torch.stack(self.losses), torch.stack(self.accuracies)]).tolist()
        return both[0], both[1]


@dataclass
class PhaseResult:
    """One pass (train or validation): per-batch means and sizes, host wait for each batch
    (``wait_s``, the first one includes worker start-up), device time of each step
    (``step_s``), wall time and peak GPU memory (NaN on the CPU)."""

    losses: list[float]
    accuracies: list[float]
    sizes: list[int]
    wait_s: list[float]
    step_s: list[float]
    wall_s: float
    peak_mem_gib: float

    @property
    def n_images(self) -> int:
        return sum(self.sizes)

    def mean(self, values: list[float]) -> float:
        """Image-weighted mean of per-batch means: the metric over the pass."""
        return sum(v * n for v, n in zip(values, self.sizes, strict=True)) / self.n_images


def timed_batches(loader: DataLoader, waits: list[float], desc: str) -> Iterator:
    """The loader's batches; the host time each ``next()`` took is appended to ``waits``."""
    batches = iter(tqdm(loader, desc=desc, unit="batch", leave=False))
    while True:
        start = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            return
        waits.append(time.perf_counter() - start)
        yield batch


def run_phase(trainer: Trainer, loader: DataLoader, train: bool) -> PhaseResult:
    """One epoch (``train``) or one validation pass over ``loader``; every step is timed on the
    device (CUDA events, read once at the end) and every wait for a batch on the host clock."""
    cfg = trainer.cfg
    trainer.model.train(train)
    stats, timer, waits = BatchStats(cfg.sync_every_step), RegionTimer(trainer.device), []
    if train:
        step, grad_mode = trainer.train_step, contextlib.nullcontext()
    else:
        step = trainer.eval_step
        grad_mode = torch.inference_mode() if cfg.val_no_grad else contextlib.nullcontext()
    with peak_memory(trainer.device) as mem, grad_mode:
        start = time.perf_counter()
        for batch in timed_batches(loader, waits, "train" if train else "val"):
            with timer.region():
                x, y = trainer.to_device(batch, train)
                loss, logits = step(x, y)
                stats.add(loss, logits, y)
        losses, accuracies = stats.host()
        step_s = timer.times()  # one synchronize
        wall_s = time.perf_counter() - start
    return PhaseResult(losses, accuracies, stats.sizes, waits, step_s, wall_s, mem.gib)
