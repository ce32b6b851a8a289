import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from effdl.data.labels import IGNORE_INDEX
from effdl.data.packing import collate_packed, pack_row
from effdl.data.padding import pad_batch
from effdl.models.lm_objective import (
    LMAccuracy,
    LMCrossEntropyLoss,
    lm_cross_entropy,
    lm_inputs,
    next_token_labels,
)


@pytest.fixture
def batch():
    torch.manual_seed(0)
    lengths = torch.tensor([6, 3, 1, 4])
    ids = torch.randint(1, 11, (4, 6))
    mask = torch.arange(6) >= lengths[:, None]
    ids[mask] = 0
    logits = torch.randn(4, 6, 11, dtype=torch.float64, requires_grad=True)
    return logits, ids, mask, lengths


def reference_pairs(ids, lengths):
    """(row, position, target) for every position whose next token is real."""
    return [(b, t, int(ids[b, t + 1])) for b in range(len(ids)) for t in range(int(lengths[b]) - 1)]


def test_labels_shift_and_ignore():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    mask = torch.tensor([[False, False, False], [False, False, True]])
    assert next_token_labels(ids, mask).tolist() == [[6, 7, -100], [9, -100, -100]]
    assert next_token_labels(ids).tolist() == [[6, 7, -100], [9, 0, -100]]


def test_loss_equals_torch_cross_entropy_on_valid_targets(batch):
    logits, ids, mask, lengths = batch
    pairs = reference_pairs(ids, lengths)
    rows, pos, targets = (torch.tensor(c) for c in zip(*pairs, strict=True))
    reference = F.cross_entropy(logits[rows, pos], targets)
    got = LMCrossEntropyLoss()(logits, ids, mask)
    torch.testing.assert_close(got, reference, rtol=1e-12, atol=1e-12)
    # and the same as torch's own ignore_index on hand-built targets
    targets_full = torch.full_like(ids, IGNORE_INDEX)
    targets_full[rows, pos] = targets
    ce = F.cross_entropy(logits.reshape(-1, 11), targets_full.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(got, ce, rtol=1e-12, atol=1e-12)


def test_padding_positions_get_no_gradient(batch):
    logits, ids, mask, lengths = batch
    LMCrossEntropyLoss()(logits, ids, mask).backward()
    no_target = torch.ones(4, 6, dtype=torch.bool)
    for b, t, _ in reference_pairs(ids, lengths):
        no_target[b, t] = False
    assert torch.all(logits.grad[no_target] == 0)
    assert torch.all(logits.grad[~no_target].abs().sum(-1) > 0)


def test_accuracy_counts_valid_targets(batch):
    logits, ids, mask, lengths = batch
    pairs = reference_pairs(ids, lengths)
    hits = sum(int(logits[b, t].argmax()) == y for b, t, y in pairs)
    got = LMAccuracy()(logits, ids, mask)
    assert got.item() == pytest.approx(hits / len(pairs))
    perfect = torch.full((1, 3, 11), -5.0)
    seq = torch.tensor([[2, 3, 4]])
    perfect[0, 0, 3] = perfect[0, 1, 4] = 5.0
    assert LMAccuracy()(perfect, seq).item() == 1.0


def test_no_targets_gives_nan():
    logits = torch.randn(2, 1, 5)
    ids = torch.ones(2, 1, dtype=torch.int64)
    assert math.isnan(LMCrossEntropyLoss()(logits, ids).item())
    assert math.isnan(LMAccuracy()(logits, ids).item())


def test_lm_inputs_of_a_padded_batch():
    batch = pad_batch([np.array([3, 4, 5], np.int32), np.array([6], np.int32)])
    inputs = lm_inputs(batch)
    assert (inputs.n_real_tokens, inputs.n_slots) == (4, 6)
    assert inputs.padding_fraction == pytest.approx(2 / 6)
    assert inputs.labels.tolist() == [[4, 5, -100], [-100, -100, -100]]
    assert list(inputs.model_kwargs) == ["input_ids", "padding_mask"]
    assert inputs.model_kwargs["input_ids"] is batch.input_ids
    assert inputs.model_kwargs["padding_mask"] is batch.padding_mask
    moved = inputs.to("cpu")
    assert torch.equal(moved.labels, inputs.labels)
    on_meta = inputs.to("meta", labels=False)
    assert on_meta.labels is inputs.labels
    assert all(t.device.type == "meta" for t in on_meta.model_kwargs.values())


@pytest.mark.gpu
def test_lm_inputs_of_a_pinned_batch_has_pinned_labels():
    # Pageable labels would make .to(cuda, non_blocking=True) wait for the GPU's queue.
    batch = pad_batch([np.array([3, 4, 5], np.int32), np.array([6], np.int32)])
    assert not lm_inputs(batch).labels.is_pinned()
    assert lm_inputs(batch.pin_memory()).labels.is_pinned()


def test_lm_inputs_pass_a_packed_batch_s_block_lists():
    rows = [pack_row([np.arange(1, 6), np.arange(1, 3)], 8, pad_id=0)]
    batch = collate_packed(rows, attention_block_size=4)
    inputs = lm_inputs(batch)
    assert inputs.model_kwargs["doc_blocks"] is batch.blocks
    assert (inputs.n_real_tokens, inputs.n_slots) == (7, 8)
    assert torch.equal(inputs.to("cpu").model_kwargs["doc_blocks"].data, batch.blocks.data)


def test_lm_inputs_of_a_packed_batch_uses_its_labels():
    ids = torch.tensor([[1, 2, 3, 0]])
    packed = SimpleNamespace(
        input_ids=ids,
        labels=torch.tensor([[2, -100, -100, -100]]),
        doc_ids=torch.tensor([[0, 0, 1, -1]]),
        position_ids=torch.tensor([[0, 1, 0, 0]]),
        n_real_tokens=3,
    )
    inputs = lm_inputs(packed)
    assert inputs.labels is packed.labels
    assert list(inputs.model_kwargs) == ["input_ids", "position_ids", "doc_ids"]
    assert all(inputs.model_kwargs[k] is getattr(packed, k) for k in inputs.model_kwargs)
    assert (inputs.n_real_tokens, inputs.n_slots) == (3, 4)
    logits = torch.randn(1, 4, 5)
    torch.testing.assert_close(
        lm_cross_entropy(logits, inputs.labels), F.cross_entropy(logits[0, :1], torch.tensor([2]))
    )
