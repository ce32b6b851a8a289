"""The data of an LM training run: which corpus and tokenizer, and per-rank batches of
next-token pairs.

Default data is the Python standard library corpus (effdl.data.stdlib_text) with its own BPE;
``--data`` takes a parquet with a ``text`` column (as seed 002's) or a UTF-8 text file (one
document per blank-line-separated block), ``--tokenizer`` a local Hugging Face tokenizer folder.

Sharding keeps the global batch of a step independent of the number of processes: with W ranks
and a per-rank batch B, rank r takes the stream's windows (or the sampler's indices) r, r + W,
r + 2W, ..., so the union over ranks of one step's micro-batches is exactly the step of a single
process with batch W * B. That is what lets a 2-process loss curve equal the 1-process one.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, get_worker_info

from effdl.cli import UsageError
from effdl.data.corpus import CorpusFormatError
from effdl.data.parquet import (
    TEXT_COLUMN,
    CollatorForCLM,
    IterableParquetDataset,
    ParquetDataset,
    as_encoder,
    read_text_column,
)
from effdl.data.stdlib_text import (
    content_hash,
    stdlib_bpe,
    stdlib_corpus,
    token_counts,
    unigram_entropy,
    write_text_parquet,
)
from effdl.data.tokenize import load_hf_tokenizer

Pair = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), each (B, S) int64
# Names other tokenizers give their begin-of-document token, tried when no config names it.
BOS_CANDIDATES = ("<bos>", "<s>", "<|begin_of_text|>", "<|endoftext|>")


@dataclass(frozen=True)
class DataSource:
    """Where the text comes from: training parquet, held-out parquet (or None), a name for logs."""

    name: str
    train: Path
    val: Path | None


@dataclass(frozen=True)
class Specials:
    """Ids of the special tokens the pipelines need; ``pad`` only fills slots the collator
    masks by position, so any id will do when the tokenizer has no pad token."""

    bos: int
    pad: int


def text_file_parquet(path: Path, cache_dir: Path) -> Path:
    """A UTF-8 text file as a parquet (cached by content hash): one document per block of
    non-empty lines, blocks separated by blank lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--data: {path} is neither a parquet nor UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    docs = [b.strip("\n") for b in re.split(r"\n\s*\n", text) if b.strip()]
    if not docs:
        raise UsageError(f"--data: {path} has no text")
    out = cache_dir / f"{path.stem}-{content_hash(docs)[:12]}.parquet"
    if not out.is_file():
        write_text_parquet(docs, out, {"source": str(path)})
    return out


def check_text_parquet(path: Path, flag: str) -> None:
    """UsageError naming ``flag`` unless ``path`` is a parquet with a ``text`` column."""
    try:
        read_text_column(path)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"{flag}: {e}") from None  # the message names the file


def resolve_data(
    data: Path | None, eval_data: Path | None, cache_dir: Path, corpus_bytes: int | None
) -> DataSource:
    """The stdlib corpus (train + held-out split) by default, else the user's files."""
    if data is None:
        if eval_data is not None:
            check_text_parquet(eval_data, "--eval-data")
        corpus = stdlib_corpus(cache_dir, max_bytes=corpus_bytes)
        return DataSource(corpus.name, corpus.train, eval_data or corpus.val)
    if not data.is_file():
        raise UsageError(
            f"--data: {data} is not a file (expected a parquet with a 'text' column or a .txt)"
        )
    train = data if data.suffix == ".parquet" else text_file_parquet(data, cache_dir)
    check_text_parquet(train, "--data")
    if eval_data is not None:
        check_text_parquet(eval_data, "--eval-data")
    return DataSource(data.name, train, eval_data)


def default_tokenizer(cache_dir: Path, corpus_bytes: int | None, vocab_size: int) -> Path:
    """The byte-level BPE trained on the stdlib corpus (built once in ``cache_dir``)."""
    return stdlib_bpe(stdlib_corpus(cache_dir, max_bytes=corpus_bytes), vocab_size)


def resolve_text(
    data: Path | None,
    eval_data: Path | None,
    tokenizer: Path | None,
    cache_dir: Path,
    corpus_bytes: int | None,
    bpe_vocab: int,
    *,
    main: bool,
    world: int,
) -> tuple[DataSource, Path]:
    """The data source and the tokenizer folder (``tokenizer``, or the stdlib BPE of
    ``bpe_vocab`` tokens). Rank 0 builds the cached corpus and BPE first, the other ranks then
    read them (a barrier in between), so no two processes write one file."""

    def resolve() -> tuple[DataSource, Path]:
        source = resolve_data(data, eval_data, cache_dir, corpus_bytes)
        return source, tokenizer or default_tokenizer(cache_dir, corpus_bytes, bpe_vocab)

    if main:
        found = resolve()
    if world > 1:
        dist.barrier()
    if not main:
        found = resolve()
    return found


def reference_entropy(path: Path, tokenizer: Any, vocab: int, max_docs: int = 2000) -> float:
    """Unigram entropy (nats/token) of the first ``max_docs`` documents of ``path``: the loss of
    a model that knows the token frequencies only."""
    first = next(pq.ParquetFile(path).iter_batches(batch_size=max_docs, columns=[TEXT_COLUMN]))
    texts = first.column(TEXT_COLUMN).to_pylist()
    return unigram_entropy(token_counts(as_encoder(tokenizer), texts, vocab))


