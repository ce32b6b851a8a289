"""Train a Llama-3 model and measure it: tokens/s, TFLOP/s, MFU, memory; loss on real text.

One loop for every variant: model size (``--model``), sequence length, per-GPU batch and
gradient accumulation, bf16 compute over fp32 master weights (autocast over fp32 parameters,
bf16 parameters with fp32 masters in the optimizer, or FSDP2's mixed precision), fused AdamW,
per-block torch.compile, packed or padded data, and one or more processes (DDP or FSDP2 under
torchrun). Warm-up + cosine LR, gradient clipping, held-out loss.

    python3 lm_training/train.py --quick                                    # CPU smoke run
    python3 lm_training/train.py --model 1b --fused-optimizer --compile     # one GPU
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
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.autograd.profiler import record_function

from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    print_table,
    require_choices,
    require_path,
    require_positive,
    require_processes,
    run_main,
    seed_everything,
    start_run,
)
from effdl.data.stdlib_text import DEFAULT_CACHE
from effdl.lm import data as lm_data
from effdl.lm.build import (
    ATTENTION_BACKENDS,
    check_llama_fits,
    llama_args,
    optimizer_and_clip,
    select_attention,
)
from effdl.lm.loss import accumulated_backward, compiled_token_loss_sum, evaluate, token_loss_sum
from effdl.lm.processes import Dist, setup_distributed, teardown_distributed
from effdl.lm.resume import flag_problem, resume_training, save_training
from effdl.lm.throughput import PendingSteps, Rates, measured_bf16_ceiling, summarize
from effdl.lm.tracing import add_profile_ranges, profiled
from effdl.models.llama import PRESETS, build_on_meta, llama_train_flops_per_token
from effdl.optim import warmup_cosine_lr
from effdl.parallel import apply_activation_checkpointing, wrap_model
from effdl.profiling.flops import peak_bf16_tflops
from effdl.profiling.kernel_split import kernel_split, kind_shares, read_trace_events, waits
from effdl.profiling.timing import RegionTimer, take_peak_memory
from effdl.results import RunLog

TASK = "lm_training"
LOG = "lm_training.jsonl"
TABLE = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "peak_gib")
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
    attention: str = "auto"  # SDPA backend (effdl.lm.build.ATTENTION_BACKENDS)
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
    ddp_reduce: str = "fp32"  # the dtype DDP's all-reduces send the gradients in
    ddp_embedding: str = "rows"  # the embedding's gradient averaged over its looked-up rows
    activation_checkpoint: str = "none"  # none, full, selective:K, op (blocks recomputed)
    save: Path | None = None  # a distributed checkpoint written when this run stops
    resume: Path | None = None  # a checkpoint to continue from
    stop_after: int = 0  # end after this many steps (0: at --steps); the schedule spans --steps
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
        require_choices(self, "attention", ATTENTION_BACKENDS)
        require_choices(self, "precision", PRECISIONS)
        require_choices(self, "dataset", ("iterable", "padded"))
        require_choices(self, "parallel", ("none", "ddp", "fsdp"))
        require_choices(self, "ddp_reduce", ("fp32", "bf16"))
        require_choices(self, "ddp_embedding", ("rows", "dense"))
        require_positive(self, "sequence_length", "batch_size", "grad_accumulation", "steps")
        require_positive(
            self, "log_every", "eval_batches", "profile_steps", "bpe_vocab", "ddp_bucket_mb"
        )
        require_positive(self, "warmup_steps", "weight_decay", "grad_clip", "stop_after", minimum=0)
        require_processes(self, "workers")
        require_positive(self, "eval_every", "timing_warmup", "lr", "min_lr", minimum=0)
        if self.ddp_reduce != "fp32" and self.parallel != "ddp":
            raise UsageError(f"--ddp-reduce {self.ddp_reduce} needs --parallel ddp")
        if self.vocab_size is not None:
            require_positive(self, "vocab_size")
        check_llama_fits(PRESETS[self.model], self.vocab_size, self.batch_size, self.sequence_length)  # fmt: skip
        problem = flag_problem(self.activation_checkpoint, self.precision, self.save, self.resume)
        if problem:
            raise UsageError(problem)
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
    model="tiny", sequence_length=128, batch_size=4, steps=8, warmup_steps=2, lr=3e-3,
    min_lr=3e-4, dtype="fp32", bpe_vocab=512, corpus_bytes=1 << 20, workers=0, log_every=1,
    eval_every=4, eval_batches=2, timing_warmup=2, profile_steps=2,
)  # fmt: skip


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
    flags.add("fused_optimizer", action="store_true", help="fused AdamW (one pass if master)")
    flags.add("compile", action="store_true", help="torch.compile each block and the loss")
    flags.add("attention", choices=[*ATTENTION_BACKENDS], help="SDPA backend; auto: torch's")
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
    flags.add("cache", type=Path, output=True, help="folder for the corpus parquets and the BPE")
    flags.add("parallel", choices=["none", "ddp", "fsdp"], help="under torchrun for N processes")
    flags.add("ddp_bucket_mb", type=float, help="MB of gradients per DDP all-reduce")
    flags.add("ddp_reduce", choices=["fp32", "bf16"], help="dtype of DDP's gradient all-reduces")
    flags.add("ddp_embedding", choices=["rows", "dense"], help="DDP averages the embedding's gradient over the rows looked up, or whole")  # fmt: skip
    flags.add("activation_checkpoint", help="blocks recomputed: none, full, selective:K, op")
    flags.add("save", type=Path, output=True, help="distributed checkpoint written at the end")
    flags.add("resume", type=Path, help="continue from a --save checkpoint")
    flags.add("stop_after", type=int, help="stop after this many steps (0: --steps)")
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


# ----------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args, cfg = parse_args(argv)
    if args.quick and args.device == "auto":
        args.device = "cpu"
    d = setup_distributed(cfg.parallel, args.device)
    finished = False
    try:
        train(args, cfg, d)
        finished = True
    finally:
        teardown_distributed(finished)


def train(args: argparse.Namespace, cfg: TrainConfig, d: Dist) -> None:
    log: RunLog | None = start_run(args, TASK, LOG).log if d.main else None
    seed_everything(args.seed)
    cuda = d.device.type == "cuda"

    # data and tokenizer: built once by rank 0, then read by all
    source, tok_dir = lm_data.resolve_text(
        cfg.data, cfg.eval_data, cfg.tokenizer, cfg.cache, cfg.corpus_bytes, cfg.bpe_vocab,
        main=d.main, world=d.world,
    )  # fmt: skip
    tokenizer, specials = lm_data.load_tokenizer(tok_dir)
    margs = llama_args(cfg.model, cfg.sequence_length, cfg.vocab_size, tokenizer.get_vocab_size())
    if cfg.eval_every and source.val is None:
        raise UsageError("--eval-every needs held-out text: give --eval-data (or use the default corpus)")  # fmt: skip
    micro_batches = lm_data.train_loader(
        source, tokenizer, specials, dataset=cfg.dataset, seq_len=cfg.sequence_length,
        batch_size=cfg.batch_size, samples=cfg.steps * cfg.grad_accumulation * cfg.batch_size * d.world,
        rank=d.rank, world=d.world, seed=args.seed, workers=cfg.workers, pin_memory=cuda,
    )  # fmt: skip
    held_out = lm_data.eval_batches(
        source.val, tokenizer, specials, seq_len=cfg.sequence_length, batch_size=cfg.batch_size,
        n_batches=cfg.eval_batches, rank=d.rank, world=d.world,
    ) if cfg.eval_every else []  # fmt: skip

    # model, optimizer, compute mode
    model = build_on_meta(margs)  # allocated by wrap_model: under FSDP2 one block at a time
    select_attention(model, cfg.attention)
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.profile and not cfg.compile:
        add_profile_ranges(model)
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    fsdp_bf16 = cfg.precision == "fsdp-mp"
    embedding_tokens = cfg.batch_size * cfg.sequence_length * cfg.grad_accumulation if cfg.parallel == "ddp" and cfg.ddp_embedding == "rows" else None  # fmt: skip
    model = wrap_model(model, cfg.parallel, fsdp_bf16, cfg.compile, d.device, d.world, bucket_cap_mb=cfg.ddp_bucket_mb, reduce_dtype=torch.bfloat16 if cfg.ddp_reduce == "bf16" else torch.float32, embedding_tokens_per_step=embedding_tokens, init_seed=args.seed)  # fmt: skip
    model.train()
    opt, clip = optimizer_and_clip(model, cfg.precision, cfg.lr, cfg.weight_decay, cfg.fused_optimizer)  # fmt: skip
    autocast = cfg.dtype == "bf16" and cfg.precision == "autocast"
    compute = torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=autocast)
    loss_fn = compiled_token_loss_sum() if cfg.compile else token_loss_sum

    gpu = torch.cuda.get_device_name(d.device) if cuda else None
    rates = Rates(
        tokens_per_step=cfg.batch_size * cfg.sequence_length * cfg.grad_accumulation * d.world,
        flops_per_token=llama_train_flops_per_token(margs, cfg.sequence_length),
        world=d.world,
        peak_tflops=peak_bf16_tflops(gpu) if gpu else None,
        ceiling_tflops=measured_bf16_ceiling(gpu),
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
        entropy = lm_data.reference_entropy(source.val or source.train, tokenizer, margs.vocab_size)
        log.log(
            f"{variant}_data",
            config,
            {"unigram_entropy_nats": entropy, "unigram_entropy_bits": entropy / math.log(2)},
        )

    start, stop = 0, min(cfg.steps, cfg.stop_after or cfg.steps)
    if cfg.resume is not None:
        start, load_s = resume_training(cfg.resume, model, opt, micro_batches, cfg.grad_accumulation)  # fmt: skip
        if log is not None:
            log.log(f"{variant}_resume", config, {"step": start, "load_s": load_s})
    timer = RegionTimer(d.device)
    write = partial(log.log, variant, config) if log is not None else None
    pending = PendingSteps(rates, timer, d, write, step_size_flags="--lr")
    rows = pending.rows  # every step written, in order
    trace = Path(args.out) / f"trace_{variant}_rank{d.rank}.json"

    with (
        profiled(
            cfg.profile, cfg.timing_warmup, cfg.profile_steps, trace, d.device
        ) as profiler_step,
        pending.flushed_on_interrupt(),  # Ctrl-C: the steps run so far are written first
    ):
        for step in range(start, stop):
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
            loss_sum, n_labels = accumulated_backward(model, batch, compute, loss_fn, d)
            grad_norm = clip(cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            with record_function("optimizer_step"):
                opt.step()
                opt.zero_grad()
            timer.stop()
            host = {
                "step": step,
                "lr": lr,
                "data_s": data_s,
                "peak_gib": take_peak_memory(d.device),
            }
            pending.add(host, loss_sum / n_labels, n_labels, grad_norm.detach().float())
            profiler_step()
            if (step + 1) % cfg.log_every == 0 or step == stop - 1:
                pending.flush()  # the host's one read of these steps' values; refuses a NaN loss
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == stop - 1):
                val = evaluate(model, held_out, compute, loss_fn, d)
                if log is not None:
                    log.log(f"{variant}_eval", config, {"step": step, "val_loss": val})
                if rows and rows[-1]["step"] == step:
                    rows[-1]["val_loss"] = val

    if cfg.save is not None:
        save_s = save_training(cfg.save, model, opt, stop)
        if log is not None:
            log.log(f"{variant}_checkpoint", config, {"step": stop, "save_s": save_s})
    summary = summarize(rows, cfg.timing_warmup)
    if log is not None and cuda and cfg.profile and trace.exists():
        split = kernel_split(read_trace_events(trace))
        log.log(f"{variant}_kernels", config, {"profile_steps": cfg.profile_steps, **split})
        shares = kind_shares(split, cfg.profile_steps)
        print_table(shares, title=f"GPU time by kernel kind, {waits(split, cfg.profile_steps)}")
    if log is not None:
        log.log(f"{variant}_summary", config, summary)
        shown = [{k: r.get(k) for k in (*TABLE, "val_loss")} for r in rows]
        where = log.env["gpu"] or log.env["cpu"]
        print_table(shown, title=f"{variant} on {d.world} x {where} (log: {log.path})")
        print_table([summary], title=f"median past the first {cfg.timing_warmup} steps")


if __name__ == "__main__":
    run_main(main)
