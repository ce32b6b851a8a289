"""Pretrain GPT-2 on the stdlib corpus: the starting weights of train.py and finetune_code.py.

From random init, 30 steps on one fixed batch take the loss only down to the batch's unigram
entropy (``probes/fixed_batch_lr_sweep.py`` logs both): a model that knows no context cannot
memorize faster. A few minutes of pretraining give one that does.

    python memory_efficient_gpt2/pretrain.py --quick                      # CPU smoke run, tiny GPT-2
    python memory_efficient_gpt2/pretrain.py --device cuda --minutes 4.5 --save /tmp/ckpt
    python memory_efficient_gpt2/train.py --device cuda --model-path /tmp/ckpt --fixed-batch --steps 30 --reference adamw
    python memory_efficient_gpt2/pretrain.py --device cuda --corpus docs --size xl --batch 16 --skip-tokens 16384 --steps 40 --warmup-steps 4 --save /tmp/xl-docs

Data (``--corpus stdlib``, the default): the token stream train.py reads by default
(effdl.data.stdlib_text.stdlib_training_text: the stdlib corpus's training half, documentation
and source, its byte-level BPE of ``--bpe-vocab`` ids, ``<bos>`` before every document; the
same ``--cache`` and ``--corpus-bytes``). train.py's ``--fixed-batch`` is the first ``batch x
seq`` tokens of that stream; the first ``--skip-tokens`` tokens (default: that batch at
train.py's default ``--batch`` and ``--seq``, also under ``--quick``) are never trained on, only
evaluated at the end (``heldout_loss``, beside their unigram and bigram entropies). The rest is
cut into ``--seq``-token windows, drawn in a seeded random order, a new order each pass (the
run repeats passes if the steps need more tokens than the corpus has).

``--corpus docs`` trains on the documentation topics alone, no code file, read by the BPE of
the stdlib code corpus (effdl.data.stdlib_code: trained on the documentation and the training
code files; ``--corpus-bytes`` caps those files), so that finetune_code.py starts from a model
that has seen none of the code it fine-tunes on or evaluates.

The skip is exact: the saved folder carries the BPE's ``tokenizer.json`` and train.py with
``--model-path`` keeps its ``<bos>`` id between documents, so both cut the identical stream.

Training: ``torch.optim.AdamW(fused=True)`` on fp32 weights, bf16 autocast on CUDA (fp32 on the
CPU), ``--batch`` sequences per step in micro-batches of ``--micro-batch`` whose gradients are
summed, gradient norm clipped to ``--grad-clip``, the learning rate warmed up linearly over
``--warmup-steps`` then along a cosine to a tenth at ``--steps`` (effdl.optim.warmup_cosine_lr);
the run stops after ``--steps`` steps or once ``--minutes`` of training wall time have passed,
whichever comes first (set-up and saving are not counted). One ``pretrain`` record per step,
then ``pretrain_summary``, in ``--out/gpt2_pretrain.jsonl``.

Output: ``--save`` (default ``--out/pretrained-<size>``), a Hugging Face GPT-2 folder that
``train.py --model-path`` loads: config.json, fp32 model.safetensors (the weights as trained;
train.py loads fp32), the BPE's tokenizer files, and notes.json (this run's config and summary).
It is written in a temporary sibling folder and renamed at the end: an interrupted run leaves
no folder under that name. An existing ``--save`` is refused before any work.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    flag_of,
    print_table,
    require_choices,
    require_fits,
    require_multiple,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.corpus import CorpusFormatError
from effdl.data.stdlib_code import docs_training_text
from effdl.data.stdlib_text import DEFAULT_CACHE, TrainingText, stdlib_training_text
from effdl.data.token_streams import next_token_entropies, text_stream
from effdl.gpt2_offload.evaluate import amp_context, heldout_loss
from effdl.gpt2_offload.inputs import step_windows, token_windows
from effdl.models.gpt2 import (
    SHAPES,
    backward_micro_batches,
    build_gpt2,
    checkpoint_blocks,
    count_params,
    gpt2_config,
    lm_loss,
    save_gpt2_folder,
)
from effdl.optim import warmup_cosine_lr
from effdl.profiling.timing import GIB, largest_measured
from effdl.results import RunLog
from effdl.tables import format_measured

TASK = "gpt2"
LOG = "gpt2_pretrain.jsonl"
CORPORA = ("stdlib", "docs")
BETAS = (0.9, 0.95)  # the usual LM-pretraining beta2: steadier than 0.999 on a short run
TABLE_ROWS = 12  # steps shown in the printed table (all are logged)


@dataclass(frozen=True)
class PretrainConfig:
    """Settings of one pretraining run (``--quick``: :data:`QUICK`)."""

    size: str = "large"
    corpus: str = "stdlib"  # or "docs": the documentation alone
    steps: int = 400  # the cosine's length (--minutes may stop the run earlier)
    batch: int = 32  # sequences per optimizer step
    seq: int = 1024
    micro_batch: int = 8  # sequences per forward/backward (fp32 weights, no checkpointing)
    lr: float = 3e-4
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    minutes: float | None = None  # training wall time allowed; None: no limit
    checkpoint_layers: int = 0  # blocks recomputed in backward (0: none)
    chunk_tokens: int = 1024  # of the chunked LM loss
    skip_tokens: int = 64 * 1024  # train.py's fixed batch: its default --batch 64 x --seq 1024
    bpe_vocab: int = 50257
    corpus_bytes: int | None = None  # cap of the stdlib corpus; None: all of it
    cache: Path = DEFAULT_CACHE
    save: Path | None = None  # None: --out/pretrained-<size>

    def validate(self) -> None:
        require_choices(self, "size", sorted(SHAPES))
        require_choices(self, "corpus", CORPORA)
        require_positive(self, "steps", "batch", "seq", "micro_batch", "chunk_tokens")
        require_positive(self, "lr", "weight_decay", "warmup_steps", "skip_tokens", minimum=0)
        require_positive(self, "bpe_vocab", minimum=259)  # 256 bytes and 3 special tokens
        for name in ("grad_clip", "minutes"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UsageError(f"{flag_of(name)} must be a finite number > 0, got {value}")
        if self.corpus_bytes is not None:
            require_positive(self, "corpus_bytes")
        shape = SHAPES[self.size]
        require_multiple(self, "batch", "micro_batch")
        require_fits("--batch --seq", self.batch * self.seq, "a step's token ids (int64)", 8)
        if self.seq > shape.n_positions:
            raise UsageError(f"--seq {self.seq} exceeds GPT-2's {shape.n_positions} positions")
        if not 0 <= self.checkpoint_layers <= shape.n_layer:
            raise UsageError(
                f"--checkpoint-layers must be 0..{shape.n_layer} for --size {self.size}, got "
                f"{self.checkpoint_layers}"
            )
        if self.bpe_vocab > shape.vocab_size:
            raise UsageError(
                f"--bpe-vocab {self.bpe_vocab} exceeds the {shape.vocab_size} ids of --size "
                f"{self.size}"
            )


FULL = PretrainConfig()
QUICK = PretrainConfig(
    size="tiny",
    steps=30,
    batch=8,
    seq=64,
    micro_batch=4,
    lr=3e-3,
    warmup_steps=3,
    skip_tokens=8 * 64,  # train.py --quick's fixed batch: --batch 8 x --seq 64
    bpe_vocab=512,
    corpus_bytes=1 << 20,
)


def parse_args() -> tuple[argparse.Namespace, PretrainConfig]:
    """The command line: the common flags, then the config's; returns (args, config)."""
    p = base_parser(__doc__.splitlines()[0], default_out="runs/gpt2")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("size", choices=sorted(SHAPES), help="GPT-2 shape, random init from --seed")
    flags.add("corpus", choices=CORPORA, help="stdlib: documentation and source; docs: no code")
    flags.add("steps", type=int, help="optimizer steps (the lr schedule's length)")
    flags.add("batch", type=int, help="sequences per optimizer step")
    flags.add("seq", type=int, help="tokens per sequence")
    flags.add("micro_batch", type=int, help="sequences per forward/backward")
    flags.add("lr", type=float, help="peak learning rate (cosine to a tenth after the warm-up)")
    flags.add("warmup_steps", type=int, help="steps of linear lr warm-up")
    flags.add("weight_decay", type=float, help="AdamW's decoupled decay")
    flags.add("grad_clip", type=float, help="max global gradient norm")
    flags.add("minutes", type=float, help="stop after this much training wall time")
    flags.add("checkpoint_layers", type=int, help="blocks recomputed in backward")
    flags.add("chunk_tokens", type=int, help="tokens per chunk of the LM loss")
    flags.add("skip_tokens", type=int, help="head of the stream held out (train.py's fixed batch)")
    flags.add("bpe_vocab", type=int, help="ids of the stdlib BPE")
    flags.add("corpus_bytes", type=int, help="cap of the stdlib corpus (train.py's, to match)")
    flags.add("cache", type=Path, output=True, help="corpus and BPE cache (train.py's)")
    flags.add("save", type=Path, output=True, help="model folder (default --out/pretrained-<size>)")
    args = p.parse_args()
    return args, flags.resolve(args)


