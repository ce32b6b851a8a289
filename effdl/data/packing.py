"""Packing documents into fixed-length rows: streaming concatenation and bin packing.

Two ways to fill rows of ``seq_len`` tokens without padding every document:

* :class:`SequencedDataset` streams documents one after another and cuts the stream into rows;
  a document that does not fit the rest of a row is split, truncated or dropped (policy).
* :func:`first_fit_decreasing` / :func:`best_fit_decreasing` place whole documents into bins
  of ``capacity`` tokens, so nothing is truncated ("Fewer Truncations Improve Language
  Modeling", Ding et al. 2024); :class:`BinDataset` + :func:`collate_bins` turn the bins into rows.

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
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from effdl.data.labels import IGNORE_INDEX
from effdl.ops.document_mask import PAD_DOC_ID, DocumentBlocks, document_blocks

OverflowPolicy = Literal["split", "truncate", "drop"]
OversizePolicy = Literal["error", "split", "drop"]


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
# Bin packing


class _MaxSegmentTree:
    """Max over an array of ints, with "leftmost index whose value >= x" in O(log n).

    Backed by a Python list because the hot loops do scalar reads and writes, which are several
    times cheaper on a list than on a numpy array.
    """

    def __init__(self, n: int, fill: int) -> None:
        size = 1
        while size < n:
            size *= 2
        self.size = size
        self.t = [fill] * (2 * size)

    def get(self, i: int) -> int:
        return self.t[i + self.size]

    def set(self, i: int, value: int) -> None:
        t = self.t
        i += self.size
        t[i] = value
        i >>= 1
        while i:
            a, b = t[2 * i], t[2 * i + 1]
            m = a if a > b else b
            if t[i] == m:
                break  # ancestors were computed from this value: unchanged
            t[i] = m
            i >>= 1

    def set_range(self, lo: int, values: Sequence[int]) -> None:
        """Overwrite leaves ``lo .. lo+len(values)-1`` and rebuild their ancestors, O(k + log n)."""
        t = self.t
        a = lo + self.size
        b = a + len(values) - 1
        t[a : b + 1] = values
        while a > 1:
            a >>= 1
            b >>= 1
            for p in range(a, b + 1):
                x, y = t[2 * p], t[2 * p + 1]
                t[p] = x if x > y else y

    def leftmost_at_least(self, x: int) -> int:
        """Smallest index whose value is >= ``x``, or -1."""
        t = self.t
        if t[1] < x:
            return -1
        i = 1
        size = self.size
        while i < size:
            i *= 2
            if t[i] < x:
                i += 1
        return i - size


@dataclass(frozen=True)
class PackingStats:
    """How well a packing fills its bins; ``lower_bound`` = ceil(total tokens / capacity)."""

    n_sequences: int
    n_pieces: int
    n_dropped: int
    n_bins: int
    total_tokens: int
    lower_bound: int
    fill_ratio: float

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


@dataclass(frozen=True)
class Packing:
    """Result of bin packing.

    The packed items are *pieces*: with ``oversize="split"`` a sequence longer than the
    capacity becomes several pieces, otherwise piece ``p`` is the whole sequence
    ``piece_seq[p]``. ``bins[b]`` lists the piece ids of bin ``b`` in placement order
    (decreasing length). ``dropped`` holds the sequence ids left out: empty ones, and with
    ``oversize="drop"`` those longer than the capacity.
    """

    capacity: int
    bins: list[np.ndarray]
    bin_of: np.ndarray
    piece_seq: np.ndarray
    piece_start: np.ndarray
    piece_len: np.ndarray
    dropped: np.ndarray
    stats: PackingStats

    def bin_slices(self, b: int) -> list[tuple[int, int, int]]:
        """``(sequence id, start, stop)`` of every piece of bin ``b``."""
        return [
            (
                int(self.piece_seq[p]),
                int(self.piece_start[p]),
                int(self.piece_start[p] + self.piece_len[p]),
            )
            for p in self.bins[b]
        ]


def _pieces(
    lengths: np.ndarray | Sequence[int], capacity: int, oversize: OversizePolicy
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate inputs and apply the oversize policy: (piece_seq, piece_start, piece_len, dropped)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if oversize not in ("error", "split", "drop"):
        raise ValueError(f"oversize must be 'error', 'split' or 'drop', got {oversize!r}")
    lens = np.asarray(lengths)
    if lens.ndim != 1 or (lens.size and not np.issubdtype(lens.dtype, np.integer)):
        raise ValueError(f"lengths must be a 1-D integer array, got {lens.dtype} {lens.shape}")
    lens = lens.astype(np.int64, copy=False)
    if lens.size and lens.min() < 0:
        first = int(np.flatnonzero(lens < 0)[0])
        raise ValueError(f"lengths must be >= 0; lengths[{first}] = {lens[first]}")
    over = lens > capacity
    if oversize == "error" and over.any():
        first = int(np.flatnonzero(over)[0])
        raise ValueError(
            f"{int(over.sum())} sequences are longer than capacity={capacity} "
            f"(first: lengths[{first}] = {lens[first]}); pass oversize='split' or 'drop'"
        )
    # empty sequences have nothing to place: they are reported as dropped under every policy
    out = (lens == 0) | (over if oversize == "drop" else False)
    ids = np.arange(lens.size, dtype=np.int64)
    kept, dropped, lens = ids[~out], ids[out], lens[~out]
    if oversize != "split" or not (lens > capacity).any():
        return kept, np.zeros_like(lens), lens, dropped
    n_pieces = -(-lens // capacity)
    seq = np.repeat(kept, n_pieces)
    first_piece = np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    start = (np.arange(seq.size, dtype=np.int64) - first_piece) * capacity
    return seq, start, np.minimum(capacity, np.repeat(lens, n_pieces) - start), dropped


def _groups(sorted_len: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(length, start, stop) of each run of equal values in a sorted array."""
    if sorted_len.size == 0:
        return
    cuts = np.flatnonzero(np.diff(sorted_len)) + 1
    starts = np.concatenate(([0], cuts))
    stops = np.concatenate((cuts, [sorted_len.size]))
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        yield int(sorted_len[a]), a, b


