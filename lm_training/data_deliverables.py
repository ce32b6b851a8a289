"""Seed 002's data and model questions, answered from the data and the model at hand.

1. The first 200 tokens of the first sample, decoded.
2. Tokens in one padded 32 x 4096 batch (ParquetDataset + CollatorForCLM) and how many of them
   the loss ignores, against the packed stream's (IterableParquetDataset) same-size batch.
4. The exact parameter count of the seed's 8B configuration, built on the meta device (nothing
   allocated), from the model and from the closed-form formula.

    python3 lm_training/data_deliverables.py --quick                 # stdlib corpus, small batch
    python3 lm_training/data_deliverables.py --data train_data.parquet --tokenizer TOKENIZER_DIR
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from effdl.cli import (
    ConfigFlags,
    base_parser,
    print_table,
    require_fits,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.labels import IGNORE_INDEX
from effdl.data.parquet import CollatorForCLM, IterableParquetDataset, ParquetDataset
from effdl.data.stdlib_text import DEFAULT_CACHE
from effdl.lm import data as lm_data
from effdl.models.llama import PRESETS, build_on_meta, count_parameters

TASK = "lm_training"
LOG = "lm_deliverables.jsonl"


@dataclass(frozen=True)
class DeliverablesConfig:
    """The batch of question 2 and the data; ``--data``/``--tokenizer`` as in train.py."""

    batch_size: int = 32
    sequence_length: int = 4096
    decoded_tokens: int = 200
    data: Path | None = None
    tokenizer: Path | None = None
    bpe_vocab: int = 8192
    corpus_bytes: int | None = None
    cache: Path = DEFAULT_CACHE

    def validate(self) -> None:
        require_positive(self, "batch_size", "sequence_length", "decoded_tokens", "bpe_vocab")
        require_fits(
            "--batch-size --sequence-length",
            self.batch_size * self.sequence_length,
            "a batch of token ids (int64)",
            bytes_per_element=8,
        )


FULL = DeliverablesConfig()
QUICK = DeliverablesConfig(batch_size=4, sequence_length=256, bpe_vocab=512, corpus_bytes=1 << 20)


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/lm_training")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("batch_size", type=int)
    flags.add("sequence_length", type=int)
    flags.add("decoded_tokens", type=int)
    flags.add("data", type=Path, help="parquet with a 'text' column or a text file")
    flags.add("tokenizer", type=Path, help="local HF tokenizer folder")
    flags.add("bpe_vocab", type=int)
    flags.add("corpus_bytes", type=int)
    flags.add("cache", type=Path, output=True)
    args = p.parse_args()
    return args, flags.resolve(args)


def main() -> None:
    args, cfg = parse_args()
    run = start_run(args, TASK, LOG)
    source = lm_data.resolve_data(cfg.data, None, cfg.cache, cfg.corpus_bytes)
    tok_dir = cfg.tokenizer or lm_data.default_tokenizer(cfg.cache, cfg.corpus_bytes, cfg.bpe_vocab)
    tok, specials = lm_data.load_tokenizer(tok_dir)
    config = {
        **{k: str(v) for k, v in dataclasses.asdict(cfg).items()},
        "data_name": source.name,
        "tokenizer_dir": str(tok_dir),
        "bos_id": specials.bos,
        "pad_id": specials.pad,
    }
    seq, batch = cfg.sequence_length, cfg.batch_size

    # 1: the first sample (BoS first, as the seed's tokenizer adds it)
    first = ParquetDataset(source.train, tok, seq, training_samples=1, bos_id=specials.bos)[0]
    ids = first["input_ids"][: cfg.decoded_tokens]
    text = tok.decode(ids, skip_special_tokens=False)
    run.log.log("first_sample", config, {"n_tokens": len(ids), "ids": ids, "decoded": text})
    print(f"\nFirst {len(ids)} tokens of the first sample, decoded:\n{text}\n")

    # 2: one padded batch against one packed batch of the same shape
    padded_ds = ParquetDataset(source.train, tok, seq, training_samples=batch, bos_id=specials.bos)
    loader = DataLoader(padded_ds, batch_size=batch, collate_fn=CollatorForCLM(seq, specials.pad))
    padded = next(iter(loader))
    packed = list(
        itertools.islice(IterableParquetDataset(source.train, tok, seq, specials.bos), batch)
    )
    packed_labels = torch.stack([y for _, y in packed])
    rows = []
    for name, labels in (("padded", padded.labels), ("packed", packed_labels)):
        ignored = int((labels == IGNORE_INDEX).sum())
        metrics = {
            "batch": len(labels),
            "tokens": labels.numel(),
            "ignored": ignored,
            "ignored_fraction": ignored / labels.numel(),
        }
        run.log.log(f"batch_{name}", config, metrics)
        rows.append({"pipeline": name, **metrics})
    print_table(rows, title=f"{batch} x {seq} label tokens of {source.name}")

    # 4: the seed's 8B configuration, counted without allocating
    args8b = PRESETS["8b"]
    from_model = sum(p.numel() for p in build_on_meta(args8b).parameters())
    counts = {
        "from_model": from_model,
        "closed_form": count_parameters(args8b),
        "vocab_size": args8b.vocab_size,
    }
    run.log.log("params_8b", {"model_args": dataclasses.asdict(args8b)}, counts)
    print_table([counts], title="Parameters of the seed's 8B configuration (meta device)")
    print(f"\nlog: {run.log.path}")


if __name__ == "__main__":
    run_main(main)
