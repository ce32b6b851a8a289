"""BatchedAugMix against torchvision.transforms.v2.AugMix's own per-image ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import AugMix

from effdl.ops.batched_augmix import (
    MAGNITUDE_BINS,
    NO_OP,
    OPS,
    PARTIAL_OPS,
    UNSIGNED_OPS,
    AugMixParams,
    BatchedAugMix,
    apply_op,
    augmix,
    magnitude_table,
)

H, W = 24, 33  # small and not square, so a swapped height and width shows
GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
# Geometric ops replay torchvision's grid arithmetic; a batched bmm or grid_sample may still
# round a coordinate differently from the single-image call, moving a bilinear sample by < 1e-5,
# which can flip the rounding of a value sitting at .5: 1 LSB on a rare pixel.
GEOMETRIC_MAX_DIFF, GEOMETRIC_MAX_FRACTION = 1, 1e-3


def make_images(batch: int, height: int = H, width: int = W, seed: int = 0) -> torch.Tensor:
    """Smooth images with noise and a different value range per channel (so autocontrast and
    equalize have work to do); sample 0 is constant (their no-op cases)."""
    gen = torch.Generator().manual_seed(seed)
    low = torch.rand(batch, 3, 1, 1, generator=gen) * 100
    span = torch.rand(batch, 3, 1, 1, generator=gen) * 155
    coarse = torch.rand(batch, 3, height // 4, width // 4, generator=gen)
    smooth = F.interpolate(coarse, size=(height, width), mode="bilinear")
    noise = torch.rand(batch, 3, height, width, generator=gen) * 20
    images = (low + span * smooth + noise).clamp(0, 255).to(torch.uint8)
    images[0] = 77
    return images


def reference_op(image: torch.Tensor, name: str, magnitude: float, interpolation: str):
    """torchvision AugMix's own dispatch from op name and magnitude to its functional kernel
    (a private method, used so the reference is torchvision's mapping, not a copy of it)."""
    ref = AugMix(interpolation=interpolation)
    return ref._apply_image_or_video_transform(
        image, name, magnitude, interpolation=ref.interpolation, fill=ref._fill
    )


def every_bin(name: str, batch: int) -> torch.Tensor:
    """Signed magnitudes of ``name`` over all bins, both signs where torchvision draws one."""
    table = magnitude_table(H, W)[OPS.index(name)]
    magnitudes = table[torch.arange(batch) % MAGNITUDE_BINS]
    if name in UNSIGNED_OPS:
        return magnitudes
    return torch.where(torch.arange(batch) % 2 == 1, -magnitudes, magnitudes)


def test_magnitude_table_and_op_order_are_torchvisions():
    space = AugMix._AUGMENTATION_SPACE
    assert list(space) == list(OPS)
    assert list(AugMix._PARTIAL_AUGMENTATION_SPACE) == list(OPS[:PARTIAL_OPS])
    table = magnitude_table(H, W)
    for k, (name, (magnitudes_fn, signed)) in enumerate(space.items()):
        expected = magnitudes_fn(MAGNITUDE_BINS, H, W)
        expected = torch.zeros(MAGNITUDE_BINS) if expected is None else expected.float()
        assert torch.equal(table[k], expected), name
        assert signed == (name not in UNSIGNED_OPS), name


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest"])
@pytest.mark.parametrize("name", OPS)
def test_each_op_matches_torchvision_per_sample(name, interpolation):
    batch = 2 * MAGNITUDE_BINS
    images = make_images(batch)
    magnitudes = every_bin(name, batch)
    ops = torch.full((batch,), OPS.index(name))
    out = apply_op(images, ops, magnitudes, interpolation)
    expected = torch.stack(
        [reference_op(images[i], name, float(magnitudes[i]), interpolation) for i in range(batch)]
    )
    assert out.dtype == torch.uint8 and out.shape == images.shape
    diff = (out.int() - expected.int()).abs()
    if name in GEOMETRIC:
        assert diff.max() <= GEOMETRIC_MAX_DIFF, name
        assert (diff > 0).float().mean() <= GEOMETRIC_MAX_FRACTION, name
    else:
        assert torch.equal(out, expected), f"{name}: {int((diff > 0).sum())} pixels differ"


def test_mixed_ops_in_one_batch_match_each_sample_alone():
    batch = 26
    images = make_images(batch, seed=1)
    ops = torch.tensor([NO_OP] + list(range(len(OPS))) * 2)[:batch]
    magnitudes = magnitude_table(H, W)[ops.clamp(min=0), torch.arange(batch) % 3] * -1
    out = apply_op(images, ops, magnitudes)
    for i in range(batch):
        alone = apply_op(images[i : i + 1], ops[i : i + 1], magnitudes[i : i + 1])
        assert torch.equal(out[i : i + 1], alone), f"sample {i} ({int(ops[i])})"
    assert torch.equal(out[0], images[0]), "NO_OP is the identity"


def draw(module: BatchedAugMix, batch: int) -> AugMixParams:
    return module.sample_params(batch, H, W, "cpu")


def test_augmix_is_torchvisions_mix_of_its_chains():
    batch = 5
    images = make_images(batch, seed=2)
    params = draw(BatchedAugMix(generator=torch.Generator().manual_seed(3)), batch)
    out = augmix(images, params)
    for i in range(batch):
        mix = params.original_weight[i] * images[i]
        for chain in range(params.ops.shape[1]):
            aug = images[i]
            for op, magnitude in zip(
                params.ops[i, chain], params.magnitudes[i, chain], strict=True
            ):
                if op != NO_OP:
                    aug = reference_op(aug, OPS[op], float(magnitude), "bilinear")
            mix.add_(params.chain_weights[i, chain] * aug)
        diff = (out[i].int() - mix.to(torch.uint8).int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= GEOMETRIC_MAX_FRACTION, i


def test_params_follow_augmix_rules():
    module = BatchedAugMix(severity=2, mixture_width=4, generator=torch.Generator().manual_seed(0))
    params = draw(module, 500)
    total = params.original_weight + params.chain_weights.sum(dim=1)
    torch.testing.assert_close(total, torch.ones(500))
    assert params.ops.shape == params.magnitudes.shape == (500, 4, 3)
    depths = (params.ops != NO_OP).sum(dim=2)
    assert set(depths.unique().tolist()) == {1, 2, 3}
    assert (params.ops[:, :, 0] != NO_OP).all(), "a chain is at least one op long"
    table = magnitude_table(H, W)
    op = params.ops.clamp(min=0)
    allowed = table[op, :2].abs()  # severity 2: the first two bins only
    assert ((params.magnitudes.abs().unsqueeze(-1) == allowed).any(-1)).all()
    unsigned = torch.isin(op, torch.tensor([OPS.index(n) for n in UNSIGNED_OPS]))
    assert (params.magnitudes[unsigned] >= 0).all()
    assert (params.magnitudes[~unsigned & (params.magnitudes != 0)] < 0).any()


@pytest.mark.parametrize(("all_ops", "n_ops"), [(True, len(OPS)), (False, PARTIAL_OPS)])
def test_ops_are_drawn_uniformly(all_ops, n_ops):
    module = BatchedAugMix(
        chain_depth=3, all_ops=all_ops, generator=torch.Generator().manual_seed(0)
    )
    ops = draw(module, 2000).ops.flatten()  # 18,000 draws
    counts = torch.bincount(ops, minlength=len(OPS)).double()
    assert counts[n_ops:].sum() == 0
    expected = ops.numel() / n_ops
    chi_square = ((counts[:n_ops] - expected) ** 2 / expected).sum()
    assert chi_square < 3 * n_ops, f"chi-square {chi_square:.1f} with {n_ops - 1} dof"


def test_seeded_generator_is_deterministic_and_seeds_differ():
    images = make_images(6)

    def run(seed: int) -> torch.Tensor:
        return BatchedAugMix(generator=torch.Generator().manual_seed(seed))(images)

    first = run(0)
    assert first.dtype == torch.uint8 and first.shape == images.shape
    assert torch.equal(first, run(0))
    assert not torch.equal(first, run(1))
    assert not torch.equal(first, images)


def test_identity_when_the_original_weight_is_one():
    batch = 4
    images = make_images(batch)
    params = draw(BatchedAugMix(generator=torch.Generator().manual_seed(0)), batch)
    params = AugMixParams(
        original_weight=torch.ones(batch),
        chain_weights=torch.zeros_like(params.chain_weights),
        ops=params.ops,
        magnitudes=params.magnitudes,
    )
    assert torch.equal(augmix(images, params), images)


@pytest.mark.parametrize(
    "images",
    [torch.zeros(2, 3, 8, 8), torch.zeros(2, 1, 8, 8, dtype=torch.uint8)],
    ids=["float", "one-channel"],
)
def test_rejects_other_than_uint8_rgb_batches(images):
    with pytest.raises(ValueError, match=r"uint8 \(B, 3, H, W\)"):
        BatchedAugMix()(images)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"severity": 11}, "severity"),
        ({"mixture_width": 0}, "mixture_width"),
        ({"alpha": 0.0}, "alpha"),
        ({"interpolation": "bicubic"}, "bicubic"),
    ],
)
def test_rejects_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchedAugMix(**kwargs)


