import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from effdl.data.padding import PadCollator
from effdl.data.samplers import (
    BalancedBatchSampler,
    UltraDuperBigBrainBatchSampler,
    UltraDuperBigBrainDataset,
    _locate,
    _remove,
)
from effdl.data.tokenize import TokenizedCorpus


def epoch(sampler):
    return [list(b) for b in sampler]


@given(
    st.lists(st.integers(0, 60), min_size=1, max_size=300),
    st.integers(1, 17),
    st.integers(0, 25),
    st.integers(0, 3),
)
@settings(max_examples=200, deadline=None)
def test_invariants_k_bound_each_index_once_batch_size(lengths, batch_size, k, seed):
    arr = np.array(lengths)
    sampler = UltraDuperBigBrainBatchSampler(arr, batch_size, k, seed=seed)
    for _ in range(2):  # two epochs: the second starts from the first's leftover state
        batches = epoch(sampler)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(lengths)))
        for b in batches:
            assert 1 <= len(b) <= batch_size
            assert arr[b].max() - arr[b].min() <= k


def test_batches_are_random_across_epochs_and_reproducible():
    lengths = np.random.default_rng(0).integers(1, 100, 2000)
    s = BalancedBatchSampler(lengths, 16, 5, seed=3)
    e0, e1 = epoch(s), epoch(s)
    assert e0 != e1
    s.set_epoch(0)
    assert epoch(s) == e0  # a pure function of (seed, epoch), whatever ran before
    fresh = BalancedBatchSampler(lengths, 16, 5, seed=3)
    fresh.set_epoch(1)
    assert epoch(fresh) == e1
    assert epoch(BalancedBatchSampler(lengths, 16, 5, seed=4)) != e0
    # Randomness inside the epoch: batch order is not sorted by length.
    firsts = [lengths[b[0]] for b in e0]
    assert firsts != sorted(firsts) and firsts != sorted(firsts, reverse=True)