# ----------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class PretrainData:
    """The token stream cut for pretraining: ``heldout`` (the skipped head, ``(n, seq)`` rows,
    possibly none) and ``windows`` (the rest, ``(m, seq)``), int64 on the CPU."""

    heldout: torch.Tensor
    windows: torch.Tensor
    text: TrainingText
    n_tokens: int


def pretrain_data(cfg: PretrainConfig) -> PretrainData:
    """All of the ``corpus`` token stream (``stdlib``: train.py's default,
    :func:`stdlib_training_text` with the BPE; ``docs``: :func:`docs_training_text`), split at
    ``skip_tokens``; :class:`UsageError` when fewer than ``batch`` windows are left."""
    read = stdlib_training_text if cfg.corpus == "stdlib" else docs_training_text
    text = read(cfg.cache, cfg.bpe_vocab, cfg.corpus_bytes)
    try:
        tokens = text_stream(
            text.docs, None, SHAPES[cfg.size].vocab_size, text.tokenizer_dir, text.name,
            text.bos_id,
        )  # fmt: skip
    except CorpusFormatError as e:
        raise UsageError(f"corpus: {e}") from None
    windows = token_windows(tokens[cfg.skip_tokens :], cfg.seq)
    if len(windows) < cfg.batch:
        raise UsageError(
            f"{text.name} gives {len(tokens):,} tokens: past --skip-tokens {cfg.skip_tokens} "
            f"they make {len(windows)} windows of --seq {cfg.seq}, fewer than --batch "
            f"{cfg.batch} (raise --corpus-bytes)"
        )
    heldout = token_windows(tokens[: cfg.skip_tokens], cfg.seq)
    return PretrainData(heldout, windows, text, len(tokens))


