"""Length-bucketed random batches: ULTRA DUPER BIG BRAIN (seed 000) = BalancedBatchSampler (seed 001).

Every batch is random, holds samples whose lengths differ by at most ``k``, and every index
appears exactly once per epoch; a batch is shorter than ``batch_size`` when too few samples of
similar length are left. Optionally a batch is sized by a padded-token budget (``max_tokens``,
as fairseq's ``--max-tokens``) instead of, or as well as, a row count. The dataset is
:class:`~effdl.data.padding.UnpaddedDataset` (alias ``UltraDuperBigBrainDataset``), collated
by :func:`~effdl.data.padding.collate_fn` (pad to the batch maximum, at most ``k`` pad tokens
per row).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from effdl.data.padding import UnpaddedDataset


def _locate(counts: np.ndarray, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bucket and offset of each rank in the concatenation of ``counts`` remaining items.

    ``counts`` (W,) remaining items per bucket; ``ranks`` (t,) in ``[0, counts.sum())``.
    Returns ``(bucket, offset)``, each (t,) int64, with ``0 <= offset < counts[bucket]``.
    O(W + t log W), in numpy.
    """
    ends = counts.cumsum()
    bucket = ends.searchsorted(ranks, side="right")
    return bucket, ranks - (ends - counts)[bucket]


def _remove(
    pool: np.ndarray, starts: np.ndarray, counts: np.ndarray, bucket: np.ndarray, pos: np.ndarray
) -> None:
    """Delete the items at distinct pool positions ``pos`` from their buckets, in O(W + t).

    Bucket ``j`` holds its remaining items in ``pool[starts[j] : starts[j] + counts[j]]``;
    ``pos[i]`` lies in bucket ``bucket[i]``'s range. Mutates ``counts`` (minus the items taken
    per bucket) and ``pool``: each bucket's shortened range keeps exactly its untaken items.
    Slots past a range are never read again in the epoch, so only the holes a deletion
    leaves inside the shortened range are filled, with the untaken items of the cut-off tail.
    """
    taken = np.bincount(bucket, minlength=len(counts))
    counts -= taken
    ends = starts + counts
    holes = pos[pos < ends[bucket]]
    holes.sort()  # ascending position = grouped by bucket
    pool[pos] = -1
    tail_first = taken.cumsum() - taken  # where each bucket's tail starts in `tail`
    tail = (ends - tail_first).repeat(taken) + np.arange(len(pos))
    movers = pool[tail]
    # A bucket's tail holds exactly as many untaken items as the bucket has holes, and both
    # lists run in bucket order, so the i-th mover goes to the i-th hole of the same bucket.
    pool[holes] = movers[movers >= 0]