def test_small_k_gives_some_short_batches_and_large_k_is_big_brain():
    lengths = np.random.default_rng(1).integers(1, 641, 5000)
    short = epoch(UltraDuperBigBrainBatchSampler(lengths, 32, 1))
    assert any(len(b) < 32 for b in short[:-1])
    # k = 640 >= max - min: one window over everything, every batch full except the last.
    big = epoch(UltraDuperBigBrainBatchSampler(lengths, 32, 640))
    assert [len(b) for b in big] == [32] * (5000 // 32) + [5000 % 32]
    spans = [lengths[b].max() - lengths[b].min() for b in big[:-1]]
    assert np.mean(spans) > 500  # random batches, like BIG BRAIN with shuffling


class CountingGenerator:
    """A numpy Generator that counts the random values the sampler asks for."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.values = 0

    def integers(self, *args, **kwargs):
        self.values += 1  # the sampler draws scalars only
        return self.rng.integers(*args, **kwargs)

    def choice(self, a, size, replace):
        self.values += size
        return self.rng.choice(a, size, replace=replace)


@pytest.mark.parametrize("n", [1_000, 200_000])
def test_work_per_batch_does_not_depend_on_n(n):
    lengths = np.random.default_rng(2).integers(1, 641, n)
    sampler = UltraDuperBigBrainBatchSampler(lengths, 64, 10)
    rng = CountingGenerator(0)
    batches = sampler._batches(rng)
    for _ in range(5):
        before = rng.values
        b = next(batches)
        # seed sample + window offset, then one rank per index taken: nothing in n
        assert rng.values - before == 2 + len(b)


def test_locate_matches_naive_walk():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, 37)
    counts[[0, -1]] = 0  # empty buckets at both ends must be skipped
    owner = np.repeat(np.arange(37), counts)  # the bucket of each rank, by enumeration
    slot = np.concatenate([np.arange(c) for c in counts])
    ranks = rng.permutation(int(counts.sum()))
    bucket, offset = _locate(counts, ranks)
    assert bucket.tolist() == owner[ranks].tolist()
    assert offset.tolist() == slot[ranks].tolist()


@given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.data())
@settings(max_examples=200, deadline=None)
def test_remove_keeps_exactly_the_untaken_items_in_each_bucket(sizes, data):
    counts = np.array(sizes)
    starts = np.cumsum(counts) - counts
    pool = np.arange(1000, 1000 + int(counts.sum()))
    left = [set(pool[s : s + c].tolist()) for s, c in zip(starts, counts, strict=True)]
    while counts.sum():
        # reference: delete a random subset of a random window of buckets from Python sets
        lo = data.draw(st.integers(0, len(counts) - 1))
        hi = data.draw(st.integers(lo + 1, len(counts)))
        view = counts[lo:hi]
        if not view.sum():
            continue
        ranks = np.array(
            data.draw(st.lists(st.integers(0, int(view.sum()) - 1), min_size=1, unique=True))
        )
        bucket, offset = _locate(view, ranks)
        pos = starts[lo:hi][bucket] + offset
        for b, value in zip(bucket, pool[pos], strict=True):
            left[lo + b].remove(int(value))
        _remove(pool, starts[lo:hi], view, bucket, pos)
        for j, (s, c) in enumerate(zip(starts, counts, strict=True)):
            assert c == len(left[j])
            assert set(pool[s : s + c].tolist()) == left[j]


def test_first_batch_is_a_uniform_subset_and_window_choice_follows_counts():
    # one window (k = 640): every index is in the first batch with probability 5 / 20
    lengths = np.arange(1, 21)
    sampler = UltraDuperBigBrainBatchSampler(lengths, 5, 640, seed=1)
    hits = np.zeros(20)
    epochs = 4000
    for e in range(epochs):
        sampler.set_epoch(e)
        hits[next(iter(sampler))] += 1
    # binomial(4000, 0.25): sd 27, so +-5 sd is +-137
    np.testing.assert_allclose(hits, epochs * 0.25, atol=137)
    # k = 0, 900 samples of length 1 and 100 of length 2: the first batch holds a uniformly
    # random remaining sample's length, so it is length 2 with probability 0.1
    lengths = np.repeat([1, 2], [900, 100])
    sampler = UltraDuperBigBrainBatchSampler(lengths, 8, 0, seed=2)
    longer = 0
    for e in range(epochs):
        sampler.set_epoch(e)
        longer += int(lengths[next(iter(sampler))[0]] == 2)
    assert abs(longer - 0.1 * epochs) <= 5 * (epochs * 0.1 * 0.9) ** 0.5


def test_iterators_of_two_epochs_do_not_share_state():
    lengths = np.random.default_rng(10).integers(1, 50, 3000)
    sampler = UltraDuperBigBrainBatchSampler(lengths, 16, 3, seed=5)
    reference = [epoch(sampler) for _ in range(2)]
    sampler.set_epoch(0)
    a, b = iter(sampler), iter(sampler)
    interleaved = [[], []]
    for pair in zip(a, b, strict=False):  # both run in lock-step on one sampler
        interleaved[0].append(pair[0])
        interleaved[1].append(pair[1])
    interleaved[0] += list(a)
    interleaved[1] += list(b)
    assert interleaved == reference


def test_hash_map_holds_indices_by_length():
    s = UltraDuperBigBrainBatchSampler(np.array([3, 1, 3, 2, 1]), 2, 0)
    assert {k: v.tolist() for k, v in s.buckets.items()} == {1: [1, 4], 2: [3], 3: [0, 2]}


def test_init_on_wikitext_size_costs_a_few_sorts():
    # O(n): a 16-bit radix sort and a few passes. Timed against the sort itself, best of three
    # each, so a loaded machine slows both sides alike.
    lengths = np.random.default_rng(3).integers(1, 641, 1_800_000)

    def best_of_three(fn):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    sort_s = best_of_three(lambda: np.argsort(lengths.astype(np.uint16), kind="stable"))
    init_s = best_of_three(lambda: UltraDuperBigBrainBatchSampler(lengths, 64, 5))
    assert init_s < 5 * sort_s


def test_dataloader_integration_pads_at_most_k():
    seqs = [[7] * n for n in np.random.default_rng(4).integers(1, 30, 200)]
    ds = UltraDuperBigBrainDataset(TokenizedCorpus.from_sequences(seqs))
    loader = DataLoader(
        ds, batch_sampler=UltraDuperBigBrainBatchSampler(ds, 8, 3), collate_fn=PadCollator(0)
    )
    total = 0
    for batch in loader:
        pads = batch.padding_mask.sum(dim=1)
        assert int(pads.max()) <= 3
        total += batch.n_real_tokens
    assert total == sum(len(s) for s in seqs)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        UltraDuperBigBrainBatchSampler(np.array([1, 2]), 0, 1)
    with pytest.raises(ValueError, match="non-empty"):
        UltraDuperBigBrainBatchSampler(np.array([]), 4, 1)
    with pytest.raises(ValueError, match="65536"):
        UltraDuperBigBrainBatchSampler(np.array([70_000]), 4, 1)
    with pytest.raises(ValueError, match="seed >= 0"):
        UltraDuperBigBrainBatchSampler(np.array([1, 2]), 4, 1, seed=-1)
    with pytest.raises(ValueError, match="epoch >= 0"):
        UltraDuperBigBrainBatchSampler(np.array([1, 2]), 4, 1).set_epoch(-1)


@given(
    st.lists(st.integers(0, 60), min_size=1, max_size=300),
    st.one_of(st.none(), st.integers(1, 17)),
    st.integers(0, 25),
    st.integers(1, 400),
    st.integers(0, 3),
)
@settings(max_examples=200, deadline=None)
def test_token_budget_invariants(lengths, batch_size, k, max_tokens, seed):
    arr = np.array(lengths)
    sampler = UltraDuperBigBrainBatchSampler(arr, batch_size, k, seed=seed, max_tokens=max_tokens)
    epochs = [epoch(sampler) for _ in range(2)]
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert 1 <= len(b) <= (batch_size or len(lengths))
            assert arr[b].max() - arr[b].min() <= k
            # padded tokens within budget; only a lone over-long row may exceed it
            assert len(b) * arr[b].max() <= max_tokens or len(b) == 1
    if len(set(lengths)) > 1 and len(lengths) >= 20:
        assert epochs[0] != epochs[1]


def test_token_budget_reproducible_and_random_across_epochs():
    lengths = np.random.default_rng(6).integers(1, 100, 2000)
    s = UltraDuperBigBrainBatchSampler(lengths, None, 5, seed=3, max_tokens=1000)
    e0, e1 = epoch(s), epoch(s)
    assert e0 != e1
    s.set_epoch(0)
    assert epoch(s) == e0
    firsts = [lengths[b[0]] for b in e0]
    assert firsts != sorted(firsts) and firsts != sorted(firsts, reverse=True)


def test_token_budget_fills_batches_exactly_with_equal_lengths():
    # 100 rows of 10 tokens, budget 95: 9 rows (90 padded tokens) per batch, remainder last
    s = UltraDuperBigBrainBatchSampler(np.full(100, 10), None, 0, max_tokens=95)
    assert sorted(len(b) for b in epoch(s)) == [1] + [9] * 11
    # both bounds: the row cap binds first
    capped = UltraDuperBigBrainBatchSampler(np.full(100, 10), 4, 0, max_tokens=95)
    assert sorted(len(b) for b in epoch(capped)) == [4] * 25


def test_token_budget_gives_at_least_budget_over_longest_rows():
    # k = 640: one window, longest row 640, so every batch but the tail holds >= 32768 // 640
    lengths = np.random.default_rng(7).integers(1, 641, 5000)
    lengths[0] = 640
    batches = epoch(UltraDuperBigBrainBatchSampler(lengths, None, 640, max_tokens=32768))
    sizes = [len(b) for b in batches]
    assert sum(sizes) == 5000
    assert min(sizes[:-1]) >= 32768 // 640  # only the epoch's last batch may run short
    assert all(len(b) * lengths[b].max() <= 32768 for b in batches)


def test_row_longer_than_budget_forms_its_own_batch():
    lengths = np.array([100, 5, 5, 5, 5])
    batches = epoch(UltraDuperBigBrainBatchSampler(lengths, None, 200, max_tokens=50))
    assert [0] in batches
    assert sorted(i for b in batches for i in b) == list(range(5))
    # every row over budget: one batch per row
    lengths = np.array([60, 70, 80, 61])
    batches = epoch(UltraDuperBigBrainBatchSampler(lengths, None, 30, max_tokens=50))
    assert sorted(batches) == [[0], [1], [2], [3]]


def test_token_budget_draws_at_most_twice_the_rows_taken():
    lengths = np.random.default_rng(8).integers(1, 641, 200_000)
    sampler = UltraDuperBigBrainBatchSampler(lengths, None, 10, max_tokens=20_000)
    rng = CountingGenerator(0)
    batches = sampler._batches(rng)
    for _ in range(20):
        before = rng.values
        b = next(batches)
        # seed + window, one rank per row taken, then rows drawn in vain: at most one chunk
        # no longer than the rows taken, in practice one row (nothing in n)
        assert 2 + len(b) <= rng.values - before <= 2 + 2 * len(b)


def test_token_budget_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size or max_tokens"):
        UltraDuperBigBrainBatchSampler(np.array([1, 2]), None, 1)
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        UltraDuperBigBrainBatchSampler(np.array([1, 2]), 4, 1, max_tokens=0)
    with pytest.raises(ValueError, match="k >= 0"):
        UltraDuperBigBrainBatchSampler(np.array([1, 2]), 4, -1)


@pytest.mark.parametrize(
    "lengths",
    [np.array([1.5, 2.7, 3.0]), np.array([np.nan, 2.0, 3.0]), [3.0, 4.0], np.array([True, False])],
)
def test_rejects_non_integer_lengths(lengths):
    with pytest.raises(ValueError, match=r"lengths must be integers \(token counts\), got dtype"):
        UltraDuperBigBrainBatchSampler(lengths, batch_size=2, k=1)
