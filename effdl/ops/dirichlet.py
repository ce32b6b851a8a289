"""Gamma and Dirichlet samples drawn from a ``torch.Generator``, on its device, with no host sync.

``torch.distributions.Gamma`` and ``Dirichlet`` draw from the global random state only. Here a
Gamma(alpha, 1) sample is Marsaglia and Tsang's method, as torch's own kernel runs it, built
from ``torch.randn``/``torch.rand`` draws that take a generator: for ``alpha < 1`` the sample
is Gamma(alpha + 1) times ``U ** (1 / alpha)``; for ``a >= 1``, with ``d = a - 1/3`` and
``c = 1 / sqrt(9 d)``, a normal ``x`` gives ``v = (1 + c x) ** 3``, accepted when ``1 + c x > 0``
and ``log U < x**2 / 2 + d (1 - v + log v)``, and the sample is ``d v``.

The rejection loop becomes :data:`GAMMA_CANDIDATES` candidates per sample, all drawn at once;
the first accepted one is taken. Each candidate is accepted with probability above 0.95, so
all of them fail with probability below ``0.05 ** 16``, about 1e-21 per sample; such a sample
takes ``d`` (a candidate with ``x = 0``) instead of an extra draw, which would need a host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

GAMMA_CANDIDATES = 16


def standard_gamma(concentration: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One Gamma(concentration, 1) sample per element of ``concentration`` (floating point,
    every value > 0), in its dtype and on its device, where ``generator`` must be. Draws
    ``2 * GAMMA_CANDIDATES + 1`` random numbers per element from ``generator``. A sample below
    the dtype's smallest normal number (small concentrations underflow) is raised to it, as
    torch's samplers do."""
    alpha = concentration
    boosted = alpha < 1
    a = torch.where(boosted, alpha + 1, alpha)
    d = (a - 1 / 3).unsqueeze(-1)
    c = torch.rsqrt(9 * d)
    shape = (*alpha.shape, GAMMA_CANDIDATES)
    like = {"dtype": alpha.dtype, "device": alpha.device, "generator": generator}
    x = torch.randn(shape, **like)
    u = 1 - torch.rand(shape, **like)  # in (0, 1], as torch's kernel draws it
    y = 1 + c * x
    v = y**3
    accepted = (y > 0) & (torch.log(u) < 0.5 * x * x + d * (1 - v + torch.log(v)))
    first = accepted.to(torch.uint8).argmax(dim=-1, keepdim=True)  # the first of the maxima
    v = torch.where(accepted.any(dim=-1, keepdim=True), v.gather(-1, first), 1.0)
    sample = (d * v).squeeze(-1)
    boost = (1 - torch.rand(alpha.shape, **like)) ** (1 / alpha)
    sample = torch.where(boosted, sample * boost, sample)
    return sample.clamp_min(torch.finfo(sample.dtype).tiny)


def sample_dirichlet(concentration: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One Dirichlet(concentration) sample per row: ``concentration`` is ``(..., k)``, floating
    point, every value > 0; the result has its shape, dtype and device, and each row sums to 1.

    Normalized Gamma samples (:func:`standard_gamma`); none is 0, so a row of tiny
    concentrations cannot give 0/0.
    """
    gamma = standard_gamma(concentration, generator)
    return gamma / gamma.sum(dim=-1, keepdim=True)
