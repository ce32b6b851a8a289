"""One training step and one held-out evaluation under a :class:`~effdl.amp.precision.Precision`,
written once for every precision setup a comparison runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from effdl.amp.precision import Precision
from effdl.data.padding import Batch
from effdl.models.lm_objective import LMAccuracy, LMCrossEntropyLoss


def scaled_step(
    optimizer: torch.optim.Optimizer,
    prec: Precision,
    forward: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    grad_region: AbstractContextManager | None = None,
    unscaled_grads: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step: gradients dropped, ``forward()`` -> (output, loss) under ``prec``'s
    autocast and the scaled backward (both inside ``grad_region``, e.g. a timer's region), then
    the scaler's unscale, skip check and optimizer step. ``unscaled_grads`` is called between
    the unscale and the step, where the gradients are the true ones (to measure their norm).
    Returns (output, loss), not detached."""
    optimizer.zero_grad(set_to_none=True)
    with grad_region or contextlib.nullcontext():
        with prec.autocast():
            output, loss = forward()
        prec.backward(loss)
    if unscaled_grads is not None:
        prec.scaler.unscale_(optimizer)
        unscaled_grads()
    prec.step(optimizer)
    return output, loss


def lm_forward(
    model: nn.Module, batch: Batch, loss_fn: LMCrossEntropyLoss
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The ``forward`` of :func:`scaled_step` for an LM taking (input_ids, padding_mask):
    (logits, next-token loss) of ``batch``."""

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(batch.input_ids, batch.padding_mask)
        return logits, loss_fn(logits, batch.input_ids, batch.padding_mask)

    return forward


@torch.no_grad()
def lm_heldout_metrics(
    model: nn.Module, batches: list[Batch], prec: Precision
) -> tuple[float, float]:
    """Next-token loss and accuracy of ``model`` over ``batches``, each batch weighted by its
    target tokens (padding excluded); the model is left in training mode."""
    model.eval()
    loss_fn, acc_fn = LMCrossEntropyLoss(), LMAccuracy()
    sums, accs, weights = [], [], []
    for b in batches:
        with prec.autocast():
            logits = model(b.input_ids, b.padding_mask)
            sums.append(loss_fn(logits, b.input_ids, b.padding_mask).float())
        accs.append(acc_fn(logits, b.input_ids, b.padding_mask).float())
        weights.append((b.lengths - 1).clamp(min=0).sum())
    model.train()
    w = torch.stack(weights).float()
    loss = (torch.stack(sums) * w).sum() / w.sum()
    acc = (torch.stack(accs) * w).sum() / w.sum()
    return loss.item(), acc.item()
