import numpy as np
import pytest
import torch

from effdl.data.labels import IGNORE_INDEX, shifted_labels
from effdl.models.lm_objective import next_token_labels


def brute_force(ids, real):
    """labels[b, t] = ids[b, t + 1] where that next token is real, else IGNORE_INDEX."""
    rows, width = ids.shape
    labels = np.empty((rows, width), dtype=np.int64)
    for b in range(rows):
        for t in range(width):
            nxt = t + 1
            labels[b, t] = ids[b, nxt] if nxt < width and real[b, nxt] else IGNORE_INDEX
    return labels


def right_padded(lengths, width, seed=0, pad_id=0):
    rng = np.random.default_rng(seed)
    real = np.arange(width) < np.asarray(lengths)[:, None]
    ids = np.where(real, rng.integers(2, 1000, (len(lengths), width)), pad_id)
    return ids.astype(np.int64), real


def test_ignore_index_is_cross_entropys_default():
    logits = torch.randn(3, 5)
    target = torch.tensor([1, IGNORE_INDEX, 4])
    torch.testing.assert_close(
        torch.nn.functional.cross_entropy(logits, target),
        torch.nn.functional.cross_entropy(logits[[0, 2]], target[[0, 2]]),
    )


@pytest.mark.parametrize("lengths", [[5, 3, 1, 7], [7, 7], [1], [0, 4]])
def test_right_padding_matches_brute_force(lengths):
    ids, real = right_padded(lengths, 7)
    labels = shifted_labels(ids, real)
    assert labels.dtype == np.int64 and labels.shape == ids.shape
    np.testing.assert_array_equal(labels, brute_force(ids, real))
    # Every row has exactly length - 1 targets: a row's last real token has no next token.
    np.testing.assert_array_equal(
        (labels != IGNORE_INDEX).sum(1), np.maximum(np.asarray(lengths) - 1, 0)
    )


@pytest.mark.parametrize("seed", range(5))
def test_any_real_mask_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50, (4, 9)).astype(np.int32)
    real = rng.random((4, 9)) < 0.6
    before = ids.copy()
    np.testing.assert_array_equal(shifted_labels(ids, real), brute_force(ids, real))
    np.testing.assert_array_equal(ids, before)  # inputs untouched


def test_agrees_with_the_torch_labels_of_the_loss():
    ids, real = right_padded([6, 2, 4], 6, seed=3)
    want = next_token_labels(torch.from_numpy(ids), torch.from_numpy(~real))
    np.testing.assert_array_equal(shifted_labels(ids, real), want.numpy())
