"""Fine-tune GPT-2-Large inside 11 GiB of GPU memory with a CPU-offloaded Adam.

bf16 working weights on the GPU, fp32 master weights and Adam moments on the CPU
(effdl.optim.CPUOffloadAdam), 64 x 1024 tokens per step.

    python memory_efficient_gpt2/train.py --quick                           # CPU smoke run, tiny GPT-2
    python memory_efficient_gpt2/train.py --device cuda --baseline          # fwd+bwd: HF, and ours
    python memory_efficient_gpt2/train.py --device cuda --steps 8           # training corpus
    python memory_efficient_gpt2/train.py --device cuda --fixed-batch --steps 30 --reference adamw
    # the fixed-batch test from pretrained weights (from random init the loss stops at the
    # batch's unigram entropy, a 43% fall): pretrain.py first, never on the fixed batch's tokens
    python memory_efficient_gpt2/pretrain.py --device cuda --minutes 4.5 --save /tmp/ckpt
    python memory_efficient_gpt2/train.py --device cuda --model-path /tmp/ckpt --fixed-batch --steps 30 --reference adamw
    python memory_efficient_gpt2/train.py --device cuda --peer torchao      # torchao's offload
    python memory_efficient_gpt2/train.py --device cuda --level 3 --steps 8   # GPT-2-XL, 11 GiB

Data: by default Python's own documentation and source (effdl.data.stdlib_text), tokenized by a
byte-level BPE of ``--bpe-vocab`` ids trained on it (GPT-2's 50257 by default, so the model keeps
its shape; built once under ``--cache``), documents separated by ``<bos>``; with
``--model-path`` the folder's own tokenizer reads that text instead, ``<bos>`` kept when that
tokenizer has it (so a pretrain.py folder, which carries the BPE, reads the identical stream;
GPT-2's own tokenizer has no ``<bos>``, its documents are joined). ``--data FILE`` reads
WikiText or a parquet, ``--data generated`` the synthetic token stream. The learning rate warms
up linearly over ``--warmup-steps``, then stays (``--lr-schedule constant``) or decays along a
cosine to a tenth (``cosine``).

``--reference adamw`` trains the same initial weights on the same batches a second time with
``torch.optim.AdamW(fused=True)`` on fp32 weights under bf16 autocast, uncapped, with the same
micro-batches and learning rates, and logs both loss curves and their gap (``equivalence``).
``--peer torchao`` runs torchao's ``CPUOffloadOptimizer`` instead of ours: Hugging Face's
GPT-2 with fp32 weights, bf16 autocast and gradient checkpointing, under the same caps, timed
by the same step code.

``--checkpoint-layers -1`` checkpoints the fewest blocks whose estimated memory
(effdl.profiling.memory_budget, with the activation bytes measured on the GPU) fits the cap.
``--moments int8`` keeps the Adam moments block-wise 8-bit on the host; ``--update-on device``
runs that 8-bit step on the GPU, bucket by bucket. ``--grad-accumulation-dtype bf16`` sums the
micro-batches' gradients on the GPU in bf16 (2 B/param instead of 4). ``--level`` names the GPT-2-XL presets
(:data:`LEVELS`); flags given beside it win. Past ``--memory-cap-gib`` (peak GPU memory) or
``--host-memory-cap-gib`` (the process's resident set, pinned buffers included, sampled after
set-up and after every step) the run stops with :class:`MemoryCapExceeded` before that step's
record is written.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    print_table,
    require_choices,
    require_multiple,
    require_path,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.corpus import CorpusFormatError, read_wikitext
from effdl.data.stdlib_text import DEFAULT_CACHE, stdlib_training_text
from effdl.data.token_streams import step_batches, synthetic_stream, text_stream
from effdl.models.gpt2 import (
    SHAPES,
    backward_micro_batches,
    build_gpt2,
    checkpoint_blocks,
    count_params,
    gpt2_config,
    lm_loss,
)
from effdl.optim import CPUOffloadAdam, warmup_cosine_lr
from effdl.optim.offload import (
    DEVICE_BUCKETS_IN_FLIGHT,
    DEVICE_CHUNK_BLOCKS,
    GRAD_ACCUMULATION_MODES,
    MOMENT_FORMATS,
    UPDATE_LOCATIONS,
)
from effdl.optim.quantized_state import BLOCK_SIZE, num_blocks, quantized_nbytes
from effdl.profiling.memory import ALLOC_CONF, use_expandable_segments
from effdl.profiling.memory_budget import (
    ACT_BYTES_PER_TOKEN_LAYER,
    fewest_checkpointed_blocks,
    memory_budget,
)
from effdl.profiling.timing import GIB, benchmark
from effdl.results import RunLog

TASK = "gpt2"
TIMELINE_KINDS = ("gpu_compute", "d2h", "h2d", "cpu_update", "cpu_accumulate", "step_wait")
MODEL_FOLDER = (
    "a local Hugging Face GPT-2 folder: config.json + model.safetensors or pytorch_model.bin"
)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # fmt: skip
TABLE_COLUMNS = ("step", "loss", "seq_per_s", "peak_gib", "host_rss_gib", "gpu_compute_s",
                 "d2h_s", "h2d_s", "cpu_update_s", "step_wait_s")  # fmt: skip
PLAIN_COLUMNS = ("step", "lr", "loss", "seq_per_s", "peak_gib", "host_rss_gib")
BUCKET_NUMEL = 2**25  # parameters per optimizer bucket (a larger tensor gets its own)
# update_on="device": bytes of the 8-bit step's temporaries per value of a chunk (offload
# module), and the fp32 copy of a chunk of a bf16 accumulator on top
DEVICE_STEP_BYTES_PER_VALUE = 40
DEVICE_STEP_BF16_GRAD_BYTES_PER_VALUE = 4
ACCUMULATOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GENERATED = "generated"  # --data value of the synthetic token stream
LR_SCHEDULES = ("constant", "cosine")
REFERENCES = ("none", "adamw")
PEERS = ("none", "torchao")
# equivalence targets: mean |loss gap| per step between ours and the reference, and each run's
# fall (1 - last / first) on a fixed batch
MAX_MEAN_GAP_NATS = 0.05
MIN_FALL = 0.5
TORCHAO_MISSING = (
    "--peer torchao needs the torchao package (torchao 0.18): pip install torchao==0.18.0, "
    "or offline pip install --no-deps torchao-0.18.0-*.whl"
)
# memory_budget counts the model's share only: the optimizer's own GPU buffers (accumulator in
# its dtype, device-update scratch) come from state_placement
WITHOUT_OPTIMIZER_BUFFERS = "none"

# GPT-2-XL presets, sugar over the flags (flags given beside --level win). Level 2 runs level 1's
# configuration: its target is the speed against the --baseline run.
LEVEL_1 = {"size": "xl", "memory_cap_gib": 16.0, "moments": "fp32", "update_on": "host"}
LEVELS: dict[int, dict] = {
    1: LEVEL_1,
    2: LEVEL_1,
    3: {"size": "xl", "memory_cap_gib": 11.0, "host_memory_cap_gib": 16.0, "moments": "int8",
        "update_on": "device", "grad_accumulation": "gpu", "grad_accumulation_dtype": "bf16"},
}  # fmt: skip


class MemoryCapExceeded(RuntimeError):
    """A measured peak passed ``--memory-cap-gib`` or ``--host-memory-cap-gib``."""


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one run: the offloaded training (default) or the baselines (``baseline``)."""

    baseline: bool = False
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
    peer: str = "none"
    baseline_micro_batches: tuple[int, ...] = (4, 8, 16)
    baseline_warmup: int = 2
    baseline_iters: int = 5

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
        require_positive(
            self, "steps", "batch", "seq", "micro_batch", "chunk_tokens", "baseline_micro_batches"
        )
        require_positive(self, "lr", "weight_decay", "warmup_steps", "dropout", minimum=0)
        require_choices(self, "lr_schedule", LR_SCHEDULES)
        require_choices(self, "reference", REFERENCES)
        require_choices(self, "peer", PEERS)
        self._validate_modes()
        self._validate_text()
        if self.cpu_threads is not None:
            require_positive(self, "cpu_threads")
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
        return self.data is not None and str(self.data) == GENERATED

    def _validate_modes(self) -> None:
        modes = [f for f, on in (("--baseline", self.baseline), ("--reference", self.reference
                 != "none"), ("--peer", self.peer != "none")) if on]  # fmt: skip
        if len(modes) > 1:
            raise UsageError(f"{' and '.join(modes)} are separate runs: give one of them")
        if not self.dropout < 1:
            raise UsageError(f"--dropout must be < 1, got {self.dropout}")
        if self.reference != "none" and self.weight_decay:
            raise UsageError(
                "--reference adamw needs --weight-decay 0: ours is Adam with L2 decay, the "
                "reference AdamW decays decoupled (the same update only without decay)"
            )

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
    baseline_warmup=1,
    baseline_iters=2,
)


