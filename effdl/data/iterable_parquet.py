from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from effdl.data.labels import IGNORE_INDEX
from effdl.data.parquet_text import as_encoder, read_text_column


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
    workers and ``rows_by_worker``, worker w reads rows w, w + W, w + 2W, ...; without it every
    worker reads every row (for a wrapper that splits the windows, as
    :class:`effdl.lm.data.RankShard` does, keeping the stream's order whatever the workers).
    """

    def __init__(
        self,
        parquet_file: str | Path,
        tokenizer: Any,
        seq_len: int,
        bos_id: int = 1,
        cycle: bool = False,
        rows_by_worker: bool = True,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.texts = read_text_column(parquet_file)
        self.real_length = len(self.texts)
        self.encode = as_encoder(tokenizer)
        self.seq_len = seq_len
        self.bos_id = bos_id
        self.cycle = cycle
        self.rows_by_worker = rows_by_worker

    def _rows(self) -> Iterator[int]:
        info = get_worker_info() if self.rows_by_worker else None
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
