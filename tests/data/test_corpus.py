import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from effdl.data.corpus import (
    CorpusFormatError,
    NullTextWarning,
    SyntheticCorpusConfig,
    corpus_name,
    generate_wikitext_lines,
    load_corpus,
    measure_corpus,
    non_empty,
    read_wikitext,
    synthetic_corpus,
    write_wikitext,
)
from effdl.data.tokenize import basic_english, basic_english_many

QUICK = SyntheticCorpusConfig.quick()


@pytest.fixture(scope="module")
def quick_lines():
    return generate_wikitext_lines(QUICK)


def test_generation_is_deterministic_in_the_seed(quick_lines):
    assert generate_wikitext_lines(QUICK) == quick_lines
    assert generate_wikitext_lines(SyntheticCorpusConfig.quick(seed=1)) != quick_lines


def test_generated_lines_have_wikitext_structure(quick_lines):
    assert len(quick_lines) == QUICK.n_lines
    assert quick_lines[0].startswith(" = ") and quick_lines[0].endswith(" = ")
    assert quick_lines[1] == " "  # blank lines are one space, as in wiki.train.raw
    blank = sum(1 for line in quick_lines if not line.strip())
    assert 0.25 < blank / len(quick_lines) < 0.45  # WikiText-103 train: 35% blank
    assert any(line.startswith(" = = ") and not line.startswith(" = = = ") for line in quick_lines)
    assert any(line.startswith(" = = = ") for line in quick_lines)
    assert all("\n" not in line for line in quick_lines)
    counts = np.array([len(line.split()) for line in non_empty(quick_lines)])
    assert (counts > 640).sum() >= 5  # the heavy tail reaches past the truncation length
    assert 60 < counts.mean() < 120  # WikiText-103: ~87 whitespace tokens per non-empty line


def test_synthetic_corpus_is_the_non_empty_lines(quick_lines):
    assert synthetic_corpus(QUICK) == [line for line in quick_lines if line.strip()]


@pytest.mark.parametrize("name", ["wiki.train.raw", "wiki.train.tokens"])
def test_write_then_read_official_layout(tmp_path, name):
    path = write_wikitext(tmp_path, QUICK, name=name)
    assert path == tmp_path / name
    assert not list(tmp_path.glob("*.tmp"))
    expected = synthetic_corpus(QUICK)
    assert read_wikitext(path) == expected
    assert read_wikitext(tmp_path) == expected  # the folder works too


def test_read_parquet_text_column(tmp_path):
    rows = [" = T = \n", " \n", " first line \n", None, "", " second \n"]
    pq.write_table(pa.table({"text": rows, "other": list(range(6))}), tmp_path / "train.parquet")
    with pytest.warns(
        NullTextWarning, match=r"train\.parquet: skipped 1 of 6 rows whose 'text' is null"
    ) as w:
        lines = read_wikitext(tmp_path / "train.parquet")
    assert lines == [" = T = ", " first line ", " second "]
    assert (w[0].message.n_null, w[0].message.n_rows) == (1, 6)


@pytest.mark.parametrize(
    ("rows", "counts"),
    [([None, None, None], "3 rows, 3 of them null"),
     ([None, " ", ""], "3 rows, 1 of them null"),
     ([], "0 rows, 0 of them null")],
)  # fmt: skip
def test_parquet_without_text_is_refused_naming_the_file(tmp_path, rows, counts):
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": pa.array(rows, type=pa.string())}), path)
    with pytest.raises(
        CorpusFormatError, match=re.escape(f"nulls.parquet: no non-empty text rows ({counts};")
    ):
        read_wikitext(path)


