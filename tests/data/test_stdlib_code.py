"""The stdlib code corpus: its split by path hash is disjoint, covers every file, is stable (the
rule pinned on named files, a file's side unchanged by a cap), holds out about the percentage
asked; its BPE and the documentation text never see a held-out file."""

import pytest

import effdl.data.stdlib_code as stdlib_code
from effdl.data.stdlib_code import (
    HELDOUT_PERCENT,
    SourceFile,
    docs_training_text,
    is_heldout,
    split_files,
    stdlib_code_corpus,
)
from effdl.data.stdlib_text import stdlib_source_files, stdlib_topics

CAP = 300_000


@pytest.fixture(scope="module")
def full():
    return stdlib_code_corpus()


def test_the_rule_is_a_hash_of_the_path_alone():
    pinned = {"abc.py": True, "csv.py": True, "typing.py": True, "asyncio/streams.py": True,
              "os.py": False, "argparse.py": False, "json/decoder.py": False}  # fmt: skip
    assert {p: is_heldout(p) for p in pinned} == pinned
    for path in pinned:  # a larger percentage holds out a superset
        sides = [is_heldout(path, percent) for percent in range(1, 100)]
        assert sides == sorted(sides)


def test_the_split_is_disjoint_and_covers_every_file(full):
    train, heldout = {f.path for f in full.train}, {f.path for f in full.heldout}
    assert not train & heldout
    assert train | heldout == {path for path, _ in stdlib_source_files()}
    assert all(is_heldout(p) for p in heldout) and not any(is_heldout(p) for p in train)
    share = len(heldout) / (len(train) + len(heldout))
    assert HELDOUT_PERCENT / 100 - 0.04 < share < HELDOUT_PERCENT / 100 + 0.04
    assert full.docs == stdlib_topics()


def test_the_split_is_stable_under_a_cap_and_repeatable(full):
    capped = stdlib_code_corpus(max_bytes=CAP)
    assert 0 < capped.n_bytes <= CAP
    kept = {f.path for f in (*capped.train, *capped.heldout)}
    assert {f.path for f in capped.heldout} == {f.path for f in full.heldout} & kept
    again = stdlib_code_corpus(max_bytes=CAP)
    assert again == capped and again.name.startswith("stdlib-code-py")
    assert capped.name != full.name
    assert stdlib_code_corpus(max_bytes=CAP, heldout_percent=20).name != capped.name


def test_split_files_keeps_order_and_refuses_a_bad_percentage():
    files = [SourceFile(p, "x = 1\n") for p in ("os.py", "abc.py", "argparse.py", "csv.py")]
    train, heldout = split_files(files)
    assert [f.path for f in train] == ["os.py", "argparse.py"]
    assert [f.path for f in heldout] == ["abc.py", "csv.py"]
    for bad in (0, 100):
        with pytest.raises(ValueError, match=r"1\.\.99"):
            split_files(files, bad)


def test_the_bpe_and_the_docs_text_never_see_a_held_out_file(tmp_path, monkeypatch):
    seen = []
    build = stdlib_code.bpe_folder

    def recording(texts, folder, vocab_size):
        seen.extend(texts)
        return build(texts, folder, vocab_size)

    monkeypatch.setattr(stdlib_code, "bpe_folder", recording)
    text = docs_training_text(tmp_path, bpe_vocab=300, max_bytes=CAP)
    corpus = stdlib_code_corpus(max_bytes=CAP)
    assert corpus.heldout and not {f.text for f in corpus.heldout} & set(seen)
    assert seen == [*corpus.docs, *(f.text for f in corpus.train)]
    assert text.docs == corpus.docs and text.name == f"{corpus.name}-docs"
    assert text.bos_id == 1 and (text.tokenizer_dir / "tokenizer.json").is_file()
    assert text.tokenizer_dir.parent == tmp_path