def _new_bins(k: int, s: int, capacity: int, first_id: int) -> tuple[np.ndarray, list[int]]:
    """Open bins for ``k`` items of length ``s``: each takes capacity // s items, the last the rest.

    Returns the bin id of each item and the remaining capacity of each new bin.
    """
    q = capacity // s
    n_new = -(-k // q)
    bin_ids = np.repeat(np.arange(first_id, first_id + n_new, dtype=np.int64), q)[:k]
    last = k - (n_new - 1) * q
    rems = [capacity - q * s] * (n_new - 1) + [capacity - last * s]
    return bin_ids, rems


def _finish(
    capacity: int,
    order: np.ndarray,
    bin_of_sorted: np.ndarray,
    n_bins: int,
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    n_sequences: int,
) -> Packing:
    piece_seq, piece_start, piece_len, dropped = pieces
    bin_of = np.empty_like(bin_of_sorted)
    bin_of[order] = bin_of_sorted
    # Stable sort by bin keeps placement order (decreasing length) inside each bin.
    by_bin = order[np.argsort(bin_of_sorted, kind="stable")]
    counts = np.bincount(bin_of_sorted, minlength=n_bins)
    bins = np.split(by_bin, np.cumsum(counts)[:-1]) if n_bins else []
    total = int(piece_len.sum())
    stats = PackingStats(
        n_sequences=n_sequences,
        n_pieces=int(piece_len.size),
        n_dropped=int(dropped.size),
        n_bins=n_bins,
        total_tokens=total,
        lower_bound=math.ceil(total / capacity),
        fill_ratio=total / (n_bins * capacity) if n_bins else 1.0,
    )
    return Packing(capacity, bins, bin_of, piece_seq, piece_start, piece_len, dropped, stats)


def first_fit_decreasing(
    lengths: np.ndarray | Sequence[int], capacity: int, *, oversize: OversizePolicy = "error"
) -> Packing:
    """First-Fit Decreasing: longest first, each into the lowest-numbered bin that fits.

    Ties in length keep input order. ``oversize`` handles sequences longer than ``capacity``:
    ``"error"`` raises ValueError, ``"split"`` cuts them into capacity-sized pieces (the last
    one shorter) packed like any other, ``"drop"`` leaves them out (listed in ``dropped``).

    Complexity: O(N log N) for the sort plus O(T log B) for T segment-tree queries over the B
    bins (max remaining capacity per bin; the leftmost bin that fits is found by descending
    the tree). Items of one length are placed together: the bin that First-Fit picks keeps
    being picked until it cannot take another item of that length, so each query places
    ``remaining // length`` items at once, so T <= N + (distinct lengths). New bins for a run
    of equal items are opened in one bulk update.
    """
    pieces = _pieces(lengths, capacity, oversize)
    piece_len = pieces[2]
    order = np.argsort(-piece_len, kind="stable")
    sorted_len = piece_len[order]
    bin_of_sorted = np.empty(order.size, dtype=np.int64)
    tree = _MaxSegmentTree(max(order.size, 1), fill=-1)  # leaf b: remaining capacity, -1 = unopened
    n_bins = 0
    for s, pos, stop in _groups(sorted_len):
        while pos < stop:
            b = tree.leftmost_at_least(s)
            if b < 0:
                break
            room = tree.get(b)
            take = min(room // s, stop - pos)
            bin_of_sorted[pos : pos + take] = b
            tree.set(b, room - take * s)
            pos += take
        if pos < stop:
            ids, rems = _new_bins(stop - pos, s, capacity, n_bins)
            bin_of_sorted[pos:stop] = ids
            tree.set_range(n_bins, rems)
            n_bins += len(rems)
    return _finish(capacity, order, bin_of_sorted, n_bins, pieces, len(np.asarray(lengths)))


def best_fit_decreasing(
    lengths: np.ndarray | Sequence[int], capacity: int, *, oversize: OversizePolicy = "error"
) -> Packing:
    """Best-Fit Decreasing: longest first, each into the fullest bin that still fits it.

    "Fullest" = smallest remaining capacity >= the length; among bins with equal remaining
    capacity the lowest-numbered one wins (the rule the brute-force reference uses). Ties in
    length keep input order. ``oversize`` as in :func:`first_fit_decreasing`.

    As in Ding et al. (2024), a segment tree over remaining capacities 0..capacity (leaf c
    holds c while some open bin has exactly c tokens left) finds the best-fit capacity in
    O(log L); a bucket per capacity holds its bins. Items of one length are placed together:
    the bin Best-Fit picks keeps being the best fit until it can no longer take that length,
    so a bucket hands out ``remaining // length`` items per bin with numpy slicing.
    Complexity: O(N log N) for the sort, O(V log L) for V bucket visits (V <= N + distinct
    lengths, far fewer on heavy-tailed lengths), plus keeping each bucket's bins sorted by id
    for the tie rule (a numpy sort of a bucket when bins were added to it).
    """
    pieces = _pieces(lengths, capacity, oversize)
    piece_len = pieces[2]
    order = np.argsort(-piece_len, kind="stable")
    sorted_len = piece_len[order]
    bin_of_sorted = np.empty(order.size, dtype=np.int64)
    tree = _MaxSegmentTree(capacity + 1, fill=-1)  # leaf c: c if bucket c is non-empty, else -1
    buckets: list[list[np.ndarray]] = [[] for _ in range(capacity + 1)]

    def add(c: int, bins: np.ndarray) -> None:
        if c > 0:  # full bins can never take another item: not worth tracking
            buckets[c].append(bins)
            if tree.get(c) < 0:
                tree.set(c, c)

    n_bins = 0
    for s, pos, stop in _groups(sorted_len):
        while pos < stop:
            c = tree.leftmost_at_least(s)
            if c < 0:
                break
            chunks = buckets[c]
            bins = chunks[0] if len(chunks) == 1 else np.sort(np.concatenate(chunks))
            q = c // s
            n_full = min(bins.size, (stop - pos) // q)
            if n_full:
                bin_of_sorted[pos : pos + n_full * q] = np.repeat(bins[:n_full], q)
                pos += n_full * q
            used = n_full
            if n_full < bins.size and pos < stop:  # the run ends inside the next bin
                r = stop - pos
                bin_of_sorted[pos:stop] = bins[n_full]
                pos = stop
                used += 1
            rest = bins[used:]
            buckets[c] = [rest] if rest.size else []
            if not rest.size:
                tree.set(c, -1)
            if n_full:
                add(c - q * s, bins[:n_full])
            if used > n_full:
                add(c - r * s, bins[n_full : n_full + 1])
        if pos < stop:
            ids, rems = _new_bins(stop - pos, s, capacity, n_bins)
            bin_of_sorted[pos:stop] = ids
            new = np.arange(n_bins, n_bins + len(rems), dtype=np.int64)
            if len(rems) > 1:
                add(rems[0], new[:-1])
            add(rems[-1], new[-1:])
            n_bins += len(rems)
    return _finish(capacity, order, bin_of_sorted, n_bins, pieces, len(np.asarray(lengths)))


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
    (bins) or, for ``"concat"``, documents.
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
    if method == "concat":
        ds = SequencedDataset(docs, seq_len, pad_id=pad_id, shuffle=shuffle, seed=seed)
        collate = functools.partial(collate_packed, **collate_options)
        return DataLoader(ds, collate_fn=collate, **loader_options)
    if method not in ("ffd", "bfd"):
        raise ValueError(f"method must be 'concat', 'ffd' or 'bfd', got {method!r}")
    lengths = getattr(docs, "lengths", None)
    if lengths is None:
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
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
