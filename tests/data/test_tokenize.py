import multiprocessing as mp
import re
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from effdl.data.corpus import CorpusFormatError, SyntheticCorpusConfig, synthetic_corpus
from effdl.data.tokenize import (
    CacheRebuiltWarning,
    TokenizedCorpus,
    Vocab,
    basic_english,
    basic_english_many,
    cached_basic_english,
    encode_with_tokenizer,
    fit_basic_english,
    load_hf_tokenizer,
    train_byte_level_bpe,
)

# Hand-checked against torchtext 0.18's rules (lowercase, then in order: ' -> " '  ",
# " -> "", . -> " . ", <br /> -> " ", , ( ) ! ? padded, ; : -> " ", whitespace collapsed).
BASIC_ENGLISH_CASES = [
    (
        "You can now install TorchText using pip!",
        ["you", "can", "now", "install", "torchtext", "using", "pip", "!"],
    ),
    ('He said "hello," then left.', ["he", "said", "hello", ",", "then", "left", "."]),
    (
        "It's John's (big) day; really: yes?",
        ["it", "'", "s", "john", "'", "s", "(", "big", ")", "day", "really", "yes", "?"],
    ),
    ("Line one.<br />Line two", ["line", "one", ".", "line", "two"]),
    ("a<br/>b", ["a<br/>b"]),  # only the exact "<br />" is removed
    ("3.14 @-@ value", ["3", ".", "14", "@-@", "value"]),
    ("wait...what!?", ["wait", ".", ".", ".", "what", "!", "?"]),
    ("Tabs\tand\nnewlines  ", ["tabs", "and", "newlines"]),
    ("a-b_c/d [x] {y}", ["a-b_c/d", "[x]", "{y}"]),
    ("ÉCOLE Straße", ["école", "straße"]),
    (" = Valkyria Chronicles III = ", ["=", "valkyria", "chronicles", "iii", "="]),
    ("end; time: 5", ["end", "time", "5"]),
    ('""', []),
    ("", []),
    ("non\u00a0breaking\u2003em", ["non", "breaking", "em"]),
]


@pytest.mark.parametrize(("line", "tokens"), BASIC_ENGLISH_CASES)
def test_basic_english_matches_hand_checked_table(line, tokens):
    assert basic_english(line) == tokens


@pytest.fixture(scope="module")
def quick_lines():
    return synthetic_corpus(SyntheticCorpusConfig.quick())


def test_joined_fast_path_equals_per_line_rules(quick_lines):
    lines = [*quick_lines[:300], *(c for c, _ in BASIC_ENGLISH_CASES if "\n" not in c)]
    lines += ["ΟΔΟΣ", "ΣΑ Σ", "x\x1cy", "q\u2028r", "tail ", "\u0130stanbul"]
    assert basic_english_many(lines) == [basic_english(line) for line in lines]
    with_newline = ["a\nb", "C.d"]  # takes the per-line path
    assert basic_english_many(with_newline) == [basic_english(line) for line in with_newline]


@given(
    st.lists(st.text(alphabet=st.characters(blacklist_characters="\n"), max_size=30), max_size=8)
)
@settings(max_examples=200, deadline=None)
def test_joined_fast_path_property(lines):
    assert basic_english_many(lines) == [basic_english(line) for line in lines]


def test_vocab_order_min_freq_and_max_size():
    counts = {"b": 3, "a": 3, "c": 1, "d": 5, "<unk>": 9}
    assert Vocab.from_counts(counts).itos == ["<pad>", "<unk>", "d", "a", "b", "c"]
    assert Vocab.from_counts(counts, min_freq=2).itos == ["<pad>", "<unk>", "d", "a", "b"]
    assert Vocab.from_counts(counts, max_size=3).itos == ["<pad>", "<unk>", "d"]
    v = Vocab.from_counts(counts)
    assert (v.pad_id, v.unk_id) == (0, 1)
    np.testing.assert_array_equal(v.encode(["a", "zzz", "d"]), [3, 1, 2])
    with pytest.raises(ValueError, match="starts with"):
        Vocab(["a", "b"])
    with pytest.raises(ValueError, match="min_freq"):
        Vocab.from_counts(counts, min_freq=0)


