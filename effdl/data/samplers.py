"""Length-bucketed random batches: ULTRA DUPER BIG BRAIN (seed 000) = BalancedBatchSampler (seed 001).

Every batch is random, holds samples whose lengths differ by at most ``k``, and every index
appears exactly once per epoch; a batch is shorter than ``batch_size`` when too few samples of
similar length are left. Optionally a batch is sized by a padded-token budget (``max_tokens``,
as fairseq's ``--max-tokens``) instead of, or as well as, a row count. The dataset is :class:`~effdl.data.padding.UnpaddedDataset` (alias
``UltraDuperBigBrainDataset``), collated by :func:`~effdl.data.padding.collate_fn` (pad to the
batch maximum, at most ``k`` pad tokens per row).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from effdl.data.padding import PadCollator, PaddedDataset, UnpaddedDataset, stack_collate
from effdl.data.tokenize import TokenizedCorpus

Pipeline = Literal["brain", "bigbrain", "ultra", "packed_concat", "packed_bfd"]
PIPELINES: tuple[str, ...] = ("brain", "bigbrain", "ultra", "packed_concat", "packed_bfd")


class _Fenwick:
    """Prefix sums over ``m`` counters with O(log m) update, prefix query and search."""

    def __init__(self, counts: list[int]) -> None:
        self.m = len(counts)
        self.tree = [0] * (self.m + 1)
        for i, c in enumerate(counts):  # O(m) build: push each node into its parent once
            j = i + 1
            self.tree[j] += c
            parent = j + (j & -j)
            if parent <= self.m:
                self.tree[parent] += self.tree[j]
        self.top = 1 << self.m.bit_length()

    def add(self, i: int, delta: int) -> None:
        i += 1
        tree, m = self.tree, self.m
        while i <= m:
            tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of counters [0, i)."""
        s, tree = 0, self.tree
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    def find(self, u: int) -> int:
        """Smallest i with prefix(i + 1) > u, for 0 <= u < total."""
        pos, step, tree, m = 0, self.top, self.tree, self.m
        while step:
            nxt = pos + step
            if nxt <= m and tree[nxt] <= u:
                pos = nxt
                u -= tree[nxt]
            step >>= 1
        return pos


class UltraDuperBigBrainBatchSampler(Sampler[list[int]]):
    """Random batches of indices whose lengths span at most ``k`` (``max - min <= k``).

    Algorithm. ``__init__`` (O(n)): a counting sort of the lengths (numpy's radix sort for
    lengths < 65536) lays out the indices grouped by length in one pool; ``buckets`` is the hash
    map ``length -> indices of that length`` (views into the pool). The ``m`` distinct lengths
    (m <= max_length + 1, a constant independent of n) get a Fenwick tree of remaining counts.

    Each batch (O(rows * log m), independent of n):

    1. draw a uniformly random remaining sample (Fenwick search on a random rank); call its
       length ``l``;
    2. pick a random window ``[lo, lo + k]`` that contains ``l`` (``lo`` uniform in
       ``[l - k, l]``, clamped to the range of lengths, so ``k >= max - min`` gives one window
       over everything: plain random batches, i.e. BIG BRAIN);
    3. draw ``min(batch_size, remaining in window)`` samples uniformly without replacement
       from the window: a random rank inside the window's prefix-sum range locates the bucket,
       and a lazy Fisher-Yates step (swap a random remaining element of the bucket with its
       last remaining one) takes the sample in O(1).

    Token budget. With ``max_tokens`` set, step 3 also closes the batch at the first drawn
    sample that would break ``rows * (max length in the batch) <= max_tokens``; that sample is
    put back by not shrinking its bucket's remaining range (the swap only moved it inside that
    range), so it stays available to later batches at O(1) cost. The batch therefore costs at
    most one extra pair of random draws and stays O(rows * log m); ``__init__`` is unchanged.
    Since every row of the window is at most the window's largest remaining length ``w``, a
    batch gets at least ``max_tokens // w`` rows (when that many are available and allowed by
    ``batch_size``). The first row is always taken, so a single sample longer than
    ``max_tokens`` forms a batch of its own (the only case that exceeds the budget). When both
    ``batch_size`` and ``max_tokens`` are given, both bounds apply; ``batch_size=None`` means
    no row cap and needs ``max_tokens``.

    Epochs: an epoch ends when every index was yielded once. ``set_epoch(e)`` fixes the next
    epoch's number; otherwise each ``__iter__`` advances it by one. The batches of an epoch are a
    function of ``(seed, epoch)`` only: epoch start resets the m counters and restores the pool
    (one block copy of n pointers, a few ms at n = 1.8 M) undoing the previous epoch's swaps.
    The number of batches varies between epochs, so there is no ``__len__``.
    """

    def __init__(
        self,
        lengths: np.ndarray | UnpaddedDataset,
        batch_size: int | None,
        k: int,
        seed: int = 0,
        *,
        max_tokens: int | None = None,
    ) -> None:
        """Index ``lengths`` (one per sample, or an :class:`UnpaddedDataset`) in O(n).

        ``batch_size``: most rows per batch (``None``: no row cap, then ``max_tokens`` is
        required); ``k``: most ``max - min`` length span inside a batch; ``max_tokens``: most
        padded tokens (``rows * max length``) per batch, exceeded only by a single-row batch.
        Raises ``ValueError`` on empty or out-of-range lengths or non-positive bounds.
        """
        if isinstance(lengths, UnpaddedDataset):
            lengths = lengths.lengths
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or len(lengths) == 0:
            raise ValueError("lengths must be a non-empty 1-D array")
        if batch_size is None and max_tokens is None:
            raise ValueError("need batch_size or max_tokens (both None leaves batches unbounded)")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"need batch_size >= 1 (or None with max_tokens), got {batch_size}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"need max_tokens >= 1 (or None), got {max_tokens}")
        if k < 0:
            raise ValueError(f"need k >= 0, got {k}")
        if lengths.min() < 0 or lengths.max() >= 2**16:
            raise ValueError("lengths must be in [0, 65536) (truncate long samples first)")
        self.batch_size, self.k, self.seed, self.epoch = batch_size, k, seed, 0
        self.max_tokens = max_tokens
        self.n = len(lengths)
        keys = lengths.astype(np.uint16)
        order = np.argsort(keys, kind="stable")  # radix sort for 16-bit keys: O(n)
        counts = np.bincount(keys)
        distinct = np.flatnonzero(counts)
        sizes = counts[distinct]
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        self._lengths = distinct.tolist()
        self._sizes = sizes.tolist()
        self._starts = starts.tolist()
        self._pristine = order.tolist()
        self._pool = list(self._pristine)
        self.buckets: dict[int, np.ndarray] = {
            int(length): order[s : s + c]
            for length, s, c in zip(distinct, starts, sizes, strict=True)
        }

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``__iter__`` produce epoch ``epoch``'s batches."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        self.epoch += 1
        return self._batches(random.Random(f"{self.seed}:{epoch}"))

    def _batches(self, rng: random.Random) -> Iterator[list[int]]:
        pool = self._pool
        pool[:] = self._pristine
        remaining = list(self._sizes)
        tree = _Fenwick(remaining)
        lengths, starts = self._lengths, self._starts
        lo_min, lo_max = lengths[0], max(lengths[0], lengths[-1] - self.k)
        total, budget = self.n, self.max_tokens
        row_cap = self.n if self.batch_size is None else self.batch_size
        while total:
            seed_bucket = tree.find(rng.randrange(total))
            length = lengths[seed_bucket]
            lo = min(max(length - rng.randint(0, self.k), lo_min), lo_max)
            first = bisect.bisect_left(lengths, lo)
            last = bisect.bisect_right(lengths, lo + self.k)
            base = tree.prefix(first)
            avail = tree.prefix(last) - base
            batch = []
            widest = 0
            for _ in range(min(row_cap, avail)):
                b = tree.find(base + rng.randrange(avail))
                start, r = starts[b], remaining[b]
                j = start + rng.randrange(r)
                end = start + r - 1
                pool[j], pool[end] = pool[end], pool[j]
                wide = max(widest, lengths[b])
                if budget is not None and batch and (len(batch) + 1) * wide > budget:
                    break  # pool[end] stays inside bucket b's remaining range: put back
                widest = wide
                batch.append(pool[end])
                remaining[b] = r - 1
                tree.add(b, -1)
                avail -= 1
            total -= len(batch)
            yield batch


