"""Seed 002's parquet pipelines: per-document samples padded by a collator, and a packed stream.

* :class:`ParquetDataset` + :class:`CollatorForCLM`: one document per sample, truncated to
  ``seq_len + 1`` tokens, padded by hand in the collator; the collator reports how many label
  tokens are ignored (the padding waste).
* :class:`IterableParquetDataset` (its own module, :mod:`effdl.data.iterable_parquet`, as the
  seed asks for it alone in a file): documents joined into one token stream with a BoS token
  in front of each, cut into samples of ``seq_len + 1`` tokens with no padding at all.

The parquet file needs a string column ``text``; it is read with pyarrow (no ``datasets``).
Rows whose ``text`` is null are skipped, their count given once by a
:class:`~effdl.data.corpus.NullTextWarning`; a file without any non-empty text is refused.
A tokenizer is either a ``tokenizers.Tokenizer`` or a Hugging Face (fast) tokenizer; both are
called without adding special tokens, so BoS placement is decided here, not by the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from effdl.data.iterable_parquet import IterableParquetDataset
from effdl.data.labels import IGNORE_INDEX
from effdl.data.parquet_text import TEXT_COLUMN, TextEncoder, as_encoder, read_text_column

__all__ = [
    "TEXT_COLUMN",
    "CLMBatch",
    "CollatorForCLM",
    "IterableParquetDataset",
    "ParquetDataset",
    "TextEncoder",
    "as_encoder",
    "read_text_column",
]


class ParquetDataset(Dataset):
    """One document per sample, tokenized on access and truncated to ``seq_len + 1`` ids.

    ``training_samples`` (default: the number of rows) may exceed the row count; indices wrap
    around, as in seed 002. With ``bos_id`` each sample starts with that token. Items are
    ``{"input_ids": list[int]}``, unpadded: :class:`CollatorForCLM` pads them.
    """

    def __init__(
        self,
        parquet_file: str | Path,
        tokenizer: Any,
        seq_len: int,
        training_samples: int | None = None,
        bos_id: int | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.texts = read_text_column(parquet_file)
        self.real_length = len(self.texts)
        self.encode = as_encoder(tokenizer)
        self.seq_len = seq_len
        self.training_samples = self.real_length if training_samples is None else training_samples
        self.bos_id = bos_id

    def __len__(self) -> int:
        return self.training_samples

    def __getitem__(self, idx: int) -> dict[str, list[int]]:
        text = self.texts[idx % self.real_length].as_py() or ""
        ids = self.encode(text)
        if self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return {"input_ids": ids[: self.seq_len + 1]}


class CLMBatch(NamedTuple):
    """Inputs and next-token labels ``(B, seq_len)`` int64; ``ignored_tokens`` counts ``-100`` labels."""

    inputs: torch.Tensor
    labels: torch.Tensor
    ignored_tokens: int


@dataclass
class CollatorForCLM:
    """Pad samples to ``seq_len + 1`` by hand, shift into inputs and labels, mask the padding.

    Padding is recognised by position (past each sample's length), not by comparing ids with
    ``pad_id``, so a real token that shares the pad id keeps its label. A sample of n ids
    yields n - 1 labels; the other ``seq_len - n + 1`` label positions are ``-100``.
    """

    seq_len: int
    pad_id: int

    def __call__(self, examples: Sequence[dict[str, Sequence[int]]]) -> CLMBatch:
        width = self.seq_len + 1
        ids = np.full((len(examples), width), self.pad_id, dtype=np.int64)
        lengths = np.empty(len(examples), dtype=np.int64)
        for row, example in enumerate(examples):
            seq = example["input_ids"]
            if len(seq) > width:
                raise ValueError(
                    f"sample {row} has {len(seq)} ids, more than seq_len + 1 = {width}"
                )
            ids[row, : len(seq)] = seq
            lengths[row] = len(seq)
        inputs = torch.from_numpy(ids[:, :-1].copy())
        labels = torch.from_numpy(ids[:, 1:].copy())
        # label j predicts id j + 1, which is padding once j + 1 >= length
        padded = torch.arange(self.seq_len)[None, :] + 1 >= torch.from_numpy(lengths)[:, None]
        labels[padded] = IGNORE_INDEX
        return CLMBatch(inputs, labels, int(padded.sum()))