def test_vocab_save_load(tmp_path):
    v = Vocab.from_counts({"x": 2, "y": 1})
    v.save(tmp_path / "v.json")
    assert Vocab.load(tmp_path / "v.json").itos == v.itos
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CorpusFormatError, match=re.escape("bad.json")):
        Vocab.load(tmp_path / "bad.json")


@pytest.mark.parametrize("workers", [1, 2])
def test_fit_basic_english_equals_reference(quick_lines, workers):
    lines = quick_lines[:400]
    corpus, vocab = fit_basic_english(lines, workers=workers, chunk_lines=97)
    assert len(corpus) == len(lines)
    for i in (0, 1, 57, 399):
        assert [vocab.itos[t] for t in corpus[i]] == basic_english(lines[i])
    # Reference vocabulary: count every token with a plain loop.
    counts: dict[str, int] = {}
    for line in lines:
        for t in basic_english(line):
            counts[t] = counts.get(t, 0) + 1
    assert vocab.itos == Vocab.from_counts(counts).itos


def test_fit_basic_english_min_freq_maps_rare_tokens_to_unk():
    corpus, vocab = fit_basic_english(["a a b", "a c"], min_freq=2, workers=1)
    assert vocab.itos == ["<pad>", "<unk>", "a"]
    np.testing.assert_array_equal(corpus.ids, [2, 2, 1, 2, 1])
    np.testing.assert_array_equal(corpus.lengths, [3, 2])


def test_tokenized_corpus_indexing_and_validation():
    c = TokenizedCorpus.from_sequences([[1, 2, 3], [], [4]])
    assert len(c) == 3 and c.n_tokens == 4
    np.testing.assert_array_equal(c[0], [1, 2, 3])
    assert c[1].size == 0
    np.testing.assert_array_equal(c[-1], [4])
    assert c.ids.dtype == np.int32 and c.offsets.dtype == np.int64
    with pytest.raises(IndexError):
        c[3]
    with pytest.raises(ValueError, match="offsets"):
        TokenizedCorpus(np.arange(3), np.array([0, 2]))
    with pytest.raises(ValueError, match="non-decreasing"):
        TokenizedCorpus(np.arange(3), np.array([0, 2, 1, 3]))


@given(
    st.lists(st.lists(st.integers(0, 99), max_size=12), max_size=20),
    st.integers(1, 8),
    st.sampled_from(["truncate", "drop"]),
    st.integers(0, 2),
)
@settings(max_examples=150, deadline=None)
def test_truncate_matches_brute_force(seqs, max_length, overflow, min_length):
    got = TokenizedCorpus.from_sequences(seqs).truncate(max_length, overflow, min_length)
    expected = [
        s[:max_length]
        for s in seqs
        if len(s) >= min_length and (overflow == "truncate" or len(s) <= max_length)
    ]
    assert [list(got[i]) for i in range(len(got))] == expected


def test_truncate_rejects_bad_mode():
    with pytest.raises(ValueError, match="overflow"):
        TokenizedCorpus.from_sequences([[1]]).truncate(4, overflow="wrap")


def test_save_load_roundtrip(tmp_path):
    c = TokenizedCorpus.from_sequences([[5, 6], [7]])
    path = c.save(tmp_path / "c.npz")
    back = TokenizedCorpus.load(path)
    np.testing.assert_array_equal(back.ids, c.ids)
    np.testing.assert_array_equal(back.offsets, c.offsets)
    np.savez(tmp_path / "bad.npz", ids=np.arange(3))
    with pytest.raises(CorpusFormatError, match=re.escape("bad.npz: not a tokenized corpus")):
        TokenizedCorpus.load(tmp_path / "bad.npz")


def test_byte_level_bpe_trains_offline_and_roundtrips(quick_lines, tmp_path):
    tok = train_byte_level_bpe(quick_lines[:500], vocab_size=400)
    assert tok.token_to_id("<pad>") == 0 and tok.token_to_id("<bos>") == 1
    assert tok.get_vocab_size() <= 400
    text = quick_lines[3]
    assert tok.decode(tok.encode(text).ids) == text
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_hf_tokenizer(tmp_path)
    corpus = encode_with_tokenizer(loaded, quick_lines[:5], bos_id=1, batch_size=2)
    assert len(corpus) == 5
    assert all(corpus[i][0] == 1 for i in range(5))
    np.testing.assert_array_equal(corpus[3][1:], tok.encode(text).ids)


