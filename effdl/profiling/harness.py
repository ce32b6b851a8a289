"""The interleaved-rounds benchmark harness: time several variants of one workload side by side.

Host-bound steps drift over seconds (other processes, CPU clocks), and so does a GPU's clock
under load; timing one variant after another lands that drift on whichever ran then. Here every
variant is built once and kept alive, warmed up, and run a few synchronized steps (its own peak
memory and its synchronized step time, which sets how many steps it is timed for); its timed
steps are then split into chunks over ``rounds`` rounds, each round running one chunk of every
variant, starting one variant later each round, after an untimed warm-up round. The device is
synchronized before each timed chunk: work a variant left queued (a GPU-bound one runs behind
its host) would otherwise run inside the next variant's chunk and hide that one's host time.
Python's cyclic GC is paused over the rounds (as ``timeit`` does). A variant that runs out of
GPU memory, to build, warm up or run, is marked OOM and dropped; the others go on.

Usage::

    def build_reference() -> Step:  # runs under the OOM guard; seed here, so variants match
        model, x = ...

        def step(steps: int, regions: Regions | None) -> None:
            for _ in range(steps):
                if regions is not None:
                    regions["fwd"].start()
                y = model(x)
                ...

        return step

    results = time_variants([Variant("reference", build_reference), ...], HarnessConfig(), device)
    results["reference"].metrics()  # {"step_s_median": ..., "peak_gib": ..., ...} or {"oom": True}
    median_ratio_ci(results["a"].step, results["reference"].step, paired=True)

A step function runs ``steps`` steps back to back (no synchronize) and leaves its variant holding
only what it held after ``build`` (drop gradients), so an idle variant holds only its base. It gets
``regions`` only in timed chunks: named :class:`RegionTimer` s for parts of each step, reported as
``<name>_s_*``. A step's time is its chunk's time over its steps, i.e. throughput;
:func:`host_timed` adds the host's own time of a region's code beside its device time.

On CUDA, :func:`capture_graph` and :func:`graph_replay_times` time a step's kernels alone:
captured once in a CUDA graph, replayed in interleaved rounds (no host cost in the numbers).
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from effdl.gc_pause import gc_paused
from effdl.profiling.timing import GIB, RegionTimer, TimingStats, peak_memory

RESERVED_REGIONS = ("step", "step_synced")  # names of the harness's own step times


class Regions:
    """Named region timers of one variant, created on first use; ``regions["fwd"].start()``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._timers: dict[str, RegionTimer] = {}

    def __getitem__(self, name: str) -> RegionTimer:
        timer = self._timers.get(name)
        if timer is None:
            if name in RESERVED_REGIONS:
                raise ValueError(f"region name {name!r} is reserved: {RESERVED_REGIONS}")
            timer = self._timers[name] = RegionTimer(self.device)
        return timer

    def times(self) -> dict[str, list[float]]:
        """Each region's durations in seconds, in the order they ran (synchronizes once)."""
        return {name: timer.times() for name, timer in self._timers.items()}


Step = Callable[[int, Regions | None], None]


@dataclass(frozen=True)
class Variant:
    """A named workload; ``build()`` allocates what it holds between steps and returns its step."""

    name: str
    build: Callable[[], Step]


