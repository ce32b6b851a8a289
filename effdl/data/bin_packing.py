"""Bin packing of sequence lengths: First-Fit and Best-Fit Decreasing.

:func:`first_fit_decreasing` / :func:`best_fit_decreasing` place whole sequences into bins of
``capacity`` tokens, so nothing is truncated ("Fewer Truncations Improve Language Modeling",
Ding et al. 2024). They see only lengths (numpy, no torch); :mod:`effdl.data.packing` turns a
:class:`Packing` into rows of tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

OversizePolicy = Literal["error", "split", "drop"]


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
    """How well a packing fills its bins; ``lower_bound`` = ceil(total tokens / capacity).

    ``fill_ratio`` is NaN when there are no bins (every sequence empty or dropped): nothing was
    packed, so no fill can be claimed; ``n_dropped == n_sequences`` says so.
    """

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


def _decreasing(piece_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The placement order (longest first, ties in input order) and the lengths in that order."""
    order = np.argsort(-piece_len, kind="stable")
    return order, piece_len[order]


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
        fill_ratio=total / (n_bins * capacity) if n_bins else math.nan,
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
    ``remaining // length`` items at once and T <= N + (distinct lengths). New bins for a run
    of equal items are opened in one bulk update.
    """
    pieces = _pieces(lengths, capacity, oversize)
    order, sorted_len = _decreasing(pieces[2])
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
    order, sorted_len = _decreasing(pieces[2])
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
