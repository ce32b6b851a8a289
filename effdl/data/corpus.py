"""WikiText-103 training text: the official files, parquet, or a generated stand-in.

A *sample* is one non-empty line of the training split (WikiText lines are paragraphs or
headings; the empty lines between them carry no text). Three sources give the same list:

* ``wiki.train.raw`` / ``wiki.train.tokens`` from the official zip (or the folder holding them);
* a parquet file with a ``text`` column, one line per row (the Hugging Face layout), read with
  pyarrow, so the ``datasets`` package is never needed; null ``text`` values are skipped and
  counted (a :class:`NullTextWarning` says how many), a file without any text is an error;
* :func:`generate_wikitext_lines`: a deterministic, seeded corpus with WikiText's line structure
  (`` = Title = `` and `` = = Section = = `` headings, blank lines, paragraphs whose token counts
  are log-normal, about 1% of them longer than 640 tokens). At full size it has WikiText-103's
  1,801,350 lines and about 100 M whitespace tokens; it is built with numpy in chunks of lines
  and can be written in the official file layout.

:func:`measure_corpus` measures what batching depends on, for any of them: line (sample) and
article lengths in tokens, and the totals, beside the real split's published figures
(``WIKITEXT103_TRAIN_*``).
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The real train split (wikitext-103-raw), as published by Merity et al. 2016 ("Pointer Sentinel
# Mixture Models"); tokens and vocabulary are counted with their tokenization, not basic_english.
WIKITEXT103_TRAIN_LINES = 1_801_350
WIKITEXT103_TRAIN_ARTICLES = 28_475
WIKITEXT103_TRAIN_TOKENS = 103_227_021
WIKITEXT103_VOCAB = 267_735
OFFICIAL_NAMES = ("wiki.train.raw", "wiki.train.tokens")

# The most frequent WikiText tokens, in rough frequency order; the rest of the vocabulary is
# made of random letter strings. Punctuation and WikiText's @-@ style joiners are included so
# that tokenizers meet the characters they handle specially.
_FUNCTION_TEXT = (
    "the , . of and in to a \" was @-@ 's The ( ) is for on as with by that he at from his it "
    "an were ; : which also are had first be In this not their one two other or after been her "
    "has its @,@ @.@ new but who they time 000 1 2 3 10 ' ! ? A He It"
)
_FUNCTION_WORDS = tuple(_FUNCTION_TEXT.split())


class CorpusFormatError(ValueError):
    """Input text that is missing or not in an expected layout; the message names the file."""


class NullTextWarning(UserWarning):
    """Rows of a parquet file whose ``text`` is null were skipped; ``n_null`` of ``n_rows``.

    A script that wants the count in its run log catches it with ``warnings.catch_warnings``.
    """

    def __init__(self, path: str | os.PathLike, n_null: int, n_rows: int) -> None:
        super().__init__(f"{path}: skipped {n_null:,} of {n_rows:,} rows whose 'text' is null")
        self.path, self.n_null, self.n_rows = str(path), n_null, n_rows


def warn_null_text(path: str | os.PathLike, n_null: int, n_rows: int, stacklevel: int = 3) -> None:
    """Say once that ``n_null`` null ``text`` rows of ``path`` were skipped (nothing if 0)."""
    if n_null:
        warnings.warn(NullTextWarning(path, n_null, n_rows), stacklevel=stacklevel)


@dataclass(frozen=True)
class SyntheticCorpusConfig:
    """Shape of the generated corpus (defaults: WikiText-103 train size).

    ``n_lines`` counts all lines, blank ones included (about 35% of WikiText's are blank).
    Paragraph token counts are log-normal with the given median and sigma, clipped to
    ``max_paragraph_tokens``; with the defaults about 1.3% of paragraphs exceed 640 tokens.
    Words follow a Zipf-Mandelbrot law over ``vocab_size`` ranks.
    """

    n_lines: int = WIKITEXT103_TRAIN_LINES
    seed: int = 0
    vocab_size: int = 200_000
    zipf_exponent: float = 1.1
    paragraph_median_tokens: float = 75.0
    paragraph_sigma: float = 0.95
    max_paragraph_tokens: int = 4000
    mean_paragraphs_per_section: float = 2.7
    sections_per_article: float = 9.0

    @classmethod
    def quick(cls, seed: int = 0) -> SyntheticCorpusConfig:
        """A small corpus (4,000 lines, about 220k tokens) for CPU smoke runs and tests."""
        return cls(n_lines=4000, seed=seed, vocab_size=20_000)

    def __post_init__(self) -> None:
        whole = all(isinstance(v, int) for v in (self.n_lines, self.vocab_size))
        if not whole or self.n_lines < 1 or self.vocab_size < len(_FUNCTION_WORDS) + 1:
            raise ValueError(
                f"SyntheticCorpusConfig needs whole numbers n_lines >= 1 and vocab_size > "
                f"{len(_FUNCTION_WORDS)}, got {self.n_lines}, {self.vocab_size}"
            )


# Line kinds of the generated corpus.
_EMPTY, _TITLE, _SECTION, _SUBSECTION, _PARAGRAPH = range(5)
_MARKERS = {_TITLE: 1, _SECTION: 2, _SUBSECTION: 3}  # '=' tokens on each side of a heading


def _word_table(cfg: SyntheticCorpusConfig, rng: np.random.Generator) -> list[str]:
    """``vocab_size`` words by frequency rank, then their capitalised forms (for headings)."""
    n_random = cfg.vocab_size - len(_FUNCTION_WORDS)
    lengths = np.clip(rng.poisson(6.0, n_random), 2, 14)
    letters = rng.integers(ord("a"), ord("z") + 1, size=int(lengths.sum()), dtype=np.uint8)
    text = letters.tobytes().decode("ascii")
    ends = np.cumsum(lengths)
    words = list(_FUNCTION_WORDS)
    words += [text[e - n : e] for e, n in zip(ends.tolist(), lengths.tolist(), strict=True)]
    return words + [w[:1].upper() + w[1:] for w in words]


def _render_table(words: list[str]) -> tuple[np.ndarray, int, int]:
    """Byte rows ``b" word"`` padded with NUL, plus ids of the ``=`` and end-of-line rows."""
    entries = [" " + w for w in words] + [" =", " \n"]
    width = max(len(e) for e in entries)
    table = np.zeros((len(entries), width), dtype=np.uint8)
    for i, e in enumerate(entries):
        table[i, : len(e)] = np.frombuffer(e.encode("ascii"), dtype=np.uint8)
    return table, len(words), len(words) + 1


def _zipf_ranks(rng: np.random.Generator, size: int, cfg: SyntheticCorpusConfig) -> np.ndarray:
    """Ranks in [0, vocab_size) by inverting the continuous Zipf-Mandelbrot CDF (q = 2.7)."""
    s, q, v = cfg.zipf_exponent, 2.7, cfg.vocab_size
    a, b = q ** (1 - s), (v + q) ** (1 - s)
    u = rng.random(size)
    r = (a + u * (b - a)) ** (1 / (1 - s)) - q
    return np.clip(r.astype(np.int64), 0, v - 1)


def _line_kinds(cfg: SyntheticCorpusConfig, rng: np.random.Generator) -> np.ndarray:
    """Kind of each line: blocks of [heading, blank, paragraph x p, blank], articles of blocks."""
    mean_block = 3 + cfg.mean_paragraphs_per_section
    n_blocks = int(cfg.n_lines / mean_block * 1.3) + 16
    paragraphs = 1 + rng.poisson(cfg.mean_paragraphs_per_section - 1, n_blocks)
    heading = np.where(rng.random(n_blocks) < 0.3, _SUBSECTION, _SECTION)
    heading[rng.random(n_blocks) < 1 / cfg.sections_per_article] = _TITLE
    heading[0] = _TITLE
    block_len = paragraphs + 3
    starts = np.concatenate(([0], np.cumsum(block_len)[:-1]))
    kinds = np.full(int(block_len.sum()), _PARAGRAPH, dtype=np.int8)
    kinds[starts] = heading
    kinds[starts + 1] = _EMPTY
    kinds[starts + block_len - 1] = _EMPTY
    return kinds[: cfg.n_lines]


def _token_counts(kinds: np.ndarray, cfg: SyntheticCorpusConfig, rng: np.random.Generator):
    """Content words per line (headings: 1-5 words; paragraphs: clipped log-normal)."""
    n = len(kinds)
    words = np.zeros(n, dtype=np.int64)
    para = kinds == _PARAGRAPH
    logn = rng.lognormal(np.log(cfg.paragraph_median_tokens), cfg.paragraph_sigma, n)
    words[para] = np.clip(logn[para], 1, cfg.max_paragraph_tokens).astype(np.int64)
    head = (kinds != _PARAGRAPH) & (kinds != _EMPTY)
    words[head] = rng.integers(1, 6, size=n)[head]
    markers = np.zeros(n, dtype=np.int64)
    for kind, m in _MARKERS.items():
        markers[kinds == kind] = m
    return words, markers


def _render_lines(
    kinds: np.ndarray,
    words: np.ndarray,
    markers: np.ndarray,
    table: np.ndarray,
    eq_id: int,
    eol_id: int,
    n_vocab: int,
    cfg: SyntheticCorpusConfig,
    rng: np.random.Generator,
) -> list[str]:
    """Token ids of a chunk of lines -> bytes -> str lines (no trailing newline)."""
    per_line = words + 2 * markers + 1  # + end-of-line token
    total = int(per_line.sum())
    line_of = np.repeat(np.arange(len(kinds)), per_line)
    line_start = np.cumsum(per_line) - per_line
    pos = np.arange(total) - line_start[line_of]
    ids = _zipf_ranks(rng, total, cfg)
    # Heading words are capitalised content words (rank >= 100), framed by '=' markers.
    m, w = markers[line_of], words[line_of]
    is_head = m > 0
    ids[is_head] = n_vocab + rng.integers(100, cfg.vocab_size, size=int(is_head.sum()))
    ids[is_head & ((pos < m) | ((pos >= m + w) & (pos < 2 * m + w)))] = eq_id
    ids[pos == per_line[line_of] - 1] = eol_id
    rows = table[ids].reshape(-1)
    text = rows[rows != 0].tobytes().decode("ascii")
    return text.split("\n")[:-1]


def iter_wikitext_lines(
    cfg: SyntheticCorpusConfig, chunk_lines: int = 100_000
) -> Iterator[list[str]]:
    """Generate the corpus lazily: lists of up to ``chunk_lines`` lines (blank lines included).

    Lines look like the official ``wiki.train.raw``: a leading space, tokens separated by single
    spaces, a trailing space, and blank lines made of one space. Deterministic in ``cfg``.
    """
    rng = np.random.default_rng(cfg.seed)
    words_list = _word_table(cfg, rng)
    table, eq_id, eol_id = _render_table(words_list)
    kinds = _line_kinds(cfg, rng)
    words, markers = _token_counts(kinds, cfg, rng)
    for lo in range(0, len(kinds), chunk_lines):
        hi = min(lo + chunk_lines, len(kinds))
        yield _render_lines(
            kinds[lo:hi],
            words[lo:hi],
            markers[lo:hi],
            table,
            eq_id,
            eol_id,
            cfg.vocab_size,
            cfg,
            rng,
        )


def generate_wikitext_lines(cfg: SyntheticCorpusConfig | None = None) -> list[str]:
    """All lines of the generated corpus, blank ones included (see :func:`iter_wikitext_lines`)."""
    lines: list[str] = []
    for chunk in iter_wikitext_lines(cfg or SyntheticCorpusConfig()):
        lines.extend(chunk)
    return lines


def non_empty(lines: list[str]) -> list[str]:
    """The samples of a WikiText split: lines with any non-whitespace character, newline-free."""
    return [line.rstrip("\r\n") for line in lines if line.strip()]


def synthetic_corpus(cfg: SyntheticCorpusConfig | None = None) -> list[str]:
    """The samples (non-empty lines) of the generated corpus."""
    samples: list[str] = []
    for chunk in iter_wikitext_lines(cfg or SyntheticCorpusConfig()):
        samples.extend(non_empty(chunk))
    return samples


def is_article_title(line: str) -> bool:
    """True for an article heading `` = Title = `` (one ``=`` each side; sections have more)."""
    text = line.strip()
    return text.startswith("= ") and text.endswith(" =") and not text.startswith("= =")


@dataclass(frozen=True)
class CorpusStats:
    """Lengths of a WikiText-style corpus: per non-empty line (a sample), in order.

    ``line_tokens`` counts the tokens of the tokenizer given to :func:`measure_corpus`,
    ``line_words`` whitespace-separated tokens (WikiText's own files are written already tokenized,
    so that is their token count); ``title`` marks article headings. An article runs from its
    heading to the next one; lines before the first heading belong to none.
    """

    n_lines: int  # all lines, blank ones included
    line_tokens: np.ndarray  # int64 per non-empty line
    line_words: np.ndarray  # int64 per non-empty line
    title: np.ndarray  # bool per non-empty line
    vocabulary: int  # distinct tokens of the tokenizer

    @property
    def n_samples(self) -> int:
        return len(self.line_tokens)

    @property
    def n_articles(self) -> int:
        return int(self.title.sum())

    def article_lengths(self, words: bool = False) -> np.ndarray:
        """Tokens (``words``: whitespace tokens) of each article, in order."""
        article = np.cumsum(self.title) - 1  # -1: before the first heading
        lengths = self.line_words if words else self.line_tokens
        inside = article >= 0
        return np.bincount(article[inside], lengths[inside], minlength=self.n_articles).astype(
            np.int64
        )

    def share_longer(self, n_tokens: int) -> float:
        """Share of the non-empty lines with more than ``n_tokens`` tokens."""
        return float((self.line_tokens > n_tokens).mean()) if self.n_samples else 0.0


def measure_corpus(
    chunks: Iterable[Sequence[str]], tokenize_lines: Callable[[Sequence[str]], list[list[str]]]
) -> CorpusStats:
    """Line and article lengths of a corpus given as chunks of lines (blank lines included, e.g.
    :func:`iter_wikitext_lines`), streamed: only the per-line counts and the set of distinct
    tokens are kept. ``tokenize_lines`` maps a list of lines to their token lists (e.g.
    :func:`effdl.data.tokenize.basic_english_many`). Time and memory: one pass, linear in the text.
    """
    n_lines, tokens, words, titles = 0, [], [], []
    vocabulary: set[str] = set()
    for chunk in chunks:
        n_lines += len(chunk)
        lines = non_empty(list(chunk))
        token_lists = tokenize_lines(lines)
        vocabulary.update(itertools.chain.from_iterable(token_lists))
        tokens.append(np.fromiter(map(len, token_lists), np.int64, len(lines)))
        words.append(np.fromiter((len(line.split()) for line in lines), np.int64, len(lines)))
        titles.append(np.fromiter(map(is_article_title, lines), bool, len(lines)))
    join = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
    return CorpusStats(n_lines, join(tokens, np.int64), join(words, np.int64),
                       join(titles, bool), len(vocabulary))  # fmt: skip


def write_wikitext(
    folder: str | os.PathLike,
    cfg: SyntheticCorpusConfig | None = None,
    name: str = "wiki.train.raw",
) -> Path:
    """Write the generated corpus as ``folder/name`` (official layout); returns the path.

    Written to a temporary name and renamed, so an interrupted run leaves no half file.
    """
    if name not in OFFICIAL_NAMES:
        raise ValueError(f"name must be one of {OFFICIAL_NAMES}, got {name!r}")
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(name + ".tmp")
    with tmp.open("w", encoding="utf-8", newline="\n") as f:
        for chunk in iter_wikitext_lines(cfg or SyntheticCorpusConfig()):
            f.write("\n".join(chunk))
            f.write("\n")
    os.replace(tmp, path)
    return path


def _resolve_text_file(path: Path) -> Path:
    if path.is_dir():
        for name in OFFICIAL_NAMES:
            if (path / name).is_file():
                return path / name
        raise CorpusFormatError(
            f"{path}: folder holds neither {' nor '.join(OFFICIAL_NAMES)} "
            "(expected the unzipped wikitext-103(-raw) folder)"
        )
    if not path.is_file():
        raise CorpusFormatError(
            f"{path}: no such file (expected wiki.train.raw, wiki.train.tokens or a .parquet)"
        )
    return path


def _read_parquet(path: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["text"])
    except (OSError, ValueError) as e:  # pyarrow raises ArrowInvalid (a ValueError) / OSError
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CorpusFormatError(
            f"{path}: cannot read a 'text' column from this parquet file ({msg})"
        ) from None
    column = table.column("text")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise CorpusFormatError(f"{path}: column 'text' has type {column.type}, expected string")
    lines = non_empty([t for t in column.to_pylist() if t is not None])
    if not lines:
        raise CorpusFormatError(
            f"{path}: no non-empty text rows ({len(column):,} rows, {column.null_count:,} of "
            "them null; expected WikiText training text)"
        )
    warn_null_text(path, column.null_count, len(column), stacklevel=4)
    return lines


def _first_non_utf8_line(path: Path) -> tuple[int, int]:
    """(line number, byte offset in the file) of the first byte that is not UTF-8.

    Only called after a decode failed: the text reader decodes in chunks, so its error's
    offset is relative to a chunk and says nothing about the line.
    """
    offset = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return lineno, offset + e.start
            offset += len(raw)
    return lineno, offset  # pragma: no cover - the text reader failed, so some line fails


def read_wikitext(path: str | os.PathLike) -> list[str]:
    """Samples (non-empty lines) of a WikiText training split.

    ``path``: ``wiki.train.raw`` / ``wiki.train.tokens``, the folder holding one of them, or a
    ``.parquet`` file with a string column ``text`` (one line per row; null values are skipped
    with a :class:`NullTextWarning` giving their count). Raises :class:`CorpusFormatError`
    naming the file when it is missing, unreadable, not text, or holds no non-empty line.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        if not path.is_file():
            raise CorpusFormatError(f"{path}: no such parquet file (expected a 'text' column)")
        return _read_parquet(path)
    path = _resolve_text_file(path)
    try:
        with path.open(encoding="utf-8") as f:
            lines = non_empty(f.readlines())
    except UnicodeDecodeError:
        lineno, offset = _first_non_utf8_line(path)
        raise CorpusFormatError(
            f"{path}:{lineno}: not UTF-8 text (byte {offset:,} of the file; "
            "expected WikiText lines)"
        ) from None
    if not lines:
        raise CorpusFormatError(f"{path}: no non-empty lines (expected WikiText training text)")
    return lines


def corpus_name(path: str | os.PathLike | None, quick: bool = False, seed: int = 0) -> str:
    """A short description of what :func:`load_corpus` reads, for run logs."""
    if path is not None:
        return str(path)
    return f"synthetic({'quick' if quick else 'wikitext103-size'}, seed={seed})"


def load_corpus(path: str | os.PathLike | None, quick: bool = False, seed: int = 0) -> list[str]:
    """The samples a script trains on: the file at ``path``, or (``None``) the generated corpus
    at full WikiText-103 size, or at the quick size with ``quick``."""
    if path is not None:
        return read_wikitext(path)
    return synthetic_corpus(
        SyntheticCorpusConfig.quick(seed) if quick else SyntheticCorpusConfig(seed=seed)
    )