# CUDA kernels round some float steps differently (reduction order of the contrast mean,
# fused multiply-adds in grid_sample and the blends), so a value at a rounding boundary moves
# by 1 LSB; later ops in a chain can widen that (a posterize or solarize threshold between the
# two values), so the bound is on how many pixels move, not only by how much.
GPU_MAX_FRACTION_OFF_BY_MORE_THAN_1 = 1e-3
GPU_MEAN_ABS_DIFF = 0.05


@pytest.mark.gpu
def test_cuda_matches_cpu_for_the_same_draw():
    batch = 16
    images = make_images(batch, 64, 80, seed=4)
    module = BatchedAugMix(generator=torch.Generator().manual_seed(0))
    params = module.sample_params(batch, 64, 80, "cpu")
    cpu = augmix(images, params)
    cuda = augmix(images.cuda(), params.to("cuda")).cpu()
    diff = (cuda.int() - cpu.int()).abs()
    assert (diff > 1).float().mean() <= GPU_MAX_FRACTION_OFF_BY_MORE_THAN_1
    assert diff.float().mean() <= GPU_MEAN_ABS_DIFF


@pytest.mark.gpu
def test_cuda_timing_of_a_vit_batch():
    from effdl.profiling.timing import benchmark

    images = torch.randint(0, 256, (256, 3, 224, 224), dtype=torch.uint8, device="cuda")
    module = BatchedAugMix(generator=torch.Generator("cuda").manual_seed(0))
    stats = benchmark(lambda: module(images), warmup=2, iters=10, device="cuda")
    out = module(images)
    assert out.shape == images.shape and out.dtype == torch.uint8
    print(f"BatchedAugMix 256x3x224x224 uint8 on {torch.cuda.get_device_name()}: "
          f"median {stats.median * 1e3:.1f} ms, min {stats.min * 1e3:.1f} ms")  # fmt: skip


@pytest.mark.gpu
def test_cuda_forward_has_no_host_sync():
    images = make_images(8, seed=5).cuda()
    module = BatchedAugMix(generator=torch.Generator("cuda").manual_seed(0))
    torch.cuda.set_sync_debug_mode("error")  # the test proves "no sync" instead of claiming it
    try:
        out = module(images)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == images.shape and out.dtype == torch.uint8
