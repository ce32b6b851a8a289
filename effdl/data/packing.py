"""Packing documents into fixed-length rows: streaming concatenation and bin packing.

Two ways to fill rows of ``seq_len`` tokens without padding every document:

* :class:`SequencedDataset` streams documents one after another and cuts the stream into rows;
  a document that does not fit the rest of a row is split, truncated or dropped (policy).
* bins of whole documents from :mod:`effdl.data.bin_packing` (First-/Best-Fit Decreasing), so
  nothing is truncated; :class:`BinDataset` + :func:`collate_bins` turn the bins into rows.

:func:`packed_loader` wires either one into a DataLoader of :class:`PackedBatch`.

Every row carries the metadata that keeps its documents apart: ``doc_ids`` (segment index per
token, ``-1`` on the padded tail), ``position_ids`` restarting at 0 in each segment,
``cu_seqlens`` (segment boundaries, the padded tail counted as one segment so the last entry is
``seq_len``) and ``labels`` (next token of the same segment, ``-100`` at segment ends and on
padding). :mod:`effdl.ops.document_mask` turns ``doc_ids`` into the attention mask that keeps
the documents of a row apart.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from effdl.data.bin_packing import Packing, best_fit_decreasing, first_fit_decreasing
from effdl.data.labels import IGNORE_INDEX
from effdl.ops.document_mask import PAD_DOC_ID, DocumentBlocks, document_blocks

OverflowPolicy = Literal["split", "truncate", "drop"]


# --------------------------------------------------------------------------------------------
# One packed row and a batch of rows


def pack_row(segments: Sequence[np.ndarray], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Concatenate ``segments`` (1-D token arrays, total <= ``seq_len``) into one padded row.

    Returns int64 ``input_ids``/``labels``/``position_ids`` and int32 ``doc_ids`` of shape
    ``(seq_len,)``, plus int32 ``cu_seqlens`` of shape ``(n_segments + has_padding + 1,)``.
    Empty segments are skipped. Padding is written here by hand (no ``pad_sequence``).
    """
    segs = [np.asarray(s) for s in segments if len(s) > 0]
    lens = np.fromiter((len(s) for s in segs), dtype=np.int64, count=len(segs))
    n = int(lens.sum())
    if n > seq_len:
        raise ValueError(f"segments hold {n} tokens, more than seq_len={seq_len}")
    ids = np.full(seq_len, pad_id, dtype=np.int64)
    if segs:
        ids[:n] = np.concatenate(segs)
    doc_ids = np.full(seq_len, PAD_DOC_ID, dtype=np.int32)
    doc_ids[:n] = np.repeat(np.arange(len(segs), dtype=np.int32), lens)
    seg_lens = np.append(lens, seq_len - n) if n < seq_len else lens
    cu = np.zeros(len(seg_lens) + 1, dtype=np.int32)
    np.cumsum(seg_lens, out=cu[1:])
    positions = np.arange(seq_len, dtype=np.int64) - np.repeat(cu[:-1], seg_lens)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    # A label is the next token only while the next token belongs to the same (real) document.
    same = (doc_ids[1:] == doc_ids[:-1]) & (doc_ids[1:] != PAD_DOC_ID)
    labels[:-1][same] = ids[1:][same]
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "doc_ids": torch.from_numpy(doc_ids),
        "position_ids": torch.from_numpy(positions),
        "cu_seqlens": torch.from_numpy(cu),
    }


