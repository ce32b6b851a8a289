"""Real text a language model can learn from, on every machine: the Python standard library.

The running interpreter ships its documentation (``pydoc_data.topics``, English prose with code
examples) and its own source tree. :func:`stdlib_corpus` turns both into one document per topic
and per ``.py`` file, splits off every ``val_every``-th document as a held-out set, and writes
the two halves as parquet files with a ``text`` column, so :mod:`effdl.data.parquet` reads them
like any other parquet corpus. The documents depend on the Python version (3.11 and 3.12 ship
different files), so each file is named by the version and a hash of its content, and the
parquet metadata records both.

:func:`stdlib_bpe` trains a byte-level BPE (``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2) on the
training half, offline, and saves it as a Hugging Face tokenizer folder. :func:`unigram_entropy`
gives the loss (nats per token) of a model that knows only token frequencies: a loss curve that
does not go below it has learned no context. :func:`stdlib_training_text` is what the GPT-2
scripts train on: the training half, its tokenizer and the ``<bos>`` id between documents.

Everything is cached under a folder the caller names and written atomically (a temporary name,
then a rename), so an interrupted build never leaves a file that looks complete.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import re
import shutil
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from effdl.data.parquet import TEXT_COLUMN, read_text_column
from effdl.data.tokenize import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    tokenizer_token_id,
    train_byte_level_bpe,
)

DEFAULT_CACHE = Path("runs/cache/lm")
# Folders of the stdlib tree that hold third-party packages or test suites, not library code.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "idle_test"})


@dataclass(frozen=True)
class TextCorpus:
    """A corpus written as two parquet files with a ``text`` column (one document per row)."""

    name: str
    train: Path
    val: Path
    n_documents: int
    n_bytes: int


def _skipped(relative: Path, size: int, max_file_bytes: int) -> bool:
    folders = relative.parts[:-1]
    in_tests = any(p in SKIPPED_DIRS or p.startswith("test") for p in folders)
    # pydoc_data/topics.py is the documentation itself, already a set of documents
    return in_tests or size > max_file_bytes or relative.as_posix() == "pydoc_data/topics.py"


def stdlib_source_files(max_file_bytes: int = 200_000) -> Iterator[tuple[str, str]]:
    """(path relative to the stdlib folder, text) of the stdlib's ``.py`` files, sorted by path.

    Skipped: site-packages, test folders, files over ``max_file_bytes`` bytes (generated tables),
    ``pydoc_data/topics.py`` (the documentation), empty files and files that are not UTF-8.
    Files are read as the iterator advances.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    for path in files:
        relative = path.relative_to(root)
        if _skipped(relative, path.stat().st_size, max_file_bytes):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield relative.as_posix(), text


def stdlib_topics() -> list[str]:
    """The documentation topics of ``pydoc_data.topics``, sorted by name."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def stdlib_documents(max_bytes: int | None = None, max_file_bytes: int = 200_000) -> list[str]:
    """The documentation topics (:func:`stdlib_topics`), then the stdlib's ``.py`` files
    (:func:`stdlib_source_files`). ``max_bytes`` caps the total UTF-8 size: documents are taken
    in order while they fit. Deterministic for a given Python installation.
    """
    docs: list[str] = []
    total = 0
    sources = (text for _, text in stdlib_source_files(max_file_bytes))
    for text in itertools.chain(stdlib_topics(), sources):
        size = len(text.encode())
        if max_bytes is not None and total + size > max_bytes:
            break
        docs.append(text)
        total += size
    return docs


def content_hash(docs: Iterable[str]) -> str:
    """SHA-256 (hex) of the documents in order; document boundaries are part of the hash."""
    h = hashlib.sha256()
    for doc in docs:
        data = doc.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def split_documents(docs: Sequence[str], val_every: int) -> tuple[list[str], list[str]]:
    """(train, val): document ``i`` is held out when ``(i + 1) % val_every == 0``."""
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every}")
    val = [d for i, d in enumerate(docs) if (i + 1) % val_every == 0]
    train = [d for i, d in enumerate(docs) if (i + 1) % val_every != 0]
    return train, val


def write_text_parquet(
    docs: Sequence[str], path: Path, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``docs`` as a parquet with one ``text`` row each (and ``metadata`` in the schema),
    under a temporary name first, then renamed: readers see the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({TEXT_COLUMN: pa.array(docs, type=pa.string())})
    if metadata:
        table = table.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def parquet_metadata(path: Path) -> dict[str, str]:
    """The key/value metadata of a parquet file's schema (empty if none)."""
    meta = pq.read_schema(path).metadata or {}
    return {k.decode(): v.decode() for k, v in meta.items() if not k.startswith(b"ARROW")}