# One implementation, the names both assignments use.
BalancedBatchSampler = UltraDuperBigBrainBatchSampler
UltraDuperBigBrainDataset = UnpaddedDataset


def make_loader(
    pipeline: Pipeline,
    corpus: TokenizedCorpus,
    batch_size: int | None,
    *,
    k: int = 640,
    max_length: int = 640,
    pad_id: int = 0,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    max_tokens: int | None = None,
) -> DataLoader:
    """A DataLoader for one batching pipeline over ``corpus`` (already cut to ``max_length``).

    ``"brain"``: :class:`PaddedDataset` (every row ``max_length`` wide), shuffled;
    ``"bigbrain"``: :class:`UnpaddedDataset` + pad-to-batch-max collation, shuffled;
    ``"ultra"``: the same dataset and collation with :class:`UltraDuperBigBrainBatchSampler`
    (span ``k``; ``max_tokens`` adds its padded-token budget, and ``batch_size=None`` then
    drops the row cap). These yield :class:`~effdl.data.padding.Batch`.
    ``"packed_concat"`` / ``"packed_bfd"``: rows of ``max_length`` tokens from
    :func:`effdl.data.packing.packed_loader` (streaming concatenation / Best-Fit Decreasing),
    yielding its ``PackedBatch`` (with ``doc_ids`` and restarting ``position_ids``).
    """
    if pipeline != "ultra" and (max_tokens is not None or batch_size is None):
        raise ValueError(
            f"max_tokens and batch_size=None apply only to pipeline 'ultra', got {pipeline!r}"
        )
    common = {"num_workers": num_workers, "pin_memory": pin_memory}
    if pipeline in ("packed_concat", "packed_bfd"):
        from effdl.data.packing import packed_loader

        method = pipeline.removeprefix("packed_")
        return packed_loader(
            corpus,
            max_length,
            batch_size,
            pad_id=pad_id,
            method=method,
            shuffle=True,
            seed=seed,
            **common,
        )
    if pipeline == "ultra":
        sampler = UltraDuperBigBrainBatchSampler(
            corpus.lengths, batch_size, k, seed=seed, max_tokens=max_tokens
        )
        return DataLoader(
            UnpaddedDataset(corpus), batch_sampler=sampler, collate_fn=PadCollator(pad_id), **common
        )
    generator = torch.Generator().manual_seed(seed)
    if pipeline == "brain":
        dataset, collate = PaddedDataset(corpus, max_length, pad_id), stack_collate
    elif pipeline == "bigbrain":
        dataset, collate = UnpaddedDataset(corpus), PadCollator(pad_id)
    else:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
        collate_fn=collate,
        **common,
    )
