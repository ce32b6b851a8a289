"""Fine-tune GPT-2-Large inside 11 GiB of GPU memory with a CPU-offloaded Adam.

bf16 working weights on the GPU, fp32 master weights and Adam moments on the CPU
(effdl.optim.CPUOffloadAdam), 64 x 1024 tokens per step.

    python memory_efficient_gpt2/train.py --quick                           # CPU smoke run, tiny GPT-2
    python memory_efficient_gpt2/train.py --device cuda --steps 8           # training corpus
    python memory_efficient_gpt2/train.py --device cuda --fixed-batch --steps 30 --reference adamw
    # the fixed-batch test from pretrained weights (from random init the loss stops at the
    # batch's unigram entropy): pretrain.py first, never on the fixed batch's tokens
    python memory_efficient_gpt2/pretrain.py --device cuda --minutes 4.5 --save /tmp/ckpt
    python memory_efficient_gpt2/train.py --device cuda --model-path /tmp/ckpt --fixed-batch --steps 30 --reference adamw
    python memory_efficient_gpt2/train.py --device cuda --level 3 --steps 8   # GPT-2-XL, 11 GiB

The speed baselines (plain forward+backward) are ``baseline.py``, torchao's offload optimizer
under the same caps ``peer_torchao.py``.

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

``--checkpoint-layers -1`` checkpoints the fewest blocks whose estimated memory
(effdl.profiling.memory_budget, with the activation bytes measured on the GPU) fits the cap.
``--moments int8`` keeps the Adam moments block-wise 8-bit on the host; ``--update-on device``
runs that 8-bit step on the GPU, bucket by bucket. ``--grad-accumulation-dtype bf16`` sums the
micro-batches' gradients on the GPU in bf16 (2 B/param instead of 4). ``--level`` names the
GPT-2-XL presets (effdl.gpt2_offload.config.LEVELS); flags given beside it win. Past
``--memory-cap-gib`` (peak GPU memory) or ``--host-memory-cap-gib`` (the process's resident set,
pinned buffers included, sampled after set-up and after every step) the run stops with
MemoryCapExceeded before that step's record is written.
"""

from __future__ import annotations

import math
import os
import time

import torch
from tqdm import tqdm

from effdl.cli import (
    UsageError,
    base_parser,
    device_from_arg,
    print_table,
    run_main,
    start_run,
)
from effdl.gpt2_offload.budget import (
    budget_metrics,
    measure_activation_bytes,
    offload_options,
    optimizer_gpu_gib,
    pick_checkpoint_layers,
    require_run_fits,
)
from effdl.gpt2_offload.config import TrainConfig, parse_train_args
from effdl.gpt2_offload.inputs import (
    initial_model,
    lr_at,
    make_batches,
    model_folder_config,
    set_lr,
)
from effdl.gpt2_offload.reference import (
    MAX_MEAN_GAP_NATS,
    MIN_FALL,
    equivalence_summary,
    run_reference,
)
from effdl.gpt2_offload.steps import (
    check_memory_caps,
    gpu_peak_gib,
    host_rss_gib,
    median,
    set_memory_cap,
    speed_summary,
    start_step,
    step_metrics,
)
from effdl.models.gpt2 import checkpoint_blocks, count_params, gpt2_config, lm_loss
from effdl.optim import CPUOffloadAdam, OffloadPlan, plan_offload
from effdl.profiling.memory import ALLOC_CONF, use_expandable_segments
from effdl.profiling.timing import GIB
from effdl.results import RunLog

TASK = "gpt2"
TIMELINE_KINDS = ("gpu_compute", "d2h", "h2d", "cpu_update", "cpu_accumulate", "step_wait")
TABLE_COLUMNS = ("step", "loss", "seq_per_s", "peak_gib", "host_rss_gib", "gpu_compute_s",
                 "d2h_s", "h2d_s", "cpu_update_s", "step_wait_s")  # fmt: skip


def resolve_cpu_threads(requested: int | None) -> int:
    """Threads for the CPU update: as requested, or all cores but two (left to data and launch)."""
    return requested or max(1, (os.cpu_count() or 2) - 2)


def build_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, device: torch.device, threads: int
) -> tuple[CPUOffloadAdam, OffloadPlan]:
    """CPUOffloadAdam over ``model``'s parameters as ``cfg`` asks, and the plan of what it
    allocates (effdl.optim.plan_offload with the same arguments)."""
    options = offload_options(cfg)
    plan = plan_offload([p.numel() for p in model.parameters()], **options)
    opt = CPUOffloadAdam(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, device=device,
        num_threads=threads, **options,
    )  # fmt: skip
    return opt, plan


def run_config(
    cfg: TrainConfig, n_params: int, ckpt: int, threads: int, data: dict[str, str]
) -> dict:
    """The ``config`` of every record of an offloaded run (``data``: make_batches's names of
    the data set and tokenizer)."""
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