def stdlib_corpus(
    cache_dir: Path = DEFAULT_CACHE,
    max_bytes: int | None = None,
    val_every: int = 20,
) -> TextCorpus:
    """The standard-library corpus as train/val parquets under ``cache_dir`` (built once).

    Files are named ``stdlib-py<major.minor>-<hash[:12]>-{train,val}.parquet``; the hash covers
    the documents (so it changes with the Python installation and with ``max_bytes``) and the
    split rule. Reading the documents again to hash them takes about a second.
    """
    docs = stdlib_documents(max_bytes)
    version = ".".join(platform.python_version_tuple()[:2])
    digest = content_hash([*docs, f"val_every={val_every}"])
    name = f"stdlib-py{version}-{digest[:12]}"
    paths = {split: Path(cache_dir) / f"{name}-{split}.parquet" for split in ("train", "val")}
    if not all(p.is_file() for p in paths.values()):
        train, val = split_documents(docs, val_every)
        meta = {
            "source": "python stdlib (pydoc_data.topics + .py files)",
            "python": platform.python_version(),
            "sha256": digest,
            "val_every": str(val_every),
        }
        for split, part in (("train", train), ("val", val)):
            write_text_parquet(part, paths[split], {**meta, "split": split})
    return TextCorpus(
        name=name,
        train=paths["train"],
        val=paths["val"],
        n_documents=len(docs),
        n_bytes=sum(len(d.encode()) for d in docs),
    )


def stdlib_bpe(corpus: TextCorpus, vocab_size: int = 8192, cache_dir: Path | None = None) -> Path:
    """A byte-level BPE trained on ``corpus.train``, saved as a Hugging Face tokenizer folder
    (:func:`bpe_folder`: ``<cache_dir>/<corpus name>-bpe<vocab_size>``, default beside the
    corpus); reused when present."""
    folder = Path(cache_dir or corpus.train.parent) / f"{corpus.name}-bpe{vocab_size}"
    if (folder / "tokenizer.json").is_file():
        return folder
    texts = pq.read_table(corpus.train, columns=[TEXT_COLUMN]).column(TEXT_COLUMN).to_pylist()
    return bpe_folder(texts, folder, vocab_size)


def bpe_folder(texts: Sequence[str], folder: Path, vocab_size: int) -> Path:
    """``folder`` holding a byte-level BPE of ``vocab_size`` ids trained on ``texts``: its
    ``tokenizer.json`` and a ``tokenizer_config.json`` naming ``<bos>``, ``<eos>`` and
    ``<pad>``, so both ``tokenizers.Tokenizer.from_file`` and ``transformers.AutoTokenizer``
    load it. Built in a temporary folder and renamed into place; an existing one is kept."""
    if (folder / "tokenizer.json").is_file():
        return folder
    tok = train_byte_level_bpe(texts, vocab_size=vocab_size)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "model_max_length": 1 << 30,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first: its folder is as good as ours
            if not (folder / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@dataclass(frozen=True)
class TrainingText:
    """The training documents of a :class:`TextCorpus` and how they become one token stream:
    tokenized with ``tokenizer_dir`` (:func:`effdl.data.token_streams.text_stream`), ``bos_id``
    before every document (None: nothing between them)."""

    docs: list[str]
    name: str
    tokenizer_dir: Path
    bos_id: int | None


def stdlib_training_text(
    cache_dir: Path = DEFAULT_CACHE,
    bpe_vocab: int = 50257,
    max_bytes: int | None = None,
    tokenizer_dir: Path | None = None,
) -> TrainingText:
    """The stdlib corpus's training half (:func:`stdlib_corpus`), read with ``tokenizer_dir``
    or, without one, the corpus's own BPE of ``bpe_vocab`` ids (:func:`stdlib_bpe`), with the
    tokenizer's ``<bos>`` id between documents when it has that token.

    One rule for every reader: a model folder that carries the BPE's ``tokenizer.json`` (as
    ``memory_efficient_gpt2/pretrain.py`` writes it) reads the very stream the BPE reads.
    """
    corpus = stdlib_corpus(cache_dir, max_bytes=max_bytes)
    docs = read_text_column(corpus.train).to_pylist()
    folder = Path(tokenizer_dir) if tokenizer_dir is not None else stdlib_bpe(corpus, bpe_vocab)
    return TrainingText(docs, corpus.name, folder, tokenizer_token_id(folder, BOS_TOKEN))


def text_blocks(texts: Iterable[str]) -> list[str]:
    """The non-empty blocks between blank lines of every text: paragraphs of the documentation,
    statements and functions of the source, the unit a WikiText line is."""
    return [b for t in texts for b in re.split(r"\n\s*\n", t) if b.strip()]


def stdlib_paragraphs(cache_dir: Path = DEFAULT_CACHE) -> tuple[list[str], str]:
    """(blocks, the corpus's name): :func:`text_blocks` of the stdlib corpus's training half."""
    corpus = stdlib_corpus(cache_dir)
    return text_blocks(read_text_column(corpus.train).to_pylist()), corpus.name


def token_counts(
    encode: Callable[[str], Sequence[int]], texts: Iterable[str], vocab_size: int
) -> np.ndarray:
    """How often each id occurs when every text is encoded: int64 of shape (vocab_size,)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for text in texts:
        ids = np.asarray(encode(text), dtype=np.int64)
        if len(ids):
            counts += np.bincount(ids, minlength=vocab_size)
    return counts


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy in nats per token of the frequency distribution ``counts`` (divide by ln 2 for
    bits): the cross-entropy loss of a model that predicts every token by its frequency alone."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        raise ValueError("unigram_entropy needs at least one token")
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())