@dataclass(frozen=True)
class HarnessConfig:
    """How long each variant is warmed up and timed.

    Timed steps per variant: ``max(min_steps, min(max_steps, ceil(min_time / synced step)))``,
    in ``min(rounds, steps)`` chunks. Warm-up: at least ``warmup_steps`` synchronized steps and
    ``warmup_time`` seconds of them, at most ``max_steps``; then ``memory_steps`` synchronized
    steps give the synchronized step time and the own peak memory.
    """

    rounds: int = 100
    min_steps: int = 5
    max_steps: int = 4000
    min_time: float = 3.0
    warmup_steps: int = 1
    warmup_time: float = 0.5
    memory_steps: int = 3

    def __post_init__(self) -> None:
        if min(self.rounds, self.min_steps, self.max_steps, self.memory_steps) < 1:
            raise ValueError(f"rounds, min_steps, max_steps, memory_steps must be >= 1: {self}")
        if min(self.warmup_steps, self.warmup_time, self.min_time) < 0:
            raise ValueError(f"warmup_steps, warmup_time, min_time must be >= 0: {self}")

    def record(self) -> dict:
        """The settings a benchmark's log records carry, under the scripts' flag names."""
        return {
            "warmup": self.warmup_steps,
            "warmup_time_s": self.warmup_time,
            "reps": self.min_steps,
            "rounds": self.rounds,
            "min_time_s": self.min_time,
        }

    def timed_steps(self, synced_step_s: float) -> int:
        """How many steps a variant whose synchronized step takes ``synced_step_s`` is timed for."""
        if self.min_time <= 0:
            return self.min_steps
        wanted = math.ceil(self.min_time / synced_step_s) if synced_step_s > 0 else self.max_steps
        return max(self.min_steps, min(self.max_steps, wanted))


@dataclass
class VariantResult:
    """Raw measurements of one variant; ``step`` holds one time per chunk, in round order."""

    name: str
    step: list[float] = field(default_factory=list)  # per chunk: its time / its steps
    synced: list[float] = field(default_factory=list)  # the synchronized memory steps
    regions: dict[str, list[float]] = field(default_factory=dict)  # per step, by name
    peaks: list[int] = field(default_factory=list)  # own peak bytes per memory step (CUDA)
    base: int = 0  # bytes allocated by build: held between steps
    chunks: int = 0
    chunk_steps: int = 0
    oom: bool = False

    def metrics(self) -> dict:
        """Medians and spreads of the times, the peak memory; ``{"oom": True}`` after an OOM.

        Memory entries are None off CUDA (not measured): PyTorch keeps no allocator statistics
        on the CPU.
        """
        if self.oom:
            return {"oom": True}
        metrics = {}
        for name, times in self.regions.items():
            metrics.update(TimingStats.from_times(times).as_dict(f"{name}_s_"))
        metrics.update(
            **TimingStats.from_times(self.step).as_dict("step_s_"),
            **TimingStats.from_times(self.synced).as_dict("step_synced_s_"),
            chunks=self.chunks,
            chunk_steps=self.chunk_steps,
            step_s_per_chunk=self.step,  # in round order, for paired comparisons
        )
        if self.peaks:
            peak = max(self.peaks)
            metrics.update(
                peak_gib=peak / GIB,
                base_gib=self.base / GIB,
                activation_peak_gib=(peak - self.base) / GIB,
            )
        else:
            metrics.update(peak_gib=None, base_gib=None, activation_peak_gib=None)
        return metrics


def fresh_state(device: torch.device) -> None:
    """Collect garbage and, on CUDA, return cached blocks and reset the peak counter."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def warm_up(
    step: Step, device: torch.device, steps: int, seconds: float, max_steps: int | None
) -> None:
    """At least ``steps`` (and one) synchronized steps and ``seconds`` of them, at most
    ``max_steps`` (None: no cap): first steps pay one-off costs (kernel loading, GEMM heuristics,
    compilation) that would inflate the synchronized steps the timed step count comes from."""
    start, done = time.perf_counter(), 0
    while done < max(steps, 1) or (
        time.perf_counter() - start < seconds and (max_steps is None or done < max_steps)
    ):
        step(1, None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        done += 1


def settle(variant: Variant, seconds: float, device: torch.device) -> None:
    """Run ``variant`` untimed for ``seconds``, then free it: a GPU host's first seconds under load
    can be disturbed, and nothing should be timed then."""
    if seconds <= 0:
        return
    step = variant.build()
    warm_up(step, device, 1, seconds, max_steps=None)
    del step
    fresh_state(device)


def measure_memory(
    step: Step, result: VariantResult, cfg: HarnessConfig, device: torch.device
) -> None:
    """Warm ``step`` up, then time ``cfg.memory_steps`` synchronized steps, each with the peak
    counter reset: their peaks less what the other (idle) variants hold are the variant's own."""
    warm_up(step, device, cfg.warmup_steps, cfg.warmup_time, cfg.max_steps)
    synced = RegionTimer(device)
    for _ in range(cfg.memory_steps):
        others = _allocated(device) - result.base
        with peak_memory(device) as mem, synced.region():
            step(1, None)
        if device.type == "cuda":
            result.peaks.append(mem.bytes - others)
    result.synced += synced.times()


