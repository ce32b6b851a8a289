"""Throughput of an LM training run: tokens/s, TFLOP/s per GPU and MFU from a step time,
against the datasheet bf16 peak and the bf16 GEMM ceiling measured on the same GPU model."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from effdl.cli import require_converged
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
    largest peak memory, and the last step's loss; None for a metric no step measured (peak
    memory on the CPU, MFU without a known peak)."""
    timed = rows[skip:]
    out = {"timed_steps": len(timed)}
    for key in SUMMARY:
        values = [r[key] for r in timed if r[key] is not None]
        out[key] = (
            (max(values) if key == "peak_gib" else statistics.median(values)) if values else None
        )
    out["final_loss"] = rows[-1]["loss"]
    return out


class PendingSteps:
    """Training steps whose device values (loss, label tokens, gradient norm) wait for one host
    read: :meth:`flush` copies all of them at once, sums loss and label tokens over the ranks,
    adds each step's time (the ``timer``'s region of that step: one region per step, from the
    first) and throughput, refuses a step whose loss is not finite (a UsageError naming
    ``step_size_flags``), and hands each row, in order, to ``write`` and to :attr:`rows`.

    Inside :meth:`flushed_on_interrupt` a Ctrl-C first writes every step already run."""

    def __init__(
        self,
        rates: Rates,
        timer: RegionTimer,
        d: Dist,
        write: Callable[[dict], object] | None = None,
        step_size_flags: str = "--lr",
    ) -> None:
        self.rates, self.timer, self.d = rates, timer, d
        self.write, self.step_size_flags = write, step_size_flags
        self.rows: list[dict] = []  # every step written so far
        self._pending: list[tuple] = []
        self._unwritten: list[dict] = []  # read, not yet written
        self._read = 0  # steps read so far: the index of the next one's timer region

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

    def flush(self, read: bool = True) -> list[dict]:
        """Read the pending steps (unless ``read`` is false: a collective when several ranks
        run) and write every step read and not yet written; returns the rows written."""
        if read and self._pending:
            hosts, local, norms = zip(*self._pending, strict=True)
            norms = torch.stack(norms).tolist()
            losses = all_reduce_sum(torch.stack(local), self.d).tolist()
            times = self.timer.times()[self._read : self._read + len(hosts)]
            rows = [
                {**h, "loss": loss, "label_tokens": int(labels), "grad_norm": norm,
                 **self.rates.metrics(step_s)}
                for h, (loss, labels), norm, step_s in zip(hosts, losses, norms, times, strict=True)
            ]  # fmt: skip
            # one assignment: a step is pending or read, never both or neither
            self._pending, self._unwritten, self._read = (
                [], self._unwritten + rows, self._read + len(rows)
            )  # fmt: skip
        written = []
        while self._unwritten:
            row = self._unwritten[0]
            require_converged(self.step_size_flags, f"training at step {row['step']}", row["loss"])
            if self.write is not None:
                self.write(row)
            del self._unwritten[0]  # once written: an interrupt may repeat a record, not lose it
            self.rows.append(row)
            written.append(row)
        return written

    @contextmanager
    def flushed_on_interrupt(self) -> Iterator[None]:
        """Ctrl-C (KeyboardInterrupt) in the block writes the steps already run, then goes on.
        With several ranks only the steps already read are: reading the others needs a
        collective, and a Ctrl-C stops the ranks at different points of a step."""
        try:
            yield
        except KeyboardInterrupt:
            self.flush(read=self.d.world == 1)
            raise
