"""The Python standard library's own code as a fine-tuning corpus, with held-out files.

:func:`stdlib_code_corpus` takes the stdlib's ``.py`` files
(:func:`effdl.data.stdlib_text.stdlib_source_files`) and splits them by file: a file is held out
when a hash of its relative path says so (:func:`is_heldout`). A file's side depends on its path
alone, so it stays put when other files come or go (another Python version, a ``max_bytes``
cap), and a held-out file is never part of anything trained: not the model's training text, not
the tokenizer. The documentation topics (``pydoc_data.topics``) are the corpus's third part, the
text to pretrain on before the code.

:func:`code_bpe` trains one byte-level BPE on the documentation and the training files, cached
under a name carrying the corpus's content hash (:func:`effdl.data.stdlib_text.bpe_folder`).
:func:`docs_training_text` is what ``pretrain.py --corpus docs`` trains on: the documentation,
read by that BPE.
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

from effdl.data.stdlib_text import (
    DEFAULT_CACHE,
    TrainingText,
    bpe_folder,
    content_hash,
    stdlib_source_files,
    stdlib_topics,
)
from effdl.data.tokenize import BOS_TOKEN, tokenizer_token_id

HELDOUT_PERCENT = 10  # of the files, by path hash


@dataclass(frozen=True)
class SourceFile:
    """One ``.py`` file of the stdlib: its path relative to the stdlib folder (POSIX
    separators) and its text."""

    path: str
    text: str


def is_heldout(path: str, percent: int = HELDOUT_PERCENT) -> bool:
    """Whether the file at ``path`` (relative, POSIX) is held out: the first 8 bytes of the
    SHA-256 of the path, as a little-endian integer, modulo 100, are below ``percent``."""
    digest = hashlib.sha256(path.encode()).digest()
    return int.from_bytes(digest[:8], "little") % 100 < percent


def split_files(
    files: list[SourceFile], percent: int = HELDOUT_PERCENT
) -> tuple[list[SourceFile], list[SourceFile]]:
    """(training files, held-out files) of ``files`` by :func:`is_heldout`, order kept."""
    if not 0 < percent < 100:
        raise ValueError(f"the held-out percentage must be in 1..99, got {percent}")
    heldout = [f for f in files if is_heldout(f.path, percent)]
    train = [f for f in files if not is_heldout(f.path, percent)]
    return train, heldout


@dataclass(frozen=True)
class CodeCorpus:
    """The documentation topics and the stdlib's code files split by :func:`split_files`;
    ``name`` carries the Python version and a hash of all three parts and the split."""

    name: str
    docs: list[str]
    train: list[SourceFile]
    heldout: list[SourceFile]
    heldout_percent: int

    @property
    def n_bytes(self) -> int:
        """UTF-8 bytes of the code files, both sides."""
        return sum(len(f.text.encode()) for f in (*self.train, *self.heldout))


def stdlib_code_corpus(
    max_bytes: int | None = None, heldout_percent: int = HELDOUT_PERCENT
) -> CodeCorpus:
    """The running Python's documentation and code files, split by path hash.

    ``max_bytes`` caps the code files' total UTF-8 size: files are taken in path order while
    they fit (the documentation is not counted). Reading the files takes about a second.
    """
    files: list[SourceFile] = []
    total = 0
    for path, text in stdlib_source_files():
        size = len(text.encode())
        if max_bytes is not None and total + size > max_bytes:
            break
        files.append(SourceFile(path, text))
        total += size
    docs = stdlib_topics()
    train, heldout = split_files(files, heldout_percent)
    parts = [*docs, *(f"{f.path}\n{f.text}" for f in train), f"heldout_percent={heldout_percent}"]
    digest = content_hash([*parts, *(f.path for f in heldout)])
    version = ".".join(platform.python_version_tuple()[:2])
    return CodeCorpus(f"stdlib-code-py{version}-{digest[:12]}", docs, train, heldout,
                      heldout_percent)  # fmt: skip


def code_bpe(corpus: CodeCorpus, vocab_size: int, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """A byte-level BPE of ``vocab_size`` ids trained on the documentation and the training
    files (never a held-out one): ``<cache_dir>/<corpus name>-bpe<vocab_size>``, built once."""
    folder = Path(cache_dir) / f"{corpus.name}-bpe{vocab_size}"
    return bpe_folder([*corpus.docs, *(f.text for f in corpus.train)], folder, vocab_size)


def docs_training_text(
    cache_dir: Path = DEFAULT_CACHE,
    bpe_vocab: int = 50257,
    max_bytes: int | None = None,
    heldout_percent: int = HELDOUT_PERCENT,
) -> TrainingText:
    """The documentation topics of :func:`stdlib_code_corpus` (no code file), read by its
    :func:`code_bpe`, ``<bos>`` between topics: pretraining that leaves every code file unseen
    (``max_bytes`` caps the code files the BPE learns from)."""
    corpus = stdlib_code_corpus(max_bytes, heldout_percent)
    folder = code_bpe(corpus, bpe_vocab, cache_dir)
    return TrainingText(corpus.docs, f"{corpus.name}-docs", folder,
                        tokenizer_token_id(folder, BOS_TOKEN))  # fmt: skip