def _draw(
    rng: np.random.Generator,
    pool: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    avail: int,
    t: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``t`` distinct uniformly random items of the ``avail`` left in buckets ``counts``.

    Returns ``(bucket, pool position, dataset index)`` of each, in random order; O(W + t):
    ``Generator.choice`` without replacement runs Floyd's algorithm, or, when t > avail / 50,
    a partial shuffle of the avail < 50 t ranks.
    """
    ranks = rng.choice(avail, t, replace=False)
    bucket, offset = _locate(counts, ranks)
    pos = starts[bucket] + offset
    return bucket, pos, pool[pos]


class UltraDuperBigBrainBatchSampler(Sampler[list[int]]):
    """Random batches of indices whose lengths span at most ``k`` (``max - min <= k``).

    Algorithm. ``__init__`` (O(n)): a counting sort of the lengths (numpy's radix sort for
    lengths < 65536) lays out the indices grouped by length in one array; ``buckets`` is the
    hash map ``length -> indices of that length`` (views into it). The ``m`` distinct lengths
    (m <= max_length + 1, a constant independent of n) each keep a count of remaining items.

    Each batch, all in numpy, O(rows + m) with no Python loop over rows or buckets:

    1. draw a uniformly random remaining sample (a random rank in the prefix sums of the m
       counts); call its length ``l``;
    2. pick a random window ``[lo, lo + k]`` that contains ``l`` (``lo`` uniform in
       ``[l - k, l]``, clamped to the range of lengths, so ``k >= max - min`` gives one window
       over everything: plain random batches, i.e. BIG BRAIN);
    3. draw ``t = min(batch_size, remaining in window)`` distinct random ranks among the
       window's remaining items (:func:`_draw`, O(t)), map each to its bucket and slot (one
       ``searchsorted`` over the <= k + 1 buckets), and delete the chosen items from their
       buckets (:func:`_remove`: holes are filled from the bucket's tail, a vectorised
       swap-remove). A uniform random t-subset of the window is exactly what drawing t samples
       one at a time gives (bucket counts follow the multivariate hypergeometric law); rows
       keep their random draw order.

    Token budget. With ``max_tokens`` set, a batch is the longest prefix of the random draw
    order with ``rows * (max length in the batch) <= max_tokens`` (the first row always
    counts, so a single sample longer than ``max_tokens`` forms a batch of its own, the only
    case over budget). Drawn in chunks, each cut at its first row that breaks the budget
    (that row and the rest of the chunk stay in their buckets): first up to
    ``2 * (max_tokens // w)`` rows, where ``w`` is the window's largest remaining length (the
    first half fits whatever it holds), then chunks of at most the rows taken so far. So a
    batch gets at least ``max_tokens // w`` rows (when available and allowed by
    ``batch_size``), usually in one chunk, and the items drawn in vain never outnumber the
    rows taken: still O(rows + m). When both ``batch_size`` and ``max_tokens`` are given, both
    bounds apply; ``batch_size=None`` means no row cap and needs ``max_tokens``.

    Epochs: an epoch ends when every index was yielded once. ``set_epoch(e)`` fixes the next
    epoch's number; otherwise each ``__iter__`` advances it by one. The batches of an epoch are
    a function of ``(seed, epoch)`` only (numpy ``Generator`` seeded with both): each
    ``__iter__`` takes its own copy of the grouped index array (one C-level block copy) and
    fresh counts. The number of batches varies between epochs, so
    there is no ``__len__``.
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
        padded tokens (``rows * max length``) per batch, exceeded only by a single-row batch;
        ``seed``: non-negative. Raises ``ValueError`` on empty, non-integer or out-of-range lengths,
        non-positive bounds or a negative seed.
        """
        if isinstance(lengths, UnpaddedDataset):
            lengths = lengths.lengths
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or len(lengths) == 0:
            raise ValueError("lengths must be a non-empty 1-D array")
        if not np.issubdtype(lengths.dtype, np.integer):
            # a cast to the uint16 keys would silently floor floats and turn NaN into 0
            raise ValueError(f"lengths must be integers (token counts), got dtype {lengths.dtype}")
        if batch_size is None and max_tokens is None:
            raise ValueError("need batch_size or max_tokens (both None leaves batches unbounded)")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"need batch_size >= 1 (or None with max_tokens), got {batch_size}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"need max_tokens >= 1 (or None), got {max_tokens}")
        if k < 0:
            raise ValueError(f"need k >= 0, got {k}")
        if seed < 0:
            raise ValueError(f"need seed >= 0, got {seed}")
        if lengths.min() < 0 or lengths.max() >= 2**16:
            raise ValueError("lengths must be in [0, 65536) (truncate long samples first)")
        self.batch_size, self.k, self.seed, self.epoch = batch_size, k, seed, 0
        self.max_tokens = max_tokens
        self.n = len(lengths)
        keys = lengths.astype(np.uint16)
        order = np.argsort(keys, kind="stable")  # radix sort for 16-bit keys: O(n)
        counts = np.bincount(keys)
        distinct = np.flatnonzero(counts)
        self._lengths = distinct
        self._length_list = distinct.tolist()
        self._sizes = counts[distinct]
        self._starts = np.cumsum(self._sizes) - self._sizes
        self._grouped = order
        self.buckets: dict[int, np.ndarray] = {
            length: order[s : s + c]
            for length, s, c in zip(
                self._length_list, self._starts.tolist(), self._sizes.tolist(), strict=True
            )
        }

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``__iter__`` produce epoch ``epoch`` (>= 0)'s batches."""
        if epoch < 0:
            raise ValueError(f"need epoch >= 0, got {epoch}")
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        self.epoch += 1
        return self._batches(np.random.default_rng((self.seed, epoch)))

    def _batches(self, rng: np.random.Generator) -> Iterator[list[int]]:
        pool = self._grouped.copy()
        remaining = self._sizes.copy()
        keys, k = self._length_list, self.k
        lo_min, lo_max = keys[0], max(keys[0], keys[-1] - k)
        total = self.n
        row_cap = self.n if self.batch_size is None else self.batch_size
        first, last = 0, len(keys)
        while total:
            if lo_min < lo_max:  # otherwise one window holds every length
                ends = remaining.cumsum()
                length = keys[int(ends.searchsorted(rng.integers(total), side="right"))]
                lo = min(max(length - int(rng.integers(k + 1)), lo_min), lo_max)
                first = bisect.bisect_left(keys, lo)
                last = bisect.bisect_right(keys, lo + k)
            window = slice(first, last)
            counts, starts = remaining[window], self._starts[window]
            avail = int(counts.sum())
            if self.max_tokens is None:
                bucket, pos, batch = _draw(rng, pool, starts, counts, avail, min(row_cap, avail))
                _remove(pool, starts, counts, bucket, pos)
                rows = batch.tolist()
            else:
                rows = self._draw_within_budget(
                    rng, pool, starts, counts, self._lengths[window], avail, min(row_cap, avail)
                )
            total -= len(rows)
            yield rows

    def _draw_within_budget(
        self,
        rng: np.random.Generator,
        pool: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        lengths: np.ndarray,
        avail: int,
        cap: int,
    ) -> list[int]:
        """Rows of one batch under ``max_tokens`` (at most ``cap``), drawn in chunks.

        ``starts``, ``counts``, ``lengths``: the window's buckets (``counts`` is a view into
        the epoch's remaining counts and is updated); ``avail``: ``counts.sum()``.
        """
        budget = self.max_tokens
        present = lengths[counts.nonzero()[0]]
        shortest, longest = int(present[0]), int(present[-1])
        # The first max_tokens // longest rows fit whatever they are, and no more than
        # max_tokens // shortest can; drawing up to twice the former usually finishes the
        # batch in one chunk and wastes at most the rows taken (the sure ones).
        sure = max(1, budget // longest) if longest else cap
        chunk = min(cap, 2 * sure, max(1, budget // shortest) if shortest else cap)
        rows: list[int] = []
        widest = 0
        while chunk > 0:
            bucket, pos, batch = _draw(rng, pool, starts, counts, avail, chunk)
            run = np.maximum.accumulate(lengths[bucket])
            np.maximum(run, widest, out=run)
            fits = (np.arange(len(rows) + 1, len(rows) + chunk + 1) * run) <= budget
            fits[0] |= not rows
            take = chunk if fits.all() else int(fits.argmin())
            _remove(pool, starts, counts, bucket[:take], pos[:take])
            rows += batch[:take].tolist()
            avail -= take
            widest = int(run[take - 1]) if take else widest
            if take < chunk:
                break
            # If every further row were as long as the widest so far, this many more fit;
            # capped at len(rows) so the items drawn in vain stay below the rows taken.
            more = budget // widest - len(rows) if widest else cap
            chunk = min(cap - len(rows), len(rows), more)
        return rows


# One implementation, the names both assignments use.
BalancedBatchSampler = UltraDuperBigBrainBatchSampler
UltraDuperBigBrainDataset = UnpaddedDataset
