"""Wall-clock timing and peak-memory measurement that is correct on CUDA and on CPU.

CUDA work is asynchronous: a host clock read right after a launch measures the launch, not the
kernel. Here CUDA regions are timed with CUDA events recorded on the current stream and read only
after a synchronize; CPU regions use ``time.perf_counter``. Warm-up iterations run first so that
lazy initialisation (cuBLAS handles, autotuning, allocator growth) stays out of the numbers.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

GIB = 1024**3


@dataclass(frozen=True)
class TimingStats:
    """Summary of repeated timings, in seconds."""

    min: float
    max: float
    mean: float
    median: float
    std: float
    n: int

    @classmethod
    def from_times(cls, times: list[float]) -> TimingStats:
        """Summarise a non-empty list of durations (seconds)."""
        if not times:
            raise ValueError("TimingStats.from_times needs at least one duration")
        return cls(
            min=min(times),
            max=max(times),
            mean=statistics.fmean(times),
            median=statistics.median(times),
            std=statistics.pstdev(times) if len(times) > 1 else 0.0,
            n=len(times),
        )

    def as_dict(self, prefix: str = "") -> dict[str, float | int]:
        """Flat dict for a results record, e.g. ``{"step_s_median": ...}`` with prefix ``step_s_``."""
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}


def median_ratio_ci(
    num: list[float],
    den: list[float],
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
    *,
    paired: bool = False,
) -> tuple[float, float]:
    """Bootstrap confidence interval of ``median(num) / median(den)``.

    Resamples with replacement ``resamples`` times (a fixed seed: the same data give the same
    interval) and returns the central ``level`` quantiles of the resampled ratios. Where samples
    are noisy (host-bound steps), this says whether a ratio's distance from 1 means more than the
    run's own noise. By default the two lists are independent samples, each resampled on its
    own; with ``paired``, ``num[i]`` and ``den[i]`` were measured side by side (the same round of
    an interleaved benchmark) and are resampled together, so drift they share (a host slowing
    down for a few seconds) stays out of the interval.
    """
    if not num or not den:
        raise ValueError("median_ratio_ci needs two non-empty samples")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1); got {level}")
    if paired and len(num) != len(den):
        raise ValueError(f"paired samples need equal lengths; got {len(num)} and {len(den)}")
    rng = random.Random(seed)
    if paired:
        idx = range(len(num))
        picks = (rng.choices(idx, k=len(num)) for _ in range(resamples))
        ratios = sorted(
            statistics.median(num[i] for i in pick) / statistics.median(den[i] for i in pick)
            for pick in picks
        )
    else:
        ratios = sorted(
            statistics.median(rng.choices(num, k=len(num)))
            / statistics.median(rng.choices(den, k=len(den)))
            for _ in range(resamples)
        )
    tail = (1 - level) / 2
    lo = ratios[int(tail * (resamples - 1))]
    hi = ratios[math.ceil((1 - tail) * (resamples - 1))]
    return lo, hi


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on a CUDA device (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Stamp = float | torch.Event  # a perf_counter reading or a recorded CUDA event


class Clock:
    """Time stamps of the work of one device, on one axis: CUDA timing events recorded on a
    stream (the current one unless given), read after one synchronize, or ``perf_counter`` on
    the CPU. The one clock of effdl's timers (:class:`RegionTimer`, :class:`Timeline`, the layer
    profiler): on CUDA a host clock read after a launch would time the launch, not the kernel.
    Events handed back with :meth:`release` are recorded again by later marks."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._free: list[torch.Event] = []
        index = self.device.index
        self._on_current = not self.cuda or index is None or index == torch.cuda.current_device()
        self.origin = self.mark()

    def mark(self, stream: torch.cuda.Stream | None = None) -> Stamp:
        """A stamp now: in ``stream``'s (or the current stream's) order of work on CUDA."""
        if not self.cuda:
            return time.perf_counter()
        ev = self._free.pop() if self._free else torch.Event(self.device, enable_timing=True)
        if stream is not None:
            ev.record(stream)
        elif self._on_current:
            ev.record()
        else:
            ev.record(torch.cuda.current_stream(self.device))
        return ev

    def seconds(self, start: Stamp, end: Stamp) -> float:
        """Seconds from ``start`` to ``end``; on CUDA once both are reached (:meth:`wait`)."""
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start

    def wait(self) -> None:
        """Wait until every stamp taken so far is reached (a synchronize on CUDA)."""
        synchronize(self.device)

    def since_origin(self, stamps: list[Stamp]) -> list[float]:
        """Seconds from the clock's creation to each stamp, after one :meth:`wait`."""
        self.wait()
        return [self.seconds(self.origin, m) for m in stamps]

    def release(self, stamps: list[Stamp]) -> None:
        """Stamps that will not be read: their events are reused by later marks."""
        if self.cuda:
            self._free += stamps