def parse_args() -> tuple[argparse.Namespace, TrainConfig]:
    """The command line: the common flags, then the config's; returns (args, config)."""
    p = base_parser(__doc__.splitlines()[0], default_out="runs/gpt2")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add(
        "baseline",
        action="store_true",
        help="fwd+bwd speed only: HF's model (fp32, fp16 autocast) and ours (bf16), no offload",
    )
    flags.add("fixed_batch", action="store_true", help="train on one fixed batch")
    flags.add("steps", type=int, help="optimizer steps")
    flags.add("batch", type=int, help="sequences per optimizer step")
    flags.add("seq", type=int, help="sequence length")
    flags.add("micro_batch", type=int, help="sequences per forward/backward")
    flags.add(
        "checkpoint_layers",
        type=int,
        help="blocks to recompute in backward; -1 = fewest that fit the cap (estimate)",
    )
    flags.add("grad_accumulation", choices=GRAD_ACCUMULATION_MODES)
    flags.add(
        "grad_accumulation_dtype",
        choices=sorted(ACCUMULATOR_DTYPES),
        help="dtype of the GPU gradient accumulator (bf16: half the bytes, one rounding per add)",
    )
    flags.add("lr", type=float, help="peak learning rate, after the warm-up")
    flags.add("warmup_steps", type=int, help="steps of linear lr warm-up")
    flags.add("lr_schedule", choices=LR_SCHEDULES, help="after the warm-up (cosine: to lr / 10)")
    flags.add("weight_decay", type=float)
    flags.add("dropout", type=float, help="of every GPT-2 dropout layer")
    flags.add("memory_cap_gib", type=float, help="peak GPU memory allowed")
    flags.add(
        "host_memory_cap_gib",
        type=float,
        help="resident set allowed to the process (pinned buffers included); None = no cap",
    )
    flags.add("moments", choices=MOMENT_FORMATS, help="Adam moments on the host")
    flags.add(
        "update_on",
        choices=UPDATE_LOCATIONS,
        help="where the Adam step runs; device needs --moments int8 and CUDA",
    )
    flags.add(
        "level",
        type=int,
        choices=sorted(LEVELS),
        help="GPT-2-XL preset: " + "; ".join(f"{n}: {preset}" for n, preset in LEVELS.items()),
    )
    flags.add("chunk_tokens", type=int, help="tokens per loss chunk")
    flags.add("cpu_threads", type=int, help="threads of the CPU update; None = cores - 2")
    flags.add("size", choices=sorted(SHAPES))
    flags.add("model_path", type=Path, help="local HF GPT-2 folder")
    flags.add(
        "data",
        type=Path,
        help=f"WikiText file/folder or parquet; '{GENERATED}' = synthetic; None = stdlib corpus",
    )
    flags.add("bpe_vocab", type=int, help="ids of the BPE trained on the stdlib corpus")
    flags.add("corpus_bytes", type=int, help="cap of the stdlib corpus; None = all of it")
    flags.add("cache", type=Path, help="folder of the stdlib corpus and its BPE")
    flags.add(
        "reference",
        choices=REFERENCES,
        help="adamw: after our run, the same steps with torch AdamW (fp32 + bf16 autocast)",
    )
    flags.add(
        "peer",
        choices=PEERS,
        help="torchao: torchao's CPUOffloadOptimizer on HF GPT-2 instead of ours",
    )
    flags.add("baseline_micro_batches", type=int, nargs="+")
    args = p.parse_args()
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