# ----------------------------------------------------------------------------------- training
def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: torch.Tensor,
    cfg: PretrainConfig,
    device: torch.device,
    lr: float,
) -> dict:
    """One optimizer step at ``lr`` over ``batch`` in micro-batches (their gradients summed,
    each loss divided by their number), the global gradient norm clipped to ``grad_clip``;
    returns loss, grad norm (before clipping), lr, step time, tokens/s, peak GPU GiB (None off
    CUDA: not measured)."""
    t0 = time.perf_counter()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        with amp_context(device):
            return lm_loss(model, ids, cfg.chunk_tokens)

    losses = backward_micro_batches(loss_of, batch, cfg.micro_batch, device)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss_value, norm_value = torch.stack([torch.stack(losses).sum(), norm]).tolist()  # one sync
    wall = time.perf_counter() - t0
    return {
        "loss": loss_value,
        "grad_norm": norm_value,
        "lr": lr,
        "step_s": wall,
        "tokens_per_s": cfg.batch * cfg.seq / wall,
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
    }


def new_model(cfg: PretrainConfig, device: torch.device) -> torch.nn.Module:
    """GPT-2 of ``size``, fp32, random init drawn on ``device`` (from the torch seed set by
    start_run; on a GPU, init there takes a second instead of half a minute on the CPU), no
    dropout, ``checkpoint_layers`` blocks checkpointed."""
    with device:
        model = build_gpt2(gpt2_config(cfg.size, dropout=0.0))
    checkpoint_blocks(model, cfg.checkpoint_layers)
    return model.train()