class RegionTimer:
    """Times many regions (e.g. every batch of an epoch) with at most one sync at the end: each
    ``start()``/``stop()`` takes a :class:`Clock` stamp, so the loop never waits for the GPU;
    ``times()`` synchronizes once."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.clock = Clock(self.device)
        self._pairs: list[tuple[Stamp, Stamp]] = []
        self._open: Stamp | None = None

    def start(self) -> None:
        if self._open is not None:
            raise RuntimeError("RegionTimer.start() called twice without stop()")
        self._open = self.clock.mark()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("RegionTimer.stop() called without start()")
        self._pairs.append((self._open, self.clock.mark()))
        self._open = None

    @contextmanager
    def region(self) -> Iterator[None]:
        self.start()
        try:
            yield
        finally:
            self.stop()

    def times(self) -> list[float]:
        """Durations of all closed regions, in seconds (synchronizes once on CUDA)."""
        self.clock.wait()
        return [self.clock.seconds(a, b) for a, b in self._pairs]

    def stats(self) -> TimingStats:
        return TimingStats.from_times(self.times())


def benchmark(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    iters: int = 10,
    device: str | torch.device,
    setup: Callable[[], object] | None = None,
) -> TimingStats:
    """Time ``fn()`` ``iters`` times after ``warmup`` untimed calls.

    ``setup`` (optional) runs before every call, outside the timed region (e.g. zeroing grads).
    Each call is timed separately (CUDA events on ``device``'s current stream, or perf_counter),
    so the stats describe single calls, not a pipelined batch of them.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(
            f"benchmark needs iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}"
        )
    dev = torch.device(device)
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    synchronize(dev)
    timer = RegionTimer(dev)
    for _ in range(iters):
        if setup is not None:
            setup()
        timer.start()
        fn()
        timer.stop()
    return timer.stats()


@dataclass
class PeakMemory:
    """Filled in by :func:`peak_memory`: ``start_bytes`` on entry, the peak when the region ends
    (``gib`` stays None where nothing was measured)."""

    gib: float | None = None
    bytes: int = 0
    start_bytes: int = 0


class _RssSampler:
    """This process's resident set size, sampled by a thread every ``interval`` seconds until
    :meth:`stop` (RSS has no resettable peak to read)."""

    def __init__(self, interval: float) -> None:
        import psutil

        self._process = psutil.Process()
        self.start = self.peak = self._process.memory_info().rss
        self._interval, self._done = interval, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(self._interval):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def stop(self) -> int:
        """End the sampling; the largest RSS seen, the final one included (bytes)."""
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        return self.peak


@contextmanager
def peak_memory(
    device: str | torch.device, *, cpu_rss: bool = False, rss_interval: float = 0.01
) -> Iterator[PeakMemory]:
    """Peak memory inside the region (bytes and GiB) and the memory at its start.

    On CUDA: resets the peak counter on entry and reads ``max_memory_allocated`` on exit, so the
    number is the region's own peak (including tensors that were alive when it started);
    ``start_bytes`` is ``memory_allocated`` on entry. On CPU ``gib`` stays None, not measured
    (PyTorch keeps no allocator statistics there), unless ``cpu_rss``: then it is this process's
    peak RSS, sampled every ``rss_interval`` seconds by a thread (a peak shorter than that can be
    missed), and ``start_bytes`` the RSS on entry.
    """
    dev = torch.device(device)
    result = PeakMemory()
    sampler = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result.start_bytes = torch.cuda.memory_allocated(dev)
    elif cpu_rss:
        sampler = _RssSampler(rss_interval)
        result.start_bytes = sampler.start
    try:
        yield result
    finally:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            result.bytes = torch.cuda.max_memory_allocated(dev)
        elif sampler is not None:
            result.bytes = sampler.stop()
        if dev.type == "cuda" or sampler is not None:
            result.gib = result.bytes / GIB


def take_peak_memory(device: str | torch.device) -> float | None:
    """Peak GiB allocated since the counter was last reset, then reset it: one step's own peak
    when called after every step. The caching allocator decides on the host, in stream order,
    so this needs no synchronize. None on CPU: not measured (no allocator statistics there)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(dev) / GIB
    torch.cuda.reset_peak_memory_stats(dev)
    return peak


def largest_measured(values: Iterable[float | None]) -> float | None:
    """The largest of ``values`` that were measured (not None); None if none was."""
    measured = [v for v in values if v is not None]
    return max(measured) if measured else None


def median_measured(values: Iterable[float | None]) -> float | None:
    """The median of ``values`` that were measured (not None); None if none was."""
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None
