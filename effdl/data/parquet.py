"""Seed 002's parquet pipelines: per-document samples padded by a collator, and a packed stream.

* :class:`ParquetDataset` + :class:`CollatorForCLM`: one document per sample, truncated to
  ``seq_len + 1`` tokens, padded by hand in the collator; the collator reports how many label
  tokens are ignored (the padding waste).
* :class:`IterableParquetDataset`: documents joined into one token stream with a BoS token in
  front of each, cut into samples of ``seq_len + 1`` tokens with no padding at all.

The parquet file needs a string column ``text``; it is read with pyarrow (no ``datasets``).
Rows whose ``text`` is null are skipped, their count given once by a
:class:`~effdl.data.corpus.NullTextWarning`; a file without any non-empty text is refused.
A tokenizer is either a ``tokenizers.Tokenizer`` or a Hugging Face (fast) tokenizer; both are
called without adding special tokens, so BoS placement is decided here, not by the tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from effdl.data.corpus import warn_null_text
from effdl.data.labels import IGNORE_INDEX

TEXT_COLUMN = "text"


@dataclass(frozen=True)
class TextEncoder:
    """``text -> token ids`` without special tokens; picklable, so DataLoader workers can spawn."""

    tokenizer: Any

    def __call__(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, Tokenizer):
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def as_encoder(tokenizer: Any) -> TextEncoder:
    """Wrap a ``tokenizers.Tokenizer`` or a Hugging Face tokenizer (anything with ``encode``)."""
    if not isinstance(tokenizer, Tokenizer) and not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"expected a tokenizers.Tokenizer or a transformers tokenizer, got {type(tokenizer).__name__}"
        )
    return TextEncoder(tokenizer)


def read_text_column(path: str | Path) -> pa.ChunkedArray:
    """The non-null ``text`` values of a parquet file, memory-mapped (copied only when some are
    null); clear errors (ValueError naming the file) for a bad file or one without any text."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such parquet file (expected a column {TEXT_COLUMN!r})")
    schema = pq.read_schema(path)
    if TEXT_COLUMN not in schema.names:
        raise ValueError(
            f"{path}: no column {TEXT_COLUMN!r} (found {schema.names}); expected one string "
            "document per row"
        )
    column = pq.read_table(path, columns=[TEXT_COLUMN], memory_map=True).column(TEXT_COLUMN)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{path}: column {TEXT_COLUMN!r} has type {column.type}, expected string")
    n_rows, n_null = len(column), column.null_count
    if n_null:
        column = column.drop_null()
    if len(column) == 0 or pc.max(pc.binary_length(column)).as_py() == 0:
        raise ValueError(
            f"{path}: no non-empty text rows ({n_rows:,} rows, {n_null:,} of them null; "
            "expected one string document per row)"
        )
    warn_null_text(path, n_null, n_rows)
    return column


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


class IterableParquetDataset(IterableDataset):
    """Documents as one token stream, ``[BoS, doc0..., BoS, doc1..., ...]``, cut with no padding.

    Each sample is a window of ``seq_len + 1`` stream tokens: ``inputs`` = its first
    ``seq_len``, ``labels`` = its last ``seq_len`` (both int64). Following seed 002, the label
    whose *input* is a BoS token (the first token of a document, predicted from BoS alone) is
    ``-100``; BoS positions are tracked as they are inserted, so a text token that happens to
    share the BoS id is not masked. Consecutive windows overlap by one token (the last label of
    one sample is the first input of the next), so every adjacent pair of the stream is a
    training pair exactly once.

    One pass over the rows ends the iteration (a final window shorter than ``seq_len + 1`` is
    dropped) unless ``cycle`` is set, in which case rows repeat forever. With DataLoader
    workers, worker w reads rows w, w + W, w + 2W, ...
    """

    def __init__(
        self,
        parquet_file: str | Path,
        tokenizer: Any,
        seq_len: int,
        bos_id: int = 1,
        cycle: bool = False,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.texts = read_text_column(parquet_file)
        self.real_length = len(self.texts)
        self.encode = as_encoder(tokenizer)
        self.seq_len = seq_len
        self.bos_id = bos_id
        self.cycle = cycle

    def _rows(self) -> Iterator[int]:
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        while True:
            yield from range(first, self.real_length, step)
            if not self.cycle or self.real_length == 0:
                return

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        width = self.seq_len + 1
        tokens: list[int] = []
        is_bos: list[bool] = []
        for row in self._rows():
            ids = self.encode(self.texts[row].as_py() or "")
            tokens.append(self.bos_id)
            tokens.extend(ids)
            is_bos.append(True)
            is_bos.extend([False] * len(ids))
            while len(tokens) >= width:
                window = torch.tensor(tokens[:width], dtype=torch.int64)
                inputs, labels = window[:-1], window[1:].clone()
                labels[torch.tensor(is_bos[: self.seq_len])] = IGNORE_INDEX
                yield inputs, labels
                del tokens[: self.seq_len]
                del is_bos[: self.seq_len]
