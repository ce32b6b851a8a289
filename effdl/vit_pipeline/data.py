"""The data of a ViT pipeline: the Clothing rows (given or generated), the loaders of the 80/20
split through the pipeline's Dataset, and what a batch goes through on the device."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch.utils.data import DataLoader

from effdl.cli import UsageError, require_path
from effdl.data.clothing import (
    AsGivenClothingDataset,
    ClothingDataset,
    ClothingFileError,
    ClothingLayoutError,
    DeviceNormalize,
    as_given_transforms,
    class_names,
    fixed_transforms,
    generate_clothing_like,
    read_clothing_frame,
    split_frame,
)
from effdl.ops.batched_augmix import BatchedAugMix
from effdl.vit_pipeline.config import PipelineConfig

SPLIT_SEED = 0  # the split is a property of the data, the same for every run and pipeline


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
            "be a batch of 1, which BatchNorm1d refuses; change --batch-size, or "
            f"{'--max-images' if cfg.data else '--n-images'} (the images read)"
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


def decoded_batches(loader: DataLoader) -> Iterator:
    """The loader's batches; an image that cannot be decoded, in this process or in a worker,
    ends the run with a :class:`UsageError` naming the file (one line, at its first touch)."""
    try:
        yield from loader
    except ClothingFileError as e:
        raise UsageError(str(e)) from None


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
