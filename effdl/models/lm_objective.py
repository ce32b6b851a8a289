"""Next-token loss and accuracy that ignore padding (seed 001's LMCrossEntropyLoss, LMAccuracy).

The shift: logits at position ``t`` predict ``input_ids[:, t + 1]``. So the last position of
every row has no target, and neither has any position whose *target* is padding (with right
padding, that is every position from ``length - 1`` on). Both metrics average over the
remaining target tokens of the whole batch (a token-level mean, not a mean of per-row means).
A batch without any target gives NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from effdl.data.labels import IGNORE_INDEX


def next_token_labels(
    input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Labels (B, T): ``labels[:, t] = input_ids[:, t + 1]``, ``IGNORE_INDEX`` where no target."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    if padding_mask is not None:
        labels[:, :-1].masked_fill_(padding_mask[:, 1:], IGNORE_INDEX)
    return labels


def lm_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, V) logits against already shifted (B, T) labels.

    For collators that produce labels themselves (packing: ``-100`` at document ends).
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )


class LMCrossEntropyLoss(nn.Module):
    """Mean next-token cross-entropy over non-padding targets.

    ``forward(logits (B, T, V), input_ids (B, T), padding_mask (B, T) bool, True = pad)``.
    """

    def forward(
        self,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return lm_cross_entropy(logits, next_token_labels(input_ids, padding_mask))


class LMAccuracy(nn.Module):
    """Fraction of non-padding targets whose argmax prediction is right (same inputs as the loss)."""

    def forward(
        self,
        logits: torch.Tensor,
        input_ids: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        labels = next_token_labels(input_ids, padding_mask)
        valid = labels != IGNORE_INDEX
        correct = (logits.argmax(dim=-1) == labels) & valid
        return correct.sum() / valid.sum()


@dataclass
class LMInputs:
    """What one LM step needs from a data batch: model keyword arguments and shifted labels.

    ``model_kwargs`` values are tensors, or anything else with ``.to(device, non_blocking)``
    (a packed batch's ``DocumentBlocks``)."""

    model_kwargs: dict[str, Any]
    labels: torch.Tensor
    n_real_tokens: int
    n_slots: int

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.n_real_tokens / self.n_slots

    def to(
        self, device: torch.device | str, non_blocking: bool = False, labels: bool = True
    ) -> LMInputs:
        """A copy on ``device``; ``labels=False`` leaves the labels where they are (a loop that
        only runs the forward does not need them on the device)."""
        kwargs = {k: v.to(device, non_blocking=non_blocking) for k, v in self.model_kwargs.items()}
        moved = self.labels.to(device, non_blocking=non_blocking) if labels else self.labels
        return LMInputs(kwargs, moved, self.n_real_tokens, self.n_slots)


def lm_inputs(batch: Any) -> LMInputs:
    """Model inputs and labels of a padded :class:`~effdl.data.padding.Batch` or a packed batch.

    Both bring their labels, made by the collate function in the DataLoader workers, so the
    training loop's thread does not spend time on them. A packed batch (anything with
    ``doc_ids``, e.g. ``effdl.data.packing.PackedBatch``) also brings restarting position ids
    and, when the collate built them, its FlexAttention block lists.
    Call it on the CPU batch (the token counts then need no device sync), then ``.to(device)``.
    """
    ids = batch.input_ids
    if hasattr(batch, "doc_ids"):
        kwargs = {"input_ids": ids, "position_ids": batch.position_ids, "doc_ids": batch.doc_ids}
        if getattr(batch, "blocks", None) is not None:
            kwargs["doc_blocks"] = batch.blocks
        return LMInputs(kwargs, batch.labels, int(batch.n_real_tokens), ids.numel())
    kwargs = {"input_ids": ids, "padding_mask": batch.padding_mask}
    return LMInputs(kwargs, batch.labels, int(batch.lengths.sum()), ids.numel())
