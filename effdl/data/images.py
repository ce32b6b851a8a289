"""Carvana-format segmentation data: the reader, a decoded-tensor cache, and a synthetic set.

Layout (as in the Kaggle Carvana Image Masking Challenge)::

    <root>/train/<car>_<view>.jpg
    <root>/train_masks/<car>_<view>_mask.gif      (car pixels > 0)

:func:`carvana_pairs` checks the layout and pairs every image with its mask.
:func:`load_carvana_tensors` decodes and resizes every pair once (in worker processes) and keeps
the result as uint8 tensors in a cache file, so training epochs do no JPEG/GIF decoding at all.
:func:`generate_synthetic_carvana` writes a seeded Carvana-like set in the same layout (car-like
silhouettes with wheels, windows and shading on textured studio backgrounds, a soft shadow that
is not part of the mask), so everything runs without the real data.
:func:`synthetic_mask_fractions` and :func:`carvana_mask_fractions` measure the share of car
pixels of each mask, of the synthetic set and of a folder (the real masks) alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

from effdl.data.process_pool import map_in_processes

IMAGE_DIR, MASK_DIR, MASK_SUFFIX = "train", "train_masks", "_mask.gif"
# The real train set (Kaggle's Carvana Image Masking Challenge): 318 cars x 16 views, 1918 x 1280.
CARVANA_TRAIN_IMAGES, CARVANA_CARS, CARVANA_WIDTH, CARVANA_HEIGHT = 5088, 318, 1918, 1280
# What PIL raises for a file it cannot identify, a truncated stream or a corrupt one.
DECODE_ERRORS = (OSError, ValueError, EOFError, SyntaxError, Image.DecompressionBombError)


class CarvanaLayoutError(ValueError):
    """The folder is not in the Carvana layout; the message says what is missing, in one line."""


class CarvanaFileError(CarvanaLayoutError):
    """An image or mask that cannot be decoded, or a mask of another size than its image; the
    message names the file, in one line."""


class CarvanaCacheError(ValueError):
    """The decoded-tensor cache cannot be written there; the message names the path, in one line."""


def carvana_pairs(root: str | os.PathLike) -> list[tuple[Path, Path]]:
    """``(image, mask)`` paths for every ``train/*.jpg``, sorted by name.

    Raises :class:`CarvanaLayoutError` when ``root``, ``train/`` or ``train_masks/`` is missing,
    when there are no images, or when an image has no ``<name>_mask.gif``.
    """
    root = Path(root)
    expected = f"expected {IMAGE_DIR}/*.jpg and {MASK_DIR}/*{MASK_SUFFIX}"
    for folder in (root, root / IMAGE_DIR, root / MASK_DIR):
        if not folder.is_dir():
            raise CarvanaLayoutError(f"{folder} is not a folder ({expected} under {root})")
    images = sorted((root / IMAGE_DIR).glob("*.jpg"))
    if not images:
        raise CarvanaLayoutError(f"no .jpg images in {root / IMAGE_DIR} ({expected})")
    pairs = [(img, root / MASK_DIR / f"{img.stem}{MASK_SUFFIX}") for img in images]
    missing = [m for _, m in pairs if not m.is_file()]
    if missing:
        raise CarvanaLayoutError(
            f"{len(missing)} of {len(pairs)} images have no mask, e.g. {missing[0]} is missing"
        )
    return pairs


def load_pair(image: Path, mask: Path, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode one pair, resized to ``size x size`` (bilinear for both, as the course's
    ``Resize``), as ``uint8`` arrays: image ``3 x size x size`` and mask ``size x size`` in {0, 1}
    (mask > 0 -> 1, the course's rule).

    Raises :class:`CarvanaFileError` naming the file when one cannot be decoded, or when the
    mask's size differs from its image's.
    """
    im, m = _decode(image, "RGB"), _decode(mask, "L")
    if im.size != m.size:
        raise CarvanaFileError(
            f"{mask}: mask is {m.size[0]}x{m.size[1]}, its image {image.name} is "
            f"{im.size[0]}x{im.size[1]} (expected the same size)"
        )
    rgb = np.asarray(im.resize((size, size), Image.BILINEAR))
    return np.ascontiguousarray(rgb.transpose(2, 0, 1)), binary_mask(m, size).astype(np.uint8)


def binary_mask(mask: Image.Image, size: int | None = None) -> np.ndarray:
    """``mask`` (mode "L") as a bool array, car = pixel > 0; with ``size``, first resized to
    ``size x size`` bilinearly, as the loader does."""
    if size is not None:
        mask = mask.resize((size, size), Image.BILINEAR)
    return np.asarray(mask) > 0


def mask_fraction(mask: Image.Image, size: int | None = None) -> float:
    """Share of the pixels of ``mask`` that are car (see :func:`binary_mask`)."""
    return float(binary_mask(mask, size).mean())


def _fractions(mask: Image.Image, sizes: Sequence[int | None]) -> tuple[float, ...]:
    return tuple(mask_fraction(mask, size) for size in sizes)


def _file_fractions(args: tuple[Path, Sequence[int | None]]) -> tuple[float, ...]:
    return _fractions(_decode(args[0], "L"), args[1])


def carvana_mask_fractions(
    root: str | os.PathLike, sizes: Sequence[int | None] = (None,), workers: int | None = None
) -> Iterator[tuple[float, ...]]:
    """For every mask under ``root`` (in :func:`carvana_pairs` order), its car fraction at each
    of ``sizes`` (None: as stored; n: resized as the loader does), lazily; decoded in
    ``workers`` processes. A mask that cannot be decoded is a :class:`CarvanaFileError`."""
    jobs = [(mask, tuple(sizes)) for _, mask in carvana_pairs(root)]
    yield from map_in_processes(_file_fractions, jobs, workers, chunksize=16)


def _decode(path: Path, mode: str) -> Image.Image:
    """The whole image at ``path`` in ``mode``; a file PIL cannot decode is a CarvanaFileError."""
    try:
        with Image.open(path) as im:
            return im.convert(mode)  # decodes every pixel: a truncated file fails here
    except DECODE_ERRORS as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CarvanaFileError(f"{path}: cannot decode this image ({msg})") from None


def _load_pair_args(args: tuple[Path, Path, int]) -> tuple[np.ndarray, np.ndarray]:
    return load_pair(*args)


@dataclass
class SegmentationTensors:
    """A decoded data set: ``images`` uint8 N x 3 x S x S, ``masks`` uint8 N x S x S in {0,1}."""

    images: torch.Tensor
    masks: torch.Tensor
    names: list[str]

    def __len__(self) -> int:
        return len(self.names)


def load_carvana_tensors(
    root: str | os.PathLike,
    size: int = 256,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
) -> SegmentationTensors:
    """Every pair under ``root`` decoded and resized to ``size`` (see :func:`load_pair`).

    With ``cache_dir`` the tensors are stored in ``<cache_dir>/carvana_<size>px_<digest>.pt``,
    where the digest covers the file names, sizes and modification times, and reused by later
    calls. Decoding runs in ``workers`` processes (default: up to 16 CPUs).
    """
    pairs = carvana_pairs(root)
    cache = None
    if cache_dir is not None:
        h = hashlib.sha1(str(size).encode())
        for img, msk in pairs:
            for f in (img, msk):
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        cache = Path(cache_dir) / f"carvana_{size}px_{h.hexdigest()[:16]}.pt"
        cached = _load_cache(cache, len(pairs), size)
        if cached is not None:
            return cached
    images = torch.empty((len(pairs), 3, size, size), dtype=torch.uint8)
    masks = torch.empty((len(pairs), size, size), dtype=torch.uint8)
    jobs = [(img, msk, size) for img, msk in pairs]
    _fill(images, masks, map_in_processes(_load_pair_args, jobs, workers, chunksize=16))
    data = SegmentationTensors(images, masks, [img.stem for img, _ in pairs])
    if cache is not None:
        _save_cache(cache, data)
    return data


def _save_cache(cache: Path, data: SegmentationTensors) -> None:
    """Write ``data`` to ``cache`` whole (a per-process temporary file, then a rename)."""
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"images": data.images, "masks": data.masks, "names": data.names}, tmp)
        os.replace(tmp, cache)
    except OSError as e:
        if tmp.is_file():
            tmp.unlink()
        raise CarvanaCacheError(
            f"{cache}: cannot write the tensor cache ({e.strerror or e}; expected a writable folder)"
        ) from None


def _load_cache(cache: Path, n: int, size: int) -> SegmentationTensors | None:
    """The tensors stored in ``cache``; None (a miss: rebuilt and rewritten) when the file is
    missing, unreadable or not the ``n`` pairs at ``size``."""
    if not cache.is_file():
        return None
    try:
        blob = torch.load(cache, weights_only=True)
        data = SegmentationTensors(blob["images"], blob["masks"], list(blob["names"]))
    except Exception:  # any damage (truncated zip, unpickling, missing keys) is a cache miss
        return None
    if data.images.shape != (n, 3, size, size) or data.masks.shape != (n, size, size):
        return None
    return data


def _fill(images: torch.Tensor, masks: torch.Tensor, results) -> None:
    for i, (img, msk) in enumerate(results):
        images[i] = torch.from_numpy(img)
        masks[i] = torch.from_numpy(msk)


# ---- the synthetic set -----------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticCarvanaConfig:
    """How many images, at what resolution (Carvana's originals are 1918 x 1280, aspect 1.5)."""

    n_images: int = 5088
    width: int = 480
    height: int = 320
    views_per_car: int = 16  # Carvana photographs each car from 16 angles
    seed: int = 0


def _smooth_noise(rng: np.random.Generator, h: int, w: int, cells: int) -> np.ndarray:
    """Low-frequency noise in [-1, 1]: a coarse random grid upsampled bicubically."""
    ch, cw = max(2, cells * h // w), max(2, cells)
    grid = Image.fromarray(rng.uniform(0, 255, (ch, cw)).astype(np.uint8))
    return np.asarray(grid.resize((w, h), Image.BICUBIC), dtype=np.float32) / 127.5 - 1.0


def _background(rng: np.random.Generator, h: int, w: int, horizon: int) -> np.ndarray:
    """A studio-like backdrop: tinted gradient wall, tiled floor, blotches and fine grain."""
    base = rng.uniform(0.55, 0.85)
    tint = rng.uniform(-0.04, 0.04, 3)
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    img = base + tint + 0.08 * (y - 0.5) + 0.07 * _smooth_noise(rng, h, w, 6)[..., None]
    # floor below the horizon: perspective tile lines
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    depth = np.clip(yy - horizon, 1, None)
    period = rng.uniform(20, 40)
    tiles = (np.sin(xx / depth * period * 3) > 0.92) | (np.sin(np.log(depth) * period / 4) > 0.95)
    floor = (yy > horizon) & tiles
    img = np.where(floor[..., None], img - rng.uniform(0.05, 0.12), img)
    img += 0.02 * rng.standard_normal((h, w, 1), dtype=np.float32)
    return img


def _car_polygons(rng: np.random.Generator, h: int, w: int):
    """Body, cabin and windows polygons plus wheel boxes of one car, in pixel coordinates."""
    view = rng.uniform(0, 1)  # 0: seen from the front, 1: from the side
    length = w * (0.4 + 0.45 * view) * rng.uniform(0.9, 1.1)
    cx = w / 2 + rng.uniform(-0.08, 0.08) * w
    ground = h * rng.uniform(0.72, 0.82)
    wheel_r = h * rng.uniform(0.06, 0.08)
    body_h = h * rng.uniform(0.15, 0.2)
    cabin_h = h * rng.uniform(0.11, 0.16)
    body_bottom = ground - wheel_r * 0.6
    body_top = body_bottom - body_h
    left, right = cx - length / 2, cx + length / 2
    nose = length * rng.uniform(0.03, 0.08)
    body = [
        (left + nose, body_top + body_h * 0.25),
        (left + 2 * nose, body_top),
        (right - 2 * nose, body_top),
        (right - nose, body_top + body_h * 0.2),
        (right, body_bottom - body_h * 0.3),
        (right - nose / 2, body_bottom),
        (left + nose / 2, body_bottom),
        (left, body_bottom - body_h * 0.3),
    ]
    c0 = left + length * rng.uniform(0.15, 0.3)
    c1 = right - length * rng.uniform(0.12, 0.3)
    slope0 = length * rng.uniform(0.06, 0.15)
    slope1 = length * rng.uniform(0.04, 0.12)
    cabin = [(c0, body_top + 1), (c0 + slope0, body_top - cabin_h),
             (c1 - slope1, body_top - cabin_h), (c1, body_top + 1)]  # fmt: skip
    inset = cabin_h * 0.15
    window = [(c0 + inset * 1.5, body_top - 1), (c0 + slope0 + inset, body_top - cabin_h + inset),
              (c1 - slope1 - inset, body_top - cabin_h + inset), (c1 - inset * 1.5, body_top - 1)]  # fmt: skip
    wheels = []
    for wx in (left + length * 0.2, right - length * 0.2):
        rx = wheel_r * (0.45 + 0.55 * view)  # wheels look narrower from the front
        wheels.append((wx - rx, ground - 2 * wheel_r, wx + rx, ground))
    if rng.uniform() < 0.5:  # mirror: the car faces the other way
        flip = lambda pts: [(w - x, y) for x, y in pts]  # noqa: E731
        body, cabin, window = flip(body), flip(cabin), flip(window)
        wheels = [(w - x1, y0, w - x0, y1) for x0, y0, x1, y1 in wheels]
    return body, cabin, window, wheels, ground, cx, length


def synthetic_car(config: SyntheticCarvanaConfig, index: int) -> tuple[Image.Image, Image.Image]:
    """Image ``index`` of the set and its mask (mode "L", 255 = car), both W x H.

    Deterministic in ``(config.seed, index)``, independent of the other images.
    """
    rng = np.random.default_rng([config.seed, index])
    w, h = config.width, config.height
    body, cabin, window, wheels, ground, cx, length = _car_polygons(rng, h, w)
    img = _background(rng, h, w, horizon=int(ground - h * rng.uniform(0.25, 0.35)))

    shadow = Image.new("L", (w, h), 0)
    ImageDraw.Draw(shadow).ellipse(
        (cx - length * 0.6, ground - h * 0.03, cx + length * 0.6, ground + h * 0.04), fill=255
    )
    shadow_a = np.asarray(shadow.filter(ImageFilter.GaussianBlur(h * 0.02)), np.float32) / 255
    img *= 1 - 0.45 * shadow_a[..., None]

    mask = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(mask)
    for poly in (body, cabin):
        draw.polygon(poly, fill=255)
    for box in wheels:
        draw.ellipse(box, fill=255)
    car = np.asarray(mask, np.float32)[..., None] / 255

    hsv_v = rng.choice([rng.uniform(0.05, 0.3), rng.uniform(0.35, 0.95)])
    color = Image.new("HSV", (1, 1), (int(rng.uniform(0, 255)), int(rng.uniform(0, 220)),
                                      int(hsv_v * 255)))  # fmt: skip
    rgb = np.asarray(color.convert("RGB"), np.float32).reshape(3) / 255
    yy = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    paint = rgb * (1.15 - 0.5 * yy) + 0.05 * _smooth_noise(rng, h, w, 12)[..., None]

    details = Image.new("L", (w, h), 0)
    ddraw = ImageDraw.Draw(details)
    ddraw.polygon(window, fill=255)
    for x0, y0, x1, y1 in wheels:
        ddraw.ellipse((x0, y0, x1, y1), fill=200)
    dark = np.asarray(details, np.float32)[..., None] / 255
    paint = paint * (1 - dark) + dark * rng.uniform(0.05, 0.2)
    img = img * (1 - car) + paint * car
    img = np.clip(img + 0.015 * rng.standard_normal(img.shape, dtype=np.float32), 0, 1)
    return Image.fromarray((img * 255).astype(np.uint8)), mask


def _synthetic_fractions(args: tuple[SyntheticCarvanaConfig, int, Sequence[int | None]]):
    config, index, sizes = args
    return _fractions(synthetic_car(config, index)[1], sizes)


def synthetic_mask_fractions(
    config: SyntheticCarvanaConfig,
    sizes: Sequence[int | None] = (None,),
    workers: int | None = None,
) -> Iterator[tuple[float, ...]]:
    """:func:`carvana_mask_fractions` of the synthetic set, image by image in index order,
    without writing it (each image is generated, as :func:`generate_synthetic_carvana` would)."""
    jobs = [(config, i, tuple(sizes)) for i in range(config.n_images)]
    yield from map_in_processes(_synthetic_fractions, jobs, workers, chunksize=16)


def _image_name(config: SyntheticCarvanaConfig, index: int) -> str:
    car, view = divmod(index, config.views_per_car)
    digest = hashlib.sha1(f"{config.seed}:{car}".encode()).hexdigest()[:12]
    return f"{digest}_{view + 1:02d}"


def _write_one(args: tuple[SyntheticCarvanaConfig, int, Path]) -> None:
    config, index, root = args
    image, mask = synthetic_car(config, index)
    name = _image_name(config, index)
    image.save(root / IMAGE_DIR / f"{name}.jpg", quality=90)
    mask.save(root / MASK_DIR / f"{name}{MASK_SUFFIX}")


def generate_synthetic_carvana(
    root: str | os.PathLike, config: SyntheticCarvanaConfig, workers: int | None = None
) -> Path:
    """Write the synthetic set to ``root`` in the Carvana layout and return ``root``.

    A folder already holding a complete set made from the same config is reused as it is. The
    set is written to a temporary sibling folder and renamed into place when complete, so an
    interrupted run leaves no partial set behind.
    """
    root = Path(root)
    stamp = json.dumps(asdict(config), sort_keys=True)
    marker = root / "synthetic.json"
    if marker.is_file() and marker.read_text() == stamp:
        return root
    if config.n_images < 1 or config.width < 32 or config.height < 32:
        raise ValueError(f"need n_images >= 1 and sides >= 32, got {config}")
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / IMAGE_DIR).mkdir(parents=True)
    (tmp / MASK_DIR).mkdir()
    jobs = [(config, i, tmp) for i in range(config.n_images)]
    for _ in map_in_processes(_write_one, jobs, workers, chunksize=8, ordered=False):
        pass
    (tmp / "synthetic.json").write_text(stamp)
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    return root
