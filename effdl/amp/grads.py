"""Batched statistics over a list of gradients, computed on the device without host syncs.

The loss scalers need one fact per step (is any gradient element inf/NaN?) and the experiments
log another (how many gradient elements are exactly zero, i.e. underflowed). Both are reduced
on the device with batched reductions; the caller decides when (and whether) to read the result
back to the host, so each costs at most one synchronization.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor


def grads_of(params: Iterable[Tensor]) -> list[Tensor]:
    """The ``.grad`` of every parameter that has one (parameters without a gradient are skipped).

    Sparse gradients are rejected: the scalers and statistics here work on dense storage.
    """
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            raise NotImplementedError("sparse gradients are not supported by effdl.amp")
        grads.append(g)
    return grads


def unscale_and_check_(grads: list[Tensor], inv_scale: float) -> Tensor | None:
    """Multiply every gradient in place by ``inv_scale``; flag non-finite values.

    Returns a 0-dim bool tensor (on the first gradient's device) that is True when any element
    of any gradient was inf or NaN *before* the multiplication, or None for an empty list.
    Nothing is read back to the host. The check is ``torch.nn.utils.get_total_norm(grads, inf)``
    (max |g|, NaN-propagating, so it is finite exactly when every gradient is; one foreach
    reduction per device and dtype); then each gradient is multiplied in its own dtype, fp16 and
    fp32 alike.
    """
    if not grads:
        return None
    any_non_finite = torch.nn.utils.get_total_norm(grads, math.inf).isfinite().logical_not()
    for g in grads:
        g.mul_(inv_scale)
    return any_non_finite


def zero_fraction(grads: list[Tensor]) -> Tensor:
    """Fraction of gradient elements that are exactly zero, as a 0-dim float32 device tensor.

    One ``count_nonzero`` per tensor and one sum; no host sync. An empty list gives NaN.
    """
    if not grads:
        return torch.tensor(float("nan"))
    total = sum(g.numel() for g in grads)
    home = grads[0].device
    nonzero = torch.stack([torch.count_nonzero(g).to(home) for g in grads]).sum()
    return 1.0 - nonzero.to(torch.float32) / total


def total_norm(grads: list[Tensor]) -> Tensor:
    """The L2 norm of all ``grads`` as one vector, in fp32, on the device (no sync): the
    gradient-norm trace a training log keeps (inf/NaN where an element is)."""
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    )
