"""One training run with the CPU-offloaded Adam, as train.py and finetune_code.py make it: the
model and :class:`effdl.optim.CPUOffloadAdam` built under the memory caps, the memory budget
logged beside the measured set-up, timed steps logged as they end, and the run's summary.

:func:`start_offload` sets up (and logs ``memory_budget``), :func:`train_offload` runs the
steps, :func:`summarize` sums them up; what a script does between them (an evaluation before
and after, say) runs on the model as trained: bf16 working weights on the device.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from effdl.gpt2_offload.budget import (
    budget_metrics,
    measure_activation_bytes,
    offload_options,
    optimizer_gpu_gib,
    pick_checkpoint_layers,
)
from effdl.gpt2_offload.config import TrainConfig
from effdl.gpt2_offload.inputs import initial_model, lr_at, set_lr
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
from effdl.models.gpt2 import checkpoint_blocks, count_params, lm_loss
from effdl.optim import CPUOffloadAdam, OffloadPlan, plan_offload
from effdl.profiling.memory import ALLOC_CONF
from effdl.profiling.timing import GIB
from effdl.results import RunLog

TIMELINE_KINDS = ("gpu_compute", "d2h", "h2d", "cpu_update", "cpu_accumulate", "step_wait")


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
    """The ``config`` of every record of an offloaded run (``data``: the names of the data set
    and tokenizer)."""
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


@dataclass
class OffloadRun:
    """A run set up by :func:`start_offload`: the model (bf16 working weights on the device),
    its optimizer, the records' ``config``, the ``memory_budget`` metrics, and the host's
    resident-set peak sampled so far."""

    model: torch.nn.Module
    opt: CPUOffloadAdam
    config: dict
    budget: dict
    rss_peak: float


def start_offload(
    cfg: TrainConfig, device: torch.device, log: RunLog, seed: int, data: dict[str, str]
) -> OffloadRun:
    """The model from the weights of ``seed`` (:func:`initial_model`) and CPUOffloadAdam under
    the memory caps, the fewest checkpointed blocks that fit (or ``--checkpoint-layers``), and a
    ``memory_budget`` record. Both caps are checked after set-up, before that record: past one,
    :class:`effdl.gpt2_offload.steps.MemoryCapExceeded`."""
    cuda = device.type == "cuda"
    if cuda:
        set_memory_cap(device, cfg.memory_cap_gib)
    threads = resolve_cpu_threads(cfg.cpu_threads)
    model = initial_model(cfg, seed).train()
    n_params = count_params(model)
    opt, plan = build_optimizer(model, cfg, device, threads)
    model.to(device)  # buffers; parameters are already bf16 working copies on the device
    static_gib = torch.cuda.memory_allocated(device) / GIB if cuda else None
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
    return OffloadRun(model, opt, config, budget, rss_peak)


def train_offload(
    run: OffloadRun,
    cfg: TrainConfig,
    batches: list[torch.Tensor],
    device: torch.device,
    log: RunLog,
    variant: str,
) -> list[dict]:
    """One step per batch of ``batches`` (lr by :func:`lr_at`), one ``variant`` record per step
    as it ends; both caps checked after every step, before its record. The last step's record
    carries the step's timeline. Returns the step metrics."""
    rows = []
    for step, batch in enumerate(tqdm(batches, desc=variant, unit="step")):
        lr = lr_at(step, cfg)
        metrics = {"step": step, **train_step(run.model, run.opt, batch, cfg, device, lr)}
        run.rss_peak = max(run.rss_peak, metrics["host_rss_gib"])
        metrics["host_rss_peak_gib"] = run.rss_peak
        check_memory_caps(cfg, f"step {step}", metrics["peak_gib"], metrics["host_rss_gib"])
        if step == len(batches) - 1:
            metrics["timeline"] = run.opt.timeline.spans()
        log.log(variant, run.config, metrics)
        rows.append(metrics)
    return rows


def summarize(rows: list[dict], fixed_batch: bool, budget: dict) -> dict:
    """speed_summary with the step time split's medians, the host resident set's peak since
    set-up, and the budget's totals beside the measured peaks."""
    timed = rows[1:] or rows
    speed = speed_summary(rows, fixed_batch)
    rss_peak = rows[-1]["host_rss_peak_gib"]
    return {
        **speed,
        **{f"{k}_s_median": median([r[f"{k}_s"] for r in timed]) for k in TIMELINE_KINDS},
        "gpu_budget_gib": budget["gpu_total_gib"],
        "host_rss_peak_gib": rss_peak,
        "host_rss_high_water_gib": max(speed["host_rss_high_water_gib"], rss_peak),
        "host_budget_gib": budget["host_total_gib"],
        "state": budget["state"],
    }
