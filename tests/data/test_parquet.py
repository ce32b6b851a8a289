import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast

from effdl.data.corpus import NullTextWarning
from effdl.data.parquet import (
    IGNORE_INDEX,
    CollatorForCLM,
    IterableParquetDataset,
    ParquetDataset,
    as_encoder,
)

TEXTS = [
    "the cat sat on the mat",
    "a dog ran in the park and the cat watched",
    "",
    "language models predict the next token",
    "the mat was red",
]


@pytest.fixture(scope="module")
def bpe():
    """A tiny word-level BPE trained offline; ids 0 and 1 are <pad> and <bos>."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<bos>", "<unk>"])
    tok.train_from_iterator(TEXTS * 3, trainer)
    return tok


@pytest.fixture
def parquet_file(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": TEXTS, "id": list(range(len(TEXTS)))}), path)
    return path


class FixedIds:
    """A tokenizer stand-in (HF-style ``encode``) that returns chosen ids per text."""

    def __init__(self, table):
        self.table = table

    def encode(self, text, add_special_tokens=True):
        return list(self.table[text])


def test_adapter_accepts_both_tokenizer_kinds(bpe):
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", pad_token="<pad>")
    for text in TEXTS:
        assert as_encoder(bpe)(text) == as_encoder(hf)(text) == bpe.encode(text).ids
    assert all(i > 2 for i in as_encoder(bpe)(TEXTS[0]))  # no special tokens added
    with pytest.raises(TypeError, match="got int"):
        as_encoder(3)


def test_parquet_dataset_truncates_and_wraps(parquet_file, bpe):
    ds = ParquetDataset(parquet_file, bpe, seq_len=4, training_samples=7, bos_id=1)
    assert len(ds) == 7
    for idx in range(7):
        full = [1, *bpe.encode(TEXTS[idx % len(TEXTS)]).ids]
        assert ds[idx]["input_ids"] == full[:5]
    assert ds[2]["input_ids"] == [1]  # empty document: BoS only
    assert len(ParquetDataset(parquet_file, bpe, seq_len=4)) == len(TEXTS)


def test_parquet_errors_name_the_file(tmp_path, bpe):
    with pytest.raises(FileNotFoundError, match=r"missing\.parquet"):
        ParquetDataset(tmp_path / "missing.parquet", bpe, 8)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"body": ["x"]}), bad)
    with pytest.raises(ValueError, match=r"bad.parquet: no column 'text' \(found \['body'\]\)"):
        IterableParquetDataset(bad, bpe, 8)
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), ints)
    with pytest.raises(ValueError, match="expected string"):
        ParquetDataset(ints, bpe, 8)


@pytest.mark.parametrize("damage", ["random-bytes", "truncated", "row-groups"])
def test_a_damaged_parquet_is_a_value_error_naming_the_file(tmp_path, bpe, damage):
    """Random bytes, a file cut short, or a footer intact over damaged row groups: one ValueError
    naming the file, not pyarrow's error without it."""
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(300)]}), whole)
    data, bad = whole.read_bytes(), tmp_path / "bad.parquet"
    if damage == "random-bytes":
        bad.write_bytes(np.random.default_rng(0).bytes(4096))
    elif damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    else:  # overwrite the first column chunk, keep the footer
        bad.write_bytes(data[:4] + bytes(len(data) // 2) + data[4 + len(data) // 2 :])
    for dataset in (ParquetDataset, IterableParquetDataset):
        with pytest.raises(ValueError, match=r"bad\.parquet: not a readable parquet file \("):
            dataset(bad, bpe, 8)


def test_collator_hand_computed_example():
    batch = CollatorForCLM(seq_len=4, pad_id=0)(
        [{"input_ids": [5, 6, 7]}, {"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [9]}]
    )
    assert batch.inputs.tolist() == [[5, 6, 7, 0], [1, 2, 3, 4], [9, 0, 0, 0]]
    assert batch.labels.tolist() == [
        [6, 7, -100, -100],
        [2, 3, 4, 5],
        [-100, -100, -100, -100],
    ]
    assert batch.ignored_tokens == 6 == int((batch.labels == IGNORE_INDEX).sum())
    assert batch.inputs.dtype == batch.labels.dtype == torch.int64


def test_collator_masks_by_position_not_by_value():
    # token 0 is also the pad id; seed 002's `labels == pad_id` would wrongly mask it
    batch = CollatorForCLM(seq_len=4, pad_id=0)([{"input_ids": [3, 0, 4]}])
    assert batch.labels.tolist() == [[0, 4, -100, -100]] and batch.ignored_tokens == 2
    with pytest.raises(ValueError, match="sample 0 has 6 ids, more than seq_len \\+ 1 = 5"):
        CollatorForCLM(seq_len=4, pad_id=0)([{"input_ids": [1, 2, 3, 4, 5, 6]}])


def test_collator_in_dataloader_counts_padding(parquet_file, bpe):
    ds = ParquetDataset(parquet_file, bpe, seq_len=16, bos_id=1)
    loader = DataLoader(ds, batch_size=len(TEXTS), collate_fn=CollatorForCLM(16, pad_id=0))
    batch = next(iter(loader))
    lengths = np.array([len(ds[i]["input_ids"]) for i in range(len(ds))])
    assert batch.inputs.shape == batch.labels.shape == (len(TEXTS), 16)
    assert batch.ignored_tokens == int((16 - (lengths - 1)).sum())


def stream_reference(texts, encode, bos_id, seq_len):
    """Windows of seq_len + 1 over [BoS, doc0, BoS, doc1, ...], overlapping by one token."""
    stream, bos_at = [], []
    for text in texts:
        bos_at.append(len(stream))
        stream += [bos_id, *encode(text)]
    is_bos = np.zeros(len(stream), dtype=bool)
    is_bos[bos_at] = True
    out, start = [], 0
    while start + seq_len + 1 <= len(stream):
        window = stream[start : start + seq_len + 1]
        labels = [IGNORE_INDEX if is_bos[start + j] else window[j + 1] for j in range(seq_len)]
        out.append((window[:-1], labels))
        start += seq_len
    return out


@pytest.mark.parametrize("seq_len", [3, 5, 8])
def test_iterable_matches_stream_reference(parquet_file, bpe, seq_len):
    got = [
        (i.tolist(), lab.tolist())
        for i, lab in IterableParquetDataset(parquet_file, bpe, seq_len, bos_id=1)
    ]
    want = stream_reference(TEXTS, lambda t: bpe.encode(t).ids, 1, seq_len)
    assert got == want and len(got) > 2


def test_iterable_bos_convention_hand_example(tmp_path):
    path = tmp_path / "two.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    # doc "a" contains id 1 as a real token; only inserted BoS positions are masked
    tok = FixedIds({"a": [7, 1, 8], "b": [9, 10]})
    rows = [(x.tolist(), y.tolist()) for x, y in IterableParquetDataset(path, tok, 4, bos_id=1)]
    # stream: [1, 7, 1, 8, 1, 9, 10]; windows of 5 starting at 0 (and 4 is too short)
    assert rows == [([1, 7, 1, 8], [-100, 1, 8, 1])]


def test_iterable_cycle_continues_past_one_pass(tmp_path):
    path = tmp_path / "two.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    tok = FixedIds({"a": [7, 8], "b": [9]})
    it = iter(IterableParquetDataset(path, tok, 3, bos_id=1, cycle=True))
    rows = [next(it) for _ in range(3)]
    # stream: 1 7 8 1 9 | 1 7 8 1 9 | ...; windows start at 0, 3, 6
    assert [r[0].tolist() for r in rows] == [[1, 7, 8], [1, 9, 1], [7, 8, 1]]
    assert [r[1].tolist() for r in rows] == [[-100, 8, 1], [-100, 1, -100], [8, 1, -100]]


def test_iterable_workers_read_disjoint_rows(tmp_path):
    path = tmp_path / "many.parquet"
    texts = [f"d{i}" for i in range(10)]
    pq.write_table(pa.table({"text": texts}), path)
    tok = FixedIds({t: [100 + i] * 3 for i, t in enumerate(texts)})
    ds = IterableParquetDataset(path, tok, 3, bos_id=1)
    seen = torch.cat([x for x, _ in DataLoader(ds, batch_size=None, num_workers=2)])
    counts = torch.bincount(seen[seen != 1] - 100, minlength=10)
    # every row is read by exactly one worker (a repeat would show up as more than 3 tokens);
    # only a worker's final window is cut short, so all but its last doc appear in full
    assert counts.numel() == 10 and (counts >= 1).all() and (counts <= 3).all()
    assert int((counts == 3).sum()) >= 8


def test_encoder_pickles_for_spawned_workers(bpe):
    enc = pickle.loads(pickle.dumps(as_encoder(bpe)))
    assert enc(TEXTS[0]) == bpe.encode(TEXTS[0]).ids


@pytest.mark.parametrize("dataset", [ParquetDataset, IterableParquetDataset])
def test_null_text_rows_are_skipped_and_counted(tmp_path, dataset):
    path = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"text": ["a", None, "b", None]}), path)
    tok = FixedIds({"a": [7, 8], "b": [9]})
    with pytest.warns(NullTextWarning, match=r"holes\.parquet: skipped 2 of 4 rows"):
        ds = dataset(path, tok, 3, bos_id=1)
    if dataset is ParquetDataset:
        assert [ds[i]["input_ids"] for i in range(len(ds))] == [[1, 7, 8], [1, 9]]
    else:
        assert [x.tolist() for x, _ in ds] == [[1, 7, 8]]  # stream 1 7 8 1 9: nulls add no BoS


@pytest.mark.parametrize("dataset", [ParquetDataset, IterableParquetDataset])
@pytest.mark.parametrize(
    ("rows", "counts"),
    [([None, None], "2 rows, 2 of them null"), (["", None], "2 rows, 1 of them null"),
     ([], "0 rows, 0 of them null")],
)  # fmt: skip
def test_parquet_without_text_is_refused_naming_the_file(tmp_path, dataset, rows, counts):
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": pa.array(rows, type=pa.string())}), path)
    with pytest.raises(ValueError, match=rf"nulls\.parquet: no non-empty text rows \({counts};"):
        dataset(path, FixedIds({}), 8)


def test_iterable_dataset_lives_alone_in_its_file_and_is_the_one_parquet_exports():
    """Seed 002, deliverable 3: the class alone (with its imports) in a python file."""
    import ast
    import inspect

    from effdl.data import iterable_parquet, parquet

    tree = ast.parse(inspect.getsource(iterable_parquet))
    kinds = {type(node) for node in tree.body} - {ast.Import, ast.ImportFrom}
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert kinds == {ast.ClassDef} and classes == ["IterableParquetDataset"]
    assert parquet.IterableParquetDataset is iterable_parquet.IterableParquetDataset