def pretrain(
    model: torch.nn.Module,
    cfg: PretrainConfig,
    data: PretrainData,
    device: torch.device,
    log: RunLog,
    seed: int,
    config: dict,
) -> tuple[list[dict], str]:
    """Train ``model`` (on ``device``; updated in place) on ``data.windows``: one ``pretrain``
    record per step; returns the step metrics and why it stopped (``steps`` or ``minutes``)."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=BETAS, weight_decay=cfg.weight_decay, fused=True
    )
    batches = step_windows(data.windows, cfg.batch, seed)
    budget_s = math.inf if cfg.minutes is None else cfg.minutes * 60
    rows, stopped = [], "steps"
    start = time.perf_counter()
    for step in tqdm(range(cfg.steps), desc="pretrain", unit="step"):
        lr = warmup_cosine_lr(step, cfg.lr, cfg.lr / 10, cfg.warmup_steps, cfg.steps)
        metrics = {"step": step, **train_step(model, opt, next(batches), cfg, device, lr)}
        metrics["elapsed_s"] = time.perf_counter() - start
        log.log("pretrain", config, metrics)
        rows.append(metrics)
        if metrics["elapsed_s"] >= budget_s and step < cfg.steps - 1:
            stopped = "minutes"
            break
    return rows, stopped


def summarize(
    rows: list[dict], data: PretrainData, cfg: PretrainConfig, heldout: float | None, stopped: str
) -> dict:
    """The run in one record: steps done and why it stopped, tokens seen and passes over the
    windows, median speed past the first step, first/last loss (last: mean of the final tenth
    of the steps, a less noisy figure), the held-out loss beside the head's entropies."""
    timed = sorted(r["tokens_per_s"] for r in rows[1:] or rows)
    tail = [r["loss"] for r in rows[-max(1, len(rows) // 10) :]]
    floors = next_token_entropies(data.heldout) if len(data.heldout) else {}
    return {
        "steps": len(rows),
        "stopped_by": stopped,
        "train_s": rows[-1]["elapsed_s"],
        "tokens_trained": len(rows) * cfg.batch * cfg.seq,
        "passes": len(rows) * cfg.batch / len(data.windows),
        "tokens_per_s_median": timed[len(timed) // 2],
        "peak_gib_max": largest_measured(r["peak_gib"] for r in rows),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "loss_tail_mean": sum(tail) / len(tail),
        "heldout_loss": heldout,
        "heldout_unigram_entropy": floors.get("unigram"),
        "heldout_bigram_entropy": floors.get("bigram"),
    }


def check_save_folder(folder: Path) -> None:
    """:class:`UsageError` unless ``folder`` is free and its parent can be written: refused
    before the work, not after it."""
    if folder.exists():
        raise UsageError(f"--save: {folder} exists (a model folder is never overwritten)")
    parent = next((p for p in folder.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--save: cannot create {folder} ({parent} is not a writable folder)")


def main() -> None:
    args, cfg = parse_args()
    save = cfg.save or Path(args.out) / f"pretrained-{cfg.size}"
    check_save_folder(save)
    data = pretrain_data(cfg)  # every input is checked before the log is opened
    run = start_run(args, task=TASK, logs=LOG)
    model = new_model(cfg, run.device)
    config = {
        **dataclasses.asdict(cfg), "save": str(save), "n_params": count_params(model),
        "data": data.text.name, "tokenizer": data.text.tokenizer_dir.name,
        "bos_id": data.text.bos_id, "corpus_tokens": data.n_tokens,
        "windows": len(data.windows), "heldout_rows": len(data.heldout),
        "optimizer": "torch.optim.AdamW(fused=True)", "betas": BETAS, "weights": "fp32",
        "amp": "bf16" if run.device.type == "cuda" else "none", "device": str(run.device),
    }  # fmt: skip
    rows, stopped = pretrain(model, cfg, data, run.device, run.log, args.seed, config)
    heldout = heldout_loss(model, data.heldout, cfg.micro_batch, cfg.chunk_tokens, run.device)
    summary = summarize(rows, data, cfg, heldout, stopped)
    save_gpt2_folder(model.cpu(), save, data.text.tokenizer_dir, {"config": config, **summary})
    run.log.log("pretrain_summary", config, {**summary, "saved": str(save)})
    every = max(1, len(rows) // TABLE_ROWS)
    table = [{k: r[k] for k in ("step", "lr", "loss", "grad_norm", "tokens_per_s")}
             for r in rows if r["step"] % every == 0 or r is rows[-1]]  # fmt: skip
    print_table(table, title=f"Pretraining GPT-2-{cfg.size} on {run.where} ({data.text.name})")
    print(
        f"{summary['steps']} steps ({summary['stopped_by']}), {summary['tokens_trained']:,} "
        f"tokens ({summary['passes']:.2f} passes) in {summary['train_s']:.0f} s; loss "
        f"{summary['loss_first']:.3f} -> {summary['loss_tail_mean']:.3f}; held-out head "
        f"{format_measured(heldout)} (unigram "
        f"{format_measured(summary['heldout_unigram_entropy'])}, bigram "
        f"{format_measured(summary['heldout_bigram_entropy'])}); saved {save} (log: {run.log.path})"
    )


if __name__ == "__main__":
    run_main(main)