def train_step(
    model: torch.nn.Module,
    opt: CPUOffloadAdam,
    batch: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
    lr: float,
) -> dict:
    """One optimizer step at ``lr`` over ``batch`` in micro-batches; step_metrics and the
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


def run_offload(
    cfg: TrainConfig,
    batches: list[torch.Tensor],
    device: torch.device,
    log: RunLog,
    seed: int,
    data: dict[str, str],
) -> tuple[list[dict], dict, dict]:
    """Train on ``batches`` with CPUOffloadAdam under the memory caps from the weights of
    ``seed``; a ``memory_budget`` record, one record per step, then a summary (returns the step
    metrics, the summary's and the records' config). Both caps are checked after set-up (before
    any record) and after every step (before its record): past one, MemoryCapExceeded."""
    cuda = device.type == "cuda"
    if cuda:
        set_memory_cap(device, cfg.memory_cap_gib)
    threads = resolve_cpu_threads(cfg.cpu_threads)
    model = initial_model(cfg, seed).train()
    n_params = count_params(model)
    opt, plan = build_optimizer(model, cfg, device, threads)
    model.to(device)  # buffers; parameters are already bf16 working copies on the device
    static_gib = torch.cuda.memory_allocated(device) / GIB if cuda else math.nan
    act_bytes = measure_activation_bytes(model, opt, device, cfg) if cuda else None
    rss_peak = host_rss_gib()
    check_memory_caps(cfg, "after set-up", gpu_peak_gib(device), rss_peak)
    ckpt = pick_checkpoint_layers(cfg, n_params, act_bytes, optimizer_gpu_gib(plan))
    checkpoint_blocks(model, ckpt)
    opt.timeline.enabled = True
    config = run_config(cfg, n_params, ckpt, threads, data)
    measured = {
        "measured_static_gib": static_gib,
        "measured_setup_host_rss_gib": rss_peak,
        "measured_moment_gib": opt.moment_nbytes() / GIB,
    }
    budget = budget_metrics(cfg, n_params, ckpt, plan, measured, act_bytes)
    log.log("memory_budget", config, budget)
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


def summarize(rows: list[dict], fixed_batch: bool, budget: dict) -> dict:
    """speed_summary with the step time split's medians, the host resident set's peak since
    set-up, and the budget's totals beside the measured peaks."""
    timed = rows[1:] or rows
    return {
        **speed_summary(rows, fixed_batch),
        **{f"{k}_s_median": median([r[f"{k}_s"] for r in timed]) for k in TIMELINE_KINDS},
        "gpu_budget_gib": budget["gpu_total_gib"],
        "host_rss_peak_gib": rows[-1]["host_rss_peak_gib"],
        "host_budget_gib": budget["host_total_gib"],
        "state": budget["state"],
    }


def print_offload(rows: list[dict], summary: dict, fixed_batch: bool, title: str) -> None:
    """Our run's step table, the state's placement and the peaks beside their estimates."""
    print_table([{k: r[k] for k in TABLE_COLUMNS} for r in rows], title=title)
    state = [{**r, "gib": r["bytes"] / GIB} for r in summary["state"]]
    print_table(state, title="Training state: where it lives (computed)")
    print(
        f"GPU: peak {summary['peak_gib_max']:.3f} GiB measured, {summary['gpu_budget_gib']:.3f} "
        f"GiB estimated; host: resident set peak {summary['host_rss_peak_gib']:.3f} GiB "
        f"measured, state {summary['host_budget_gib']:.3f} GiB computed"
    )
    if fixed_batch:
        drop = summary["loss_drop"]
        print(f"fixed batch: loss fell by {drop:.1%} in {len(rows)} steps (target >= 50%)")


def print_equivalence(rows: list[dict], reference: list[dict], eq: dict, data: str) -> None:
    """Both loss curves step by step, their gap, and the verdict against the targets."""
    table = [{"step": r["step"], "lr": r["lr"], "ours": r["loss"], "reference": ref["loss"],
              "gap": gap} for r, ref, gap in zip(rows, reference, eq["abs_gap"], strict=True)]  # fmt: skip
    print_table(table, title=f"Equivalence with torch AdamW ({data})")
    print(
        f"mean |gap| {eq['mean_abs_gap']:.4f} nats (max {eq['max_abs_gap']:.4f}; target <= "
        f"{MAX_MEAN_GAP_NATS}); fall ours {eq['fall_ours']:.1%}, reference "
        f"{eq['fall_reference']:.1%} (target >= {MIN_FALL:.0%}): "
        f"{'PASS' if eq['passed'] else 'FAIL'}"
    )


def main() -> None:
    args, cfg = parse_train_args(base_parser(__doc__.splitlines()[0], default_out="runs/gpt2"))
    # Before CUDA starts: without it the cap counts memory reserved between segments.
    use_expandable_segments()
    # Every input is checked before the log is opened: a refused run leaves no record.
    model_config = model_folder_config(cfg.model_path, cfg.size, cfg.seq) or gpt2_config(cfg.size)
    device = device_from_arg("cpu" if args.quick and args.device == "auto" else args.device)
    require_run_fits(cfg, model_config, device)  # before the data and the model are made
    batches, data = make_batches(cfg, model_config.vocab_size, args.seed)
    run = start_run(args, task=TASK, logs="gpt2.jsonl")
    if cfg.update_on == "device" and run.device.type != "cuda":
        raise UsageError(
            f"--update-on device runs the 8-bit Adam step on the GPU: it needs --device cuda "
            f"(this run is on {run.device})"
        )
    rows, summary, config = run_offload(cfg, batches, run.device, run.log, args.seed, data)
    title = f"CPU-offloaded Adam on {run.where} (log: {run.log.path})"
    print_offload(rows, summary, cfg.fixed_batch, title)
    if cfg.reference == "adamw":
        reference = run_reference(cfg, batches, run.device, run.log, args.seed, config)
        eq = equivalence_summary(rows, reference)
        run.log.log("equivalence", config, eq)
        print_equivalence(rows, reference, eq, data["data"])


if __name__ == "__main__":
    run_main(main)