def load_tokenizer(folder: Path) -> tuple[Any, Specials]:
    """A ``tokenizers.Tokenizer`` from a local folder and its BoS/pad ids.

    The ids come from ``tokenizer_config.json`` when it names them, else from the vocabulary
    (``<bos>``, ``<s>``, ...); a tokenizer without any BoS token is refused (the packed stream
    separates documents with it)."""
    try:
        tok = load_hf_tokenizer(folder)
    except CorpusFormatError as e:
        raise UsageError(f"--tokenizer: {e}") from None
    named = {}
    config = Path(folder) / "tokenizer_config.json"
    if config.is_file():
        raw = json.loads(config.read_text(encoding="utf-8"))
        for key in ("bos_token", "pad_token", "eos_token"):
            value = raw.get(key)
            named[key] = value.get("content") if isinstance(value, dict) else value
    bos = _token_id(tok, [named.get("bos_token"), *BOS_CANDIDATES])
    if bos is None:
        raise UsageError(f"--tokenizer: {folder} has no begin-of-document token ({BOS_CANDIDATES})")
    pad = _token_id(tok, [named.get("pad_token"), "<pad>", named.get("eos_token")])
    return tok, Specials(bos=bos, pad=bos if pad is None else pad)


def _token_id(tok: Any, names: list[str | None]) -> int | None:
    for name in names:
        if name is not None and tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    return None


class RankShard(IterableDataset):
    """Every ``world``-th item of an iterable dataset, starting at ``rank``. Under DataLoader
    workers, worker k of n yields this rank's batches k, k + n, ... (``batch_size`` items
    each): the DataLoader takes batches from its workers in turn, so the rank's items come in
    the stream's order whatever the number of workers, and a step's global batch is the same
    for any number of ranks and workers. Each worker reads the whole stream: give it one that
    does not split its rows by worker."""

    def __init__(
        self, dataset: IterableDataset, rank: int, world: int, batch_size: int = 1
    ) -> None:
        self.dataset, self.rank, self.world, self.batch_size = dataset, rank, world, batch_size

    def __iter__(self) -> Iterator[Any]:
        items = itertools.islice(iter(self.dataset), self.rank, None, self.world)
        info = get_worker_info()
        if info is None:
            return items
        n, k, b = info.num_workers, info.id, self.batch_size
        return (item for i, item in enumerate(items) if (i // b) % n == k)


def _pairs(batch: Any) -> Pair:
    return batch[0], batch[1]  # a (inputs, labels) pair or a CLMBatch


def train_loader(
    source: DataSource,
    tokenizer: Any,
    specials: Specials,
    *,
    dataset: str,
    seq_len: int,
    batch_size: int,
    samples: int,
    rank: int,
    world: int,
    seed: int,
    workers: int,
    pin_memory: bool,
) -> Iterator[Pair]:
    """Micro-batches ``(inputs, labels)`` (B, S) of this rank, on the CPU, endlessly.

    ``iterable``: the packed stream (IterableParquetDataset, cycling over the rows), sharded by
    window. ``padded``: one document per sample (ParquetDataset + CollatorForCLM), ``samples``
    of them in all ranks together, shuffled by a DistributedSampler (seeded) and cycled.
    """
    common = {
        "batch_size": batch_size,
        "num_workers": workers,
        "pin_memory": pin_memory,
        "persistent_workers": workers > 0,
    }
    if dataset == "iterable":
        stream = IterableParquetDataset(
            source.train, tokenizer, seq_len, specials.bos, cycle=True, rows_by_worker=False
        )
        loader = DataLoader(RankShard(stream, rank, world, batch_size), **common)
        return map(_pairs, loader)
    docs = ParquetDataset(source.train, tokenizer, seq_len, samples, bos_id=specials.bos)
    sampler = DistributedSampler(docs, world, rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(
        docs,
        sampler=sampler,
        collate_fn=CollatorForCLM(seq_len, specials.pad),
        drop_last=True,
        **common,
    )
    return map(_pairs, itertools.chain.from_iterable(itertools.repeat(loader)))


def eval_batches(
    path: Path,
    tokenizer: Any,
    specials: Specials,
    *,
    seq_len: int,
    batch_size: int,
    n_batches: int,
    rank: int,
    world: int,
) -> list[Pair]:
    """The first ``n_batches`` packed batches of this rank from a held-out parquet (fewer if it
    is short; the same ones at every evaluation)."""
    stream = IterableParquetDataset(path, tokenizer, seq_len, specials.bos)
    windows = list(itertools.islice(RankShard(stream, rank, world), n_batches * batch_size))
    if len(windows) < batch_size:
        raise UsageError(
            f"--batch-size {batch_size} --sequence-length {seq_len}: {path} holds too little "
            "held-out text for one batch"
        )
    out = []
    for i in range(0, len(windows) - batch_size + 1, batch_size):
        chunk = windows[i : i + batch_size]
        out.append((torch.stack([x for x, _ in chunk]), torch.stack([y for _, y in chunk])))
    return out