@dataclass
class PackedBatch:
    """A batch of packed rows (B rows of L tokens).

    ``cu_seqlens`` (int32) indexes the flattened ``(B*L,)`` token stream, as varlen attention
    kernels expect; ``max_seqlen`` is the longest segment. ``n_real_tokens`` counts non-padding
    tokens and ``n_label_tokens`` the labels that are not ``-100``. ``blocks``: FlexAttention
    block lists of ``doc_ids`` when the collate built them (``attention_block_size``).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    n_real_tokens: int
    n_label_tokens: int
    blocks: DocumentBlocks | None = None

    _DEVICE_FIELDS = ("input_ids", "labels", "doc_ids", "position_ids", "cu_seqlens", "blocks")

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor on ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        """Called by ``DataLoader(pin_memory=True)``."""
        return self._map(lambda t: t.pin_memory())

    def _map(self, fn) -> PackedBatch:
        return replace(
            self,
            **{
                k: fn(getattr(self, k)) for k in self._DEVICE_FIELDS if getattr(self, k) is not None
            },
        )


def collate_packed(
    rows: Sequence[dict[str, torch.Tensor]],
    n_rows: int | None = None,
    pad_id: int | None = None,
    attention_block_size: int | None = None,
) -> PackedBatch:
    """Stack rows from :func:`pack_row` (all of one length) into a :class:`PackedBatch`.

    With ``n_rows`` (and ``pad_id``), a short batch is topped up with all-padding rows, so
    every batch has the same shape: compiled kernels (FlexAttention) would otherwise compile
    again for a final partial batch. ``attention_block_size``: also build the FlexAttention
    block lists of ``doc_ids`` (:func:`effdl.ops.document_mask.document_blocks`), here
    on the CPU, where DataLoader workers take that work off the training loop.
    """
    if not rows:
        raise ValueError("collate_packed needs at least one row")
    seq_len = rows[0]["input_ids"].shape[0]
    if n_rows is not None and len(rows) < n_rows:
        if pad_id is None:
            raise ValueError("collate_packed: topping up to n_rows needs pad_id")
        rows = [*rows, *[pack_row([], seq_len, pad_id)] * (n_rows - len(rows))]
    cus = [r["cu_seqlens"] for r in rows]
    global_cu = torch.cat([cus[0]] + [c[1:] + i * seq_len for i, c in enumerate(cus) if i > 0])
    doc_ids = torch.stack([r["doc_ids"] for r in rows])
    labels = torch.stack([r["labels"] for r in rows])
    blocks = None
    if attention_block_size is not None:
        blocks = document_blocks(doc_ids, attention_block_size)
    return PackedBatch(
        input_ids=torch.stack([r["input_ids"] for r in rows]),
        labels=labels,
        doc_ids=doc_ids,
        position_ids=torch.stack([r["position_ids"] for r in rows]),
        cu_seqlens=global_cu,
        max_seqlen=int(torch.diff(global_cu).max()),
        n_real_tokens=int((doc_ids != PAD_DOC_ID).sum()),
        n_label_tokens=int((labels != IGNORE_INDEX).sum()),
        blocks=blocks,
    )


# --------------------------------------------------------------------------------------------
# Streaming concatenation


class SequencedDataset(IterableDataset):
    """Concatenate documents into rows of exactly ``seq_len`` tokens (seed 001's packing).

    Documents are taken in order (or in a seeded permutation with ``shuffle``; call
    :meth:`set_epoch` between epochs) and appended to the current row. When a document does
    not fit the room left in the row, ``overflow`` decides:

    * ``"split"`` (default): fill the row with its head, continue the rest in the next row(s);
      no token is lost and only the last row of a shard is padded;
    * ``"truncate"``: fill the row with its head and discard the rest;
    * ``"drop"``: discard the document and close the row with padding.

    Each item is a dict from :func:`pack_row`; batch with ``collate_fn=collate_packed``.
    Under a DataLoader with workers, each worker packs a contiguous shard of the document
    order, so every document is used exactly once per epoch across workers. The final partial
    row of each shard is padded (or skipped with ``drop_last``). ``set_epoch`` acts on the
    copy a worker receives when an epoch starts, so it does not reach ``persistent_workers``.
    """

    def __init__(
        self,
        docs: Sequence[np.ndarray],
        seq_len: int,
        *,
        pad_id: int,
        overflow: OverflowPolicy = "split",
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        if overflow not in ("split", "truncate", "drop"):
            raise ValueError(f"overflow must be 'split', 'truncate' or 'drop', got {overflow!r}")
        self.docs = docs
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.overflow = overflow
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Change the shuffle permutation (same in every worker, different per epoch)."""
        self.epoch = epoch

    def _shard(self) -> np.ndarray:
        n = len(self.docs)
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(n)
        else:
            order = np.arange(n)
        info = get_worker_info()
        if info is None:
            return order
        return np.array_split(order, info.num_workers)[info.id]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        seq_len = self.seq_len
        segments: list[np.ndarray] = []
        used = 0
        for i in self._shard():
            doc = np.asarray(self.docs[int(i)])
            while len(doc) > 0:
                room = seq_len - used
                if len(doc) <= room:
                    segments.append(doc)
                    used += len(doc)
                    break
                if self.overflow == "drop":
                    if used > 0:
                        yield pack_row(segments, seq_len, self.pad_id)
                        segments, used = [], 0
                    break
                segments.append(doc[:room])
                yield pack_row(segments, seq_len, self.pad_id)
                segments, used = [], 0
                if self.overflow == "truncate":
                    break
                doc = doc[room:]
            if used == seq_len:
                yield pack_row(segments, seq_len, self.pad_id)
                segments, used = [], 0
        if used > 0 and not self.drop_last:
            yield pack_row(segments, seq_len, self.pad_id)


# --------------------------------------------------------------------------------------------
# Bins as a dataset


class BinDataset(Dataset):
    """Map-style dataset over a :class:`Packing`: item ``b`` = the token arrays of bin ``b``.

    ``docs[i]`` must return the 1-D token array of sequence ``i`` (the sequences whose lengths
    were packed). Batch with ``collate_fn=functools.partial(collate_bins, seq_len=..., pad_id=...)``.
    """

    def __init__(self, docs: Sequence[np.ndarray], packing: Packing) -> None:
        self.docs = docs
        self.packing = packing

    def __len__(self) -> int:
        return len(self.packing.bins)

    def __getitem__(self, b: int) -> list[np.ndarray]:
        return [np.asarray(self.docs[i])[a:z] for i, a, z in self.packing.bin_slices(b)]


def collate_bins(
    batch: Sequence[Sequence[np.ndarray]],
    seq_len: int,
    pad_id: int,
    n_rows: int | None = None,
    attention_block_size: int | None = None,
) -> PackedBatch:
    """Collate bins (each a list of token arrays, total <= ``seq_len``) into a PackedBatch
    (topped up to ``n_rows`` rows, block lists as in :func:`collate_packed`)."""
    rows = [pack_row(segments, seq_len, pad_id) for segments in batch]
    return collate_packed(rows, n_rows, pad_id, attention_block_size)


def packed_loader(
    docs: Sequence[np.ndarray],
    seq_len: int,
    batch_size: int,
    *,
    pad_id: int,
    method: Literal["concat", "ffd", "bfd"] = "bfd",
    shuffle: bool = False,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    static_shape: bool = True,
    attention_block_size: int | None = None,
) -> DataLoader:
    """A DataLoader of :class:`PackedBatch` (``batch_size`` rows of ``seq_len`` tokens).

    ``static_shape``: top up short batches (the last one; with workers, each worker's last)
    with all-padding rows, so every batch is ``(batch_size, seq_len)``.
    ``attention_block_size``: batches also carry FlexAttention block lists (``blocks``),
    built in the workers (use it when the model runs FlexAttention, e.g. 128).

    ``"concat"``: :class:`SequencedDataset` (split policy: documents may be cut at row ends).
    ``"ffd"``/``"bfd"``: bins from First-/Best-Fit Decreasing over ``docs``' lengths (taken from
    ``docs.lengths`` when present), nothing cut except documents longer than ``seq_len``
    (split into pieces); the packing is at ``loader.dataset.packing``. Shuffling permutes rows
    (bins) or, for ``"concat"``, documents. Raises ValueError when ``docs`` hold no token (the
    loader would be empty) or their lengths are not integers.
    """
    collate_options = {
        "n_rows": batch_size if static_shape else None,
        "pad_id": pad_id,
        "attention_block_size": attention_block_size,
    }
    loader_options = {
        "batch_size": batch_size,
        "num_workers": num_workers,
        "pin_memory": pin_memory,
    }
    if method not in ("concat", "ffd", "bfd"):
        raise ValueError(f"method must be 'concat', 'ffd' or 'bfd', got {method!r}")
    lengths = getattr(docs, "lengths", None)
    if lengths is None:
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    lengths = np.asarray(lengths)
    if lengths.size and not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"document lengths must be integers, got dtype {lengths.dtype}")
    if not lengths.any():
        # an empty loader would leave a training loop that waits for a token budget spinning
        raise ValueError(f"nothing to pack: all {len(lengths)} documents are empty")
    if method == "concat":
        ds = SequencedDataset(docs, seq_len, pad_id=pad_id, shuffle=shuffle, seed=seed)
        collate = functools.partial(collate_packed, **collate_options)
        return DataLoader(ds, collate_fn=collate, **loader_options)
    pack = best_fit_decreasing if method == "bfd" else first_fit_decreasing
    packing = pack(lengths, seq_len, oversize="split")
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        BinDataset(docs, packing),
        shuffle=shuffle,
        generator=generator,
        collate_fn=functools.partial(collate_bins, seq_len=seq_len, **collate_options),
        **loader_options,
    )
