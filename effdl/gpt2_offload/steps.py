"""Timed training steps of a GPT-2 offload run, measured the same way for every optimizer:
peak GPU memory and the host's resident set against the run's caps, step time, speed, and the
summary every run logs."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable

import psutil
import torch
from tqdm import tqdm

from effdl.gpt2_offload.config import TrainConfig
from effdl.gpt2_offload.inputs import lr_at, set_lr
from effdl.models.gpt2 import backward_micro_batches
from effdl.profiling.timing import GIB, largest_measured
from effdl.results import RunLog


class MemoryCapExceeded(RuntimeError):
    """A measured peak passed ``--memory-cap-gib`` or ``--host-memory-cap-gib``."""


def set_memory_cap(device: torch.device, cap_gib: float) -> float:
    """Enforce the cap with the caching allocator; returns the fraction set."""
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    frac = min(1.0, cap_gib / total)
    torch.cuda.set_per_process_memory_fraction(frac, device)
    return frac


def gpu_peak_gib(device: torch.device) -> float | None:
    """``torch.cuda.max_memory_allocated`` in GiB (None off CUDA: not measured)."""
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def host_rss_gib() -> float:
    """The process's resident set now (pinned host buffers included), in GiB."""
    return psutil.Process().memory_info().rss / GIB


def host_rss_high_water_gib() -> float:
    """The kernel's high-water mark of the process's resident set since it started, in GiB
    (it also sees the peaks between two samples of :func:`host_rss_gib`, but is updated lazily:
    memory returned with ``madvise`` may leave a sampled peak above it)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB  # bytes vs KiB


def check_memory_caps(cfg: TrainConfig, when: str, peak_gib: float | None, rss_gib: float) -> None:
    """Raise :class:`MemoryCapExceeded` naming the cap and the measurement if GPU peak
    (None off CUDA: nothing to check) or host resident set passed its cap."""
    if peak_gib is not None and peak_gib > cfg.memory_cap_gib:
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
    return {
        "loss": loss_value,
        "lr": lr,
        "step_s": wall,
        "seq_per_s": cfg.batch / wall,
        "peak_gib": gpu_peak_gib(device),
        "host_rss_gib": host_rss_gib(),
    }


def plain_step(
    opt: torch.optim.Optimizer,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    batch: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
    lr: float,
) -> dict:
    """One step of an optimizer that steps after backward (torch's AdamW, torchao's offload):
    the run's micro-batches, gradients summed in ``.grad``, then ``opt.step()`` at ``lr``;
    :func:`step_metrics`."""
    t0 = start_step(device)
    losses = backward_micro_batches(loss_of, batch, cfg.micro_batch, device)
    set_lr(opt, lr)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return step_metrics(cfg, device, t0, losses, lr)


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
    after every step, before its record, as in the offloaded run."""
    rows = []
    for step, batch in enumerate(tqdm(batches, desc=variant, unit="step")):
        metrics = {"step": step, **plain_step(opt, loss_of, batch, cfg, device, lr_at(step, cfg))}
        if capped:
            check_memory_caps(cfg, f"step {step}", metrics["peak_gib"], metrics["host_rss_gib"])
        log.log(variant, config, metrics)
        rows.append(metrics)
    log.log(f"{variant}_summary", config, speed_summary(rows, cfg.fixed_batch))
    return rows


def median(values: list[float]) -> float:
    """The upper median (a measured value, not an average of two)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def speed_summary(rows: list[dict], fixed_batch: bool) -> dict:
    """What every run's summary holds: median speed and step time past the first step (it pays
    the warm-up), peak GPU memory (None off CUDA) and host resident set, loss drop."""
    timed = rows[1:] or rows
    first, last = rows[0]["loss"], rows[-1]["loss"]
    rss_peak = max(r["host_rss_gib"] for r in rows)
    metrics = {
        "steps": len(rows),
        "seq_per_s_median": median([r["seq_per_s"] for r in timed]),
        "step_s_median": median([r["step_s"] for r in timed]),
        "peak_gib_max": largest_measured(r["peak_gib"] for r in rows),
        "host_rss_peak_gib": rss_peak,
        "host_rss_high_water_gib": max(host_rss_high_water_gib(), rss_peak),
        "loss_first": first,
        "loss_last": last,
        "loss_drop": 1.0 - last / first,
    }
    if fixed_batch:
        metrics["loss_halved"] = last <= 0.5 * first
    return metrics


def hf_loss(model: torch.nn.Module, ids: torch.Tensor, amp_dtype: torch.dtype) -> torch.Tensor:
    """Hugging Face's own loss (full logits) under autocast."""
    with torch.autocast(ids.device.type, dtype=amp_dtype):
        return model(ids, labels=ids).loss
