"""The batching pipelines of seed 000 Task 2 and seed 001, each as one DataLoader.

BRAIN pads every row to the maximum length; BIG BRAIN pads to the batch maximum; ULTRA DUPER BIG
BRAIN buckets samples of similar length (:mod:`effdl.data.samplers`); the packed pipelines fill
fixed-width rows with whole documents (:mod:`effdl.data.packing`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.utils.data import DataLoader

from effdl.data.packing import packed_loader
from effdl.data.padding import PadCollator, PaddedDataset, UnpaddedDataset, stack_collate
from effdl.data.samplers import UltraDuperBigBrainBatchSampler
from effdl.data.tokenize import TokenizedCorpus

Pipeline = Literal["brain", "bigbrain", "ultra", "packed_concat", "packed_bfd"]
PIPELINES: tuple[str, ...] = ("brain", "bigbrain", "ultra", "packed_concat", "packed_bfd")


def make_loader(
    pipeline: Pipeline,
    corpus: TokenizedCorpus,
    batch_size: int | None,
    *,
    k: int = 640,
    max_length: int = 640,
    pad_id: int = 0,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    max_tokens: int | None = None,
    attention_block_size: int | None = None,
) -> DataLoader:
    """A DataLoader for one batching pipeline over ``corpus`` (already cut to ``max_length``).

    ``"brain"``: :class:`PaddedDataset` (every row ``max_length`` wide), shuffled;
    ``"bigbrain"``: :class:`UnpaddedDataset` + pad-to-batch-max collation, shuffled;
    ``"ultra"``: the same dataset and collation with :class:`UltraDuperBigBrainBatchSampler`
    (span ``k``; ``max_tokens`` adds its padded-token budget, and ``batch_size=None`` then
    drops the row cap). These yield :class:`~effdl.data.padding.Batch`.
    ``"packed_concat"`` / ``"packed_bfd"``: rows of ``max_length`` tokens from
    :func:`effdl.data.packing.packed_loader` (streaming concatenation / Best-Fit Decreasing),
    yielding its ``PackedBatch`` (with ``doc_ids`` and restarting ``position_ids``, and with
    ``attention_block_size`` FlexAttention block lists built in the workers).
    """
    if pipeline != "ultra" and (max_tokens is not None or batch_size is None):
        raise ValueError(
            f"max_tokens and batch_size=None apply only to pipeline 'ultra', got {pipeline!r}"
        )
    common = {"num_workers": num_workers, "pin_memory": pin_memory}
    if pipeline in ("packed_concat", "packed_bfd"):
        method = pipeline.removeprefix("packed_")
        return packed_loader(
            corpus,
            max_length,
            batch_size,
            pad_id=pad_id,
            method=method,
            shuffle=True,
            seed=seed,
            attention_block_size=attention_block_size,
            **common,
        )
    if pipeline == "ultra":
        sampler = UltraDuperBigBrainBatchSampler(
            corpus.lengths, batch_size, k, seed=seed, max_tokens=max_tokens
        )
        return DataLoader(
            UnpaddedDataset(corpus), batch_sampler=sampler, collate_fn=PadCollator(pad_id), **common
        )
    generator = torch.Generator().manual_seed(seed)
    if pipeline == "brain":
        dataset, collate = PaddedDataset(corpus, max_length, pad_id), stack_collate
    elif pipeline == "bigbrain":
        dataset, collate = UnpaddedDataset(corpus), PadCollator(pad_id)
    else:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
        collate_fn=collate,
        **common,
    )
