"""The Clothing data set (Kaggle "clothing-dataset-full"): reader, split, the course's data path
as given and as fixed, and a generated Clothing-like set in the same layout.

Layout::

    <root>/images.csv                    columns image, sender_id, label, kids
    <root>/images_original/<image>.jpg   photos of varying, often large, resolution

Two data paths over the same 80/20 split (:func:`split_frame`, pandas ``frame.sample``):

- :class:`AsGivenClothingDataset` + :func:`as_given_transforms`: the label map is built by
  reading the CSV again, every item is looked up with pandas ``.loc``, every JPEG is decoded at
  full resolution and squashed to 320 x 320, then CenterCrop(224) -> RandomResizedCrop(224) ->
  flip -> AugMix -> ToTensor (float, no Normalize).
- :class:`ClothingDataset` + :func:`fixed_transforms`: labels as one int64 array built once; the
  JPEG decoder scales down by 2/4/8 in the DCT (``Image.draft``) to the smallest size still
  >= 320 per side, so large photos cost a fraction of a full decode; the central-224 crop and the
  random resized crop are one crop + resize (:class:`CenterRandomResizedCrop`, the same
  distribution of boxes, one resample fewer); AugMix stays (it is the recipe's augmentation),
  applied to the uint8 tensor (torchvision converts a PIL input to one and back anyway) or left
  to the device, where one batched kernel set augments the whole batch; items
  are uint8 tensors (4x fewer bytes through worker queues and the host-to-device copy),
  made float and normalised on the device by :class:`DeviceNormalize` (Normalize is added).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

from effdl.data.images import DECODE_ERRORS
from effdl.data.process_pool import map_in_processes

CSV_NAME, IMAGE_DIR = "images.csv", "images_original"
COLUMNS = ("image", "sender_id", "label", "kids")
RESIZE, CROP = 320, 224
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

# The 20 labels and their approximate frequencies in clothing-dataset-full (5,403 photos):
# heavily imbalanced, T-Shirt about 19%, Skip about 0.2%.
CLOTHING_IMAGES = 5403
LABEL_COUNTS = {
    "T-Shirt": 1011, "Longsleeve": 699, "Pants": 692, "Shoes": 431, "Shirt": 378,
    "Dress": 357, "Outwear": 312, "Shorts": 308, "Not sure": 228, "Hat": 171, "Skirt": 155,
    "Polo": 120, "Undershirt": 118, "Blazer": 109, "Hoodie": 100, "Body": 69, "Other": 67,
    "Top": 43, "Blouse": 23, "Skip": 12,
}  # fmt: skip


class ClothingLayoutError(ValueError):
    """The folder is not in the clothing-dataset-full layout; the message says what is wrong."""


class ClothingFileError(ClothingLayoutError):
    """An image that cannot be decoded; the message names the file, in one line, and ``path``
    is that file.

    Raised in a DataLoader worker it comes back to the main process as this class, rebuilt by
    torch from one string: the message with the worker's traceback in front. The constructor
    keeps only the original message (the traceback's last line), so the error stays one line
    wherever the image was decoded.
    """

    def __init__(self, message: str) -> None:
        message = str(message)
        if "\n" in message.strip():  # torch's ExceptionWrapper.reraise: the traceback first
            last = message.strip().splitlines()[-1]
            message = last.partition(f"{type(self).__name__}: ")[2] or last
        super().__init__(message)
        self.path = Path(message.rpartition(DECODE_FAILED)[0])


# ---- reading and splitting -------------------------------------------------------------------


def read_clothing_frame(root: str | os.PathLike) -> pd.DataFrame:
    """``images.csv`` of ``root`` (columns as in :data:`COLUMNS`, image and label as str).

    Raises :class:`ClothingLayoutError` naming the path when ``root``, the CSV or the image folder
    is missing, the CSV lacks a column or has no rows, or a listed image has no ``.jpg``.
    """
    root = Path(root)
    expected = f"expected {CSV_NAME} ({', '.join(COLUMNS)}) and {IMAGE_DIR}/<image>.jpg"
    if not root.is_dir():
        raise ClothingLayoutError(f"{root} is not a folder ({expected})")
    csv, images = root / CSV_NAME, root / IMAGE_DIR
    if not csv.is_file():
        raise ClothingLayoutError(f"{csv} is missing ({expected})")
    if not images.is_dir():
        raise ClothingLayoutError(f"{images} is not a folder ({expected})")
    try:
        frame = pd.read_csv(csv, dtype={"image": str, "label": str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ClothingLayoutError(f"{csv}: not a readable CSV ({e})") from None
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ClothingLayoutError(f"{csv} lacks columns {missing} (has {list(frame.columns)})")
    if frame.empty or frame["image"].isna().any() or frame["label"].isna().any():
        raise ClothingLayoutError(f"{csv}: no rows, or rows without an image or a label")
    absent = [name for name in frame["image"] if not (images / f"{name}.jpg").is_file()]
    if absent:
        raise ClothingLayoutError(
            f"{len(absent)} of {len(frame)} images in {csv} have no file, "
            f"e.g. {images / (absent[0] + '.jpg')}"
        )
    return frame


def class_names(frame: pd.DataFrame) -> list[str]:
    """The label map's order: the sorted distinct labels (index = class id)."""
    return sorted(frame["label"].unique())


def split_frame(
    frame: pd.DataFrame, val_fraction: float = 0.2, seed: int = 0
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, val): ``frame.sample`` of ``1 - val_fraction`` of the rows (seeded), the rest."""
    train = frame.sample(frac=1 - val_fraction, random_state=seed)
    return train, frame.drop(train.index)


def image_path(root: Path, name: str) -> Path:
    return root / IMAGE_DIR / f"{name}.jpg"


DECODE_FAILED = ": cannot decode this image"  # the Carvana reader's wording


def decode_rgb(path: Path, min_side: int | None = None) -> Image.Image:
    """The image at ``path`` decoded whole, in RGB; with ``min_side``, at the JPEG decoder's
    reduced scale (:func:`decode_reduced`). A file PIL cannot decode is a
    :class:`ClothingFileError` naming it: the run stops at its first touch of a bad file."""
    try:
        with Image.open(path) as im:
            if min_side is not None:
                im.draft("RGB", (min_side, min_side))
            return im.convert("RGB")  # decodes every pixel: a truncated file fails here
    except DECODE_ERRORS as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ClothingFileError(f"{path}{DECODE_FAILED} ({reason})") from None


# ---- the data path as given ------------------------------------------------------------------


def as_given_transforms() -> tuple[Callable, Callable]:
    """(train, val) transforms of the course's pipeline: PIL in, float tensor in [0, 1] out."""
    train = T.Compose([
        T.Resize((RESIZE, RESIZE)), T.CenterCrop(CROP), T.RandomResizedCrop(CROP),
        T.RandomHorizontalFlip(), T.AugMix(), T.ToTensor(),
    ])  # fmt: skip
    val = T.Compose([T.Resize((RESIZE, RESIZE)), T.CenterCrop(CROP), T.ToTensor()])
    return train, val


class AsGivenClothingDataset(Dataset):
    """The course's Dataset: re-reads ``images.csv`` for its label map, pandas ``.loc`` per item,
    full-resolution PIL decode and RGB conversion."""

    def __init__(self, root: str | os.PathLike, frame: pd.DataFrame, transform: Callable) -> None:
        self.root = Path(root)
        self.frame = frame
        self.transform = transform
        labels = pd.read_csv(self.root / CSV_NAME, dtype={"label": str})
        self.label_to_index = {name: i for i, name in enumerate(class_names(labels))}

    def __len__(self) -> int:
        return len(self.frame)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        row = self.frame.loc[self.frame.index[idx]]
        image = decode_rgb(image_path(self.root, row["image"]))
        return self.transform(image), self.label_to_index[row["label"]]


# ---- the fixed data path ---------------------------------------------------------------------


class CenterRandomResizedCrop:
    """``RandomResizedCrop(size)`` applied to the ``CenterCrop(window)`` of a PIL image, as one
    crop + resize: the box is drawn by torchvision's own sampler on the window's size (so the
    same random stream gives the same box) and shifted into the image."""

    def __init__(self, window: int = CROP, size: int = CROP) -> None:
        self.window = window
        self.size = [size, size]
        self._window_shape = torch.empty(0, window, window)  # a shape for get_params, no data
        self.scale, self.ratio = [0.08, 1.0], [3 / 4, 4 / 3]  # RandomResizedCrop's defaults

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        top = round((height - self.window) / 2)
        left = round((width - self.window) / 2)
        i, j, h, w = T.RandomResizedCrop.get_params(self._window_shape, self.scale, self.ratio)
        return TF.resized_crop(image, top + i, left + j, h, w, self.size, antialias=True)


def fixed_transforms(augmix: bool = True) -> tuple[Callable, Callable]:
    """(train, val) of the fixed path: PIL in (decoded at >= 320 per side), uint8 tensor out.
    ``augmix=False`` leaves AugMix to the device (:class:`effdl.ops.batched_augmix.BatchedAugMix`
    on the whole batch)."""
    train = T.Compose([
        T.Resize((RESIZE, RESIZE)), CenterRandomResizedCrop(CROP, CROP),
        T.RandomHorizontalFlip(), T.PILToTensor(), *([T.AugMix()] if augmix else []),
    ])  # fmt: skip
    val = T.Compose([T.Resize((RESIZE, RESIZE)), T.CenterCrop(CROP), T.PILToTensor()])
    return train, val


def decode_reduced(path: Path, min_side: int = RESIZE) -> Image.Image:
    """An RGB JPEG decoded at 1/1, 1/2, 1/4 or 1/8 scale: the smallest still >= ``min_side``
    per side (the decoder skips the discarded DCT coefficients, so a 3000 px photo decodes at
    about 1/64 of the full cost). A file that cannot be decoded is a :class:`ClothingFileError`."""
    return decode_rgb(path, min_side)


class ClothingDataset(Dataset):
    """Items ``(transform(image), label)`` of ``frame``'s rows; labels are indices into
    ``classes``, looked up once. Images are decoded at reduced scale by :func:`decode_reduced`."""

    def __init__(
        self, root: str | os.PathLike, frame: pd.DataFrame, classes: list[str], transform: Callable
    ) -> None:
        root = Path(root)
        index = {name: i for i, name in enumerate(classes)}
        self.paths = [image_path(root, name) for name in frame["image"]]
        self.labels = frame["label"].map(index).to_numpy(dtype=np.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        return self.transform(decode_reduced(self.paths[idx])), int(self.labels[idx])


class DeviceNormalize:
    """uint8 ``B x 3 x H x W`` on the device -> float32 ``(x / 255 - mean) / std`` (ImageNet
    statistics), the constants made once on the device."""

    def __init__(self, device: torch.device) -> None:
        mean = torch.tensor(IMAGENET_MEAN).reshape(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD).reshape(1, 3, 1, 1)
        self.scale = (255 * std).to(device)
        self.shift = (mean / std).to(device)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return images.float().div_(self.scale).sub_(self.shift)


# ---- the generated Clothing-like set ---------------------------------------------------------


def label_sequence(n_images: int, seed: int) -> list[str]:
    """``n_images`` labels in the real set's proportions (largest remainder), shuffled."""
    total = sum(LABEL_COUNTS.values())
    exact = {name: n_images * c / total for name, c in LABEL_COUNTS.items()}
    counts = {name: math.floor(x) for name, x in exact.items()}
    by_remainder = sorted(exact, key=lambda name: counts[name] - exact[name])
    for name in by_remainder[: n_images - sum(counts.values())]:
        counts[name] += 1
    labels = [name for name, c in counts.items() for _ in range(c)]
    order = np.random.default_rng([seed, n_images]).permutation(n_images)
    return [labels[i] for i in order]


SHAPES = ("ellipse", "rectangle", "triangle", "tee", "ring")
TEXTURES = ("solid", "rows", "columns", "checks")


def _class_style(label: str) -> tuple[str, str, float]:
    """(shape, texture, hue) of a class: 5 shapes x 4 textures, a hue per class."""
    c = list(LABEL_COUNTS).index(label)
    return SHAPES[c % 5], TEXTURES[c // 5], (c * 0.381966) % 1.0


def _photo_size(rng: np.random.Generator, min_side: int, max_side: int) -> tuple[int, int]:
    """(width, height): long side log-uniform in [min_side, max_side], aspect 0.6..1, mostly
    portrait, as phone and catalogue photos are."""
    long = round(math.exp(rng.uniform(math.log(min_side), math.log(max_side))))
    short = min(long, max(min_side, round(long * rng.uniform(0.6, 1.0))))
    return (short, long) if rng.uniform() < 0.7 else (long, short)


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, ...]) -> None:
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    if shape == "ellipse":
        draw.ellipse(box, fill=255)
    elif shape == "rectangle":
        draw.rectangle(box, fill=255)
    elif shape == "triangle":
        draw.polygon([(x0 + w / 2, y0), (x1, y1), (x0, y1)], fill=255)
    elif shape == "tee":
        draw.rectangle((x0, y0, x1, y0 + h * 0.3), fill=255)
        draw.rectangle((x0 + w * 0.3, y0, x1 - w * 0.3, y1), fill=255)
    else:  # ring
        draw.ellipse(box, fill=255)
        draw.ellipse((x0 + w * 0.3, y0 + h * 0.3, x1 - w * 0.3, y1 - h * 0.3), fill=0)


def _texture(texture: str, h: int, w: int, period: float) -> np.ndarray:
    """A 0/1 pattern (h x w x 1) that modulates the object's brightness."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) / period
    rows, cols = np.floor(yy) % 2, np.floor(xx) % 2
    pattern = {"solid": np.zeros_like(yy), "rows": rows, "columns": cols,
               "checks": (rows + cols) % 2}[texture]  # fmt: skip
    return pattern[..., None]


def _hsv_rgb(hue: float, sat: float, val: float) -> np.ndarray:
    color = Image.new("HSV", (1, 1), (int(hue * 255), int(sat * 255), int(val * 255)))
    return np.asarray(color.convert("RGB"), np.float32).reshape(3) / 255


def clothing_like_image(
    label: str, seed: int, index: int, min_side: int, max_side: int
) -> Image.Image:
    """Photo ``index`` of the generated set: a class-specific shape, texture and hue at a random
    place and scale on a smooth, tinted background, drawn at <= 384 px and scaled up to its
    photo size with film-like grain. Deterministic in ``(seed, index)``."""
    rng = np.random.default_rng([seed, index])
    width, height = _photo_size(rng, min_side, max_side)
    k = min(1.0, 384 / max(width, height))
    w, h = max(8, round(width * k)), max(8, round(height * k))
    coarse = Image.fromarray(rng.uniform(0, 255, (4, 4, 3)).astype(np.uint8))
    base = np.asarray(coarse.resize((w, h), Image.BICUBIC), np.float32) / 255
    img = 0.35 + 0.4 * base * rng.uniform(0.3, 1.0)

    shape, texture, hue = _class_style(label)
    side = min(w, h) * rng.uniform(0.45, 0.8)
    cx, cy = w / 2 + rng.uniform(-0.12, 0.12) * w, h / 2 + rng.uniform(-0.12, 0.12) * h
    mask = Image.new("L", (w, h), 0)
    box = (cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2)
    _draw_shape(ImageDraw.Draw(mask), shape, box)
    alpha = np.asarray(mask, np.float32)[..., None] / 255
    color = _hsv_rgb((hue + rng.uniform(-0.03, 0.03)) % 1.0, rng.uniform(0.6, 1.0), 1.0)
    shade = rng.uniform(0.45, 0.95) * (1 - 0.45 * _texture(texture, h, w, side / 6))
    img = img * (1 - alpha) + color * shade * alpha
    img += 0.03 * rng.standard_normal((h, w, 3), dtype=np.float32)
    photo = Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8))
    if (w, h) != (width, height):
        photo = photo.resize((width, height), Image.BILINEAR)
    grain = rng.integers(-6, 7, (128, 128, 3), dtype=np.int16)
    pixels = (
        np.asarray(photo, np.int16)
        + np.tile(grain, (height // 128 + 1, width // 128 + 1, 1))[:height, :width]
    )
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def clothing_like_sizes(n_images: int, seed: int, min_side: int, max_side: int) -> np.ndarray:
    """``n_images x 2`` (width, height) of the generated photos, as :func:`clothing_like_image`
    draws them, without drawing a pixel."""
    sizes = [_photo_size(np.random.default_rng([seed, i]), min_side, max_side)
             for i in range(n_images)]  # fmt: skip
    return np.array(sizes, dtype=np.int64).reshape(n_images, 2)


def image_sizes(root: str | os.PathLike) -> np.ndarray:
    """``N x 2`` (width, height) of every photo listed in ``root``'s ``images.csv``, in its
    order, read from the file headers (no decoding). Layout errors as
    :func:`read_clothing_frame`; a file PIL cannot identify is a :class:`ClothingFileError`."""
    root = Path(root)
    sizes = []
    for name in read_clothing_frame(root)["image"]:
        path = image_path(root, name)
        try:
            with Image.open(path) as im:
                sizes.append(im.size)
        except DECODE_ERRORS as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ClothingFileError(f"{path}{DECODE_FAILED} ({reason})") from None
    return np.array(sizes, dtype=np.int64).reshape(len(sizes), 2)


def _write_image(args: tuple[str, str, int, int, int, int, Path]) -> None:
    name, label, seed, index, min_side, max_side, folder = args
    image = clothing_like_image(label, seed, index, min_side, max_side)
    image.save(folder / f"{name}.jpg", quality=90)


def _write_images(jobs: list[tuple], workers: int | None) -> None:
    for _ in map_in_processes(_write_image, jobs, workers, chunksize=4, ordered=False):
        pass


def clothing_like_frame(n_images: int, seed: int) -> pd.DataFrame:
    """The generated set's ``images.csv``: UUID names, sender ids, labels, a few kids' items."""
    rng = np.random.default_rng([seed, n_images, 1])
    names = [str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range(n_images)]
    return pd.DataFrame({
        "image": names,
        "sender_id": rng.integers(0, 400, n_images),
        "label": label_sequence(n_images, seed),
        "kids": rng.uniform(size=n_images) < 0.05,
    })  # fmt: skip


def generate_clothing_like(
    root: str | os.PathLike,
    n_images: int = 5400,
    seed: int = 0,
    workers: int | None = None,
    *,
    min_side: int = 400,
    max_side: int = 3000,
) -> Path:
    """Write a Clothing-like set to ``root`` in the clothing-dataset-full layout; return ``root``.

    Labels follow the real set's 20 classes and their imbalance (:data:`LABEL_COUNTS`); photos
    have a long side log-uniform in ``[min_side, max_side]`` px, JPEG quality 90. A folder that
    already holds a complete set of the same settings is reused; otherwise the set is written to
    a temporary sibling folder in ``workers`` processes (default: up to 16 CPUs) and renamed into
    place when complete, so an interrupted run never leaves a half-written set.
    """
    if n_images < 1 or not 16 <= min_side <= max_side:
        raise ValueError(f"need n_images >= 1 and 16 <= min_side <= max_side, got "
                         f"{n_images}, {min_side}, {max_side}")  # fmt: skip
    root = Path(root)
    settings = {"n_images": n_images, "seed": seed, "min_side": min_side, "max_side": max_side}
    stamp = json.dumps(settings, sort_keys=True)
    marker = root / "clothing_like.json"
    if marker.is_file() and marker.read_text() == stamp:
        return root
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / IMAGE_DIR).mkdir(parents=True)
    frame = clothing_like_frame(n_images, seed)
    jobs = [
        (name, label, seed, i, min_side, max_side, tmp / IMAGE_DIR)
        for i, (name, label) in enumerate(zip(frame["image"], frame["label"], strict=True))
    ]
    try:
        _write_images(jobs, workers)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    frame.to_csv(tmp / CSV_NAME, index=False)
    (tmp / marker.name).write_text(stamp)
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    return root
