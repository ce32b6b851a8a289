import functools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from effdl.data.bin_packing import best_fit_decreasing
from effdl.data.labels import IGNORE_INDEX
from effdl.data.packing import (
    BinDataset,
    SequencedDataset,
    collate_bins,
    collate_packed,
    pack_row,
    packed_loader,
)
from effdl.ops.document_mask import PAD_DOC_ID, document_blocks

# ---------------------------------------------------------------------------------------------
# rows, batches and masks


def test_pack_row_hand_example():
    row = pack_row([np.array([11, 12, 13]), np.array([], dtype=np.int64), np.array([21, 22])], 8, 0)
    assert row["input_ids"].tolist() == [11, 12, 13, 21, 22, 0, 0, 0]
    assert row["labels"].tolist() == [12, 13, -100, 22, -100, -100, -100, -100]
    assert row["doc_ids"].tolist() == [0, 0, 0, 1, 1, -1, -1, -1]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert row["cu_seqlens"].tolist() == [0, 3, 5, 8]
    full = pack_row([np.array([1, 2]), np.array([3, 4])], 4, 0)
    assert full["cu_seqlens"].tolist() == [0, 2, 4] and full["labels"].tolist() == [
        2,
        -100,
        4,
        -100,
    ]
    with pytest.raises(ValueError, match="more than seq_len=3"):
        pack_row([np.array([1, 2]), np.array([3, 4])], 3, 0)


def test_collate_packed_global_cu_seqlens_and_counts():
    rows = [
        pack_row([np.array([1, 2, 3])], 4, 0),
        pack_row([np.array([4]), np.array([5, 6, 7])], 4, 0),
    ]
    batch = collate_packed(rows)
    assert batch.input_ids.shape == (2, 4) and batch.input_ids.dtype == torch.int64
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 5, 8]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == 3
    assert batch.n_real_tokens == 7 and batch.n_label_tokens == 2 + 0 + 2
    moved = batch.to("cpu")
    assert moved.labels.equal(batch.labels) and moved.max_seqlen == 3
    with pytest.raises(ValueError, match="at least one row"):
        collate_packed([])


# ---------------------------------------------------------------------------------------------
# SequencedDataset


def make_docs(lengths):
    """Doc i holds tokens i*1000 + 1 .. i*1000 + len: each token names its doc and offset."""
    return [np.arange(1, n + 1, dtype=np.int64) + 1000 * i for i, n in enumerate(lengths)]


