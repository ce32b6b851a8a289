"""The next-token loss of an LM training run: summed over label tokens, its backward over
micro-batches and ranks, and the held-out loss over all ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import nn

from effdl.data.labels import IGNORE_INDEX
from effdl.lm.processes import Dist, all_reduce_sum
from effdl.ops.cross_entropy import cross_entropy_sum
from effdl.parallel import gradient_sync

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32 over labels that are not ``IGNORE_INDEX``;
    ``logits`` (..., V), ``labels`` (...). No fp32 copy of the whole logits is made
    (:func:`effdl.ops.cross_entropy.cross_entropy_sum`): the loss of eager runs."""
    return cross_entropy_sum(logits.flatten(0, -2), labels.flatten(), ignore=IGNORE_INDEX)


def upcast_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same loss as :func:`token_loss_sum` through ``F.cross_entropy`` on an fp32 copy of
    the logits: what compiled runs compile (inductor fuses the upcast into its own kernels)."""
    upcast = logits.flatten(0, -2).float()
    return F.cross_entropy(upcast, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def compiled_token_loss_sum() -> LossFn:
    """``torch.compile`` of :func:`upcast_token_loss_sum`: the loss of compiled runs."""
    return torch.compile(upcast_token_loss_sum)


def accumulated_backward(
    model: nn.Module,
    batch: Sequence[tuple[torch.Tensor, torch.Tensor]],
    compute: AbstractContextManager,
    loss_fn: LossFn,
    d: Dist,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of every micro-batch ``(inputs, labels)`` of ``batch`` (on the
    device), leaving the gradients of the mean loss over the label tokens of all ranks and
    micro-batches; DDP/FSDP synchronize gradients on the last micro-batch only. Returns the
    summed loss of this rank and the label tokens of all ranks (both on the device)."""
    n_labels = all_reduce_sum(sum((y != IGNORE_INDEX).sum() for _, y in batch).float(), d)
    loss_sum = torch.zeros((), device=d.device)
    for i, (x, y) in enumerate(batch):
        with gradient_sync(model, i == len(batch) - 1):
            with compute:
                logits = model(x)
            part = loss_fn(logits, y)
            # DDP and FSDP average gradients over ranks: undo it to get the global sum
            (part * (d.world / n_labels)).backward()
        loss_sum += part.detach()
    return loss_sum, n_labels


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    compute: AbstractContextManager,
    loss_fn: LossFn,
    d: Dist,
) -> float:
    """Mean held-out loss per label token over all ranks' batches (one host read); every
    forward runs inside ``compute`` (autocast or a null context)."""
    total = torch.zeros(2, device=d.device, dtype=torch.float64)
    for x, y in batches:
        x, y = x.to(d.device), y.to(d.device)
        with compute:
            logits = model(x)
        total[0] += loss_fn(logits, y).double()
        total[1] += (y != IGNORE_INDEX).sum()
    loss, count = all_reduce_sum(total, d).tolist()
    return loss / count
