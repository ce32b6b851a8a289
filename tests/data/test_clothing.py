"""The Clothing data paths: the generated set's layout and determinism, layout errors, the split,
and the fixed path against the path as given (labels, crop boxes, normalisation)."""

import shutil

import numpy as np
import pandas as pd
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import DataLoader

import effdl.data.clothing as clothing
from effdl.data.clothing import (
    COLUMNS,
    LABEL_COUNTS,
    AsGivenClothingDataset,
    CenterRandomResizedCrop,
    ClothingDataset,
    ClothingFileError,
    ClothingLayoutError,
    DeviceNormalize,
    as_given_transforms,
    class_names,
    clothing_like_sizes,
    decode_reduced,
    decode_rgb,
    fixed_transforms,
    generate_clothing_like,
    image_sizes,
    label_sequence,
    read_clothing_frame,
    split_frame,
)

SMALL = {"min_side": 48, "max_side": 96}


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    return generate_clothing_like(
        tmp_path_factory.mktemp("cl") / "set", 30, seed=3, workers=1, **SMALL
    )


def test_generated_set_has_the_clothing_layout(small_set):
    frame = read_clothing_frame(small_set)
    assert list(frame.columns) == list(COLUMNS) and len(frame) == 30
    assert set(frame["label"]) <= set(LABEL_COUNTS) and frame["image"].is_unique
    for name in frame["image"]:
        with Image.open(small_set / "images_original" / f"{name}.jpg") as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            assert all(48 <= side <= 96 for side in im.size)


def test_generation_is_deterministic_in_parallel_and_reuses_a_complete_set(small_set, tmp_path):
    again = generate_clothing_like(tmp_path / "again", 30, seed=3, workers=2, **SMALL)
    assert (again / "images.csv").read_bytes() == (small_set / "images.csv").read_bytes()
    for path in sorted((small_set / "images_original").iterdir()):
        assert (again / "images_original" / path.name).read_bytes() == path.read_bytes()
    stamp = (again / "images.csv").stat().st_mtime_ns
    generate_clothing_like(tmp_path / "again", 30, seed=3, workers=2, **SMALL)
    assert (again / "images.csv").stat().st_mtime_ns == stamp
    other = generate_clothing_like(tmp_path / "other", 30, seed=4, workers=1, **SMALL)
    assert (other / "images.csv").read_bytes() != (small_set / "images.csv").read_bytes()


def test_an_interrupted_generation_leaves_no_set_behind(tmp_path, monkeypatch):
    def fail(job):
        raise OSError("disk full")

    monkeypatch.setattr(clothing, "_write_image", fail)
    with pytest.raises(OSError, match="disk full"):
        generate_clothing_like(tmp_path / "set", 4, workers=1, **SMALL)
    assert list(tmp_path.iterdir()) == []


def test_labels_follow_the_real_proportions():
    assert pd.Series(label_sequence(5403, 0)).value_counts().to_dict() == LABEL_COUNTS
    counts = pd.Series(label_sequence(5400, 0)).value_counts()
    total = sum(LABEL_COUNTS.values())
    for name, c in LABEL_COUNTS.items():
        assert abs(counts[name] - 5400 * c / total) < 1
    assert label_sequence(5400, 0) != label_sequence(5400, 1)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no_root", r"is not a folder \(expected images.csv"),
        ("no_csv", r"images.csv is missing"),
        ("no_images", r"images_original is not a folder"),
        ("bad_column", r"images.csv lacks columns \['label'\]"),
        ("missing_image", r"1 of 3 images in .*images.csv have no file, e.g. .*b.jpg"),
    ],
)
def test_layout_errors_name_the_path_and_the_expectation(tmp_path, breakage, message):
    root = tmp_path / "set"
    (root / "images_original").mkdir(parents=True)
    frame = pd.DataFrame({"image": ["a", "b", "c"], "sender_id": [1, 2, 3],
                          "label": ["Hat", "Shoes", "Hat"], "kids": [False] * 3})  # fmt: skip
    for name in ("a", "c"):
        Image.new("RGB", (8, 8)).save(root / "images_original" / f"{name}.jpg")
    if breakage == "bad_column":
        frame = frame.drop(columns="label")
    if breakage != "no_csv":
        frame.to_csv(root / "images.csv", index=False)
    if breakage != "missing_image":
        Image.new("RGB", (8, 8)).save(root / "images_original" / "b.jpg")
    if breakage == "no_images":
        for p in (root / "images_original").iterdir():
            p.unlink()
        (root / "images_original").rmdir()
    target = tmp_path / "nowhere" if breakage == "no_root" else root
    with pytest.raises(ClothingLayoutError, match=message):
        read_clothing_frame(target)


def damaged_copy(small_set, tmp_path, damage: str):
    """A copy of the small set whose first image is random bytes or cut in half; its path."""
    root = shutil.copytree(small_set, tmp_path / "set")
    path = root / "images_original" / f"{read_clothing_frame(root)['image'].iloc[0]}.jpg"
    if damage == "random_bytes":
        path.write_bytes(np.random.default_rng(0).bytes(2000))
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return root, path


