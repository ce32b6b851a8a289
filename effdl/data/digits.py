"""Small real image-classification sets for learning curves: scikit-learn's bundled digits, or
CIFAR-10's python batches from a local folder.

Default: the 1,797 handwritten 8x8 digits that ship inside scikit-learn (real data, no network),
split into train and test by a seeded permutation. With ``data_dir``: CIFAR-10 as the official
python archive unpacks it::

    <data_dir>/data_batch_1 .. data_batch_5, <data_dir>/test_batch
    (each a pickled dict with b"data": uint8 (N, 3072) in channel-major order, b"labels": N ints)

The batches are pickles, and unpickling runs code the file names: point it at trusted files only.

Only when scikit-learn is not importable and no folder is given, a seeded generated set of 8x8
class-dependent images stands in (``source`` says so), so scripts still run everywhere.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_FILE = "test_batch"
CIFAR_LAYOUT = (
    "CIFAR-10 python batches: data_batch_1..data_batch_5 and test_batch, each a pickled dict "
    'with b"data" (N x 3072 uint8) and b"labels"'
)
CIFAR_SHAPE = (3, 32, 32)
DIGITS_SHAPE = (1, 8, 8)
NUM_CLASSES = 10


class DigitsDataError(ValueError):
    """A data folder that is not in CIFAR-10's python layout; the message names the file and the
    expected layout, in one line."""


@dataclass(frozen=True)
class DigitsData:
    """A train/test split of 10-class images.

    ``x_*``: float32 (N, C, H, W) in [0, 1] (``image_shape`` = (C, H, W)); ``y_*``: int64 (N,)
    class indices in 0..9; ``source`` names the data set (and says when it is generated).
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    source: str
    image_shape: tuple[int, int, int]
    num_classes: int = NUM_CLASSES


def load_digits_tensors(
    data_dir: str | Path | None = None, seed: int = 0, test_fraction: float = 0.2
) -> DigitsData:
    """CIFAR-10 from ``data_dir`` (its own test batch is the test set; ``test_fraction`` and
    ``seed`` are unused), else scikit-learn's digits split by ``seed`` with ``test_fraction`` of
    the images held out, else (no scikit-learn) a generated stand-in of the same shape and size.
    Raises DigitsDataError for a folder without the CIFAR files or with unreadable ones."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if data_dir is not None:
        return _read_cifar(Path(data_dir))
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        x, y = _generated_digits(seed)
        source = "generated 8x8 class-dependent images (scikit-learn not installed)"
    else:
        digits = load_digits()
        x = torch.as_tensor(digits.images, dtype=torch.float32) / 16  # pixel values 0..16
        y = torch.as_tensor(digits.target, dtype=torch.int64)
        source = "scikit-learn digits (8x8, 1797 images)"
    return _split(x.unsqueeze(1), y, seed, test_fraction, source, DIGITS_SHAPE)


def _split(
    x: torch.Tensor,
    y: torch.Tensor,
    seed: int,
    test_fraction: float,
    source: str,
    image_shape: tuple[int, int, int],
) -> DigitsData:
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = max(1, round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return DigitsData(x[train], y[train], x[test], y[test], source, image_shape)


def _generated_digits(seed: int, n: int = 1797) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (n, 8, 8) in [0, 1], labels): one random smooth prototype per class plus noise,
    so a classifier has something to learn and its test accuracy means something."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.rand(NUM_CLASSES, 1, 4, 4, generator=g)
    prototypes = torch.nn.functional.interpolate(prototypes, size=(8, 8), mode="bilinear")[:, 0]
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    x = prototypes[y] + 0.25 * torch.randn(n, 8, 8, generator=g)
    return x.clamp(0, 1), y


def _read_cifar(root: Path) -> DigitsData:
    train = [_read_cifar_batch(root / name) for name in CIFAR_TRAIN_FILES]
    x_test, y_test = _read_cifar_batch(root / CIFAR_TEST_FILE)
    return DigitsData(
        torch.cat([x for x, _ in train]),
        torch.cat([y for _, y in train]),
        x_test,
        y_test,
        f"CIFAR-10 python batches from {root}",
        CIFAR_SHAPE,
    )


def _read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float32 (N, 3, 32, 32) in [0, 1], labels int64) of one pickled batch."""
    if not path.is_file():
        raise DigitsDataError(f"{path} is missing (expected {CIFAR_LAYOUT})")
    try:
        with path.open("rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except Exception as e:  # a damaged pickle can raise almost anything
        reason = f"{type(e).__name__}: {e}"
        raise DigitsDataError(
            f"{path} is not readable ({reason}; expected {CIFAR_LAYOUT})"
        ) from None
    size = int(np.prod(CIFAR_SHAPE))
    if data.ndim != 2 or data.shape[1] != size or len(labels) != len(data):
        raise DigitsDataError(
            f"{path} holds data of shape {data.shape} and {len(labels)} labels "
            f"(expected N x {size} and N labels; {CIFAR_LAYOUT})"
        )
    if labels.size and not (labels.min() >= 0 and labels.max() < NUM_CLASSES):
        raise DigitsDataError(f"{path} has labels outside 0..{NUM_CLASSES - 1}")
    x = torch.from_numpy(data.reshape(-1, *CIFAR_SHAPE)).float() / 255
    return x, torch.from_numpy(labels)