def time_variants(
    variants: Sequence[Variant], cfg: HarnessConfig, device: torch.device
) -> dict[str, VariantResult]:
    """Build every variant, measure its memory, then time all of them in interleaved rounds
    (see the module docstring); results by name, in the order given."""
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique: {names}")
    results = {v.name: VariantResult(v.name) for v in variants}
    alive: dict[str, Step] = {}
    fresh_state(device)
    for variant in variants:
        before = _allocated(device)
        try:
            alive[variant.name] = variant.build()
        except torch.cuda.OutOfMemoryError:
            results[variant.name].oom = True
            continue
        results[variant.name].base = _allocated(device) - before

    def drop(name: str) -> None:
        results[name].oom = True
        del alive[name]
        fresh_state(device)

    for name, step in list(alive.items()):
        result = results[name]
        try:
            measure_memory(step, result, cfg, device)
        except torch.cuda.OutOfMemoryError:
            drop(name)
            continue
        n = cfg.timed_steps(statistics.median(result.synced))
        result.chunks = min(cfg.rounds, n)
        result.chunk_steps = math.ceil(n / result.chunks)

    chunk_timers = {name: RegionTimer(device) for name in alive}
    regions = {name: Regions(device) for name in alive}
    gc.collect()
    with gc_paused():  # a cyclic collection would land on whichever variant runs then
        for rnd in range(-1, cfg.rounds):  # round -1 warms up, untimed
            shift = max(rnd, 0) % len(names)
            for name in names[shift:] + names[:shift]:
                if name not in alive or rnd >= results[name].chunks:
                    continue
                steps = results[name].chunk_steps
                try:
                    if rnd < 0:
                        alive[name](steps, None)
                        continue
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # no other variant's work in this chunk
                    chunk_timers[name].start()
                    alive[name](steps, regions[name])
                    chunk_timers[name].stop()
                except torch.cuda.OutOfMemoryError:
                    drop(name)
    for name in alive:
        result = results[name]
        result.step += [t / result.chunk_steps for t in chunk_timers[name].times()]
        result.regions = regions[name].times()
    alive.clear()
    fresh_state(device)
    return results


@contextlib.contextmanager
def host_timed(regions: Regions | None, name: str, host: dict[str, list[float]]) -> Iterator[None]:
    """Region ``name`` on the device's clock, and the host's own time of the code inside
    (``perf_counter``) appended to ``host[name]``; nothing when ``regions`` is None (an untimed
    step)."""
    if regions is None:
        yield
        return
    with regions[name].region():
        start = time.perf_counter()
        yield
        host[name].append(time.perf_counter() - start)


def capture_graph(
    step: Callable[[], None],
    device: torch.device,
    warmup: int = 3,
    before_capture: Callable[[], None] | None = None,
) -> torch.cuda.CUDAGraph:
    """``step`` warmed up ``warmup`` times on a side stream (compiles what compiles, picks
    kernels), then, after ``before_capture`` (e.g. dropping gradients, so the capture allocates
    them), captured in a CUDA graph. The caller keeps alive what the graph reads and writes."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def graph_replay_times(
    graphs: dict[str, torch.cuda.CUDAGraph], rounds: int, replays: int
) -> dict[str, list[float]]:
    """Per name, seconds per replay in each of ``rounds`` interleaved rounds of ``replays``
    back-to-back replays between two CUDA events, after one untimed replay of each."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for g in graphs.values():
        g.replay()
    for _ in range(rounds):
        for name, g in graphs.items():
            start.record()
            for _ in range(replays):
                g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3 / replays)
    return times