def datasets(root):
    frame = read_clothing_frame(root)
    transform = fixed_transforms()[1]
    return [AsGivenClothingDataset(root, frame, as_given_transforms()[1]),
            ClothingDataset(root, frame, class_names(frame), transform)]  # fmt: skip


@pytest.mark.parametrize("damage", ["random_bytes", "truncated"])
def test_an_image_that_cannot_be_decoded_is_an_error_naming_it(small_set, tmp_path, damage):
    root, path = damaged_copy(small_set, tmp_path, damage)
    for dataset in datasets(root):
        with pytest.raises(ClothingFileError) as e:
            dataset[0]
        assert isinstance(e.value, ClothingLayoutError)  # the class callers already catch
        assert e.value.path == path and str(e.value).startswith(f"{path}: cannot decode")
        assert len(str(e.value).splitlines()) == 1
        assert dataset[1][0].shape == (3, 224, 224)  # the others still load


def test_a_worker_that_cannot_decode_raises_the_same_one_line_error(small_set, tmp_path):
    """DataLoader re-raises a worker's exception as its class, built from a message with the
    worker's traceback in front: the error keeps only its own line and the file."""
    root, path = damaged_copy(small_set, tmp_path, "random_bytes")
    for dataset in datasets(root):
        with pytest.raises(ClothingFileError) as e:
            next(iter(DataLoader(dataset, batch_size=4, num_workers=1)))
        assert e.value.path == path and len(str(e.value).splitlines()) == 1
        assert str(e.value).startswith(f"{path}: cannot decode this image (")


def test_split_is_a_seeded_80_20_partition(small_set):
    frame = read_clothing_frame(small_set)
    train, val = split_frame(frame, seed=1)
    assert (len(train), len(val)) == (24, 6)
    assert sorted([*train.index, *val.index]) == list(frame.index)
    assert split_frame(frame, seed=1)[0].index.equals(train.index)
    assert not split_frame(frame, seed=2)[0].index.equals(train.index)


def test_fixed_dataset_labels_equal_the_as_given_ones(small_set):
    frame = read_clothing_frame(small_set)
    classes = class_names(frame)
    for part in split_frame(frame):
        given = AsGivenClothingDataset(small_set, part, transform=lambda im: 0)
        fixed = ClothingDataset(small_set, part, classes, transform=lambda im: 0)
        labels = [fixed[i][1] for i in range(len(fixed))]
        assert labels == [given[i][1] for i in range(len(given))]
        assert labels == [classes.index(name) for name in part["label"]]


def test_transforms_give_224_px_images(small_set):
    frame = read_clothing_frame(small_set)
    row = frame.iloc[0]
    path = small_set / "images_original" / f"{row['image']}.jpg"
    for transform in as_given_transforms():
        x = transform(Image.open(path).convert("RGB"))
        assert x.shape == (3, 224, 224) and x.dtype == torch.float32
        assert x.min() >= 0 and x.max() <= 1
    for transform in fixed_transforms():
        x = transform(decode_reduced(path))
        assert x.shape == (3, 224, 224) and x.dtype == torch.uint8


@pytest.mark.parametrize("seed", range(5))
def test_one_crop_equals_center_crop_then_random_resized_crop(seed):
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (320, 320, 3), dtype=np.uint8))
    torch.manual_seed(seed)
    given = T.Compose([T.CenterCrop(224), T.RandomResizedCrop(224)])(image)
    torch.manual_seed(seed)
    fixed = CenterRandomResizedCrop(224, 224)(image)
    assert np.array_equal(np.asarray(fixed), np.asarray(given))


def test_reduced_decode_keeps_320_px_per_side(tmp_path):
    image = Image.fromarray(np.full((1400, 1000, 3), 120, dtype=np.uint8))
    image.save(tmp_path / "big.jpg", quality=90)
    reduced = decode_reduced(tmp_path / "big.jpg")
    assert reduced.mode == "RGB" and reduced.size == (500, 700)  # 1/2: 1/4 would be < 320
    image.resize((300, 420)).save(tmp_path / "small.jpg")
    assert decode_reduced(tmp_path / "small.jpg").size == (300, 420)


def test_device_normalize_equals_to_tensor_then_normalize():
    x = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    reference = T.Normalize(clothing.IMAGENET_MEAN, clothing.IMAGENET_STD)(x.float() / 255)
    out = DeviceNormalize(torch.device("cpu"))(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference)


def test_image_sizes_are_the_decoded_sizes_and_the_generator_draws(small_set):
    frame = read_clothing_frame(small_set)
    decoded = [np.asarray(decode_rgb(clothing.image_path(small_set, n))).shape[1::-1]
               for n in frame["image"]]  # fmt: skip
    sizes = image_sizes(small_set)
    assert sizes.shape == (30, 2) and sizes.tolist() == [list(d) for d in decoded]
    assert np.array_equal(clothing_like_sizes(30, 3, **SMALL), sizes)
    assert sizes.max() <= SMALL["max_side"] and sizes.min() >= SMALL["min_side"]
