"""The typed config of a GPT-2 offload run, its presets (full, ``--quick``, the GPT-2-XL
``--level`` presets) and its command-line flags, validated once at the boundary."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from effdl.cli import (
    ConfigFlags,
    UsageError,
    require_choices,
    require_fits,
    require_multiple,
    require_path,
    require_positive,
    require_processes,
)
from effdl.data.stdlib_text import DEFAULT_CACHE
from effdl.models.gpt2 import MODEL_FOLDER, SHAPES
from effdl.optim.offload import GRAD_ACCUMULATION_MODES, MOMENT_FORMATS, UPDATE_LOCATIONS

ACCUMULATOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GENERATED = "generated"  # --data value of the synthetic token stream
LR_SCHEDULES = ("constant", "cosine")
REFERENCES = ("none", "adamw")

# GPT-2-XL presets, sugar over the flags (flags given beside --level win). Each sets every flag
# the levels differ in, so a level applies whole over any other preset.
LEVELS: dict[int, dict] = {
    1: {"size": "xl", "memory_cap_gib": 16.0, "host_memory_cap_gib": None, "moments": "fp32",
        "update_on": "host", "grad_accumulation": "gpu", "grad_accumulation_dtype": "fp32"},
    # Level 1's 16 GiB, for speed: level 3's optimizer frees GPU memory (fewer blocks recomputed)
    # and takes the update off the CPU.
    2: {"size": "xl", "memory_cap_gib": 16.0, "host_memory_cap_gib": None, "moments": "int8",
        "update_on": "device", "grad_accumulation": "gpu", "grad_accumulation_dtype": "bf16"},
    3: {"size": "xl", "memory_cap_gib": 11.0, "host_memory_cap_gib": 16.0, "moments": "int8",
        "update_on": "device", "grad_accumulation": "gpu", "grad_accumulation_dtype": "bf16"},
}  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run: ours offloaded, the AdamW reference, or a peer optimizer."""

    fixed_batch: bool = False
    steps: int = 8
    batch: int = 64
    seq: int = 1024
    micro_batch: int = 4
    checkpoint_layers: int = -1  # -1: the fewest that fit the cap (estimate)
    grad_accumulation: str = "gpu"
    grad_accumulation_dtype: str = "fp32"  # of the "gpu" accumulator
    lr: float = 3e-4
    warmup_steps: int = 5  # linear warm-up from lr / warmup_steps
    lr_schedule: str = "constant"  # after the warm-up: constant or cosine down to lr / 10
    weight_decay: float = 0.0
    dropout: float = 0.0
    memory_cap_gib: float = 11.0
    host_memory_cap_gib: float | None = None  # None: no cap on the host's resident set
    moments: str = "fp32"
    update_on: str = "host"
    level: int | None = None  # the LEVELS preset the flags started from (recorded, not read)
    chunk_tokens: int = 1024
    cpu_threads: int | None = None  # None: all cores but two
    size: str = "large"
    model_path: Path | None = None
    data: Path | None = None  # None: the stdlib corpus; Path("generated"): the synthetic stream
    bpe_vocab: int = 50257  # of the stdlib BPE
    corpus_bytes: int | None = None  # cap of the stdlib corpus; None: all of it
    cache: Path = DEFAULT_CACHE
    reference: str = "none"
    baseline: bool = False  # after the run: the plain models' forward+backward, same process
    baseline_micro_batches: tuple[int, ...] = (4, 8, 16)

    def validate(self) -> None:
        require_choices(self, "size", sorted(SHAPES))
        require_choices(self, "grad_accumulation", GRAD_ACCUMULATION_MODES)
        require_choices(self, "grad_accumulation_dtype", sorted(ACCUMULATOR_DTYPES))
        if self.grad_accumulation_dtype != "fp32" and self.grad_accumulation != "gpu":
            raise UsageError(
                "--grad-accumulation-dtype bf16 is the GPU accumulator's dtype: it needs "
                "--grad-accumulation gpu"
            )
        require_choices(self, "moments", MOMENT_FORMATS)
        require_choices(self, "update_on", UPDATE_LOCATIONS)
        if self.update_on == "device" and self.moments != "int8":
            raise UsageError(
                "--update-on device runs the 8-bit Adam step on the GPU: it needs --moments int8"
            )
        require_positive(self, "steps", "batch", "seq", "micro_batch", "chunk_tokens")
        require_positive(self, "lr", "weight_decay", "warmup_steps", "dropout", minimum=0)
        require_choices(self, "lr_schedule", LR_SCHEDULES)
        require_choices(self, "reference", REFERENCES)
        if not self.dropout < 1:
            raise UsageError(f"--dropout must be < 1, got {self.dropout}")
        if self.reference != "none" and self.weight_decay:
            raise UsageError(
                "--reference adamw needs --weight-decay 0: ours is Adam with L2 decay, the "
                "reference AdamW decays decoupled (the same update only without decay)"
            )
        self._validate_text()
        require_positive(self, "baseline_micro_batches")
        require_fits("--baseline-micro-batches --seq", max(self.baseline_micro_batches) * self.seq,
                     "a baseline micro-batch's token ids (int64)", 8)  # fmt: skip
        require_processes(self, "cpu_threads", minimum=1)
        if not self.memory_cap_gib > 0:
            raise UsageError(f"--memory-cap-gib must be > 0, got {self.memory_cap_gib}")
        if self.host_memory_cap_gib is not None and not self.host_memory_cap_gib > 0:
            raise UsageError(f"--host-memory-cap-gib must be > 0, got {self.host_memory_cap_gib}")
        shape = SHAPES[self.size]
        if not -1 <= self.checkpoint_layers <= shape.n_layer:
            raise UsageError(
                f"--checkpoint-layers must be -1 (auto) or 0..{shape.n_layer} for --size "
                f"{self.size}, got {self.checkpoint_layers}"
            )
        require_multiple(self, "batch", "micro_batch")
        require_fits("--batch --seq", self.batch * self.seq, "a step's token ids (int64)", 8)
        if self.seq > shape.n_positions:
            raise UsageError(f"--seq {self.seq} exceeds GPT-2's {shape.n_positions} positions")
        if self.model_path is not None:
            require_path(self.model_path, MODEL_FOLDER, "--model-path")
        if self.data is not None and not self.synthetic:
            require_path(
                self.data,
                f"WikiText-103 files, a parquet with a 'text' column, or '{GENERATED}'",
                "--data",
            )

    @property
    def synthetic(self) -> bool:
        """Whether ``--data generated`` asks for the synthetic token stream."""
        return self.data is not None and str(self.data) == GENERATED

    def _validate_text(self) -> None:
        require_positive(self, "bpe_vocab", minimum=259)  # 256 bytes and 3 special tokens
        if self.corpus_bytes is not None:
            require_positive(self, "corpus_bytes")
        vocab = SHAPES[self.size].vocab_size
        if self.data is None and self.model_path is None and self.bpe_vocab > vocab:
            raise UsageError(
                f"--bpe-vocab {self.bpe_vocab} exceeds the {vocab} ids of --size {self.size}"
            )


