"""The ``text`` column of a parquet file and the tokenizer call the parquet datasets share.

The file needs a string column ``text``, read with pyarrow (no ``datasets``). Rows whose
``text`` is null are skipped, their count given once by a
:class:`~effdl.data.corpus.NullTextWarning`; a file without any non-empty text is refused. A
tokenizer is a ``tokenizers.Tokenizer`` or a Hugging Face (fast) tokenizer, called without
special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from effdl.data.corpus import warn_null_text

TEXT_COLUMN = "text"


@dataclass(frozen=True)
class TextEncoder:
    """``text -> token ids`` without special tokens; picklable, so DataLoader workers can spawn."""

    tokenizer: Any

    def __call__(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, Tokenizer):
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def as_encoder(tokenizer: Any) -> TextEncoder:
    """Wrap a ``tokenizers.Tokenizer`` or a Hugging Face tokenizer (anything with ``encode``)."""
    if not isinstance(tokenizer, Tokenizer) and not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"expected a tokenizers.Tokenizer or a transformers tokenizer, got {type(tokenizer).__name__}"
        )
    return TextEncoder(tokenizer)


def read_text_column(path: str | Path) -> pa.ChunkedArray:
    """The non-null ``text`` values of a parquet file, memory-mapped (copied only when some are
    null); clear errors (ValueError naming the file) for a bad file or one without any text."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such parquet file (expected a column {TEXT_COLUMN!r})")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:  # random bytes, a file cut short
        raise ValueError(f"{path}: not a readable parquet file ({_first_line(e)})") from None
    if TEXT_COLUMN not in schema.names:
        raise ValueError(
            f"{path}: no column {TEXT_COLUMN!r} (found {schema.names}); expected one string "
            "document per row"
        )
    try:
        table = pq.read_table(path, columns=[TEXT_COLUMN], memory_map=True)
    except (pa.ArrowException, OSError) as e:  # a footer intact, row groups damaged
        raise ValueError(f"{path}: not a readable parquet file ({_first_line(e)})") from None
    column = table.column(TEXT_COLUMN)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{path}: column {TEXT_COLUMN!r} has type {column.type}, expected string")
    n_rows, n_null = len(column), column.null_count
    if n_null:
        column = column.drop_null()
    if len(column) == 0 or pc.max(pc.binary_length(column)).as_py() == 0:
        raise ValueError(
            f"{path}: no non-empty text rows ({n_rows:,} rows, {n_null:,} of them null; "
            "expected one string document per row)"
        )
    warn_null_text(path, n_null, n_rows)
    return column


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
