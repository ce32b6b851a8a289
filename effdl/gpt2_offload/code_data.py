"""The data of a fine-tune on code (memory_efficient_gpt2/finetune_code.py), from the stdlib code
corpus (effdl.data.stdlib_code): the training files' tokens cut into windows to train on, the
held-out files' tokens cut into rows to evaluate on, and prompts cut from held-out files
(effdl.data.code_prompts), all read by one tokenizer (:class:`Codec`); and the check that the
starting weights were not pretrained on code this split holds out (:func:`pretraining_corpus`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from effdl.cli import UsageError
from effdl.data.code_prompts import CodePrompt, select_prompts
from effdl.data.stdlib_code import CodeCorpus, code_bpe
from effdl.data.stdlib_text import content_hash
from effdl.data.token_streams import text_stream
from effdl.data.tokenize import BOS_TOKEN, EOS_TOKEN, load_hf_tokenizer
from effdl.gpt2_offload.inputs import token_windows

# ids a continuation ends at: our BPE's document markers, GPT-2's end of text
STOP_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<|endoftext|>")
NOTES = "notes.json"  # pretrain.py's record of what a model folder was trained on


@dataclass(frozen=True)
class Codec:
    """Text to ids and back: a Hugging Face ``tokenizer.json`` in ``tokenizer_dir``, or without
    one the UTF-8 bytes (as :func:`effdl.data.token_streams.text_stream` reads text)."""

    tokenizer_dir: Path | None
    name: str

    @functools.cached_property
    def _tokenizer(self):
        return None if self.tokenizer_dir is None else load_hf_tokenizer(self.tokenizer_dir)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        if self._tokenizer is None:
            return list(text.encode())
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out (a byte id past 255 reads as U+FFFD)."""
        if self._tokenizer is None:
            return bytes(i if i < 256 else 0xFF for i in ids).decode("utf-8", errors="replace")
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        """The id of the special ``token``; None where the codec has none."""
        return None if self._tokenizer is None else self._tokenizer.token_to_id(token)


def finetune_codec(
    model_path: Path | None, corpus: CodeCorpus, bpe_vocab: int, cache: Path
) -> Codec:
    """What a fine-tune reads with: ``model_path``'s ``tokenizer.json`` (pretrain.py saves the
    BPE it trained with there), its UTF-8 bytes when the folder has none, and without a
    ``model_path`` the corpus's own BPE of ``bpe_vocab`` ids (:func:`code_bpe`, built once
    under ``cache``)."""
    if model_path is None:
        folder = code_bpe(corpus, bpe_vocab, cache)
        return Codec(folder, folder.name)
    if (model_path / "tokenizer.json").is_file():
        return Codec(model_path, str(model_path))
    return Codec(None, "utf-8 bytes")


def pretraining_corpus(model_path: Path | None) -> str:
    """What ``model_path``'s weights were pretrained on, as its ``notes.json`` says (pretrain.py
    writes one): ``"docs"``; ``"unknown"`` for a folder without notes (not pretrain.py's), and
    ``"none"`` without a folder (random init). :class:`UsageError` naming ``--model-path`` for
    weights pretrained on the stdlib corpus: its training half holds code files this split
    holds out."""
    if model_path is None:
        return "none"
    notes = model_path / NOTES
    if not notes.is_file():
        return "unknown"
    try:
        config = json.loads(notes.read_text(encoding="utf-8")).get("config", {})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise UsageError(f"--model-path: {notes} is not a readable JSON object ({e})") from None
    corpus = config.get("corpus", "stdlib")  # folders from before --corpus: the stdlib corpus
    if corpus != "docs":
        raise UsageError(
            f"--model-path: {model_path} was pretrained on the {corpus} corpus, whose code files "
            "include held-out ones; pretrain with pretrain.py --corpus docs"
        )
    return corpus


@dataclass(frozen=True)
class CodeData:
    """A fine-tune's inputs: ``windows`` ((m, seq) ids of the training files), ``heldout``
    ((n, seq) ids of the held-out files), the ``prompts`` and their ids (``<bos>`` first where
    the codec has it), and the ids a continuation stops at."""

    corpus: CodeCorpus
    codec: Codec
    windows: torch.Tensor
    heldout: torch.Tensor
    prompts: list[CodePrompt]
    prompt_ids: list[list[int]]
    stop_ids: frozenset[int]

    def summary(self) -> dict:
        """The ``corpus`` record's metrics: which files each side has (so no held-out file is
        trained on), their tokens, the prompts."""
        return {
            "train_files": [f.path for f in self.corpus.train],
            "heldout_files": [f.path for f in self.corpus.heldout],
            "train_sha256": content_hash(f.text for f in self.corpus.train),
            "doc_topics": len(self.corpus.docs),
            "train_windows": len(self.windows),
            "train_tokens": self.windows.numel(),
            "heldout_rows": len(self.heldout),
            "heldout_tokens": self.heldout.numel(),
            "prompts": [{"path": p.path, "name": p.name, "kind": p.kind, "line": p.line,
                         "text": p.text, "tokens": len(ids)}
                        for p, ids in zip(self.prompts, self.prompt_ids, strict=True)],
        }  # fmt: skip


def code_data(
    corpus: CodeCorpus,
    codec: Codec,
    seq: int,
    vocab: int,
    n_prompts: int,
    prompt_tokens: int,
    heldout_rows: int | None = None,
) -> CodeData:
    """The training files and the held-out files each as one token stream (``<bos>`` before
    every file where the codec has it) cut into ``seq``-token rows (the first ``heldout_rows``
    held-out rows; None: all), and ``n_prompts`` prompts of held-out files (the last
    ``prompt_tokens`` ids of each). ValueError when the held-out files hold too few prompts;
    CorpusFormatError when the text gives ids past ``vocab``."""
    bos = codec.token_id(BOS_TOKEN)

    def stream(files, part: str) -> torch.Tensor:
        texts = [f.text for f in files]
        return text_stream(texts, None, vocab, codec.tokenizer_dir, f"{corpus.name} {part}", bos)

    prompts = select_prompts(corpus.heldout, n_prompts)
    prefix = [] if bos is None else [bos]
    prompt_ids = [(prefix + codec.encode(p.text))[-prompt_tokens:] for p in prompts]
    stops = (codec.token_id(t) for t in STOP_TOKENS)
    return CodeData(
        corpus=corpus,
        codec=codec,
        windows=token_windows(stream(corpus.train, "training files"), seq),
        heldout=token_windows(stream(corpus.heldout, "held-out files"), seq)[:heldout_rows],
        prompts=prompts,
        prompt_ids=prompt_ids,
        stop_ids=frozenset(i for i in stops if i is not None),
    )