def test_read_errors_name_the_file(tmp_path):
    with pytest.raises(CorpusFormatError, match=re.escape("nope.raw: no such file")):
        read_wikitext(tmp_path / "nope.raw")
    with pytest.raises(
        CorpusFormatError, match=re.escape("neither wiki.train.raw nor wiki.train.tokens")
    ):
        read_wikitext(tmp_path)
    (tmp_path / "blank.raw").write_text(" \n\n \n")
    with pytest.raises(CorpusFormatError, match=re.escape("blank.raw: no non-empty lines")):
        read_wikitext(tmp_path / "blank.raw")
    (tmp_path / "bin.raw").write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(CorpusFormatError, match=re.escape("bin.raw:2: not UTF-8")):
        read_wikitext(tmp_path / "bin.raw")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "no_text.parquet")
    with pytest.raises(
        CorpusFormatError, match=re.escape("no_text.parquet: cannot read a 'text' column")
    ):
        read_wikitext(tmp_path / "no_text.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(
        CorpusFormatError, match=re.escape("ints.parquet: column 'text' has type int64")
    ):
        read_wikitext(tmp_path / "ints.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(CorpusFormatError, match=re.escape("junk.parquet")):
        read_wikitext(tmp_path / "junk.parquet")
    with pytest.raises(CorpusFormatError, match=re.escape("missing.parquet: no such parquet file")):
        read_wikitext(tmp_path / "missing.parquet")


def test_load_corpus_defaults_to_generated_data(tmp_path):
    assert load_corpus(None, quick=True, seed=0) == synthetic_corpus(QUICK)
    assert corpus_name(None, quick=True) == "synthetic(quick, seed=0)"
    path = write_wikitext(tmp_path, QUICK)
    assert load_corpus(path) == synthetic_corpus(QUICK)
    assert corpus_name(path) == str(path)


def test_config_validation():
    with pytest.raises(ValueError, match="n_lines"):
        SyntheticCorpusConfig(n_lines=0)
    with pytest.raises(ValueError, match="whole numbers"):
        SyntheticCorpusConfig(n_lines=float("nan"))


@pytest.mark.slow
def test_full_size_generation_is_wikitext_sized():
    lines = generate_wikitext_lines(SyntheticCorpusConfig())
    assert len(lines) == 1_801_350
    sample = non_empty(lines[::50])
    tokens_estimate = np.mean([len(s.split()) for s in sample]) * len(sample) * 50
    assert 80e6 < tokens_estimate < 125e6


@pytest.mark.parametrize(
    ("head", "lineno", "offset"),
    [(b"", 1, "1"), (b" = T = \n \n", 3, "11"), (b"ok line\n" * 200_000, 200_001, "1,600,001")],
)
def test_non_utf8_line_inside_a_valid_file_is_named_by_line_and_byte(
    tmp_path, head, lineno, offset
):
    """The text reader decodes in chunks: the error must still name the file's line and byte."""
    path = tmp_path / "wiki.train.raw"
    path.write_bytes(head + b"x\xffy\n" + b"more text\n")
    with pytest.raises(
        CorpusFormatError,
        match=re.escape(f"wiki.train.raw:{lineno}: not UTF-8 text (byte {offset} of the file;"),
    ):
        read_wikitext(tmp_path)


def test_measure_corpus_matches_brute_force_counts(quick_lines):
    chunks = [quick_lines[i : i + 333] for i in range(0, len(quick_lines), 333)]  # cuts articles
    s = measure_corpus(chunks, basic_english_many)
    samples = [line for line in quick_lines if line.strip()]
    tokens = [len(basic_english(line)) for line in samples]
    assert (s.n_lines, s.n_samples) == (len(quick_lines), len(samples))
    assert s.line_tokens.tolist() == tokens
    assert s.line_words.tolist() == [len(line.split()) for line in samples]
    assert s.vocabulary == len({t for line in samples for t in basic_english(line)})
    titles = [i for i, line in enumerate(samples) if re.fullmatch(r" = [^=].* = ", line)]
    assert s.n_articles == len(titles) > 10
    ends = [*titles[1:], len(samples)]
    expected = [sum(tokens[a:b]) for a, b in zip(titles, ends, strict=True)]
    assert s.article_lengths().tolist() == expected
    assert s.share_longer(640) == sum(t > 640 for t in tokens) / len(tokens) > 0
    whole = measure_corpus([quick_lines], basic_english_many)
    assert whole.line_tokens.tolist() == tokens and whole.title.tolist() == s.title.tolist()


def test_an_article_runs_from_its_heading_and_lines_before_the_first_belong_to_none():
    lines = [" a b ", " ", " = T = ", " ", " = = S = = ", " c d e ", " = U = ", " f "]
    s = measure_corpus([lines], lambda batch: [line.split() for line in batch])
    assert s.title.tolist() == [False, True, False, False, True, False]
    assert s.n_articles == 2
    assert s.article_lengths().tolist() == [3 + 5 + 3, 3 + 1]
    assert s.share_longer(2) == 4 / 6
