import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from effdl.data.images import (
    CarvanaCacheError,
    CarvanaFileError,
    CarvanaLayoutError,
    SyntheticCarvanaConfig,
    carvana_mask_fractions,
    carvana_pairs,
    generate_synthetic_carvana,
    load_carvana_tensors,
    load_pair,
    mask_fraction,
    synthetic_car,
    synthetic_mask_fractions,
)

CFG = SyntheticCarvanaConfig(n_images=6, width=96, height=64, views_per_car=3, seed=3)


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory):
    return generate_synthetic_carvana(tmp_path_factory.mktemp("carvana") / "set", CFG, workers=2)


def test_synthetic_set_has_carvana_layout(synthetic_root):
    pairs = carvana_pairs(synthetic_root)
    assert len(pairs) == 6
    img, mask = pairs[0]
    assert img.parent.name == "train" and mask.parent.name == "train_masks"
    assert mask.name == f"{img.stem}_mask.gif" and img.stem.endswith(("_01", "_02", "_03"))
    assert Image.open(img).size == (96, 64)


def test_generation_is_deterministic_and_masks_cover_a_car():
    a_img, a_mask = synthetic_car(CFG, 4)
    b_img, b_mask = synthetic_car(CFG, 4)
    assert np.array_equal(np.asarray(a_img), np.asarray(b_img))
    assert np.array_equal(np.asarray(a_mask), np.asarray(b_mask))
    frac = (np.asarray(a_mask) > 0).mean()
    assert 0.05 < frac < 0.5
    other, _ = synthetic_car(SyntheticCarvanaConfig(seed=4, width=96, height=64), 4)
    assert not np.array_equal(np.asarray(a_img), np.asarray(other))


def test_car_pixels_differ_from_background():
    img, mask = synthetic_car(SyntheticCarvanaConfig(width=192, height=128), 0)
    x, m = np.asarray(img, np.float32), np.asarray(mask) > 0
    assert np.abs(x[m].mean(0) - x[~m].mean(0)).max() > 10


def test_load_pair_resizes_and_binarises(synthetic_root):
    img, msk = load_pair(*carvana_pairs(synthetic_root)[0], size=32)
    assert img.shape == (3, 32, 32) and img.dtype == np.uint8
    assert msk.shape == (32, 32) and set(np.unique(msk)) <= {0, 1} and msk.any()


def test_tensor_cache_is_written_and_reused(synthetic_root, tmp_path):
    first = load_carvana_tensors(synthetic_root, size=32, cache_dir=tmp_path, workers=2)
    files = list(tmp_path.glob("carvana_32px_*.pt"))
    assert len(files) == 1
    second = load_carvana_tensors(synthetic_root, size=32, cache_dir=tmp_path, workers=1)
    assert torch.equal(first.images, second.images) and torch.equal(first.masks, second.masks)
    assert first.names == second.names and len(first) == 6
    direct = load_pair(*carvana_pairs(synthetic_root)[2], size=32)
    assert np.array_equal(first.images[2].numpy(), direct[0])


def test_existing_set_is_reused(synthetic_root):
    marker = synthetic_root / "synthetic.json"
    before = marker.stat().st_mtime_ns
    generate_synthetic_carvana(synthetic_root, CFG, workers=1)
    assert marker.stat().st_mtime_ns == before


def test_layout_errors_are_one_line_and_name_the_problem(tmp_path):
    with pytest.raises(CarvanaLayoutError, match="is not a folder"):
        carvana_pairs(tmp_path / "nope")
    (tmp_path / "train").mkdir()
    with pytest.raises(CarvanaLayoutError, match="train_masks"):
        carvana_pairs(tmp_path)
    (tmp_path / "train_masks").mkdir()
    with pytest.raises(CarvanaLayoutError, match=r"no \.jpg images"):
        carvana_pairs(tmp_path)
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "car_01.jpg")
    with pytest.raises(CarvanaLayoutError, match="1 of 1 images have no mask") as e:
        carvana_pairs(tmp_path)
    assert "\n" not in str(e.value) and "car_01_mask.gif" in str(e.value)


