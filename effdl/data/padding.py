"""Hand-written padding: fixed-length samples (BRAIN) and pad-to-batch-max collation (BIG BRAIN).

Both pipelines read a :class:`~effdl.data.tokenize.TokenizedCorpus` (already truncated to the
maximum length) and produce the same :class:`Batch`: token ids right-padded with ``pad_id``, a
boolean padding mask (``True`` on padding, PyTorch's ``key_padding_mask`` convention), the
real lengths and the next-token labels (made here, in the DataLoader workers, so the training
loop's thread does not spend time on them). No ``pad_sequence``, no default-collate or tokenizer
padding: :func:`pad_batch` writes every sample into a pre-filled array with one boolean-mask
assignment.

Names from the assignments: seed 000's BRAIN is :class:`PaddedDataset`; BIG BRAIN is
:class:`UnpaddedDataset` + :func:`collate_fn`, seed 001's ``StandardDataset`` + ``collate_fn``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from effdl.data.labels import shifted_labels
from effdl.data.tokenize import TokenizedCorpus


class Batch(NamedTuple):
    """``input_ids`` (B, T) int64, ``padding_mask`` (B, T) bool (True = pad), ``lengths`` (B,),
    ``labels`` (B, T) int64: the next token, ``-100`` where it is padding or past the row."""

    input_ids: torch.Tensor
    padding_mask: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def from_arrays(cls, ids: np.ndarray, real: np.ndarray, lengths: np.ndarray) -> Batch:
        """The batch of right-padded ``ids`` (B, T) whose real tokens ``real`` (B, T) marks."""
        return cls(
            torch.from_numpy(ids),
            torch.from_numpy(~real),
            torch.from_numpy(lengths),
            torch.from_numpy(shifted_labels(ids, real)),
        )

    def pin_memory(self) -> Batch:
        return Batch(*(t.pin_memory() for t in self))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in self))

    @property
    def n_real_tokens(self) -> int:
        return int(self.lengths.sum())


def pad_batch(samples: Sequence[np.ndarray], pad_id: int = 0, pad_to: int | None = None) -> Batch:
    """Right-pad 1-D integer arrays to ``pad_to`` (default: the longest sample) into a Batch.

    Raises ValueError if a sample is longer than ``pad_to``. O(B * T), one numpy fill + one
    masked assignment (row-major order puts each sample's tokens at the start of its row).
    """
    if not samples:
        raise ValueError("pad_batch needs at least one sample")
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    longest = int(lengths.max())
    width = longest if pad_to is None else pad_to
    if longest > width:
        raise ValueError(f"a sample has {longest} tokens, more than pad_to={pad_to}")
    real = np.arange(width) < lengths[:, None]
    ids = np.full((len(samples), width), pad_id, dtype=np.int64)
    ids[real] = np.concatenate(samples)
    return Batch.from_arrays(ids, real, lengths)


def collate_fn(samples: Sequence[np.ndarray], pad_id: int = 0) -> Batch:
    """BIG BRAIN collation: pad to the longest sample of this batch."""
    return pad_batch(samples, pad_id=pad_id)


@dataclass(frozen=True)
class PadCollator:
    """:func:`collate_fn` with a fixed ``pad_id`` (picklable, for DataLoader workers)."""

    pad_id: int = 0

    def __call__(self, samples: Sequence[np.ndarray]) -> Batch:
        return pad_batch(samples, pad_id=self.pad_id)


class UnpaddedDataset(Dataset):
    """Samples of a tokenized corpus as they are (int32 arrays of their own length).

    ``lengths`` is exposed for length-aware samplers (:mod:`effdl.data.samplers`).
    """

    def __init__(self, corpus: TokenizedCorpus) -> None:
        self.corpus = corpus

    def __len__(self) -> int:
        return len(self.corpus)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.corpus[i]

    @property
    def lengths(self) -> np.ndarray:
        return self.corpus.lengths


class PaddedDataset(Dataset):
    """BRAIN: every sample padded to ``max_length`` in ``__getitem__``.

    Items are ``(ids, length)`` with ``ids`` an int64 array of shape (max_length,);
    :func:`stack_collate` stacks them (stacking equal shapes is not padding).
    """

    def __init__(self, corpus: TokenizedCorpus, max_length: int = 640, pad_id: int = 0) -> None:
        longest = int(corpus.lengths.max()) if len(corpus) else 0
        if longest > max_length:
            raise ValueError(
                f"corpus has a {longest}-token sample; truncate it to max_length={max_length} first"
            )
        self.corpus = corpus
        self.max_length = max_length
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.corpus)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        sample = self.corpus[i]
        ids = np.full(self.max_length, self.pad_id, dtype=np.int64)
        ids[: len(sample)] = sample
        return ids, len(sample)


def stack_collate(items: Sequence[tuple[np.ndarray, int]]) -> Batch:
    """Collation for :class:`PaddedDataset`: stack fixed-length rows, derive mask, lengths and
    labels."""
    ids = np.stack([x for x, _ in items])
    lengths = np.fromiter((n for _, n in items), dtype=np.int64, count=len(items))
    real = np.arange(ids.shape[1]) < lengths[:, None]
    return Batch.from_arrays(ids, real, lengths)


# Seed 001's name for the BIG BRAIN dataset.
StandardDataset = UnpaddedDataset
