"""Tokenize a corpus once and keep the token ids: basic_english + vocabulary, or subword tokenizers.

* :func:`basic_english` is torchtext 0.18's ``get_tokenizer("basic_english")`` rewritten (torchtext
  cannot be imported with torch >= 2.4): lowercase, twelve regex substitutions in a fixed order,
  split on whitespace. :func:`fit_basic_english` tokenizes a whole corpus in worker processes,
  counts tokens in the same pass and builds a :class:`Vocab` (``<pad>`` = 0, ``<unk>`` = 1, then
  tokens by decreasing count, ties alphabetical; ``min_freq`` / ``max_size`` cut the tail).
* :func:`load_hf_tokenizer` loads a Hugging Face tokenizer from a local folder (never the hub);
  :func:`train_byte_level_bpe` trains a byte-level BPE offline on the corpus at hand, with
  ``<pad>`` = 0 and ``<bos>`` = 1 (the BoS id seed 002 uses). :func:`encode_with_tokenizer` runs
  either over a corpus in batches (the Rust side encodes a batch on all cores).
* :class:`TokenizedCorpus` holds the result as one flat int32 array of ids plus int64 offsets,
  so an epoch indexes arrays instead of re-tokenizing; it saves to / loads from one ``.npz``.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import re
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np

from effdl.data.corpus import CorpusFormatError, corpus_name, load_corpus

PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<unk>", "<bos>", "<eos>"


class CacheRebuiltWarning(UserWarning):
    """A token cache could not be read (truncated, corrupt, not a file); it is rebuilt."""


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``path`` unique to this call, then rename it
    over ``path``: concurrent writers never see or clobber each other's half-written files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        tmp.chmod(0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"cannot write {path} ({e.strerror or e})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# torchtext 0.18, torchtext/data/utils.py: applied in this order to the lowercased line.
_BASIC_ENGLISH_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"\'", " '  "),
        (r"\"", ""),
        (r"\.", " . "),
        (r"<br \/>", " "),
        (r",", " , "),
        (r"\(", " ( "),
        (r"\)", " ) "),
        (r"\!", " ! "),
        (r"\?", " ? "),
        (r"\;", " "),
        (r"\:", " "),
        (r"\s+", " "),
    )
)


def basic_english(line: str) -> list[str]:
    """torchtext's ``basic_english`` tokenizer, rule for rule.

    Lowercase; pad ``'`` ``.`` ``,`` ``(`` ``)`` ``!`` ``?`` with spaces; delete ``"``; replace
    ``<br />``, ``;`` and ``:`` with a space; collapse whitespace; split.
    """
    line = line.lower()
    for pattern, replacement in _BASIC_ENGLISH_RULES:
        line = pattern.sub(replacement, line)
    return line.split()


def basic_english_many(lines: Sequence[str]) -> list[list[str]]:
    """``[basic_english(l) for l in lines]``, computed on the lines joined by newlines.

    Equivalent because no rule but the last matches across a newline (so the first eleven can
    run on the joined text), lowercasing is per character with newline as a context break, and
    ``str.split()`` splits on exactly the characters ``\\s`` matches (so the last rule is
    implied by the split). Lines that themselves contain a newline take the per-line path.
    """
    if not lines:
        return []
    if any("\n" in line for line in lines):
        return [basic_english(line) for line in lines]
    text = "\n".join(lines).lower()
    for pattern, replacement in _BASIC_ENGLISH_RULES[:-1]:
        text = pattern.sub(replacement, text)
    return [part.split() for part in text.split("\n")]


@dataclass
class Vocab:
    """Token <-> id mapping; ``itos[0] == "<pad>"`` and ``itos[1] == "<unk>"``."""

    itos: list[str]
    stoi: dict[str, int] = field(init=False, repr=False)
    pad_id: ClassVar[int] = 0
    unk_id: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if self.itos[:2] != [PAD_TOKEN, UNK_TOKEN]:
            raise ValueError(f"a Vocab starts with {PAD_TOKEN!r}, {UNK_TOKEN!r}")
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("Vocab tokens must be unique")

    def __len__(self) -> int:
        return len(self.itos)

    @classmethod
    def from_counts(
        cls, counts: Mapping[str, int], min_freq: int = 1, max_size: int | None = None
    ) -> Vocab:
        """Specials, then tokens with count >= ``min_freq`` by decreasing count (ties by token).

        ``max_size`` caps the total size, specials included.
        """
        if min_freq < 1 or (max_size is not None and max_size < 2):
            raise ValueError(f"need min_freq >= 1 and max_size >= 2, got {min_freq}, {max_size}")
        kept = sorted(
            (
                (t, c)
                for t, c in counts.items()
                if c >= min_freq and t not in (PAD_TOKEN, UNK_TOKEN)
            ),
            key=lambda tc: (-tc[1], tc[0]),
        )
        itos = [PAD_TOKEN, UNK_TOKEN] + [t for t, _ in kept]
        return cls(itos[:max_size] if max_size is not None else itos)

    def encode(self, tokens: Iterable[str]) -> np.ndarray:
        """Ids (int32) of ``tokens``; unknown tokens map to ``unk_id``."""
        get = self.stoi.get
        return np.fromiter((get(t, self.unk_id) for t in tokens), dtype=np.int32)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokens as a JSON list (temporary name, then renamed)."""
        text = json.dumps(self.itos)
        _write_atomically(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocab:
        try:
            itos = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise CorpusFormatError(f"{path}: cannot read a vocabulary ({e})") from None
        if not isinstance(itos, list):
            raise CorpusFormatError(f"{path}: expected a JSON list of tokens")
        return cls(itos)


@dataclass
class TokenizedCorpus:
    """Token ids of ``n`` samples: sample ``i`` is ``ids[offsets[i]:offsets[i + 1]]``.

    ``ids`` is int32 of shape (total tokens,), ``offsets`` int64 of shape (n + 1,) starting at 0
    and non-decreasing. Indexing returns a view (no copy).
    """

    ids: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        self.ids = np.ascontiguousarray(self.ids, dtype=np.int32)
        self.offsets = np.ascontiguousarray(self.offsets, dtype=np.int64)
        o = self.offsets
        if o.ndim != 1 or len(o) < 1 or o[0] != 0 or o[-1] != len(self.ids):
            raise ValueError("offsets must be 1-D, start at 0 and end at len(ids)")
        if np.any(o[1:] < o[:-1]):
            raise ValueError("offsets must be non-decreasing")

    @classmethod
    def from_sequences(cls, seqs: Iterable[Sequence[int] | np.ndarray]) -> TokenizedCorpus:
        arrays = [np.asarray(s, dtype=np.int32) for s in seqs]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        return cls(ids, np.concatenate(([0], np.cumsum(lengths))))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i %= len(self)
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample, int64 of shape (n,)."""
        return np.diff(self.offsets)

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def truncate(
        self,
        max_length: int = 640,
        overflow: Literal["truncate", "drop"] = "truncate",
        min_length: int = 1,
    ) -> TokenizedCorpus:
        """A new corpus where no sample is longer than ``max_length`` tokens.

        ``overflow="truncate"`` keeps the first ``max_length`` tokens of a longer sample,
        ``"drop"`` removes the sample. Samples shorter than ``min_length`` are removed too (an
        empty sample has nothing to predict, and a fully masked attention row gives NaN).
        O(total tokens), vectorised.
        """
        if overflow not in ("truncate", "drop"):
            raise ValueError(f"overflow must be 'truncate' or 'drop', got {overflow!r}")
        if max_length < 1 or min_length < 0:
            raise ValueError(
                f"need max_length >= 1, min_length >= 0; got {max_length}, {min_length}"
            )
        lengths = self.lengths
        keep = lengths >= min_length
        if overflow == "drop":
            keep &= lengths <= max_length
        new_len = np.where(keep, np.minimum(lengths, max_length), 0)
        # Mark the removed tail of every cut sample as a [start, end) range, then cumsum.
        cut_start = self.offsets[:-1] + new_len
        cut_end = self.offsets[1:]
        cut = cut_start < cut_end
        delta = np.zeros(self.n_tokens + 1, dtype=np.int8)
        delta[cut_start[cut]] += 1
        delta[cut_end[cut]] -= 1
        keep_tok = np.cumsum(delta[:-1], dtype=np.int8) == 0
        offsets = np.concatenate(([0], np.cumsum(new_len[keep])))
        return TokenizedCorpus(self.ids[keep_tok], offsets)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``ids`` and ``offsets`` to one ``.npz`` (a temporary name unique to this call,
        then renamed, so concurrent savers to one path each leave a whole file)."""
        path = Path(path)

        def write(tmp: Path) -> None:
            with tmp.open("wb") as f:
                np.savez(f, ids=self.ids, offsets=self.offsets)

        _write_atomically(path, write)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenizedCorpus:
        path = Path(path)
        try:
            with np.load(path) as z:
                return cls(z["ids"], z["offsets"])
        except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as e:
            raise CorpusFormatError(
                f"{path}: not a tokenized corpus (expected an .npz with 'ids' and 'offsets'; {e})"
            ) from None


def _count_chunk(lines: Sequence[str]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Tokenize a chunk with chunk-local ids: (local tokens, local ids, counts, lengths)."""
    token_lists = basic_english_many(lines)
    local: dict[str, int] = {}
    add = local.setdefault
    ids = np.fromiter(
        (add(t, len(local)) for t in itertools.chain.from_iterable(token_lists)), dtype=np.int32
    )
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    counts = np.bincount(ids, minlength=len(local))
    return list(local), ids, counts, lengths


def _pool_map(fn: Callable, chunks: list, workers: int) -> list:
    if workers <= 1 or len(chunks) <= 1:
        return [fn(c) for c in chunks]
    # fork shares the parent's imports; spawn (macOS/Windows) re-imports effdl in each worker.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with mp.get_context(method).Pool(workers) as pool:
        return pool.map(fn, chunks, chunksize=1)


def fit_basic_english(
    lines: Sequence[str],
    min_freq: int = 1,
    max_size: int | None = None,
    workers: int | None = None,
    chunk_lines: int = 20_000,
) -> tuple[TokenizedCorpus, Vocab]:
    """Tokenize ``lines`` with :func:`basic_english`, build the vocabulary, return ids + vocab.

    One pass over the text: worker processes tokenize chunks with chunk-local ids and counts;
    the parent merges counts into a :class:`Vocab` and maps local ids to global ids with one
    numpy gather per chunk. Sample ``i`` of the result is line ``i`` (possibly empty). The
    tokenization divides by the number of ``workers`` (default: every core); the merge does not.
    """
    workers = workers or os.cpu_count() or 1
    chunks = [lines[i : i + chunk_lines] for i in range(0, len(lines), chunk_lines)]
    parts = _pool_map(_count_chunk, chunks, workers)
    totals: dict[str, int] = {}
    for tokens, _, counts, _ in parts:
        for t, c in zip(tokens, counts.tolist(), strict=True):
            totals[t] = totals.get(t, 0) + c
    vocab = Vocab.from_counts(totals, min_freq=min_freq, max_size=max_size)
    get = vocab.stoi.get
    ids, lengths = [], []
    for tokens, local_ids, _, lens in parts:
        remap = np.fromiter((get(t, vocab.unk_id) for t in tokens), np.int32, count=len(tokens))
        ids.append(remap[local_ids])
        lengths.append(lens)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.concatenate(([0], np.cumsum(all_lengths)))
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    return TokenizedCorpus(flat, offsets), vocab


def load_hf_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from a local folder or ``tokenizer.json`` (never the hub).

    A folder without ``tokenizer.json`` (e.g. GPT-2's ``vocab.json`` + ``merges.txt``) goes
    through ``transformers.AutoTokenizer`` with ``local_files_only=True`` and must give a fast
    tokenizer.
    """
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.is_file():
        try:
            return Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise CorpusFormatError(f"{file}: not a tokenizers JSON file ({e})") from None
    if not path.is_dir():
        raise CorpusFormatError(f"{path}: no such tokenizer file or folder")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CorpusFormatError(
            f"{path}: no tokenizer.json and transformers cannot load a tokenizer from it ({e})"
        ) from None
    if not getattr(tok, "is_fast", False):
        raise CorpusFormatError(f"{path}: only a slow (Python) tokenizer is available")
    return tok.backend_tokenizer


def tokenizer_token_id(tokenizer_dir: str | os.PathLike | None, token: str) -> int | None:
    """The id of ``token`` in ``tokenizer_dir/tokenizer.json``; None without that file (the
    readers then fall back to UTF-8 bytes) or without that token in it."""
    file = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir is not None else None
    if file is None or not file.is_file():
        return None
    return load_hf_tokenizer(file).token_to_id(token)


def train_byte_level_bpe(lines: Sequence[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Train a byte-level BPE on ``lines`` (offline); ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2.

    Byte-level: every string is representable, so there is no ``<unk>``. Returns a
    ``tokenizers.Tokenizer``; ``.save(folder / "tokenizer.json")`` makes it loadable by
    :func:`load_hf_tokenizer`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def encode_with_tokenizer(
    tokenizer, lines: Sequence[str], bos_id: int | None = None, batch_size: int = 8192
) -> TokenizedCorpus:
    """Encode ``lines`` with a ``tokenizers.Tokenizer`` (no special tokens added by it).

    ``bos_id`` (optional) is put in front of every sample. Batches go through
    ``encode_batch``, which runs on all cores in Rust.
    """
    prefix = [] if bos_id is None else [bos_id]
    seqs: list[list[int]] = []
    for i in range(0, len(lines), batch_size):
        batch = tokenizer.encode_batch(list(lines[i : i + batch_size]), add_special_tokens=False)
        seqs.extend(prefix + enc.ids for enc in batch)
    return TokenizedCorpus.from_sequences(seqs)


def cached_basic_english(
    load_lines: Callable[[], Sequence[str]],
    cache: str | os.PathLike | None = None,
    min_freq: int = 1,
    max_size: int | None = None,
    workers: int | None = None,
    source: str | None = None,
) -> tuple[TokenizedCorpus, Vocab, bool]:
    """:func:`fit_basic_english` with an on-disk cache; returns (corpus, vocab, cache_hit).

    ``cache`` names an ``.npz`` (ids + offsets); the vocabulary goes beside it as
    ``<stem>.vocab.json`` and the options it was built with (``source``, ``min_freq``,
    ``max_size``) as ``<stem>.options.json``. On a hit nothing is read or tokenized
    (``load_lines`` is not called); a cache built with other options raises
    :class:`CorpusFormatError` (a different vocabulary would silently change the model), and
    one without recorded options is rebuilt, as is one that cannot be read (truncated or
    corrupt files, a folder in their place: a :class:`CacheRebuiltWarning` names the file).
    Each file is written to a temporary name and renamed, the options file last, so processes
    building the same cache at once each leave it whole; a cache path that cannot be written
    raises :class:`CorpusFormatError` naming it.
    """
    options = {"source": source, "min_freq": min_freq, "max_size": max_size}
    if cache is not None:
        npz = Path(cache)
        vocab_path = npz.with_name(npz.stem + ".vocab.json")
        options_path = npz.with_name(npz.stem + ".options.json")
        hit = _read_cache(npz, vocab_path, options_path, options)
        if hit is not None:
            return *hit, True
    corpus, vocab = fit_basic_english(load_lines(), min_freq, max_size, workers)
    if cache is not None:
        try:
            corpus.save(npz)
            vocab.save(vocab_path)
            _write_atomically(options_path, lambda tmp: tmp.write_text(json.dumps(options)))
        except OSError as e:
            raise CorpusFormatError(f"token cache: {e.strerror}; give another cache path") from None
    return corpus, vocab, False


def _read_cache(
    npz: Path, vocab_path: Path, options_path: Path, options: dict
) -> tuple[TokenizedCorpus, Vocab] | None:
    """The cached corpus and vocabulary, or None for a miss (rebuild)."""
    if not options_path.exists():
        return None  # never completed, or an older cache without options
    try:
        built_with = json.loads(options_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        _warn_rebuild(f"{options_path}: not a JSON options file ({e})")
        return None
    if built_with != options:
        raise CorpusFormatError(
            f"{npz} was built with {built_with}, this run asks for {options}: "
            "give another cache path or delete that one"
        )
    try:
        return TokenizedCorpus.load(npz), Vocab.load(vocab_path)
    except CorpusFormatError as e:
        _warn_rebuild(str(e))
        return None


def _warn_rebuild(reason: str) -> None:
    # stacklevel 4: the warning points at the caller of cached_basic_english
    warnings.warn(f"{reason}; rebuilding the token cache", CacheRebuiltWarning, stacklevel=4)


def prepare_wikitext_ids(
    path: str | os.PathLike | None,
    *,
    quick: bool = False,
    seed: int = 0,
    cache: str | os.PathLike | None = None,
    min_freq: int = 1,
    max_size: int | None = None,
    max_length: int = 640,
    overflow: Literal["truncate", "drop"] = "truncate",
    workers: int | None = None,
) -> tuple[TokenizedCorpus, Vocab, str]:
    """The task-2 data path in one call: read (or generate) WikiText lines, tokenize with
    basic_english (cached), cut to ``max_length``; returns (corpus, vocab, source name)."""
    source = corpus_name(path, quick, seed)
    corpus, vocab, _ = cached_basic_english(
        lambda: load_corpus(path, quick, seed), cache, min_freq, max_size, workers, source
    )
    return corpus.truncate(max_length, overflow), vocab, source
