"""Batched statistics over a list of gradients, computed on the device without host syncs.

The loss scalers need one fact per step (is any gradient element inf/NaN?) and the experiments
log another (how many gradient elements are exactly zero, i.e. underflowed). Both are reduced
on the device with foreach/batched ops; the caller decides when (and whether) to read the result
back to the host, so each costs at most one synchronization.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import Tensor


def group_by_device_and_dtype(tensors: Iterable[Tensor]) -> dict[tuple, list[Tensor]]:
    """Bucket tensors by ``(device, dtype)``: foreach kernels take their fast path per bucket."""
    groups: dict[tuple, list[Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return groups


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
    Nothing is read back to the host. Per (device, dtype) bucket this is one
    ``_foreach_norm(inf)`` (max |g| per tensor, NaN-propagating, so it is finite exactly when the
    tensor is) and one ``_foreach_mul_``; fp16 and fp32 gradients are both handled in their own
    dtype.
    """
    if not grads:
        return None
    flags = []
    for group in group_by_device_and_dtype(grads).values():
        norms = torch._foreach_norm(group, float("inf"))
        flags.append(torch.stack(norms).isfinite().all())
        torch._foreach_mul_(group, inv_scale)
    home = flags[0].device
    all_finite = flags[0] if len(flags) == 1 else torch.stack([f.to(home) for f in flags]).all()
    return all_finite.logical_not()


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