FULL = TrainConfig()
QUICK = TrainConfig(
    steps=4,
    batch=8,
    seq=64,
    micro_batch=2,
    lr=1e-3,
    warmup_steps=1,
    size="tiny",
    bpe_vocab=512,
    corpus_bytes=1 << 20,
    baseline_micro_batches=(2, 4),
)

# add_argument keywords of each TrainConfig field's flag
FLAGS: dict[str, dict] = {
    "fixed_batch": {"action": "store_true", "help": "train on one fixed batch"},
    "steps": {"type": int, "help": "optimizer steps"},
    "batch": {"type": int, "help": "sequences per optimizer step"},
    "seq": {"type": int, "help": "sequence length"},
    "micro_batch": {"type": int, "help": "sequences per forward/backward"},
    "checkpoint_layers": {
        "type": int,
        "help": "blocks to recompute in backward; -1 = fewest that fit the cap (estimate)",
    },
    "grad_accumulation": {"choices": GRAD_ACCUMULATION_MODES},
    "grad_accumulation_dtype": {
        "choices": sorted(ACCUMULATOR_DTYPES),
        "help": "dtype of the GPU gradient accumulator (bf16: half the bytes, one rounding per add)",
    },
    "lr": {"type": float, "help": "peak learning rate, after the warm-up"},
    "warmup_steps": {"type": int, "help": "steps of linear lr warm-up"},
    "lr_schedule": {"choices": LR_SCHEDULES, "help": "after the warm-up (cosine: to lr / 10)"},
    "weight_decay": {"type": float},
    "dropout": {"type": float, "help": "of every GPT-2 dropout layer"},
    "memory_cap_gib": {"type": float, "help": "peak GPU memory allowed"},
    "host_memory_cap_gib": {
        "type": float,
        "help": "resident set allowed to the process (pinned buffers included); None = no cap",
    },
    "moments": {"choices": MOMENT_FORMATS, "help": "Adam moments on the host"},
    "update_on": {
        "choices": UPDATE_LOCATIONS,
        "help": "where the Adam step runs; device needs --moments int8 and CUDA",
    },
    "level": {
        "type": int,
        "choices": sorted(LEVELS),
        "help": "GPT-2-XL preset: " + "; ".join(f"{n}: {preset}" for n, preset in LEVELS.items()),
    },
    "chunk_tokens": {"type": int, "help": "tokens per loss chunk"},
    "cpu_threads": {"type": int, "help": "threads of the CPU update; None = cores - 2"},
    "size": {"choices": sorted(SHAPES)},
    "model_path": {"type": Path, "help": "local HF GPT-2 folder"},
    "data": {
        "type": Path,
        "help": f"WikiText file/folder or parquet; '{GENERATED}' = synthetic; None = stdlib corpus",
    },
    "bpe_vocab": {"type": int, "help": "ids of the BPE trained on the stdlib corpus"},
    "corpus_bytes": {"type": int, "help": "cap of the stdlib corpus; None = all of it"},
    "cache": {"type": Path, "output": True, "help": "folder of the stdlib corpus and its BPE"},
    "reference": {
        "choices": REFERENCES,
        "help": "adamw: after our run, the same steps with torch AdamW (fp32 + bf16 autocast)",
    },
    "baseline": {
        "action": "store_true",
        "help": "after our run: Hugging Face's and our GPT-2 forward+backward without offload, "
        "timed in this process, and our speed over each",
    },
    "baseline_micro_batches": {
        "type": int,
        "nargs": "+",
        "help": "sequences per forward/backward at which --baseline times each model",
    },
}
# flags of our offloaded run alone (a peer optimizer or a probe has no use for them)
OFFLOAD_ONLY_FLAGS = ("checkpoint_layers", "grad_accumulation", "grad_accumulation_dtype",
                      "moments", "update_on", "level", "cpu_threads", "reference", "baseline",
                      "baseline_micro_batches")  # fmt: skip


