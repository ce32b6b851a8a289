"""Runs of the GPT-like LM over each batching pipeline, as the batching benchmarks make them: the
config fields they share, their flags and checks, the device-dependent defaults, the corpus and
each variant's DataLoader."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, replace

import torch
from torch.utils.data import DataLoader

from effdl.cli import (
    AUTO,
    ConfigFlags,
    Run,
    UsageError,
    add_text_corpus_args,
    base_parser,
    decide_auto,
    int_or_auto,
    require_choices,
    require_positive,
    require_processes,
)
from effdl.data.corpus import CorpusFormatError
from effdl.data.pipelines import PIPELINES, make_loader
from effdl.data.tokenize import TokenizedCorpus, Vocab, prepare_wikitext_ids
from effdl.models.gpt_like import GPTLikeModel


@dataclass
class PipelineRunConfig:
    """The settings of a run over the batching pipelines; ``"auto"`` fields depend on the device
    (:func:`for_device`). The model is the assignment's GPTLikeConfig (its sizes here)."""

    pipelines: list[str] = field(default_factory=lambda: list(PIPELINES))
    ks: list[int] = field(default_factory=lambda: [5, 50])
    batch_size: int = 32
    max_length: int = 640
    dtype: str = AUTO
    workers: int | str = AUTO
    n_layers: int = 1
    d_model: int = 1024
    n_heads: int = 8
    d_ff: int = 2048

    def check_fields(self, dtypes: list[str], minimum: int) -> None:
        """UsageError unless the shared fields are valid; sizes must be >= ``minimum``."""
        require_choices(self, "pipelines", PIPELINES)
        require_positive(self, "ks", minimum=0)
        require_positive(self, "batch_size", minimum=minimum)
        require_positive(self, "max_length", minimum=2)  # a packed row holds a token and its next
        require_positive(self, "n_layers", "d_model", "n_heads", "d_ff")
        require_choices(self, "dtype", [AUTO, *dtypes])
        require_processes(self, "workers")


def pipeline_parser(
    description: str, full: PipelineRunConfig, quick: PipelineRunConfig, dtypes: list[str]
) -> tuple[argparse.ArgumentParser, ConfigFlags]:
    """The parser with the common flags (``--data``/``--cache`` included) bound to the shared
    config fields; the script adds its own with ``flags.add``."""
    p = base_parser(description, default_out="runs/task2")
    add_text_corpus_args(p)
    flags = ConfigFlags(p, full, quick)
    flags.add("pipelines", nargs="+", choices=PIPELINES, help="batching pipelines to run")
    flags.add("ks", type=int, nargs="+", help="length spans of the 'ultra' pipeline")
    flags.add("batch_size", type=int, help="rows per batch")
    flags.add("max_length", type=int, help="samples are cut to this many tokens; packed row width")
    flags.add("n_layers", type=int, help="decoder layers")
    flags.add(
        "dtype",
        choices=[AUTO, *dtypes],
        help="precision; auto = bf16 autocast on CUDA, fp32 on CPU",
    )
    flags.add("workers", type=int_or_auto, help="DataLoader workers; auto = 6 on CUDA, 0 on CPU")
    return p, flags


def for_device(cfg: PipelineRunConfig, device: torch.device) -> PipelineRunConfig:
    """``cfg`` with its ``"auto"`` fields decided for ``device``."""
    cuda = device.type == "cuda"
    return replace(
        cfg,
        dtype=decide_auto(cfg.dtype, "bf16" if cuda else "fp32"),
        workers=decide_auto(cfg.workers, 6 if cuda else 0),
    )


@dataclass(frozen=True)
class Corpus:
    """The tokenized corpus of a run, its vocabulary, its name and the seconds it took."""

    ids: TokenizedCorpus
    vocab: Vocab
    source: str
    prep_s: float

    def describe(self) -> str:
        """One line for the console: the corpus, its size and what preparing it took."""
        return (
            f"corpus: {self.source}: {len(self.ids):,} samples, {self.ids.n_tokens:,} tokens, "
            f"vocab {len(self.vocab):,} ({self.prep_s:.1f} s to read/generate + tokenize)"
        )


def load_corpus(args: argparse.Namespace, max_length: int, **options: object) -> Corpus:
    """The token ids of ``--data`` (or the generated corpus) cut to ``max_length``, cached in
    ``--cache``; ``options`` go to :func:`prepare_wikitext_ids`. Bad files are a UsageError."""
    start = time.perf_counter()
    try:
        ids, vocab, source = prepare_wikitext_ids(
            args.data,
            quick=args.quick,
            seed=args.seed,
            cache=args.cache,
            max_length=max_length,
            **options,
        )
    except CorpusFormatError as e:
        raise UsageError(f"--data/--cache: {e}") from None
    if len(ids) == 0 or ids.n_tokens == 0:
        raise UsageError(f"--data: {source}: no non-empty text rows (expected WikiText lines)")
    return Corpus(ids, vocab, source, time.perf_counter() - start)


def variants(cfg: PipelineRunConfig) -> list[tuple[str, int | None]]:
    """``(pipeline, k)`` of every run: each ``k`` for ``"ultra"``, ``None`` for the others."""
    return [(p, k) for p in cfg.pipelines for k in (cfg.ks if p == "ultra" else [None])]


def variant_name(pipeline: str, k: int | None) -> str:
    """The log's variant name of a run: the pipeline, with ``_k<k>`` for ULTRA's spans."""
    return pipeline if k is None else f"{pipeline}_k{k}"


def loader(
    pipeline: str,
    k: int | None,
    cfg: PipelineRunConfig,
    corpus: Corpus,
    model: GPTLikeModel,
    run: Run,
    batch_size: int | None,
    max_tokens: int | None = None,
) -> DataLoader:
    """The DataLoader of one variant (see :func:`effdl.data.pipelines.make_loader`), with the
    FlexAttention block lists ``model`` takes on ``run.device`` built in its workers."""
    return make_loader(
        pipeline,
        corpus.ids,
        batch_size,
        k=k or 0,
        max_length=cfg.max_length,
        pad_id=corpus.vocab.pad_id,
        seed=run.seed,
        num_workers=cfg.workers,
        pin_memory=run.device.type == "cuda",
        attention_block_size=model.loader_block_size(run.device),
        max_tokens=max_tokens,
    )
