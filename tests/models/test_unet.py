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


def test_gradient_matches_finite_differences_and_reaches_every_parameter():
    """Autograd's gradient against a float64 central difference along a random direction in
    parameter space (gradcheck per element would take 500k forwards)."""
    torch.manual_seed(0)
    model = UNet().double()
    x, target = torch.randn(2, 3, 16, 16, dtype=torch.float64), torch.rand(2, 1, 16, 16).double()
    params = list(model.parameters())

    def loss() -> torch.Tensor:
        out = model(x)
        return torch.nn.functional.binary_cross_entropy_with_logits(out, target)

    grads = torch.autograd.grad(loss(), params)
    assert all(g.abs().sum() > 0 for g in grads)
    direction = [torch.randn_like(p) for p in params]
    eps = 1e-8  # small enough that no ReLU input crosses zero (a kink breaks the difference)
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            for p, d in zip(params, direction, strict=True):
                p.add_(d, alpha=sign * eps)
            values.append(loss())
            for p, d in zip(params, direction, strict=True):
                p.sub_(d, alpha=sign * eps)
    numeric = (values[0] - values[1]) / (2 * eps)
    analytic = sum((g * d).sum() for g, d in zip(grads, direction, strict=True))
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=0)


def test_rejects_sizes_not_divisible_by_8():
    with pytest.raises(ValueError, match="divisible by 8"):
        UNet()(torch.randn(1, 3, 30, 32))
