"""Train a Llama-3 model and measure it: tokens/s, TFLOP/s, MFU, memory; loss on real text.

One loop for every variant: model size (``--model``), sequence length, per-GPU batch and
gradient accumulation, bf16 compute over fp32 master weights (autocast over fp32 parameters,
bf16 parameters with fp32 masters in the optimizer, or FSDP2's mixed precision), fused AdamW,
per-block torch.compile, packed or padded data, and one or more processes (DDP or FSDP2 under
torchrun). Warm-up + cosine LR, gradient clipping, held-out loss.

    python lm_training/train.py --quick                                    # CPU smoke run
    python lm_training/train.py --model 1b --fused-optimizer --compile     # one GPU
    torchrun --nproc-per-node 2 lm_training/train.py --model 1b --parallel fsdp --precision fsdp-mp

Per step: loss, LR, gradient norm, tokens/s, TFLOP/s per GPU, MFU against the datasheet bf16
peak and against the measured GEMM ceiling (reports/results/ceilings), peak memory, step time
from CUDA events. The host reads the GPU once per ``--log-every`` steps (all the steps' losses
and norms in one copy). A summary record leaves out the first ``--timing-warmup`` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import lm_data
import lm_setup
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.profiler import record_function

from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    print_table,
    require_choices,
    require_path,
    require_positive,
    run_main,
    seed_everything,
    start_run,
)
from effdl.data.labels import IGNORE_INDEX
from effdl.data.parquet import TEXT_COLUMN, as_encoder
from effdl.data.stdlib_text import DEFAULT_CACHE, token_counts, unigram_entropy
from effdl.models.llama import PRESETS, TransformerModelArgs
from effdl.optim import MasterWeights, warmup_cosine_lr
from effdl.parallel import gradient_sync, wrap_model
from effdl.profiling.flops import llama_train_flops_per_token, peak_bf16_tflops
from effdl.profiling.kernel_split import kernel_split, read_trace_events
from effdl.profiling.timing import RegionTimer, take_peak_memory
from effdl.results import RunLog

TASK = "lm_training"
LOG = "lm_training.jsonl"
TABLE = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "peak_gib")
SUMMARY = ("tokens_per_s", "tflops", "mfu", "mfu_measured", "step_s", "peak_gib")
PRECISIONS = ("autocast", "master", "fsdp-mp")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one run; every field is a flag (``batch_size`` -> ``--batch-size``)."""

    model: str = "1b"
    vocab_size: int | None = None  # None: the preset's
    sequence_length: int = 2048
    batch_size: int = 4  # per process
    grad_accumulation: int = 1
    steps: int = 60
    warmup_steps: int = 10  # LR warm-up
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: no clipping (the norm is still logged)
    fused_optimizer: bool = False
    compile: bool = False
    attention: str = "auto"  # SDPA backend (lm_setup.ATTENTION_BACKENDS)
    dtype: str = "bf16"
    precision: str = "autocast"
    dataset: str = "iterable"
    data: Path | None = None
    eval_data: Path | None = None
    tokenizer: Path | None = None
    bpe_vocab: int = 8192
    corpus_bytes: int | None = None  # None: the whole stdlib corpus
    cache: Path = DEFAULT_CACHE
    parallel: str = "none"
    ddp_bucket_mb: float = 200.0  # DDP all-reduce bucket (torch's default is 25 MB)
    workers: int = 2
    log_every: int = 10
    eval_every: int = 0  # 0: no held-out loss
    eval_batches: int = 8
    timing_warmup: int = 5
    profile: bool = False
    profile_steps: int = 3
    name: str = ""  # the records' variant; "" = made from the settings

    def validate(self) -> None:
        require_choices(self, "model", PRESETS)
        require_choices(self, "dtype", ("bf16", "fp32"))
        require_choices(self, "attention", lm_setup.ATTENTION_BACKENDS)
        require_choices(self, "precision", PRECISIONS)
        require_choices(self, "dataset", ("iterable", "padded"))
        require_choices(self, "parallel", ("none", "ddp", "fsdp"))
        require_positive(
            self,
            "sequence_length",
            "batch_size",
            "grad_accumulation",
            "steps",
            "log_every",
            "eval_batches",
            "profile_steps",
            "bpe_vocab",
        )
        require_positive(
            self,
            "warmup_steps",
            "weight_decay",
            "grad_clip",
            "workers",
            "eval_every",
            "timing_warmup",
            minimum=0,
        )
        require_positive(self, "lr", "min_lr", minimum=0)
        require_positive(self, "ddp_bucket_mb")
        if self.min_lr > self.lr:
            raise UsageError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if self.precision == "fsdp-mp" and (self.parallel != "fsdp" or self.dtype != "bf16"):
            raise UsageError("--precision fsdp-mp needs --parallel fsdp and --dtype bf16")
        if self.precision == "master" and (self.parallel != "none" or self.dtype != "bf16"):
            raise UsageError(
                "--precision master needs --parallel none and --dtype bf16 "
                "(DDP and FSDP own the parameters' gradients: use --precision fsdp-mp)"
            )
        if self.timing_warmup >= self.steps:
            raise UsageError(
                f"--timing-warmup {self.timing_warmup} leaves none of --steps {self.steps}"
            )
        for name, what in (
            ("data", "a parquet with a 'text' column or a text file"),
            ("eval_data", "a parquet with a 'text' column"),
            ("tokenizer", "a local Hugging Face tokenizer folder"),
        ):
            if getattr(self, name) is not None:
                require_path(getattr(self, name), what, "--" + name.replace("_", "-"))

    def variant(self, world: int) -> str:
        if self.name:
            return self.name
        compute = f"bf16-{self.precision}" if self.dtype == "bf16" else "fp32"
        parts = [
            self.model,
            f"s{self.sequence_length}",
            f"b{self.batch_size}x{self.grad_accumulation}",
            compute,
            "fused" if self.fused_optimizer else "",
            "compile" if self.compile else "",
            self.dataset,
            f"{self.parallel}{world}" if self.parallel != "none" else "",
        ]
        return "-".join(p for p in parts if p)


