import pytest
import torch

from effdl.models.unet import UNet


def test_shapes_channels_and_parameter_count():
    model = UNet()
    x = torch.randn(2, 3, 64, 48)
    skip1 = model.down1(x)
    assert skip1.shape == (2, 32, 32, 24)
    assert model.down2(model.pool(skip1)).shape == (2, 128, 16, 12)
    assert model(x).shape == (2, 1, 64, 48)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [
        (3, 16), (16, 32), (32, 64), (64, 128), (128, 128),
        (256, 128), (128, 32), (64, 64), (64, 32), (32, 16), (16, 1),
    ]  # fmt: skip
    assert convs[1].stride == (2, 2) and convs[4].kernel_size == (1, 1)
    expected = sum(
        c.weight.numel() + (c.bias.numel() if c.bias is not None else 0) for c in convs
    ) + 2 * sum(c.out_channels for c in convs[:-1])  # BatchNorm weight + bias
    assert sum(p.numel() for p in model.parameters()) == expected


def test_backward_reaches_every_parameter():
    model = UNet()
    out = model(torch.randn(2, 3, 32, 32))
    torch.nn.functional.binary_cross_entropy_with_logits(out, torch.ones_like(out)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_rejects_sizes_not_divisible_by_8():
    with pytest.raises(ValueError, match="divisible by 8"):
        UNet()(torch.randn(1, 3, 30, 32))
