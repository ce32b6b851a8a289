"""The digits/CIFAR loader: the CIFAR reader on tiny batches in the official pickle format, its
refusals in words, and scikit-learn's digits (split and scaling) when scikit-learn is present."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch

from effdl.data.digits import (
    CIFAR_TEST_FILE,
    CIFAR_TRAIN_FILES,
    DigitsDataError,
    load_digits_tensors,
)


def write_batch(path, data: np.ndarray, labels: list[int]) -> None:
    with path.open("wb") as f:
        pickle.dump({b"data": data, b"labels": labels, b"batch_label": b"fake"}, f)


@pytest.fixture
def cifar_dir(tmp_path):
    """Five training batches of 2 images and a test batch of 3, pixel values known."""
    rng = np.random.default_rng(0)
    for name in CIFAR_TRAIN_FILES:
        write_batch(tmp_path / name, rng.integers(0, 256, (2, 3072), dtype=np.uint8), [3, 7])
    write_batch(tmp_path / CIFAR_TEST_FILE, np.full((3, 3072), 255, dtype=np.uint8), [0, 1, 9])
    return tmp_path


def test_cifar_batches_are_read_in_channel_major_order(cifar_dir):
    data = load_digits_tensors(cifar_dir)
    assert data.image_shape == (3, 32, 32)
    assert data.x_train.shape == (10, 3, 32, 32) and data.x_train.dtype == torch.float32
    assert data.y_train.tolist() == [3, 7] * 5 and data.y_train.dtype == torch.int64
    assert data.y_test.tolist() == [0, 1, 9]
    assert torch.equal(data.x_test, torch.ones(3, 3, 32, 32))
    with (cifar_dir / CIFAR_TRAIN_FILES[0]).open("rb") as f:
        first = pickle.load(f)[b"data"][0]
    expected = torch.from_numpy(first.reshape(3, 32, 32)).float() / 255  # R plane, G, B
    assert torch.equal(data.x_train[0], expected)
    assert "CIFAR-10" in data.source


def test_missing_batch_is_named_with_the_layout(cifar_dir):
    (cifar_dir / "data_batch_3").unlink()
    with pytest.raises(DigitsDataError, match=r"data_batch_3 is missing \(expected CIFAR-10"):
        load_digits_tensors(cifar_dir)


def test_empty_folder_is_refused(tmp_path):
    with pytest.raises(DigitsDataError, match="data_batch_1 is missing"):
        load_digits_tensors(tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a pickle", "is not readable"),
        (pickle.dumps({b"labels": [1]}), r"is not readable \(KeyError"),
        (pickle.dumps({b"data": np.zeros((2, 10), np.uint8), b"labels": [1, 2]}), "shape"),
        (pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]}), "labels"),
    ],
)
def test_bad_batch_is_refused_in_one_line(cifar_dir, content, message):
    (cifar_dir / CIFAR_TEST_FILE).write_bytes(content)
    with pytest.raises(DigitsDataError, match=message) as refused:
        load_digits_tensors(cifar_dir)
    assert CIFAR_TEST_FILE in str(refused.value) and "\n" not in str(refused.value)


def test_sklearn_digits_split_and_scale():
    datasets = pytest.importorskip("sklearn.datasets")
    data = load_digits_tensors(seed=1, test_fraction=0.25)
    assert data.image_shape == (1, 8, 8) and "scikit-learn" in data.source
    assert data.x_train.shape[1:] == (1, 8, 8)
    assert len(data.y_train) + len(data.y_test) == 1797
    assert len(data.y_test) == round(1797 * 0.25)
    assert data.x_train.min() == 0 and data.x_train.max() == 1
    # The split is a permutation of the bundled set: every image is in exactly one half.
    raw = datasets.load_digits()
    both = torch.cat([data.x_train, data.x_test]).flatten(1) * 16
    reference = torch.as_tensor(raw.data, dtype=torch.float32)
    assert torch.equal(both.sort(0).values, reference.sort(0).values)
    assert set(data.y_test.tolist()) == set(range(10))
    again = load_digits_tensors(seed=1, test_fraction=0.25)
    assert torch.equal(again.y_test, data.y_test)


def test_generated_fallback_without_sklearn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import raises ImportError
    data = load_digits_tensors(seed=0)
    assert "generated" in data.source and "scikit-learn not installed" in data.source
    assert data.x_train.shape[1:] == (1, 8, 8) and len(data.y_train) + len(data.y_test) == 1797
    assert data.x_train.min() >= 0 and data.x_train.max() <= 1
    # Class-dependent: each class's mean image is nearer its own class's test images.
    means = torch.stack([data.x_train[data.y_train == c].mean(0) for c in range(10)])
    nearest = torch.cdist(data.x_test.flatten(1), means.flatten(1)).argmin(1)
    assert (nearest == data.y_test).float().mean() > 0.9


def test_test_fraction_out_of_range_is_refused():
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits_tensors(test_fraction=1.0)
