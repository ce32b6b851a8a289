"""Flat streams of token ids for LM training, and the per-step batches cut from them.

:func:`synthetic_stream` needs no data and is learnable (repeated phrases); :func:`text_stream`
tokenizes text lines with a local tokenizer, or as raw bytes when there is none (no download).
:func:`next_token_entropies` gives the loss floors of a batch that a model reaches by knowing
its token frequencies (unigram) or the next token's frequencies after each token (bigram).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from effdl.data.corpus import CorpusFormatError
from effdl.data.stdlib_text import unigram_entropy


def synthetic_stream(n_tokens: int, vocab: int, seed: int) -> Tensor:
    """A learnable token stream: Zipf-distributed draws from 512 fixed random phrases of 4-32
    tokens each (inside a phrase the next token is predictable). int64, ``(n_tokens,)``."""
    g = torch.Generator().manual_seed(seed)
    phrases = [
        torch.randint(0, vocab, (int(torch.randint(4, 33, (1,), generator=g)),), generator=g)
        for _ in range(512)
    ]
    weights = 1.0 / torch.arange(1, len(phrases) + 1, dtype=torch.float64)
    out, n = [], 0
    while n < n_tokens:
        for k in torch.multinomial(weights, 4096, replacement=True, generator=g).tolist():
            out.append(phrases[k])
            n += len(phrases[k])
    return torch.cat(out)[:n_tokens]


ENCODE_BATCH_LINES = 64  # lines per ``encode_batch`` call (Rust threads; bounds the overshoot)


def text_stream(
    lines: list[str],
    n_tokens: int | None,
    vocab: int,
    tokenizer_dir: Path | None = None,
    source: str | Path = "text",
    bos_id: int | None = None,
) -> Tensor:
    """The first ``n_tokens`` token ids of ``lines`` (read by :func:`effdl.data.corpus.read_wikitext`
    or any reader of text lines), int64; all of them when ``n_tokens`` is None.

    Tokenized with ``tokenizer_dir/tokenizer.json`` (a Hugging Face tokenizer) if that file
    exists, a few lines per ``encode_batch`` call (the ids ``encode`` gives, on all cores), else
    as the UTF-8 bytes of each line and its newline (ids < 256: crude, but needs no download).
    With ``bos_id``, that id goes before every line (documents kept apart, as
    :class:`effdl.data.parquet.IterableParquetDataset` packs them). Raises
    :class:`CorpusFormatError` naming ``source`` if the lines give too few tokens or ids outside
    ``vocab``.
    """
    tok_file = tokenizer_dir / "tokenizer.json" if tokenizer_dir is not None else None
    if tok_file is not None and tok_file.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tok_file))

        def encode(batch: list[str]) -> list[list[int]]:
            return [e.ids for e in tokenizer.encode_batch(batch)]
    else:

        def encode(batch: list[str]) -> list[list[int]]:
            return [list((line + "\n").encode("utf-8")) for line in batch]

    prefix = [] if bos_id is None else [bos_id]
    wanted = float("inf") if n_tokens is None else n_tokens
    ids: list[int] = []
    for start in range(0, len(lines), ENCODE_BATCH_LINES):
        for line_ids in encode(lines[start : start + ENCODE_BATCH_LINES]):
            ids += prefix + line_ids
        if len(ids) >= wanted:
            break
    if not ids or (n_tokens is not None and len(ids) < n_tokens):
        raise CorpusFormatError(f"{source} gives {len(ids)} tokens, need {n_tokens or 1}")
    tokens = torch.tensor(ids[:n_tokens], dtype=torch.long)
    if int(tokens.max()) >= vocab:
        raise CorpusFormatError(f"{source} gives token id {int(tokens.max())} >= vocab {vocab}")
    return tokens


def step_batches(
    stream: Callable[[int], Tensor], steps: int, batch: int, seq: int, *, fixed: bool = False
) -> list[Tensor]:
    """One ``(batch, seq)`` tensor per step, cut in order from ``stream(n_tokens)``; with
    ``fixed``, every step gets the same first batch (and only that much is read)."""
    distinct = 1 if fixed else steps
    chunks = list(stream(distinct * batch * seq).view(distinct, batch, seq))
    return [chunks[0]] * steps if fixed else chunks


def next_token_entropies(batch: Tensor) -> dict[str, float | int]:
    """Entropies, in nats, of the next-token targets of ``batch`` (rows of token ids, each row's
    first token a context only) under the batch's own statistics: ``unigram`` (each target's
    frequency among the targets: the loss of a model that predicts the batch's token
    frequencies), ``bigram`` (the conditional entropy of a target given the token before it), and
    ``targets`` and ``distinct`` (ids among the targets)."""
    if batch.dim() != 2 or batch.shape[1] < 2:
        raise ValueError(f"expected (rows, length >= 2) token ids, got shape {tuple(batch.shape)}")
    prev, target = batch[:, :-1].reshape(-1).long(), batch[:, 1:].reshape(-1).long()

    def entropy(keys: Tensor) -> float:  # of the distinct keys' frequencies
        return unigram_entropy(keys.unique(return_counts=True)[1].numpy())

    n = target.numel()
    unigram = entropy(target)
    # H(next | previous) = H(previous, next) - H(previous)
    bigram = entropy(prev * (int(target.max()) + 1) + target) - entropy(prev)
    return {"targets": n, "distinct": int(target.unique().numel()), "unigram": unigram,
            "bigram": bigram}  # fmt: skip
