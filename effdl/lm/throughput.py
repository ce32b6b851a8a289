"""Throughput of an LM training run: tokens/s, TFLOP/s per GPU and MFU from a step time,
against the datasheet bf16 peak and the bf16 GEMM ceiling measured on the same GPU model."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from effdl.lm.processes import Dist, all_reduce_sum
from effdl.profiling.timing import RegionTimer
from effdl.results import read_records

CEILINGS = Path(__file__).resolve().parent.parent.parent / "reports" / "results" / "ceilings"
SUMMARY = ("tokens_per_s", "tflops", "mfu", "mfu_measured", "step_s", "peak_gib")


def measured_bf16_ceiling(gpu_name: str | None, folder: Path = CEILINGS) -> float | None:
    """The best bf16 dense-GEMM TFLOP/s measured on this GPU model by
    swiglu_checkpoint/gpu_ceilings.py (records ``matmul_bf16`` in ``folder``); None if absent."""
    if gpu_name is None or not folder.is_dir():
        return None
    found = [
        rec["metrics"]["tflops"]
        for file in sorted(folder.glob("*.jsonl"))
        for rec in read_records(file)
        if rec["variant"] == "matmul_bf16" and rec["env"].get("gpu") == gpu_name
    ]
    return max(found) if found else None


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
        """``step_s`` and the throughput it means: tokens/s, TFLOP/s per GPU, both MFUs."""
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
    """Medians of the throughput metrics (:data:`SUMMARY`) past the first ``skip`` steps, the
    largest peak memory, and the last step's loss."""
    timed = rows[skip:]
    out = {"timed_steps": len(timed)}
    for key in SUMMARY:
        values = [r[key] for r in timed if r[key] is not None and not math.isnan(r[key])]
        out[key] = (
            (max(values) if key == "peak_gib" else statistics.median(values)) if values else None
        )
    out["final_loss"] = rows[-1]["loss"]
    return out


class PendingSteps:
    """Training steps whose device values (loss, label tokens, gradient norm) wait for one host
    read: :meth:`flush` copies all of them at once, sums loss and label tokens over the ranks,
    and adds each step's time (the ``timer``'s last regions, one per step) and throughput."""

    def __init__(self, rates: Rates, timer: RegionTimer, d: Dist) -> None:
        self.rates, self.timer, self.d = rates, timer, d
        self._pending: list[dict] = []

    def add(
        self,
        host_values: dict,
        loss: torch.Tensor,
        label_tokens: torch.Tensor,
        grad_norm: torch.Tensor,
    ) -> None:
        """One step: its host-side values and its 0-d device tensors (``loss``: this rank's
        share of the step's mean loss, ``label_tokens``: of all ranks)."""
        self._pending.append((host_values, torch.stack([loss, label_tokens]), grad_norm))

    def flush(self) -> list[dict]:
        """The rows of the pending steps, in order (a collective when several ranks run)."""
        if not self._pending:
            return []
        hosts, local, norms = zip(*self._pending, strict=True)
        norms = torch.stack(norms).tolist()
        losses = all_reduce_sum(torch.stack(local), self.d).tolist()
        times = self.timer.times()[-len(hosts) :]
        rows = [
            {**h, "loss": loss, "label_tokens": int(labels), "grad_norm": norm,
             **self.rates.metrics(step_s)}
            for h, (loss, labels), norm, step_s in zip(hosts, losses, norms, times, strict=True)
        ]  # fmt: skip
        self._pending.clear()
        return rows