FULL = TrainConfig()
QUICK = TrainConfig(
    model="tiny",
    sequence_length=128,
    batch_size=4,
    steps=8,
    warmup_steps=2,
    lr=3e-3,
    min_lr=3e-4,
    dtype="fp32",
    bpe_vocab=512,
    corpus_bytes=1 << 20,
    workers=0,
    log_every=1,
    eval_every=4,
    eval_batches=2,
    timing_warmup=2,
    profile_steps=2,
)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, TrainConfig]:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/lm_training")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("model", choices=sorted(PRESETS), help="shape preset (effdl.models.llama.PRESETS)")
    flags.add("vocab_size", type=int, help="override the preset's vocabulary; None = preset's")
    flags.add("sequence_length", type=int)
    flags.add("batch_size", type=int, help="sequences per micro-batch per process")
    flags.add("grad_accumulation", type=int, help="micro-batches per optimizer step")
    flags.add("steps", type=int, help="optimizer steps")
    flags.add("warmup_steps", type=int, help="linear LR warm-up steps, then cosine to --min-lr")
    flags.add("lr", type=float)
    flags.add("min_lr", type=float)
    flags.add("weight_decay", type=float)
    flags.add("grad_clip", type=float, help="max gradient norm; 0 = off")
    flags.add(
        "fused_optimizer",
        action="store_true",
        help="AdamW(fused=True); with --precision master the update is always one pass "
        "(effdl.ops.fused_adamw)",
    )
    flags.add("compile", action="store_true", help="torch.compile each block and the loss")
    flags.add(
        "attention", choices=lm_setup.ATTENTION_BACKENDS, help="SDPA backend; auto = torch's choice"
    )
    flags.add("dtype", choices=["bf16", "fp32"], help="compute dtype; master weights stay fp32")
    flags.add(
        "precision",
        choices=list(PRECISIONS),
        help="how bf16 compute is done: torch.autocast over fp32 parameters; master: bf16 "
        "parameters, fp32 masters and gradient sums in the optimizer; FSDP2 MixedPrecisionPolicy",
    )
    flags.add(
        "dataset",
        choices=["iterable", "padded"],
        help="packed stream (IterableParquetDataset) or padded documents (ParquetDataset)",
    )
    flags.add("data", type=Path, help="parquet with a 'text' column or a text file; None = stdlib")
    flags.add("eval_data", type=Path, help="held-out parquet; None = the stdlib split")
    flags.add("tokenizer", type=Path, help="local HF tokenizer folder; None = BPE on the stdlib")
    flags.add("bpe_vocab", type=int, help="vocabulary of the default BPE")
    flags.add("corpus_bytes", type=int, help="cap of the stdlib corpus; None = all of it")
    flags.add("cache", type=Path, help="folder for the corpus parquets and the BPE")
    flags.add("parallel", choices=["none", "ddp", "fsdp"], help="under torchrun for N processes")
    flags.add("ddp_bucket_mb", type=float, help="MB of gradients per DDP all-reduce")
    flags.add("workers", type=int, help="DataLoader worker processes")
    flags.add("log_every", type=int, help="steps between the host's reads of the GPU")
    flags.add("eval_every", type=int, help="steps between held-out losses; 0 = off")
    flags.add("eval_batches", type=int)
    flags.add("timing_warmup", type=int, help="first steps left out of the summary")
    flags.add("profile", action="store_true", help="torch.profiler trace after the timing warm-up")
    flags.add("profile_steps", type=int)
    flags.add("name", help="variant name in the log")
    args = p.parse_args(argv)
    return args, flags.resolve(args)