def test_invalid_config():
    with pytest.raises(ValueError):
        generate_synthetic_carvana("/tmp/never-written", SyntheticCarvanaConfig(n_images=0))


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("truncated_jpeg", r"train/{stem}\.jpg: cannot decode this image \("),
        ("corrupt_gif", r"train_masks/{stem}_mask\.gif: cannot decode this image \("),
        ("other_size", r"{stem}_mask\.gif: mask is 50x40, its image {stem}\.jpg is 96x64"),
    ],
)
def test_damaged_file_is_named_in_one_line(synthetic_root, tmp_path, what, message):
    root = shutil.copytree(synthetic_root, tmp_path / "set")
    image, mask = carvana_pairs(root)[4]
    if what == "truncated_jpeg":
        image.write_bytes(image.read_bytes()[:600])
    elif what == "corrupt_gif":
        mask.write_bytes(b"GIF89a and then nothing")
    else:
        Image.new("L", (50, 40)).save(mask)
    with pytest.raises(CarvanaFileError, match=message.format(stem=image.stem)) as e:
        load_carvana_tensors(root, size=32, workers=2)  # raised in a worker, named here
    assert "\n" not in str(e.value)
    assert isinstance(e.value, CarvanaLayoutError)  # scripts catch the one class


@pytest.mark.parametrize("damage", [b"", b"not a torch file", None])
def test_damaged_tensor_cache_is_a_miss_and_rewritten(synthetic_root, tmp_path, damage):
    good = load_carvana_tensors(synthetic_root, size=32, cache_dir=tmp_path, workers=1)
    (cache,) = tmp_path.glob("carvana_32px_*.pt")
    if damage is None:  # a whole file of other tensors
        torch.save({"images": good.images[:2], "masks": good.masks[:2], "names": ["a"]}, cache)
    else:
        cache.write_bytes(damage)
    again = load_carvana_tensors(synthetic_root, size=32, cache_dir=tmp_path, workers=1)
    assert torch.equal(again.images, good.images) and again.names == good.names
    assert torch.load(cache, weights_only=True)["names"] == good.names


@pytest.mark.parametrize("blocker", ["a file", "a folder"])
def test_unwritable_tensor_cache_is_one_error_naming_it(synthetic_root, tmp_path, blocker):
    if blocker == "a file":  # the cache folder is a file
        cache_dir = tmp_path / "cache"
        cache_dir.write_text("x")
    else:  # the cache file's name is taken by a folder
        cache_dir = tmp_path
        load_carvana_tensors(synthetic_root, size=32, cache_dir=cache_dir, workers=1)
        (cache,) = cache_dir.glob("carvana_32px_*.pt")
        cache.unlink()
        cache.mkdir()
        (cache / "keep").write_text("x")
    with pytest.raises(
        CarvanaCacheError, match=r"carvana_32px_.*\.pt: cannot write the tensor cache"
    ):
        load_carvana_tensors(synthetic_root, size=32, cache_dir=cache_dir, workers=1)
    assert not list(tmp_path.rglob("*.tmp*"))


def test_mask_fractions_are_the_car_pixel_shares_of_the_written_masks(synthetic_root):
    generated = list(synthetic_mask_fractions(CFG, (None, 32), workers=1))
    masks = [np.asarray(synthetic_car(CFG, i)[1]) for i in range(CFG.n_images)]
    assert [g[0] for g in generated] == [np.count_nonzero(m) / m.size for m in masks]
    pairs = carvana_pairs(synthetic_root)
    on_disk = list(carvana_mask_fractions(synthetic_root, (None, 32), workers=2))
    stored = [np.asarray(Image.open(mask).convert("L")) for _, mask in pairs]
    assert [f[0] for f in on_disk] == [np.count_nonzero(m) / m.size for m in stored]
    assert [f[1] for f in on_disk] == [load_pair(*pair, size=32)[1].mean() for pair in pairs]
    assert sorted(on_disk) == sorted(generated)  # the files hold exactly the generated masks
    assert mask_fraction(Image.new("L", (4, 2), 0)) == 0.0
    assert mask_fraction(Image.new("L", (4, 2), 255), size=3) == 1.0
