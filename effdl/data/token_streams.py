"""Flat streams of token ids for LM training, and the per-step batches cut from them.

:func:`synthetic_stream` needs no data and is learnable (repeated phrases); :func:`text_stream`
reads a text file with a local tokenizer, or as raw bytes when there is none (no download).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from effdl.data.corpus import CorpusFormatError


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


def text_stream(path: Path, n_tokens: int, vocab: int, tokenizer_dir: Path | None = None) -> Tensor:
    """The first ``n_tokens`` token ids of a UTF-8 text file, int64.

    Tokenized with ``tokenizer_dir/tokenizer.json`` (a Hugging Face tokenizer) if that file
    exists, else as raw UTF-8 bytes (ids < 256: crude, but needs no download). Raises
    :class:`CorpusFormatError` naming the file if it cannot be read, is too short, or gives
    ids outside ``vocab``.
    """
    try:
        with Path(path).open("rb") as f:
            raw = f.read(n_tokens * 8)
    except OSError as e:
        raise CorpusFormatError(f"{path}: cannot read ({e.strerror or e})") from None
    tok_file = tokenizer_dir / "tokenizer.json" if tokenizer_dir is not None else None
    if tok_file is not None and tok_file.exists():
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tok_file)).encode(raw.decode("utf-8", "ignore")).ids
        tokens = torch.tensor(ids, dtype=torch.long)
    else:
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    if tokens.numel() < n_tokens:
        raise CorpusFormatError(f"{path} gives {tokens.numel()} tokens, need {n_tokens}")
    tokens = tokens[:n_tokens]
    if int(tokens.max()) >= vocab:
        raise CorpusFormatError(f"{path} gives token id {int(tokens.max())} >= vocab {vocab}")
    return tokens


def step_batches(
    stream: Callable[[int], Tensor], steps: int, batch: int, seq: int, *, fixed: bool = False
) -> list[Tensor]:
    """One ``(batch, seq)`` tensor per step, cut in order from ``stream(n_tokens)``; with
    ``fixed``, every step gets the same first batch (and only that much is read)."""
    distinct = 1 if fixed else steps
    chunks = list(stream(distinct * batch * seq).view(distinct, batch, seq))
    return [chunks[0]] * steps if fixed else chunks