def parse_train_args(
    parser: argparse.ArgumentParser,
    names: Iterable[str] = tuple(FLAGS),
    full: TrainConfig = FULL,
    quick: TrainConfig = QUICK,
    extra: Mapping[str, dict] | None = None,
) -> tuple[argparse.Namespace, TrainConfig]:
    """Add the flags of the fields ``names`` (default: all) and the ``extra`` flags (a field of
    ``full``'s class each, with its ``add_argument`` keywords) to ``parser``, parse the command
    line, fill in the ``--level`` preset under the flags given beside it, and return (args, the
    config: ``full`` or, with ``--quick``, ``quick``, with the flags given; validated)."""
    flags = ConfigFlags(parser, full, quick)
    for name in names:
        flags.add(name, **FLAGS[name])
    for name, options in (extra or {}).items():
        flags.add(name, **options)
    args = parser.parse_args()
    apply_level(args)
    return args, flags.resolve(args)


def apply_level(args: argparse.Namespace) -> None:
    """Give ``args`` the ``--level`` preset's value of every flag the user did not give (the
    config flags default to absent, so the preset then reads as if typed)."""
    if getattr(args, "level", None) is None:
        return
    for name, value in LEVELS[args.level].items():
        if not hasattr(args, name):
            setattr(args, name, value)