# ----------------------------------------------------------------------------------- inputs
def check_model_folder(cfg: TrainConfig):
    """The ``GPT2Config`` of ``--model-path`` (None without one), refusing in one line what
    ``from_pretrained`` would fail on or load wrongly: no config.json or weights, another
    model type, another shape than ``--size``, ``--seq`` beyond its positions, missing weights
    (which Hugging Face would initialize at random with only a warning)."""
    from transformers import GPT2Config

    folder = cfg.model_path
    if folder is None:
        return None
    if not folder.is_dir():
        raise UsageError(f"--model-path: {folder} is not a folder (expected {MODEL_FOLDER})")
    config_file = folder / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(
            f"--model-path: {folder} has no config.json (expected {MODEL_FOLDER})"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(
            f"--model-path: {config_file} is not a readable JSON config ({e})"
        ) from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type != "gpt2":
        raise UsageError(
            f"--model-path: {config_file} has model_type {model_type!r}, expected 'gpt2'"
        )
    try:
        config = GPT2Config.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--model-path: {config_file}: not a GPT-2 config ({e})") from None
    shape = SHAPES[cfg.size]
    found = {k: getattr(config, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size")}
    if found != {k: getattr(shape, k) for k in found}:
        sizes = [name for name, s in SHAPES.items() if found == {k: getattr(s, k) for k in found}]
        hint = f"give --size {sizes[0]}" if sizes else f"--size is one of {sorted(SHAPES)}"
        raise UsageError(
            f"--model-path: {config_file} describes {found}, not --size {cfg.size} ({hint})"
        )
    if cfg.seq > config.n_positions:
        raise UsageError(
            f"--seq {cfg.seq} exceeds the {config.n_positions} positions of {config_file}"
        )
    missing = expected_weights(config) - checkpoint_weights(folder)
    if missing:
        raise UsageError(
            f"--model-path: the weights in {folder} lack {len(missing)} tensors of GPT-2 "
            f"(e.g. {sorted(missing)[0]})"
        )
    return config


def _weight_name(key: str) -> str:
    """A checkpoint key without the ``transformer.`` prefix (hub checkpoints omit it)."""
    return key.removeprefix("transformer.")


def expected_weights(config) -> set[str]:
    """Names of the tensors a GPT-2 of ``config`` loads (the tied LM head excluded)."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        names = GPT2LMHeadModel(config).state_dict().keys()
    tied = config.tie_word_embeddings
    return {_weight_name(k) for k in names if not (tied and k == "lm_head.weight")}


def checkpoint_weights(folder: Path) -> set[str]:
    """Names of the tensors stored in ``folder`` (read from headers, no weights loaded)."""
    from safetensors import SafetensorError, safe_open

    present = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        raise UsageError(f"--model-path: {folder} has no weights (expected {MODEL_FOLDER})")
    path = present[0]
    try:
        if path.name.endswith(".index.json"):
            keys = json.loads(path.read_text(encoding="utf-8"))["weight_map"].keys()
        elif path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                keys = list(f.keys())
        else:
            keys = torch.load(path, map_location="meta", weights_only=True, mmap=True).keys()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError,
            SafetensorError, json.JSONDecodeError) as e:  # fmt: skip
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"--model-path: cannot read the weights {path} ({msg})") from None
    return {_weight_name(k) for k in keys}


def load_model(cfg: TrainConfig, fast_gelu: bool = True) -> torch.nn.Module:
    """The GPT-2 to train, fp32 on the CPU: random init for ``--size`` (drawn from the torch
    seed of the moment), or ``--model-path``'s weights; every dropout layer at ``--dropout``."""
    from safetensors import SafetensorError

    config = gpt2_config(cfg.size, fast_gelu=fast_gelu, dropout=cfg.dropout)
    try:
        model = build_gpt2(config, cfg.model_path, fast_gelu=fast_gelu)
    except (OSError, SafetensorError) as e:  # e.g. weights truncated past their header
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"--model-path: cannot load {cfg.model_path} ({msg})") from None
    for module in model.modules():  # a pretrained config brings its own rates
        if isinstance(module, torch.nn.Dropout):
            module.p = cfg.dropout
    return model


def initial_model(cfg: TrainConfig, seed: int, fast_gelu: bool = True) -> torch.nn.Module:
    """:func:`load_model` with the torch seed set to ``seed`` first: every run of one
    invocation (ours, the reference) starts from the same weights."""
    torch.manual_seed(seed)
    return load_model(cfg, fast_gelu)


def model_tokenizer(cfg: TrainConfig) -> str:
    """What :func:`text_stream` tokenizes with, given ``--model-path`` (or none): the folder's
    ``tokenizer.json``, else the UTF-8 bytes."""
    folder = cfg.model_path
    return str(folder) if folder and (folder / "tokenizer.json").is_file() else "utf-8 bytes"


def make_batches(
    cfg: TrainConfig, vocab: int, seed: int
) -> tuple[list[torch.Tensor], dict[str, str]]:
    """One (batch, seq) int64 tensor per step (the same one with --fixed-batch), and the names
    of the data and tokenizer for the records: the stdlib corpus by default
    (:func:`effdl.data.stdlib_text.stdlib_training_text`: with ``--model-path``, read by the
    folder's tokenizer, ``<bos>`` kept between documents when it has that token), the synthetic
    stream for ``--data generated``, else ``--data`` read as the other scripts read it (checked
    in full)."""
    if cfg.data is None:
        try:
            text = stdlib_training_text(cfg.cache, cfg.bpe_vocab, cfg.corpus_bytes, cfg.model_path)
        except CorpusFormatError as e:  # the folder's tokenizer.json does not load
            raise UsageError(f"--model-path: {e}") from None
        tokenizer = model_tokenizer(cfg) if cfg.model_path else text.tokenizer_dir.name
        names = {"data": text.name, "tokenizer": tokenizer}
        stream = functools.partial(
            text_stream, text.docs, vocab=vocab, tokenizer_dir=text.tokenizer_dir,
            source=text.name, bos_id=text.bos_id,
        )  # fmt: skip
    elif cfg.synthetic:
        stream = functools.partial(synthetic_stream, vocab=vocab, seed=seed)
        names = {"data": "synthetic", "tokenizer": "none"}
    else:
        try:
            lines = read_wikitext(cfg.data)
        except CorpusFormatError as e:
            raise UsageError(f"--data: {e}") from None
        if not lines:
            raise UsageError(f"--data: {cfg.data} holds no non-empty text")
        stream = functools.partial(
            text_stream, lines, vocab=vocab, tokenizer_dir=cfg.model_path, source=cfg.data
        )
        names = {"data": str(cfg.data), "tokenizer": model_tokenizer(cfg)}
    try:
        batches = step_batches(stream, cfg.steps, cfg.batch, cfg.seq, fixed=cfg.fixed_batch)
    except CorpusFormatError as e:
        raise UsageError(f"--data: {e}") from None
    return batches, names


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of ``step`` (0-based): ``lr * (step + 1) / warmup_steps`` during the
    warm-up, then ``lr`` (constant) or a cosine from ``lr`` down to ``lr / 10`` at the last step."""
    if cfg.lr_schedule == "constant" and step >= cfg.warmup_steps:
        return cfg.lr
    return warmup_cosine_lr(step, cfg.lr, cfg.lr / 10, cfg.warmup_steps, cfg.steps)


def set_lr(opt, lr: float) -> None:
    """Give every parameter group of ``opt`` the learning rate ``lr``."""
    for group in opt.param_groups:
        group["lr"] = lr


# ----------------------------------------------------------------------------------- baseline
BASELINE_COLUMNS = ("micro_batch", "seq_per_s", "peak_gib")


def time_fwd_bwd(
    model: torch.nn.Module,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    cfg: TrainConfig,
    micro_batch: int,
    device: torch.device,
) -> dict | None:
    """Metrics of one micro-batch's fwd+bwd (``loss_of(ids)`` then backward); None when it runs
    out of memory."""
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, cfg.seq), device=device)

    def fwd_bwd() -> None:
        loss_of(ids).backward()

    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        stats = benchmark(
            fwd_bwd,
            warmup=cfg.baseline_warmup,
            iters=cfg.baseline_iters,
            device=device,
            setup=lambda: model.zero_grad(set_to_none=True),
        )
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return None
    peak = gpu_peak_gib(device)
    return {
        "micro_batch": micro_batch,
        "seq_per_s": micro_batch / stats.median,
        "peak_gib": peak,
        **stats.as_dict("fwd_bwd_s_"),
    }


def hf_loss(model: torch.nn.Module, ids: torch.Tensor, amp_dtype: torch.dtype) -> torch.Tensor:
    """Hugging Face's own loss (full logits) under autocast."""
    with torch.autocast(ids.device.type, dtype=amp_dtype):
        return model(ids, labels=ids).loss


def baseline_models(cfg: TrainConfig, device: torch.device):
    """(variant, model, loss_of, amp, weights) of each baseline: Hugging Face's model as shipped
    (fp32 weights, gelu_new) under fp16 autocast, and ours as the offloaded run computes (bf16
    weights, tanh GELU, the chunked loss) without the offload, the cap or checkpointing."""
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    hf = load_model(cfg, fast_gelu=False)
    hf.to(device).train()
    yield (
        "baseline",
        hf,
        functools.partial(hf_loss, hf, amp_dtype=amp_dtype),
        str(amp_dtype),
        "fp32",
    )
    del hf
    own = load_model(cfg).to(device, torch.bfloat16).train()
    own_loss = functools.partial(lm_loss, own, chunk_tokens=cfg.chunk_tokens)
    yield "baseline_own", own, own_loss, "none", "bf16"


def run_baseline(cfg: TrainConfig, device: torch.device, log: RunLog) -> list[dict]:
    """Forward+backward speed of each baseline model at every micro-batch size, and the best."""
    rows = []
    for variant, model, loss_of, amp, weights in baseline_models(cfg, device):
        found = []
        for mb in cfg.baseline_micro_batches:
            metrics = time_fwd_bwd(model, loss_of, cfg, mb, device)
            if metrics is None:
                found.append({"micro_batch": mb, "seq_per_s": float("nan"), "note": "OOM"})
                continue
            config = {"size": cfg.size, "seq": cfg.seq, "micro_batch": mb, "amp": amp,
                      "weights": weights}  # fmt: skip
            log.log(variant, config, metrics)
            found.append({k: metrics[k] for k in BASELINE_COLUMNS})
        ok = [r for r in found if not math.isnan(r["seq_per_s"])]
        if not ok:
            raise RuntimeError(f"{variant}: every micro-batch size ran out of memory")
        best = max(ok, key=lambda r: r["seq_per_s"])
        log.log(f"{variant}_best", {"size": cfg.size, "seq": cfg.seq}, best)
        rows += [{"variant": variant, **r} for r in found]
        del model, loss_of
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------- ours
def resolve_cpu_threads(requested: int | None) -> int:
    """Threads for the CPU update: as requested, or all cores but two (left to data and launch)."""
    return requested or max(1, (os.cpu_count() or 2) - 2)


def set_memory_cap(device: torch.device, cap_gib: float) -> float:
    """Enforce the cap with the caching allocator; returns the fraction set."""
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    frac = min(1.0, cap_gib / total)
    torch.cuda.set_per_process_memory_fraction(frac, device)
    return frac


def measure_activation_bytes(
    model: torch.nn.Module, opt: CPUOffloadAdam, device: torch.device, cfg: TrainConfig
) -> float:
    """Bytes autograd keeps per token per block, measured on one sequence with no block
    checkpointed (also a warm-up); the gradients it makes are discarded."""
    ids = torch.randint(0, model.config.vocab_size, (1, cfg.seq), device=device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    loss = lm_loss(model, ids, cfg.chunk_tokens)
    held = torch.cuda.memory_allocated(device) - before
    # the loss function keeps its fp32 LM-head gradient and the hidden-state gradient
    held -= model.lm_head.weight.numel() * 4 + cfg.seq * model.config.n_embd * 2
    opt.backward(loss)
    opt.zero_grad()
    return held / (cfg.seq * model.config.n_layer)


def pick_checkpoint_layers(
    cfg: TrainConfig, n_params: int, act_bytes: float | None, optimizer_gib: float
) -> int:
    """``--checkpoint-layers`` if given, else the fewest blocks whose estimate (weights,
    activations, loss chunk) fits the cap less ``optimizer_gib`` (:func:`optimizer_gpu_gib`)."""
    if cfg.checkpoint_layers >= 0:
        return cfg.checkpoint_layers
    n = fewest_checkpointed_blocks(
        SHAPES[cfg.size], n_params, cfg.micro_batch, cfg.seq, WITHOUT_OPTIMIZER_BUFFERS,
        cfg.memory_cap_gib - optimizer_gib, cfg.chunk_tokens, act_bytes_per_token_layer=act_bytes,
    )  # fmt: skip
    if n is None:
        raise UsageError(
            f"--micro-batch {cfg.micro_batch}: does not fit {cfg.memory_cap_gib} GiB even with "
            "every block checkpointed; use a smaller micro-batch"
        )
    return n


def run_config(
    cfg: TrainConfig, n_params: int, ckpt: int, threads: int, data: dict[str, str]
) -> dict:
    """The ``config`` of every record of an offloaded run (``data``: :func:`make_batches`'s
    names of the data set and tokenizer)."""
    return {
        "size": cfg.size,
        "n_params": n_params,
        "seq": cfg.seq,
        "batch": cfg.batch,
        "micro_batch": cfg.micro_batch,
        "n_micro": cfg.batch // cfg.micro_batch,
        "checkpoint_layers": ckpt,
        "grad_accumulation": cfg.grad_accumulation,
        "grad_accumulation_dtype": cfg.grad_accumulation_dtype,
        "lr": cfg.lr,
        "warmup_steps": cfg.warmup_steps,
        "lr_schedule": cfg.lr_schedule,
        "dropout": cfg.dropout,
        "cpu_threads": threads,
        "memory_cap_gib": cfg.memory_cap_gib,
        "host_memory_cap_gib": cfg.host_memory_cap_gib,
        "cuda_alloc_conf": os.environ.get(ALLOC_CONF, ""),
        "moments": cfg.moments,
        "update_on": cfg.update_on,
        "level": cfg.level,
        "chunk_tokens": cfg.chunk_tokens,
        **data,
        "pretrained": cfg.model_path is not None,
    }


def largest_buckets(param_numels: list[int]) -> list[int]:
    """Upper bounds of the :data:`DEVICE_BUCKETS_IN_FLIGHT` largest optimizer buckets: a tensor
    larger than :data:`BUCKET_NUMEL` gets a bucket of its own, the others share full ones."""
    biggest = sorted(param_numels, reverse=True)[:DEVICE_BUCKETS_IN_FLIGHT]
    return [max(BUCKET_NUMEL, n) for n in biggest]


def device_update_scratch_bytes(buckets: list[int], cfg: TrainConfig) -> int:
    """Device bytes ``update_on="device"`` adds at most (the offload module's count): the
    scratch of the buckets in flight, ``buckets`` values each (fp32 masters, int8 moments with
    their absmaxes, fp32 gradients when they come from the host), and the temporaries of one
    chunk of the 8-bit step (with a bf16 accumulator, its chunk read as fp32 too)."""
    per_value = 4 + 2 + (4 if cfg.grad_accumulation == "cpu" else 0)
    scratch = sum(n * per_value + 2 * num_blocks(n) * 4 for n in buckets)
    step_per_value = DEVICE_STEP_BYTES_PER_VALUE + (
        DEVICE_STEP_BF16_GRAD_BYTES_PER_VALUE if cfg.grad_accumulation_dtype == "bf16" else 0
    )
    return scratch + step_per_value * DEVICE_CHUNK_BLOCKS * BLOCK_SIZE


def state_placement(n_params: int, buckets: list[int], cfg: TrainConfig) -> list[dict]:
    """What the training state is, where it lives and its bytes, as the optimizer allocates it
    on a CUDA run (``n_params`` parameters; alignment padding left out): one row per buffer
    with ``state``, ``where`` (gpu or host), ``dtype``, ``bytes``."""
    n = n_params
    int8 = cfg.moments == "int8"
    on_device = cfg.update_on == "device"
    gpu_accumulates = cfg.grad_accumulation == "gpu"
    moment_dtype, moment_bytes = (
        ("uint8 + fp32 absmax", quantized_nbytes(n)) if int8 else ("fp32", 4 * n)
    )
    # the host gradient buffer sums in fp32 ("cpu") or receives the GPU accumulator as it is
    acc_dtype = cfg.grad_accumulation_dtype if gpu_accumulates else "fp32"
    acc_bytes = ACCUMULATOR_DTYPES[acc_dtype].itemsize * n
    rows = [
        ("working_weights", "gpu", "bf16", 2 * n),
        ("master_weights", "host", "fp32", 4 * n),
        ("exp_avg", "host", moment_dtype, moment_bytes),
        ("exp_avg_sq", "host", moment_dtype, moment_bytes),
        ("grad_accumulation", "gpu", acc_dtype, acc_bytes if gpu_accumulates else 0),
        ("grad", "host", acc_dtype, 0 if on_device and gpu_accumulates else acc_bytes),
        ("grad_stage", "host", "bf16", 0 if gpu_accumulates else 2 * n),
        ("weight_stage", "host", "bf16", 0 if on_device else 2 * n),
        ("device_update_scratch", "gpu", "fp32 + uint8",
         device_update_scratch_bytes(buckets, cfg) if on_device else 0),
    ]  # fmt: skip
    return [{"state": s, "where": w, "dtype": d, "bytes": b} for s, w, d, b in rows if b]


def placed_gib(state: list[dict], where: str) -> float:
    """GiB of the ``state_placement`` rows that live ``where``."""
    return sum(r["bytes"] for r in state if r["where"] == where) / GIB


def optimizer_gpu_rows(state: list[dict]) -> dict[str, float]:
    """GiB of the optimizer's own GPU buffers by ``state_placement`` row: the gradient
    accumulator in its dtype and the device update's scratch (what memory_budget is not given)."""
    return {
        r["state"]: r["bytes"] / GIB
        for r in state
        if r["where"] == "gpu" and r["state"] != "working_weights"
    }


def optimizer_gpu_gib(state: list[dict]) -> float:
    """GiB of :func:`optimizer_gpu_rows` together."""
    return sum(optimizer_gpu_rows(state).values())


def gpu_estimate(
    cfg: TrainConfig, n_params: int, ckpt: int, act_bytes: float | None, state: list[dict]
) -> dict[str, float]:
    """GiB the GPU holds, by row: memory_budget's working weights, activations and loss chunk
    (``ckpt`` blocks checkpointed), then :func:`optimizer_gpu_rows`, and ``total``."""
    rows = memory_budget(
        SHAPES[cfg.size], n_params, cfg.micro_batch, cfg.seq, ckpt, WITHOUT_OPTIMIZER_BUFFERS,
        cfg.chunk_tokens, act_bytes_per_token_layer=act_bytes,
    )  # fmt: skip
    rows = {k: v for k, v in rows.items() if k not in ("grad_accumulation_fp32", "total")}
    rows.update(optimizer_gpu_rows(state))
    return {**rows, "total": sum(rows.values())}


def log_budget(
    log: RunLog,
    cfg: TrainConfig,
    config: dict,
    state: list[dict],
    measured: dict[str, float],
    act_bytes: float | None,
) -> dict:
    """The ``memory_budget`` record: the state's placement, the GPU estimate
    (:func:`gpu_estimate`) and the host state, beside what was measured after set-up; returns
    its metrics."""
    gpu = gpu_estimate(cfg, config["n_params"], config["checkpoint_layers"], act_bytes, state)
    metrics = {
        **{f"gpu_{k}_gib": v for k, v in gpu.items()},
        **{f"host_{r['state']}_gib": r["bytes"] / GIB for r in state if r["where"] == "host"},
        "host_total_gib": placed_gib(state, "host"),
        "state": state,
        **measured,
        "measured_act_bytes_per_token_layer": act_bytes if act_bytes else math.nan,
        "estimated_act_bytes_per_token_layer": ACT_BYTES_PER_TOKEN_LAYER * SHAPES[cfg.size].n_embd,
    }
    log.log("memory_budget", config, metrics)
    return metrics


def gpu_peak_gib(device: torch.device) -> float:
    """``torch.cuda.max_memory_allocated`` in GiB (``nan`` off CUDA)."""
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else math.nan


def host_rss_gib() -> float:
    """The process's resident set now (pinned host buffers included), in GiB."""
    return psutil.Process().memory_info().rss / GIB


def host_rss_high_water_gib() -> float:
    """The kernel's high-water mark of the process's resident set since it started, in GiB
    (it also sees the peaks between two samples of :func:`host_rss_gib`)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB  # bytes vs KiB


def check_memory_caps(cfg: TrainConfig, when: str, peak_gib: float, rss_gib: float) -> None:
    """Raise :class:`MemoryCapExceeded` naming the cap and the measurement if GPU peak
    (``nan`` off CUDA) or host resident set passed its cap."""
    if peak_gib > cfg.memory_cap_gib:
        raise MemoryCapExceeded(
            f"{when}: peak GPU memory {peak_gib:.3f} GiB (torch.cuda.max_memory_allocated) "
            f"exceeds --memory-cap-gib {cfg.memory_cap_gib}"
        )
    cap = cfg.host_memory_cap_gib
    if cap is not None and rss_gib > cap:
        raise MemoryCapExceeded(
            f"{when}: host resident set {rss_gib:.3f} GiB exceeds --host-memory-cap-gib {cap}"
        )


def start_step(device: torch.device) -> float:
    """The start of a timed step: the GPU's peak memory statistic reset, the clock read."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return time.perf_counter()


def step_metrics(
    cfg: TrainConfig, device: torch.device, t0: float, losses: list[torch.Tensor], lr: float
) -> dict:
    """What every timed step records, ours or another optimizer's: the summed micro-batch
    ``losses`` (read once: the step's one sync, after the optimizer's work was queued), wall time
    since ``t0``, sequences per second, peak GPU memory, the host's resident set, the lr."""
    loss_value = float(torch.stack(losses).sum())
    wall = time.perf_counter() - t0
    peak_gib = gpu_peak_gib(device)
    return {
        "loss": loss_value,
        "lr": lr,
        "step_s": wall,
        "seq_per_s": cfg.batch / wall,
        "peak_gib": peak_gib,
        "host_rss_gib": host_rss_gib(),
    }


def train_step(
    model: torch.nn.Module,
    opt: CPUOffloadAdam,
    batch: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
    lr: float,
) -> dict:
    """One optimizer step at ``lr`` over ``batch`` in micro-batches; :func:`step_metrics` and the
    timeline totals."""
    n_micro = cfg.batch // cfg.micro_batch
    opt.timeline.reset()
    set_lr(opt, lr)  # before the final backward: buckets are updated inside it
    t0 = start_step(device)
    losses = []
    for i, mb in enumerate(batch.split(cfg.micro_batch)):
        start = opt.timeline.mark()
        loss = lm_loss(model, mb.to(device, non_blocking=True), cfg.chunk_tokens) / n_micro
        opt.backward(loss, final=i == n_micro - 1)
        opt.timeline.add("gpu_compute", i, start, opt.timeline.mark())
        losses.append(loss.detach())
    t_step = time.perf_counter()
    opt.step()
    opt.timeline.add("step_wait", -1, t_step, time.perf_counter())
    metrics = step_metrics(cfg, device, t0, losses, lr)
    totals = opt.timeline.totals()
    return {**metrics, **{f"{kind}_s": totals.get(kind, 0.0) for kind in TIMELINE_KINDS}}


def plain_step(
    opt: torch.optim.Optimizer,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    batch: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
    lr: float,
) -> dict:
    """One step of an optimizer that steps after backward (torch's AdamW, torchao's offload):
    the same micro-batches as :func:`train_step`, gradients summed in ``.grad``, then
    ``opt.step()`` at ``lr``; :func:`step_metrics`."""
    t0 = start_step(device)
    losses = backward_micro_batches(loss_of, batch, cfg.micro_batch, device)
    set_lr(opt, lr)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return step_metrics(cfg, device, t0, losses, lr)


def run_offload(
    cfg: TrainConfig,
    batches: list[torch.Tensor],
    device: torch.device,
    log: RunLog,
    seed: int,
    data: dict[str, str],
) -> tuple[list[dict], dict, dict]:
    """Train on ``batches`` with CPUOffloadAdam under the memory caps from the weights of
    ``seed``; one record per step, then a summary (returns the step metrics, the summary's and
    the records' config).
    Both caps are checked after set-up (before any record) and after every step (before its
    record): past one, :class:`MemoryCapExceeded`."""
    cuda = device.type == "cuda"
    if cuda:
        set_memory_cap(device, cfg.memory_cap_gib)
    threads = resolve_cpu_threads(cfg.cpu_threads)
    model = initial_model(cfg, seed).train()
    n_params = count_params(model)
    buckets = largest_buckets([p.numel() for p in model.parameters()])
    opt = CPUOffloadAdam(
        model.parameters(),
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        device=device,
        working_dtype=torch.bfloat16,
        grad_accumulation=cfg.grad_accumulation,
        grad_accumulation_dtype=ACCUMULATOR_DTYPES[cfg.grad_accumulation_dtype],
        bucket_numel=BUCKET_NUMEL,
        num_threads=threads,
        moments=cfg.moments,
        update_on=cfg.update_on,
    )
    model.to(device)  # buffers; parameters are already bf16 working copies on the device
    static_gib = torch.cuda.memory_allocated(device) / GIB if cuda else math.nan
    act_bytes = measure_activation_bytes(model, opt, device, cfg) if cuda else None
    setup_peak = gpu_peak_gib(device)
    rss_peak = host_rss_gib()
    check_memory_caps(cfg, "after set-up", setup_peak, rss_peak)
    state = state_placement(n_params, buckets, cfg)
    ckpt = pick_checkpoint_layers(cfg, n_params, act_bytes, optimizer_gpu_gib(state))
    checkpoint_blocks(model, ckpt)
    opt.timeline.enabled = True
    config = run_config(cfg, n_params, ckpt, threads, data)
    measured = {
        "measured_static_gib": static_gib,
        "measured_setup_host_rss_gib": rss_peak,
        "measured_moment_gib": opt.moment_nbytes() / GIB,
    }
    budget = log_budget(log, cfg, config, state, measured, act_bytes)
    variant = "fixed_batch" if cfg.fixed_batch else "corpus"
    rows = []
    for step, batch in enumerate(tqdm(batches, desc=variant, unit="step")):
        metrics = {"step": step, **train_step(model, opt, batch, cfg, device, lr_at(step, cfg))}
        rss_peak = max(rss_peak, metrics["host_rss_gib"])
        metrics["host_rss_peak_gib"] = rss_peak
        check_memory_caps(cfg, f"step {step}", metrics["peak_gib"], metrics["host_rss_gib"])
        if step == len(batches) - 1:
            metrics["timeline"] = opt.timeline.spans()
        log.log(variant, config, metrics)
        rows.append(metrics)
    opt.close()
    summary = summarize(rows, cfg.fixed_batch, budget)
    log.log(f"{variant}_summary", config, summary)
    return rows, summary, config


def median(values: list[float]) -> float:
    """The upper median (a measured value, not an average of two)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def speed_summary(rows: list[dict], fixed_batch: bool) -> dict:
    """What every run's summary holds: median speed and step time past the first step (it pays
    the warm-up), peak GPU memory and host resident set, loss drop."""
    timed = rows[1:] or rows
    first, last = rows[0]["loss"], rows[-1]["loss"]
    metrics = {
        "steps": len(rows),
        "seq_per_s_median": median([r["seq_per_s"] for r in timed]),
        "step_s_median": median([r["step_s"] for r in timed]),
        "peak_gib_max": max(r["peak_gib"] for r in rows),
        "host_rss_peak_gib": max(r["host_rss_gib"] for r in rows),
        "host_rss_high_water_gib": host_rss_high_water_gib(),
        "loss_first": first,
        "loss_last": last,
        "loss_drop": 1.0 - last / first,
    }
    if fixed_batch:
        metrics["loss_halved"] = last <= 0.5 * first
    return metrics


def summarize(rows: list[dict], fixed_batch: bool, budget: dict) -> dict:
    """:func:`speed_summary` with the step time split's medians, the host resident set's peak
    since set-up, and the budget's totals beside the measured peaks."""
    timed = rows[1:] or rows
    return {
        **speed_summary(rows, fixed_batch),
        **{f"{k}_s_median": median([r[f"{k}_s"] for r in timed]) for k in TIMELINE_KINDS},
        "gpu_budget_gib": budget["gpu_total_gib"],
        "host_rss_peak_gib": rows[-1]["host_rss_peak_gib"],
        "host_budget_gib": budget["host_total_gib"],
        "state": budget["state"],
    }


# ----------------------------------------------------------------------------------- others
def run_plain(
    variant: str,
    opt: torch.optim.Optimizer,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    batches: list[torch.Tensor],
    cfg: TrainConfig,
    device: torch.device,
    log: RunLog,
    config: dict,
    capped: bool,
) -> list[dict]:
    """Train on ``batches`` with :func:`plain_step`, one ``variant`` record per step and a
    ``<variant>_summary`` (:func:`speed_summary`); with ``capped``, both memory caps are checked
    after every step, before its record, as in our run."""
    rows = []
    for step, batch in enumerate(tqdm(batches, desc=variant, unit="step")):
        metrics = {"step": step, **plain_step(opt, loss_of, batch, cfg, device, lr_at(step, cfg))}
        if capped:
            check_memory_caps(cfg, f"step {step}", metrics["peak_gib"], metrics["host_rss_gib"])
        log.log(variant, config, metrics)
        rows.append(metrics)
    log.log(f"{variant}_summary", config, speed_summary(rows, cfg.fixed_batch))
    return rows


def autocast_lm_loss(model: torch.nn.Module, ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Our chunked loss under bf16 autocast (fp32 weights, bf16 matmuls)."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        return lm_loss(model, ids, chunk_tokens)


def run_reference(
    cfg: TrainConfig,
    batches: list[torch.Tensor],
    device: torch.device,
    log: RunLog,
    seed: int,
    config: dict,
    betas: tuple[float, float] = (0.9, 0.999),
) -> list[dict]:
    """The same model from the same initial weights (``seed``) trained on ``batches`` by
    ``torch.optim.AdamW(fused=True)``: fp32 weights on ``device``, bf16 autocast, no memory cap
    and no checkpointing, the same micro-batches and learning rates as ours, ``betas`` as ours
    by default (records ``reference_adamw``)."""
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    model = initial_model(cfg, seed).to(device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay, fused=True
    )
    loss_of = functools.partial(autocast_lm_loss, model, chunk_tokens=cfg.chunk_tokens)
    ref_config = {**config, "optimizer": "torch.optim.AdamW(fused=True)", "weights": "fp32",
                  "amp": "bf16", "checkpoint_layers": 0, "memory_cap_gib": None}  # fmt: skip
    return run_plain("reference_adamw", opt, loss_of, batches, cfg, device, log, ref_config, False)


def equivalence_summary(ours: list[dict], reference: list[dict]) -> dict:
    """Both loss curves, their |gap| per step with its mean and max, each run's fall
    (1 - last / first), and the pass flags against :data:`MAX_MEAN_GAP_NATS` and
    :data:`MIN_FALL`."""
    loss_ours = [r["loss"] for r in ours]
    loss_ref = [r["loss"] for r in reference]
    gap = [abs(a - b) for a, b in zip(loss_ours, loss_ref, strict=True)]
    fall_ours = 1.0 - loss_ours[-1] / loss_ours[0]
    fall_ref = 1.0 - loss_ref[-1] / loss_ref[0]
    mean_gap = sum(gap) / len(gap)
    gap_ok, fall_ok = mean_gap <= MAX_MEAN_GAP_NATS, min(fall_ours, fall_ref) >= MIN_FALL
    return {
        "steps": len(gap),
        "lr": [r["lr"] for r in ours],
        "loss_ours": loss_ours,
        "loss_reference": loss_ref,
        "abs_gap": gap,
        "mean_abs_gap": mean_gap,
        "max_abs_gap": max(gap),
        "fall_ours": fall_ours,
        "fall_reference": fall_ref,
        "max_mean_gap_nats": MAX_MEAN_GAP_NATS,
        "min_fall": MIN_FALL,
        "gap_ok": gap_ok,
        "fall_ok": fall_ok,
        "passed": gap_ok and fall_ok,
    }


def import_torchao_offload():
    """torchao's ``CPUOffloadOptimizer`` class and torchao's version; :class:`UsageError`
    naming the package when it is not installed."""
    try:
        import torchao
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        raise UsageError(TORCHAO_MISSING) from None
    return CPUOffloadOptimizer, torchao.__version__


def run_torchao_peer(
    cfg: TrainConfig,
    batches: list[torch.Tensor],
    device: torch.device,
    log: RunLog,
    seed: int,
    data: dict[str, str],
) -> tuple[list[dict], dict]:
    """torchao's ``CPUOffloadOptimizer`` (AdamW, fused, on the CPU) training Hugging Face's
    ``GPT2LMHeadModel`` (``gelu_new``, its own full-logits loss) with fp32 weights and
    gradients on the GPU, bf16 autocast and gradient checkpointing in every block, on
    ``batches`` in our micro-batches, under our caps set the same way; records ``torchao``
    per step and ``torchao_summary`` (returns the step metrics and the summary's)."""
    offload_class, version = import_torchao_offload()
    if device.type == "cuda":
        set_memory_cap(device, cfg.memory_cap_gib)
    model = initial_model(cfg, seed, fast_gelu=False).to(device).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = offload_class(
        model.parameters(), torch.optim.AdamW, lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    check_memory_caps(cfg, "after set-up", gpu_peak_gib(device), host_rss_gib())
    config = {
        "size": cfg.size, "n_params": count_params(model), "seq": cfg.seq, "batch": cfg.batch,
        "micro_batch": cfg.micro_batch, "n_micro": cfg.batch // cfg.micro_batch,
        "checkpoint_layers": SHAPES[cfg.size].n_layer, "lr": cfg.lr,
        "warmup_steps": cfg.warmup_steps, "lr_schedule": cfg.lr_schedule, "dropout": cfg.dropout,
        "cpu_threads": torch.get_num_threads(), "memory_cap_gib": cfg.memory_cap_gib,
        "host_memory_cap_gib": cfg.host_memory_cap_gib, **data,
        "pretrained": cfg.model_path is not None,
        "optimizer": f"torchao {version} CPUOffloadOptimizer(AdamW fused)", "weights": "fp32",
        "amp": "bf16",
    }  # fmt: skip
    loss_of = functools.partial(hf_loss, model, amp_dtype=torch.bfloat16)
    rows = run_plain("torchao", opt, loss_of, batches, cfg, device, log, config, True)
    return rows, speed_summary(rows, cfg.fixed_batch)


def main() -> None:
    args, cfg = parse_args()
    # Before CUDA starts: without it the cap counts memory reserved between segments.
    use_expandable_segments()
    # Every input is checked before the log is opened: a refused run leaves no record.
    model_config = check_model_folder(cfg) or gpt2_config(cfg.size)
    if cfg.peer == "torchao":
        import_torchao_offload()
    if cfg.baseline:
        batches, data = None, None
    else:
        batches, data = make_batches(cfg, model_config.vocab_size, args.seed)
    run = start_run(args, task=TASK, logs="gpt2.jsonl")
    if cfg.update_on == "device" and run.device.type != "cuda" and not cfg.baseline:
        raise UsageError(
            f"--update-on device runs the 8-bit Adam step on the GPU: it needs --device cuda "
            f"(this run is on {run.device})"
        )
    if cfg.baseline:
        rows = run_baseline(cfg, run.device, run.log)
        print_table(rows, title=f"Baseline fwd+bwd on {run.where} (log: {run.log.path})")
        return
    if cfg.peer == "torchao":
        rows, summary = run_torchao_peer(cfg, batches, run.device, run.log, args.seed, data)
        table = [{k: r[k] for k in PLAIN_COLUMNS} for r in rows]
        print_table(table, title=f"torchao CPUOffloadOptimizer on {run.where} ({data['data']})")
        print(f"{summary['seq_per_s_median']:.2f} seq/s, peak {summary['peak_gib_max']:.3f} GiB")
        return
    rows, summary, config = run_offload(cfg, batches, run.device, run.log, args.seed, data)
    table = [{k: r[k] for k in TABLE_COLUMNS} for r in rows]
    print_table(table, title=f"CPU-offloaded Adam on {run.where} (log: {run.log.path})")
    state = [{**r, "gib": r["bytes"] / GIB} for r in summary["state"]]
    print_table(state, title="Training state: where it lives (computed)")
    print(
        f"GPU: peak {summary['peak_gib_max']:.3f} GiB measured, {summary['gpu_budget_gib']:.3f} "
        f"GiB estimated; host: resident set peak {summary['host_rss_peak_gib']:.3f} GiB "
        f"measured, state {summary['host_budget_gib']:.3f} GiB computed"
    )
    if cfg.fixed_batch:
        drop = 1.0 - rows[-1]["loss"] / rows[0]["loss"]
        print(f"fixed batch: loss fell by {drop:.1%} in {len(rows)} steps (target >= 50%)")
    if cfg.reference == "adamw":
        reference = run_reference(cfg, batches, run.device, run.log, args.seed, config)
        eq = equivalence_summary(rows, reference)
        run.log.log("equivalence", config, eq)
        table = [{"step": r["step"], "lr": r["lr"], "ours": r["loss"], "reference": ref["loss"],
                  "gap": gap} for r, ref, gap in zip(rows, reference, eq["abs_gap"], strict=True)]  # fmt: skip
        print_table(table, title=f"Equivalence with torch AdamW ({data['data']})")
        print(
            f"mean |gap| {eq['mean_abs_gap']:.4f} nats (max {eq['max_abs_gap']:.4f}; target <= "
            f"{MAX_MEAN_GAP_NATS}); fall ours {eq['fall_ours']:.1%}, reference "
            f"{eq['fall_reference']:.1%} (target >= {MIN_FALL:.0%}): "
            f"{'PASS' if eq['passed'] else 'FAIL'}"
        )


if __name__ == "__main__":
    run_main(main)