# ----------------------------------------------------------------------------------- pieces
def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32 over labels that are not ``IGNORE_INDEX``."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def model_args(cfg: TrainConfig, tokenizer_vocab: int) -> TransformerModelArgs:
    args = dataclasses.replace(PRESETS[cfg.model], seq_len=cfg.sequence_length)
    if cfg.vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=cfg.vocab_size)
    if tokenizer_vocab > args.vocab_size:
        raise UsageError(
            f"the tokenizer has {tokenizer_vocab} tokens, more than --model {cfg.model}'s "
            f"vocabulary of {args.vocab_size}: use --vocab-size or a smaller --bpe-vocab"
        )
    return args


def reference_entropy(path: Path, tokenizer, vocab: int, max_docs: int = 2000) -> float:
    """Unigram entropy (nats/token) of the first ``max_docs`` documents of ``path``."""
    first = next(pq.ParquetFile(path).iter_batches(batch_size=max_docs, columns=[TEXT_COLUMN]))
    texts = first.column(TEXT_COLUMN).to_pylist()
    return unigram_entropy(token_counts(as_encoder(tokenizer), texts, vocab))


def all_reduce_sum(t: torch.Tensor, d: lm_setup.Dist) -> torch.Tensor:
    if d.world > 1:
        dist.all_reduce(t)
    return t


@torch.no_grad()
def evaluate(model, batches, compute, loss_fn, d: lm_setup.Dist) -> float:
    """Mean held-out loss per label token over all ranks' batches (one host read)."""
    total = torch.zeros(2, device=d.device, dtype=torch.float64)
    for x, y in batches:
        x, y = x.to(d.device), y.to(d.device)
        with compute:
            logits = model(x)
        total[0] += loss_fn(logits, y).double()
        total[1] += (y != IGNORE_INDEX).sum()
    loss, count = all_reduce_sum(total, d).tolist()
    return loss / count


@dataclass(frozen=True)
class Rates:
    """What turns a step time into throughput: tokens per step (all ranks), FLOPs per token,
    the processes, and the two yardsticks (TFLOP/s per GPU; None where unknown)."""

    tokens_per_step: int
    flops_per_token: float
    world: int
    peak_tflops: float | None
    ceiling_tflops: float | None

    def metrics(self, step_s: float) -> dict:
        tokens_per_s = self.tokens_per_step / step_s
        tflops = self.flops_per_token * tokens_per_s / self.world / 1e12
        return {
            "step_s": step_s,
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "mfu_measured": tflops / self.ceiling_tflops if self.ceiling_tflops else None,
        }


def summarize(rows: list[dict], skip: int) -> dict:
    """Medians of the throughput metrics past the first ``skip`` steps, the largest peak memory."""
    timed = rows[skip:]
    out = {"timed_steps": len(timed)}
    for key in SUMMARY:
        values = [r[key] for r in timed if r[key] is not None and not math.isnan(r[key])]
        out[key] = (
            (max(values) if key == "peak_gib" else statistics.median(values)) if values else None
        )
    out["final_loss"] = rows[-1]["loss"]
    return out


# ----------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args, cfg = parse_args(argv)
    if args.quick and args.device == "auto":
        args.device = "cpu"
    d = lm_setup.setup_distributed(cfg.parallel, args.device)
    finished = False
    try:
        train(args, cfg, d)
        finished = True
    finally:
        lm_setup.teardown_distributed(finished)


