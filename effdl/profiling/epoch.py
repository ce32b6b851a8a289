"""One timed, forward-only pass of a language model over a DataLoader (a mock epoch).

Every batch's forward is timed on the device (:class:`~effdl.profiling.timing.RegionTimer`, one
synchronize at the end), and the epoch's wall time on the main thread is split into waiting for
the DataLoader and queueing the forwards, so a slow pipeline shows where its time goes.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from effdl.profiling.timing import RegionTimer, peak_memory


@dataclass(frozen=True)
class EpochTiming:
    """What :func:`time_epoch` measured over its timed batches (seconds, tokens).

    ``batch_s``: device time of each batch's forward. ``epoch_s``: wall time of the timed pass.
    ``real_tokens`` / ``slots``: non-padding tokens / token positions fed to the model;
    ``widths``: each batch's padded width. Host split of ``epoch_s``: ``first_batch_s`` (until
    the first batch arrives, worker start-up included), ``wait_s`` (later waits for the
    DataLoader), ``launch_s`` (host time to move each batch and queue its forward).
    ``peak_mem_gib``: the pass's own peak GPU memory (None on CPU: not measured).
    """

    batch_s: list[float]
    epoch_s: float
    real_tokens: int
    slots: int
    widths: list[int]
    peak_mem_gib: float | None
    first_batch_s: float
    wait_s: float
    launch_s: float

    @property
    def n_batches(self) -> int:
        return len(self.batch_s)

    @property
    def compute_s(self) -> float:
        """Summed device time of the forwards."""
        return float(np.sum(self.batch_s))

    @property
    def padding_fraction(self) -> float:
        return 1 - self.real_tokens / self.slots

    def host_split(self) -> dict[str, float]:
        """``first_batch_s``, ``wait_s`` and ``launch_s`` as a dict (log fields)."""
        return {
            "first_batch_s": self.first_batch_s,
            "wait_s": self.wait_s,
            "launch_s": self.launch_s,
        }


def time_epoch(
    forward: Callable[..., Any],
    loader: Iterable,
    device: torch.device,
    *,
    inputs_of: Callable[[Any], Any],
    precision: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    max_batches: int | None = None,
    warmup_batches: int = 10,
    progress: bool = False,
) -> EpochTiming:
    """Run ``forward(**model_kwargs)`` on the first ``warmup_batches`` batches of ``loader``
    (untimed), then time it on every batch of a fresh pass (at most ``max_batches``).

    ``loader`` yields padded or packed batches, which ``inputs_of`` turns into model inputs
    (``n_real_tokens``, ``n_slots``, ``model_kwargs``, ``to(device, ...)``, as
    :func:`~effdl.models.lm_objective.lm_inputs` gives; their token counts are taken on the CPU
    batch, so counting needs no device
    sync). Runs under ``torch.inference_mode()`` and ``precision()`` (e.g. an autocast
    factory); the labels stay on the host. ``progress`` shows a bar over the timed pass.
    Raises ``ValueError`` if the timed pass gets no batch.
    """
    with torch.inference_mode(), precision():
        for i, batch in enumerate(loader):
            if i >= warmup_batches:
                break
            forward(**inputs_of(batch).to(device, labels=False).model_kwargs)
        timer = RegionTimer(device)
        real = slots = 0
        widths: list[int] = []
        waits: list[float] = []
        launches: list[float] = []
        with peak_memory(device) as mem:
            start = time.perf_counter()
            batches = iter(
                tqdm(loader, desc="  epoch", unit="batch", leave=False, disable=not progress)
            )
            for _ in itertools.islice(itertools.count(), max_batches):
                t0 = time.perf_counter()
                batch = next(batches, None)
                t1 = time.perf_counter()
                if batch is None:
                    break
                waits.append(t1 - t0)
                inputs = inputs_of(batch)
                real += inputs.n_real_tokens
                slots += inputs.n_slots
                widths.append(inputs.model_kwargs["input_ids"].shape[1])
                inputs = inputs.to(device, non_blocking=True, labels=False)
                timer.start()
                forward(**inputs.model_kwargs)
                timer.stop()
                launches.append(time.perf_counter() - t1)
            times = timer.times()  # one synchronize
            epoch_s = time.perf_counter() - start
    if not waits:
        raise ValueError("time_epoch: the loader gave no batch to time")
    return EpochTiming(
        batch_s=times,
        epoch_s=epoch_s,
        real_tokens=real,
        slots=slots,
        widths=widths,
        peak_mem_gib=mem.gib,
        first_batch_s=waits[0],
        wait_s=float(np.sum(waits[1:])),
        launch_s=float(np.sum(launches)),
    )
