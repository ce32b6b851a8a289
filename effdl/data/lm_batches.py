"""Fixed LM batches for comparing training setups: text samples (a seeded subset of a WikiText
file, or of the standard library's paragraphs), a seeded train/held-out split, and the batches
of a pipeline moved to the device once, so every setup replays the same batches in the same
order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from effdl.cli import UsageError, require_path
from effdl.data.corpus import CorpusFormatError, read_wikitext
from effdl.data.padding import Batch
from effdl.data.pipelines import make_loader
from effdl.data.stdlib_text import stdlib_paragraphs
from effdl.data.tokenize import TokenizedCorpus, Vocab, fit_basic_english


@dataclass
class LMData:
    """The tokenized corpus split into training and held-out samples, batched on the device."""

    train_corpus: TokenizedCorpus
    train: list[Batch]  # one per training step
    heldout: list[Batch]
    vocab: Vocab
    source: str


def text_samples(
    data: Path | None, n_samples: int, seed: int, cache_dir: Path
) -> tuple[list[str], str]:
    """(lines, what they are): a seeded subset of ``n_samples`` lines of ``data`` (WikiText-103
    files or a parquet with a ``text`` column), or, without ``data``, of the paragraphs of the
    standard-library corpus (real text, built once under ``cache_dir``). A bad path or format is
    a UsageError naming ``--data``."""
    if data is None:
        lines, name = stdlib_paragraphs(cache_dir)
        source = f"{name} paragraphs"
    else:
        require_path(data, "WikiText-103 files or a parquet with a 'text' column", "--data")
        try:
            lines = read_wikitext(data)
        except CorpusFormatError as e:
            raise UsageError(f"--data: {e}") from None
        source = str(data)
    if len(lines) > n_samples:
        pick = np.random.default_rng(seed).choice(len(lines), n_samples, replace=False)
        lines = [lines[i] for i in np.sort(pick)]
    return lines, f"{source} ({len(lines)} lines)"


def split_corpus(
    corpus: TokenizedCorpus, n_heldout: int, seed: int
) -> tuple[TokenizedCorpus, TokenizedCorpus]:
    """(train, held-out) corpora of disjoint samples, chosen by a seeded permutation."""
    order = np.random.default_rng(seed).permutation(len(corpus))
    take = lambda idx: TokenizedCorpus.from_sequences(corpus[int(i)] for i in idx)  # noqa: E731
    return take(order[n_heldout:]), take(order[:n_heldout])


def device_batches(
    corpus: TokenizedCorpus,
    n: int,
    pipeline: str,
    batch_size: int,
    *,
    k: int,
    max_length: int,
    pad_id: int,
    seed: int,
    device: torch.device,
) -> list[Batch]:
    """The first ``n`` batches of ``pipeline`` (see :func:`effdl.data.pipelines.make_loader`),
    epoch after epoch, each moved to ``device`` once."""
    loader = make_loader(pipeline, corpus, batch_size, k=k, max_length=max_length,
                         pad_id=pad_id, seed=seed)  # fmt: skip
    out: list[Batch] = []
    while len(out) < n:
        for batch in loader:
            out.append(batch.to(device))
            if len(out) == n:
                break
    return out


def fixed_lm_data(
    lines: list[str],
    source: str,
    *,
    max_vocab: int,
    max_length: int,
    pipeline: str,
    batch_size: int,
    k: int,
    steps: int,
    eval_batches: int,
    seed: int,
    device: torch.device,
) -> LMData:
    """``lines`` tokenized (basic_english, ``max_vocab`` entries), cut to ``max_length``, split
    into ``eval_batches`` held-out batches' worth of samples and the rest, and batched: one
    training batch per step. Too few samples for the held-out set and one batch is a
    UsageError naming ``--data/--n-samples``."""
    corpus, vocab = fit_basic_english(lines, max_size=max_vocab)
    # A sample needs two tokens to have a target; a bucket of one-token samples would have none.
    corpus = corpus.truncate(max_length, min_length=2)
    n_heldout = eval_batches * batch_size
    if len(corpus) < n_heldout + batch_size:
        raise UsageError(f"--data/--n-samples: {len(corpus)} usable samples, need more than "
                         f"{n_heldout + batch_size} (held-out set plus one batch)")  # fmt: skip
    train_corpus, heldout_corpus = split_corpus(corpus, n_heldout, seed)
    batching = {"k": k, "max_length": max_length, "pad_id": vocab.pad_id, "seed": seed,
                "device": device}  # fmt: skip
    return LMData(
        train_corpus=train_corpus,
        train=device_batches(train_corpus, steps, pipeline, batch_size, **batching),
        heldout=device_batches(heldout_corpus, eval_batches, pipeline, batch_size, **batching),
        vocab=vocab,
        source=source,
    )