def test_load_hf_tokenizer_errors(tmp_path):
    with pytest.raises(CorpusFormatError, match="no such tokenizer"):
        load_hf_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CorpusFormatError, match=re.escape("tokenizer.json: not a tokenizers JSON")):
        load_hf_tokenizer(tmp_path)


def test_cached_basic_english_hits_the_cache(tmp_path):
    calls = []

    def load():
        calls.append(1)
        return ["a b", "b c ."]

    first, vocab, hit = cached_basic_english(load, tmp_path / "c.npz", workers=1)
    assert not hit and (tmp_path / "c.vocab.json").is_file()
    again, vocab2, hit2 = cached_basic_english(load, tmp_path / "c.npz", workers=1)
    assert hit2 and len(calls) == 1
    np.testing.assert_array_equal(again.ids, first.ids)
    assert vocab2.itos == vocab.itos
    # Other options than the cache was built with: a clear error, not another vocabulary.
    with pytest.raises(CorpusFormatError, match=r"c\.npz was built with .*'max_size': None"):
        cached_basic_english(load, tmp_path / "c.npz", max_size=2, workers=1)
    # A cache without recorded options (an older one) is rebuilt, then hits again.
    (tmp_path / "c.options.json").unlink()
    _, _, hit3 = cached_basic_english(load, tmp_path / "c.npz", workers=1)
    assert not hit3 and len(calls) == 2
    assert cached_basic_english(load, tmp_path / "c.npz", workers=1)[2]


def _save_many(args):
    path, seed = args
    corpus = TokenizedCorpus.from_sequences([np.arange(seed % 7 + 1)] * 200)
    for _ in range(20):
        corpus.save(path)
    return seed


def test_concurrent_saves_to_one_cache_path_each_leave_a_whole_file(tmp_path):
    path = tmp_path / "shared.npz"
    with mp.get_context("fork").Pool(4) as pool:
        assert sorted(pool.map(_save_many, [(path, s) for s in range(4)])) == [0, 1, 2, 3]
    loaded = TokenizedCorpus.load(path)
    assert len(loaded) == 200
    assert [p.name for p in tmp_path.iterdir()] == ["shared.npz"]  # no temporary file left


def _corrupt_truncate(npz):
    npz.write_bytes(npz.read_bytes()[:50])


def _corrupt_garbage(npz):
    npz.write_bytes(b"not a zip")


def _corrupt_options(npz):
    npz.with_name("c.options.json").write_text("{bad")


def _corrupt_vocab(npz):
    npz.with_name("c.vocab.json").write_text('{"not": "a list"}')


@pytest.mark.parametrize(
    ("corrupt", "named"),
    [(_corrupt_truncate, r"c\.npz: not a tokenized corpus"),
     (_corrupt_garbage, r"c\.npz: not a tokenized corpus"),
     (_corrupt_options, r"c\.options\.json: not a JSON options file"),
     (_corrupt_vocab, r"c\.vocab\.json: expected a JSON list")],
)  # fmt: skip
def test_corrupt_cache_is_a_miss_rebuilt_with_a_warning_naming_the_file(tmp_path, corrupt, named):
    def load():
        return ["a b", "b c ."]

    npz = tmp_path / "c.npz"
    first, vocab, _ = cached_basic_english(load, npz, workers=1)
    corrupt(npz)
    with pytest.warns(CacheRebuiltWarning, match=named + ".*rebuilding the token cache"):
        again, vocab2, hit = cached_basic_english(load, npz, workers=1)
    assert not hit and vocab2.itos == vocab.itos
    np.testing.assert_array_equal(again.ids, first.ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cached_basic_english(load, npz, workers=1)[2]  # the rebuilt cache hits


def test_cache_path_that_cannot_be_written_is_one_error_naming_it(tmp_path):
    npz = tmp_path / "c.npz"
    npz.mkdir()
    with pytest.raises(
        CorpusFormatError, match=r"token cache: cannot write .*c\.npz \(Is a directory\)"
    ):
        cached_basic_english(lambda: ["a b"], npz, workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]  # no temporary file left
