import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from effdl.data.padding import (
    Batch,
    PadCollator,
    PaddedDataset,
    StandardDataset,
    UnpaddedDataset,
    collate_fn,
    pad_batch,
    stack_collate,
)
from effdl.data.tokenize import TokenizedCorpus
from effdl.models.lm_objective import next_token_labels


def brute_force_pad(samples, pad_id, width):
    ids = [[*s, *([pad_id] * (width - len(s)))] for s in samples]
    mask = [[j >= len(s) for j in range(width)] for s in samples]
    return (
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(mask, dtype=torch.bool),
        [len(s) for s in samples],
    )


@given(
    st.lists(st.lists(st.integers(1, 1000), max_size=15), min_size=1, max_size=9),
    st.integers(0, 3),
)
@settings(max_examples=150, deadline=None)
def test_pad_batch_matches_brute_force(seqs, pad_id):
    samples = [np.array(s, dtype=np.int32) for s in seqs]
    width = max(len(s) for s in seqs)
    batch = pad_batch(samples, pad_id=pad_id)
    ids, mask, lengths = brute_force_pad(seqs, pad_id, width)
    assert batch.input_ids.dtype == torch.int64 and batch.padding_mask.dtype == torch.bool
    assert torch.equal(batch.input_ids, ids)
    assert torch.equal(batch.padding_mask, mask)
    assert batch.lengths.tolist() == lengths
    assert batch.n_real_tokens == sum(lengths)
    # labels made in the collate equal the loss's own shift of the padded batch
    assert batch.labels.dtype == torch.int64
    assert torch.equal(batch.labels, next_token_labels(ids, mask))


def test_pad_to_fixed_width_and_errors():
    samples = [np.array([3, 4], np.int32), np.array([5], np.int32)]
    batch = pad_batch(samples, pad_id=9, pad_to=4)
    assert batch.input_ids.tolist() == [[3, 4, 9, 9], [5, 9, 9, 9]]
    with pytest.raises(ValueError, match="more than pad_to=1"):
        pad_batch(samples, pad_to=1)
    with pytest.raises(ValueError, match="at least one sample"):
        pad_batch([])


def test_collate_fn_pads_to_batch_max_only():
    samples = [np.array([1, 2, 3], np.int32), np.array([4], np.int32)]
    assert collate_fn(samples).input_ids.shape == (2, 3)
    assert torch.equal(
        PadCollator(pad_id=7)(samples).input_ids, torch.tensor([[1, 2, 3], [4, 7, 7]])
    )


@pytest.fixture
def corpus():
    return TokenizedCorpus.from_sequences([[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]])


def test_brain_dataset_pads_every_sample_to_max_length(corpus):
    ds = PaddedDataset(corpus, max_length=6, pad_id=0)
    ids, n = ds[0]
    assert ids.tolist() == [1, 2, 3, 0, 0, 0] and n == 3
    batch = stack_collate([ds[i] for i in range(len(ds))])
    reference = pad_batch([corpus[i] for i in range(len(corpus))], pad_to=6)
    for got, want in zip(batch, reference, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="truncate it to max_length=3"):
        PaddedDataset(corpus, max_length=3)


def test_big_brain_through_a_dataloader(corpus):
    assert StandardDataset is UnpaddedDataset
    ds = UnpaddedDataset(corpus)
    assert ds.lengths.tolist() == [3, 1, 2, 4]
    batches = list(DataLoader(ds, batch_size=2, collate_fn=PadCollator(0)))
    assert all(isinstance(b, Batch) for b in batches)
    assert [tuple(b.input_ids.shape) for b in batches] == [(2, 3), (2, 4)]
    assert batches[1].input_ids.tolist() == [[5, 6, 0, 0], [7, 8, 9, 10]]


def test_batch_moves_and_pins():
    b = pad_batch([np.array([1], np.int32)])
    moved = b.to("cpu")
    assert isinstance(moved, Batch) and torch.equal(moved.input_ids, b.input_ids)
