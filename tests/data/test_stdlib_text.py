"""The stdlib corpus: deterministic content and names, the held-out rule, atomic parquet files
readable by the seed-002 datasets, the BPE folder, and the unigram entropy against closed forms."""

import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from effdl.data.parquet import ParquetDataset
from effdl.data.stdlib_text import (
    content_hash,
    parquet_metadata,
    split_documents,
    stdlib_bpe,
    stdlib_corpus,
    stdlib_documents,
    token_counts,
    unigram_entropy,
    write_text_parquet,
)
from effdl.data.tokenize import load_hf_tokenizer

CAP = 600_000  # the documentation topics and the first library files


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return stdlib_corpus(tmp_path_factory.mktemp("lm"), max_bytes=CAP)


def test_documents_are_capped_and_start_with_the_documentation():
    from pydoc_data.topics import topics

    docs = stdlib_documents(max_bytes=CAP)
    assert sum(len(d.encode()) for d in docs) <= CAP
    assert docs[: len(topics)] == [topics[k] for k in sorted(topics)]
    assert any("def " in d for d in docs[len(topics) :])  # source files follow


def test_the_corpus_is_deterministic(corpus, tmp_path):
    again = stdlib_corpus(tmp_path, max_bytes=CAP)
    assert again.name == corpus.name and again.n_bytes == corpus.n_bytes
    for split in ("train", "val"):
        a = pq.read_table(getattr(corpus, split)).column("text").to_pylist()
        b = pq.read_table(getattr(again, split)).column("text").to_pylist()
        assert a == b


def test_file_names_and_metadata_record_version_and_hash(corpus):
    import platform

    version = ".".join(platform.python_version_tuple()[:2])
    assert corpus.name.startswith(f"stdlib-py{version}-")
    meta = parquet_metadata(corpus.train)
    assert meta["python"] == platform.python_version()
    assert meta["sha256"].startswith(corpus.name.rsplit("-", 1)[1])
    assert (meta["split"], parquet_metadata(corpus.val)["split"]) == ("train", "val")


def test_every_20th_document_is_held_out(corpus):
    n_train = pq.read_metadata(corpus.train).num_rows
    n_val = pq.read_metadata(corpus.val).num_rows
    assert n_train + n_val == corpus.n_documents
    assert n_val == corpus.n_documents // 20
    assert split_documents(list("abcdefg"), 3) == (list("abdeg"), list("cf"))
    with pytest.raises(ValueError, match="val_every"):
        split_documents(["a"], 1)


def test_the_hash_sees_document_boundaries():
    assert content_hash(["ab", "c"]) != content_hash(["a", "bc"])
    assert content_hash(["ab", "c"]) == content_hash(["ab", "c"])


def test_parquet_is_written_atomically_and_reads_as_seed_data(tmp_path):
    path = write_text_parquet(["one doc", "two"], tmp_path / "d.parquet", {"k": "v"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.parquet"]  # no temporary left
    assert parquet_metadata(path) == {"k": "v"}
    ds = ParquetDataset(path, _Chars(), seq_len=4)
    assert ds[0]["input_ids"] == [ord(c) for c in "one d"]


class _Chars:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_bpe_folder_has_the_specials_and_is_reused(corpus, tmp_path):
    folder = stdlib_bpe(corpus, vocab_size=300, cache_dir=tmp_path)
    tok = load_hf_tokenizer(folder)
    assert tok.get_vocab_size() == 300
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
    assert '"bos_token": "<bos>"' in (folder / "tokenizer_config.json").read_text()
    mtime = (folder / "tokenizer.json").stat().st_mtime_ns
    assert stdlib_bpe(corpus, vocab_size=300, cache_dir=tmp_path) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]


def test_unigram_entropy_against_closed_forms():
    assert unigram_entropy(np.full(8, 5)) == pytest.approx(math.log(8))
    assert unigram_entropy(np.array([0, 7, 0])) == 0.0
    p = np.array([0.5, 0.25, 0.25])
    assert unigram_entropy(p * 4) == pytest.approx(1.5 * math.log(2))
    with pytest.raises(ValueError, match="at least one token"):
        unigram_entropy(np.zeros(3))


def test_token_counts_counts_every_token():
    counts = token_counts(lambda s: [ord(c) - 97 for c in s], ["abca", "", "c"], vocab_size=4)
    assert counts.tolist() == [2, 1, 2, 0]
