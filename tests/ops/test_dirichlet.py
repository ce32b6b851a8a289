"""Generator-driven Gamma and Dirichlet samples against torch.distributions' samplers."""

from __future__ import annotations

import math

import pytest
import torch

from effdl.ops.dirichlet import sample_dirichlet, standard_gamma

N = 100_000
# Two-sample Kolmogorov-Smirnov bound at a 1e-3 level for n = m = N; the seeds are fixed, so a
# pass is deterministic and the level only says how strict the bound is.
KS_BOUND = math.sqrt(-math.log(1e-3 / 2) / 2) * math.sqrt(2 / N)


def ks_statistic(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest gap between the empirical CDFs of two 1-D samples (ties counted at once)."""
    a, b = a.double().sort().values, b.double().sort().values
    points = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, points, right=True) / a.numel()
    cdf_b = torch.searchsorted(b, points, right=True) / b.numel()
    return (cdf_a - cdf_b).abs().max().item()


@pytest.mark.parametrize("alpha", [0.05, 0.3, 1.0, 2.5, 40.0])
def test_gamma_matches_torch_distributions(alpha: float) -> None:
    g = torch.Generator().manual_seed(0)
    ours = standard_gamma(torch.full((N,), alpha), generator=g)
    torch.manual_seed(1)
    ref = torch.distributions.Gamma(torch.tensor(alpha), torch.tensor(1.0)).sample((N,))
    assert ours.dtype == torch.float32 and ours.shape == (N,)
    assert (ours > 0).all() and ours.isfinite().all()
    assert ks_statistic(ours, ref) < KS_BOUND
    # mean alpha and variance alpha, within 5 standard errors
    assert abs(ours.double().mean().item() - alpha) < 5 * math.sqrt(alpha / N)
    assert abs(ours.double().var().item() / alpha - 1) < 5 * math.sqrt((2 + 6 / alpha) / N)


@pytest.mark.parametrize("concentration", [(1.0, 1.0), (1.0, 1.0, 1.0), (0.2, 3.0, 0.7)])
def test_dirichlet_marginals_match_torch_distributions(concentration: tuple) -> None:
    alpha = torch.tensor(concentration)
    g = torch.Generator().manual_seed(0)
    ours = sample_dirichlet(alpha.expand(N, -1), generator=g)
    torch.manual_seed(1)
    ref = torch.distributions.Dirichlet(alpha).sample((N,))
    torch.testing.assert_close(ours.sum(-1), torch.ones(N))
    for k in range(len(concentration)):
        assert ks_statistic(ours[:, k], ref[:, k]) < KS_BOUND, k


def test_seeded_generator_is_deterministic_and_seeds_differ() -> None:
    alpha = torch.full((64, 3), 1.0)

    def draw(seed: int) -> torch.Tensor:
        return sample_dirichlet(alpha, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(0), draw(0))
    assert not torch.equal(draw(0), draw(1))


def test_tiny_concentrations_still_give_rows_that_sum_to_one() -> None:
    """Gamma(0.001) samples underflow fp32; they are raised to the smallest normal, not 0/0."""
    rows = sample_dirichlet(torch.full((1000, 4), 1e-3), generator=torch.Generator().manual_seed(0))
    assert rows.isfinite().all() and (rows >= 0).all()
    torch.testing.assert_close(rows.sum(-1), torch.ones(1000))


@pytest.mark.gpu
def test_cuda_draws_on_the_generators_device_without_a_host_sync() -> None:
    alpha = torch.full((256, 3), 1.0, device="cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    torch.cuda.set_sync_debug_mode("error")  # the test proves "no sync" instead of claiming it
    try:
        rows = sample_dirichlet(alpha, generator=gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rows.device.type == "cuda"
    torch.testing.assert_close(rows.sum(-1), torch.ones(256, device="cuda"))
