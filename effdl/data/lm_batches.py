"""Fixed LM batches for comparing training setups: text samples (a seeded subset of a WikiText
file, or the generated corpus), a seeded train/held-out split, and the batches of a pipeline
moved to the device once, so every setup replays the same batches in the same order."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from effdl.cli import UsageError, require_memory, require_path
from effdl.data.corpus import (
    CorpusFormatError,
    SyntheticCorpusConfig,
    read_wikitext,
    synthetic_corpus,
)
from effdl.data.padding import Batch
from effdl.data.pipelines import make_loader
from effdl.data.tokenize import TokenizedCorpus, Vocab, fit_basic_english

# Non-empty lines are about two thirds of the generated lines: ask for this share more.
NON_EMPTY_SHARE = 0.6


@dataclass
class LMData:
    """The tokenized corpus split into training and held-out samples, batched on the device."""

    train_corpus: TokenizedCorpus
    train: list[Batch]  # one per training step
    heldout: list[Batch]
    vocab: Vocab
    source: str


def text_samples(
    data: Path | None, n_samples: int, synthetic_vocab: int, seed: int
) -> tuple[list[str], str]:
    """(lines, what they are): a seeded subset of ``n_samples`` lines of ``data`` (WikiText-103
    files or a parquet with a ``text`` column), or that many non-empty generated lines with
    ``synthetic_vocab`` distinct words. A bad path or format, or generated text larger than the
    host's free memory, is a UsageError naming ``--data`` or ``--n-samples``."""
    if data is None:
        synthetic = SyntheticCorpusConfig(n_lines=int(n_samples / NON_EMPTY_SHARE) + 100,
                                          seed=seed, vocab_size=synthetic_vocab)  # fmt: skip
        require_host_memory(n_samples, synthetic)
        return synthetic_corpus(synthetic)[:n_samples], f"synthetic(n={n_samples}, seed={seed})"
    require_path(data, "WikiText-103 files or a parquet with a 'text' column", "--data")
    try:
        lines = read_wikitext(data)
    except CorpusFormatError as e:
        raise UsageError(f"--data: {e}") from None
    if len(lines) > n_samples:
        pick = np.random.default_rng(seed).choice(len(lines), n_samples, replace=False)
        lines = [lines[i] for i in np.sort(pick)]
    return lines, f"{data} ({len(lines)} lines)"


def require_host_memory(n_samples: int, synthetic: SyntheticCorpusConfig) -> None:
    """UsageError unless ``n_samples`` generated lines fit in the host's free memory; their size
    is extrapolated from a pilot of 2,000 lines (a lower bound: tokenizing needs more)."""
    pilot = synthetic_corpus(replace(synthetic, n_lines=2000))
    need = n_samples * sum(map(sys.getsizeof, pilot)) / max(len(pilot), 1)
    require_memory(f"--n-samples {n_samples:,}", need, "cpu", what="the generated text")


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