def train(args: argparse.Namespace, cfg: TrainConfig, d: lm_setup.Dist) -> None:
    log: RunLog | None = start_run(args, TASK, LOG).log if d.main else None
    seed_everything(args.seed)
    cuda = d.device.type == "cuda"

    # data and tokenizer: built once by rank 0, then read by all
    if d.main:
        source = lm_data.resolve_data(cfg.data, cfg.eval_data, cfg.cache, cfg.corpus_bytes)
        tok_dir = cfg.tokenizer or lm_data.default_tokenizer(
            cfg.cache, cfg.corpus_bytes, cfg.bpe_vocab
        )
    if d.world > 1:
        dist.barrier()
    if not d.main:
        source = lm_data.resolve_data(cfg.data, cfg.eval_data, cfg.cache, cfg.corpus_bytes)
        tok_dir = cfg.tokenizer or lm_data.default_tokenizer(
            cfg.cache, cfg.corpus_bytes, cfg.bpe_vocab
        )
    tokenizer, specials = lm_data.load_tokenizer(tok_dir)
    margs = model_args(cfg, tokenizer.get_vocab_size())
    if cfg.eval_every and source.val is None:
        raise UsageError(
            "--eval-every needs held-out text: give --eval-data (or use the default corpus)"
        )
    micro_batches = lm_data.train_loader(
        source,
        tokenizer,
        specials,
        dataset=cfg.dataset,
        seq_len=cfg.sequence_length,
        batch_size=cfg.batch_size,
        samples=cfg.steps * cfg.grad_accumulation * cfg.batch_size * d.world,
        rank=d.rank,
        world=d.world,
        seed=args.seed,
        workers=cfg.workers,
        pin_memory=cuda,
    )
    held_out = (
        lm_data.eval_batches(
            source.val,
            tokenizer,
            specials,
            seq_len=cfg.sequence_length,
            batch_size=cfg.batch_size,
            n_batches=cfg.eval_batches,
            rank=d.rank,
            world=d.world,
        )
        if cfg.eval_every
        else []
    )

    # model, optimizer, compute mode
    lm_setup.select_attention(cfg.attention)
    model = lm_setup.build_model(margs, d.device, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.profile and not cfg.compile:
        lm_setup.add_profile_ranges(model)
    fsdp_bf16 = cfg.precision == "fsdp-mp"
    model = wrap_model(
        model, cfg.parallel, fsdp_bf16, cfg.compile, d.device, d.world,
        bucket_cap_mb=cfg.ddp_bucket_mb,
    )  # fmt: skip
    model.train()
    make_opt = partial(
        lm_setup.make_optimizer,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        fused=cfg.fused_optimizer,
    )
    if cfg.precision == "master":
        opt = MasterWeights(model, make_opt, torch.bfloat16)
        clip = opt.clip_grad_norm_  # applied inside the update's pass
    else:
        opt = make_opt(model.parameters())
        clip = partial(torch.nn.utils.clip_grad_norm_, list(model.parameters()))
    autocast = cfg.dtype == "bf16" and cfg.precision == "autocast"
    compute = torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=autocast)
    loss_fn = torch.compile(token_loss_sum) if cfg.compile else token_loss_sum

    gpu = torch.cuda.get_device_name(d.device) if cuda else None
    rates = Rates(
        tokens_per_step=cfg.batch_size * cfg.sequence_length * cfg.grad_accumulation * d.world,
        flops_per_token=llama_train_flops_per_token(margs, cfg.sequence_length),
        world=d.world,
        peak_tflops=peak_bf16_tflops(gpu) if gpu else None,
        ceiling_tflops=lm_setup.measured_bf16_ceiling(gpu),
    )
    variant = cfg.variant(d.world)
    config = {
        **{k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()},
        "model_args": dataclasses.asdict(margs),
        "n_params": n_params,
        "world": d.world,
        "data_name": source.name,
        "tokenizer_dir": str(tok_dir),
        "device": str(d.device),
        "tokens_per_step": rates.tokens_per_step,
        "flops_per_token": rates.flops_per_token,
        "peak_bf16_tflops": rates.peak_tflops,
        "measured_bf16_tflops": rates.ceiling_tflops,
    }
    if log is not None:
        entropy = reference_entropy(source.val or source.train, tokenizer, margs.vocab_size)
        log.log(
            f"{variant}_data",
            config,
            {"unigram_entropy_nats": entropy, "unigram_entropy_bits": entropy / math.log(2)},
        )

    timer = RegionTimer(d.device)
    pending: list[dict] = []
    rows: list[dict] = []
    trace = Path(args.out) / f"trace_{variant}_rank{d.rank}.json"

    def flush() -> None:
        """Read the pending steps' values in one copy and log them (rank 0)."""
        local = torch.stack([torch.stack([p.pop("loss"), p.pop("label_tokens")]) for p in pending])
        norms = torch.stack([p.pop("grad_norm") for p in pending]).tolist()
        losses = all_reduce_sum(local, d).tolist()
        times = timer.times()[-len(pending) :]
        for p, (loss, labels), norm, step_s in zip(pending, losses, norms, times, strict=True):
            row = {
                **p,
                "loss": loss,
                "label_tokens": int(labels),
                "grad_norm": norm,
                **rates.metrics(step_s),
            }
            rows.append(row)
            if log is not None:
                log.log(variant, config, row)
        pending.clear()

    with lm_setup.profiled(
        cfg.profile, cfg.timing_warmup, cfg.profile_steps, trace, d.device
    ) as profiler_step:
        for step in range(cfg.steps):
            lr = warmup_cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)
            for group in opt.param_groups:
                group["lr"] = lr
            timer.start()
            wait = time.perf_counter()
            with record_function("data_loading"):
                batch = [next(micro_batches) for _ in range(cfg.grad_accumulation)]
                batch = [
                    (x.to(d.device, non_blocking=True), y.to(d.device, non_blocking=True))
                    for x, y in batch
                ]
            data_s = time.perf_counter() - wait
            # the step's loss is a mean over the label tokens of all ranks and micro-batches
            n_labels = all_reduce_sum(sum((y != IGNORE_INDEX).sum() for _, y in batch).float(), d)
            loss_sum = torch.zeros((), device=d.device)
            for i, (x, y) in enumerate(batch):
                with gradient_sync(model, i == len(batch) - 1):
                    with compute:
                        logits = model(x)
                    part = loss_fn(logits, y)
                    # DDP and FSDP average gradients over ranks: undo it to get the global sum
                    (part * (d.world / n_labels)).backward()
                loss_sum += part.detach()
            grad_norm = clip(cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
                grad_norm = grad_norm.full_tensor()
            with record_function("optimizer_step"):
                opt.step()
                opt.zero_grad()
            timer.stop()
            pending.append(
                {
                    "step": step,
                    "lr": lr,
                    "loss": loss_sum / n_labels,
                    "label_tokens": n_labels,
                    "grad_norm": grad_norm.detach().float(),
                    "data_s": data_s,
                    "peak_gib": take_peak_memory(d.device),
                }
            )
            profiler_step()
            if (step + 1) % cfg.log_every == 0 or step == cfg.steps - 1:
                flush()
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
                val = evaluate(model, held_out, compute, loss_fn, d)
                if log is not None:
                    log.log(f"{variant}_eval", config, {"step": step, "val_loss": val})
                if rows and rows[-1]["step"] == step:
                    rows[-1]["val_loss"] = val

    summary = summarize(rows, cfg.timing_warmup)
    if log is not None and cuda and cfg.profile and trace.exists():
        split = kernel_split(read_trace_events(trace))
        log.log(f"{variant}_kernels", config, {"profile_steps": cfg.profile_steps, **split})
        shares = [{"kind": k, "ms per step": v / cfg.profile_steps, "share of span": sh}
                  for (k, v), sh in zip(split["by_kind_ms"].items(), split["by_kind_share"].values(),
                                        strict=True)]  # fmt: skip
        print_table(
            shares, title=f"GPU time by kernel kind over {cfg.profile_steps} profiled steps"
        )
    if log is not None:
        log.log(f"{variant}_summary", config, summary)
        shown = [{k: r.get(k) for k in (*TABLE, "val_loss")} for r in rows]
        where = log.env["gpu"] or log.env["cpu"]
        print_table(shown, title=f"{variant} on {d.world} x {where} (log: {log.path})")
        print_table([summary], title=f"median past the first {cfg.timing_warmup} steps")


if __name__ == "__main__":
    run_main(main)