def real_segments(row):
    """The (doc, offsets) of each real segment in one packed row."""
    ids, doc_ids = row["input_ids"], row["doc_ids"]
    out = []
    for d in range(int(doc_ids.max()) + 1):
        seg = ids[doc_ids == d].numpy()
        out.append((int(seg[0] // 1000), (seg % 1000 - 1).tolist()))
    return out


def check_row_metadata(row, seq_len):
    ids, labels, doc_ids, pos, cu = (
        row[k] for k in ("input_ids", "labels", "doc_ids", "position_ids", "cu_seqlens")
    )
    assert ids.shape == labels.shape == doc_ids.shape == pos.shape == (seq_len,)
    assert cu[0] == 0 and cu[-1] == seq_len
    for k in range(len(cu) - 1):
        a, z = int(cu[k]), int(cu[k + 1])
        assert (doc_ids[a:z] == doc_ids[a]).all()
        assert pos[a:z].tolist() == list(range(z - a))
        if doc_ids[a] == PAD_DOC_ID:
            assert (labels[a:z] == IGNORE_INDEX).all()
        else:
            assert (
                labels[a : z - 1].tolist() == ids[a + 1 : z].tolist()
                and labels[z - 1] == IGNORE_INDEX
            )


def test_sequenced_split_keeps_every_token_in_order():
    lengths = [5, 9, 1, 14, 3, 7, 2]
    docs = make_docs(lengths)
    rows = list(SequencedDataset(docs, 8, pad_id=0))
    for r in rows:
        check_row_metadata(r, 8)
    stream = np.concatenate([r["input_ids"][r["doc_ids"] >= 0].numpy() for r in rows])
    np.testing.assert_array_equal(stream, np.concatenate(docs))
    assert len(rows) == -(-sum(lengths) // 8)
    assert (rows[-1]["doc_ids"] == PAD_DOC_ID).sum() == 8 * len(rows) - sum(lengths)


def test_sequenced_truncate_and_drop():
    docs = make_docs([5, 6, 20, 3])
    trunc = list(SequencedDataset(docs, 8, pad_id=0, overflow="truncate"))
    # [d0 5 + d1 head 3] [d2 head 8] [d3 3 + pad]
    assert [real_segments(r) for r in trunc] == [
        [(0, [0, 1, 2, 3, 4]), (1, [0, 1, 2])],
        [(2, list(range(8)))],
        [(3, [0, 1, 2])],
    ]
    drop = list(SequencedDataset(docs, 8, pad_id=0, overflow="drop"))
    # d1 does not fit after d0: dropped, row closed; d2 longer than a row: dropped
    assert [real_segments(r) for r in drop] == [[(0, [0, 1, 2, 3, 4])], [(3, [0, 1, 2])]]
    for r in trunc + drop:
        check_row_metadata(r, 8)
    with pytest.raises(ValueError, match="overflow must be"):
        SequencedDataset(docs, 8, pad_id=0, overflow="defer")


def test_sequenced_drop_last_skips_partial_row():
    docs = make_docs([5, 6])
    assert len(list(SequencedDataset(docs, 8, pad_id=0, drop_last=True))) == 1
    assert len(list(SequencedDataset(docs, 8, pad_id=0))) == 2


def test_sequenced_shuffle_epochs_and_workers():
    lengths = np.random.default_rng(0).integers(1, 30, size=60).tolist()
    docs = make_docs(lengths)
    ds = SequencedDataset(docs, 16, pad_id=0, shuffle=True, seed=3)

    def doc_multiset(rows):
        toks = np.concatenate([r["input_ids"][r["doc_ids"] >= 0].numpy() for r in rows])
        return np.sort(toks)

    first = list(ds)
    ds.set_epoch(1)
    second = list(ds)
    assert not torch.equal(first[0]["input_ids"], second[0]["input_ids"])
    everything = np.sort(np.concatenate(docs))
    np.testing.assert_array_equal(doc_multiset(first), everything)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate_packed)
    batches = list(loader)
    rows = [
        {k: getattr(b, k)[i] for k in ("input_ids", "doc_ids")}
        for b in batches
        for i in range(b.input_ids.shape[0])
    ]
    np.testing.assert_array_equal(doc_multiset(rows), everything)  # no doc lost or repeated


def test_bins_to_batches_round_trip():
    lengths = [9, 3, 7, 2, 16, 5, 1, 4]
    docs = make_docs(lengths)
    packing = best_fit_decreasing(lengths, 10, oversize="split")
    ds = BinDataset(docs, packing)
    loader = DataLoader(
        ds, batch_size=3, collate_fn=functools.partial(collate_bins, seq_len=10, pad_id=0)
    )
    tokens = []
    for batch in loader:
        assert batch.input_ids.shape[1] == 10
        tokens.append(batch.input_ids[batch.doc_ids >= 0].numpy())
        # every segment is a contiguous run of one document, positions restart at 0
        for row in range(batch.input_ids.shape[0]):
            fields = ("input_ids", "labels", "doc_ids", "position_ids")
            one = {k: getattr(batch, k)[row] for k in fields}
            check_row_metadata({**one, "cu_seqlens": _row_cu(batch, row)}, 10)
    np.testing.assert_array_equal(np.sort(np.concatenate(tokens)), np.sort(np.concatenate(docs)))


def _row_cu(batch, row):
    """The part of the batch-global cu_seqlens that covers one row, shifted to start at 0."""
    seq_len = batch.input_ids.shape[1]
    cu = batch.cu_seqlens
    return cu[(cu >= row * seq_len) & (cu <= (row + 1) * seq_len)] - row * seq_len


class DocsWithLengths(list):
    """A list of token arrays exposing ``lengths`` like effdl.data.tokenize.TokenizedCorpus."""

    @property
    def lengths(self):
        return np.array([len(d) for d in self], dtype=np.int64)


@pytest.mark.parametrize("method", ["concat", "ffd", "bfd"])
def test_packed_loader_delivers_every_token_once(method):
    lengths = [7, 0, 12, 3, 25, 9, 1, 16, 4]  # one empty doc, one longer than a row
    docs = DocsWithLengths(make_docs(lengths))
    loader = packed_loader(docs, 16, 2, pad_id=0, method=method, shuffle=True, seed=1)
    batches = list(loader)
    tokens = np.concatenate([b.input_ids[b.doc_ids >= 0].numpy() for b in batches])
    np.testing.assert_array_equal(np.sort(tokens), np.sort(np.concatenate(docs)))
    assert sum(b.n_real_tokens for b in batches) == sum(lengths)
    assert all(b.input_ids.shape == (2, 16) for b in batches)  # static shape: last one topped up
    if method != "concat":
        packing = loader.dataset.packing
        used_rows = sum(int((b.doc_ids >= 0).any(dim=1).sum()) for b in batches)
        assert packing.stats.n_bins == used_rows
        unpadded = packed_loader(docs, 16, 2, pad_id=0, method=method, static_shape=False)
        assert packing.stats.n_bins == sum(b.input_ids.shape[0] for b in unpadded)
        np.testing.assert_array_equal(packing.dropped, [1])
    with pytest.raises(ValueError, match="method must be"):
        packed_loader(docs, 16, 2, pad_id=0, method="wfd")


@pytest.mark.parametrize("method", ["concat", "bfd"])
def test_packed_loader_builds_attention_block_lists_in_the_workers(method):
    docs = DocsWithLengths(make_docs([7, 12, 3, 25, 9, 1, 16, 4]))
    loader = packed_loader(docs, 16, 2, pad_id=0, method=method, attention_block_size=4)
    for batch in loader:
        assert torch.equal(batch.blocks.data, document_blocks(batch.doc_ids, 4).data)
        moved = batch.to("cpu")
        assert moved.blocks.block_size == 4 and torch.equal(moved.blocks.data, batch.blocks.data)
    assert packed_loader(docs, 16, 2, pad_id=0, method=method).__iter__().__next__().blocks is None


def test_collate_tops_up_a_short_batch_with_padding_rows():
    rows = [pack_row([np.arange(1, 4)], 6, pad_id=0)]
    batch = collate_packed(rows, n_rows=3, pad_id=0)
    assert batch.input_ids.shape == (3, 6)
    assert (batch.doc_ids[1:] == PAD_DOC_ID).all() and (batch.labels[1:] == IGNORE_INDEX).all()
    assert batch.n_real_tokens == 3 and batch.n_label_tokens == 2
    assert batch.cu_seqlens.tolist() == [0, 3, 6, 12, 18]
    with pytest.raises(ValueError, match="needs pad_id"):
        collate_packed(rows, n_rows=3)


@pytest.mark.parametrize("method", ["concat", "ffd", "bfd"])
def test_packed_loader_refuses_docs_without_tokens(method):
    docs = [np.zeros(0, dtype=np.int64)] * 3
    with pytest.raises(ValueError, match="nothing to pack: all 3 documents are empty"):
        packed_loader(docs, 16, 2, pad_id=0, method=method)


def test_packed_loader_refuses_float_lengths():
    class Docs(list):
        lengths = np.array([2.5, 3.0])

    docs = Docs([np.arange(2), np.arange(3)])
    with pytest.raises(ValueError, match="lengths must be integers, got dtype float64"):
        packed_loader(docs, 16, 2, pad_id=0, method="bfd")
