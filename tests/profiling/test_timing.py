import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from effdl.profiling.timing import (
    Clock,
    RegionTimer,
    TimingStats,
    benchmark,
    largest_measured,
    median_measured,
    median_ratio_ci,
    peak_memory,
    take_peak_memory,
)


def test_stats_match_statistics_module():
    times = [0.3, 0.1, 0.4, 0.1, 0.5]
    s = TimingStats.from_times(times)
    assert (s.min, s.max, s.n) == (0.1, 0.5, 5)
    assert s.mean == pytest.approx(statistics.fmean(times))
    assert s.median == pytest.approx(statistics.median(times))
    assert s.std == pytest.approx(statistics.pstdev(times))
    assert s.as_dict("t_")["t_median"] == s.median


def test_stats_reject_empty():
    with pytest.raises(ValueError, match="at least one"):
        TimingStats.from_times([])


def test_benchmark_cpu_times_fn_alone_and_counts_calls(monkeypatch):
    """A fake clock that fn advances by 10 ms and setup by 20 ms: the timed region holds fn
    alone, whatever the machine's load."""
    import effdl.profiling.timing as timing

    clock = {"now": 0.0}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    calls = {"fn": 0, "setup": 0}

    def fn():
        calls["fn"] += 1
        clock["now"] += 0.010

    def setup():
        calls["setup"] += 1
        clock["now"] += 0.020  # outside the timed region

    s = benchmark(fn, warmup=2, iters=4, device="cpu", setup=setup)
    assert calls == {"fn": 6, "setup": 6}
    assert s.n == 4
    assert s.median == pytest.approx(0.010) and s.max == pytest.approx(0.010)


def test_benchmark_rejects_bad_counts():
    with pytest.raises(ValueError, match="iters"):
        benchmark(lambda: None, iters=0, device="cpu")


def test_region_timer_cpu_and_misuse(monkeypatch):
    """On a fake clock: each region's duration exactly, whatever the machine's load."""
    clock = {"now": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    t = RegionTimer("cpu")
    for d in (0.25, 0.5):
        with t.region():
            clock["now"] += d
        clock["now"] += 1.0  # between regions: not counted
    assert t.times() == [0.25, 0.5]
    with pytest.raises(RuntimeError):
        t.stop()
    t.start()
    with pytest.raises(RuntimeError):
        t.start()


def test_peak_memory_is_not_measured_on_cpu():
    """No allocator statistics on the CPU: None (null in a log), not NaN."""
    with peak_memory("cpu") as mem:
        torch.ones(10)
    assert mem.gib is None and mem.bytes == 0
    assert take_peak_memory("cpu") is None


def test_largest_and_median_of_what_was_measured():
    assert largest_measured([None, 1.5, None, 0.5]) == 1.5
    assert median_measured([None, 3.0, 1.0, 2.0]) == 2.0
    assert largest_measured([None, None]) is None and median_measured([]) is None
    assert math.isnan(median_measured([math.nan]))  # a NaN that was computed stays NaN


RSS_PROBE = """
import json, threading, time, torch
from effdl.profiling.timing import peak_memory
threads = threading.active_count()
size = 128 * 2**20
with peak_memory("cpu", cpu_rss=True, rss_interval=0.005) as mem:
    x = torch.ones(size, dtype=torch.uint8)  # written: resident, not just reserved
    time.sleep(0.1)
    del x
print(json.dumps({"size": size, "start": mem.start_bytes, "peak": mem.bytes, "gib": mem.gib,
                  "threads_left": threading.active_count() - threads}))
"""


def test_peak_memory_cpu_rss_sees_a_freed_allocation_and_stops_its_sampler():
    """RSS sampling catches a buffer held for a few sampling intervals and freed before the
    region ends; the sampling thread is gone after the region. In a fresh process: in this one,
    earlier tests leave freed memory resident that the buffer may reuse without RSS growing."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", RSS_PROBE], capture_output=True, text=True,
                          env=env, timeout=120, check=True)  # fmt: skip
    got = json.loads(done.stdout)
    assert got["start"] > 0
    assert got["peak"] - got["start"] >= 0.9 * got["size"]
    assert got["gib"] == pytest.approx(got["peak"] / 2**30)
    assert got["threads_left"] == 0


def test_clock_on_the_cpu_reads_perf_counter_from_its_origin(monkeypatch):
    now = iter([10.0, 10.5, 12.0, 13.25])
    monkeypatch.setattr(time, "perf_counter", lambda: next(now))
    clock = Clock("cpu")  # origin 10.0
    a, b, c = clock.mark(), clock.mark(), clock.mark()
    assert clock.seconds(a, c) == 2.75
    assert clock.since_origin([a, b, c]) == [0.5, 2.0, 3.25]
    clock.release([a, b])  # host stamps hold nothing to reuse
    assert not clock.cuda


@pytest.mark.gpu
def test_clock_reuses_released_events_and_times_the_kernel():
    clock = Clock("cuda")
    a = torch.randn(4096, 4096, device="cuda")
    start = clock.mark()
    for _ in range(3):
        a @ a
    end = clock.mark()
    (took,) = clock.since_origin([end])
    assert took >= clock.seconds(start, end) > 1e-4  # three 4096^3 GEMMs: well above a launch
    clock.release([start])
    assert clock.mark() is start


@pytest.mark.gpu
def test_benchmark_cuda_events_time_the_kernel_not_the_launch():
    # A GEMM that takes milliseconds: a launch-only (unsynchronized) timer would read microseconds.
    a = torch.randn(4096, 4096, device="cuda")
    s = benchmark(lambda: a @ a, warmup=2, iters=5, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 5
    assert s.median == pytest.approx(wall, rel=0.3)


@pytest.mark.gpu
def test_peak_memory_cuda_sees_region_allocation():
    # Tensors of earlier tests may still be alive: they count in the peak, so compare above them.
    alive = torch.cuda.memory_allocated() / 2**30
    with peak_memory("cuda") as mem:
        x = torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda")  # 0.25 GiB
        del x
    assert 0.25 <= mem.gib - alive < 0.5
    with peak_memory("cuda") as mem2:
        pass
    assert mem2.gib - alive < 0.25  # reset on entry: the earlier tensor does not count


def test_median_ratio_ci_brackets_the_ratio_and_scales_with_it():
    rng = random.Random(1)
    den = [1.0 + 0.1 * rng.gauss(0, 1) for _ in range(30)]
    num = [0.8 + 0.08 * rng.gauss(0, 1) for _ in range(30)]
    lo, hi = median_ratio_ci(num, den)
    point = statistics.median(num) / statistics.median(den)
    assert lo < point < hi
    assert hi < 1.0  # a 20% gap is well outside 10% noise with 30 samples each
    assert median_ratio_ci(num, den) == (lo, hi)  # seeded: reproducible
    lo2, hi2 = median_ratio_ci([2 * v for v in num], den)  # same resamples, ratio doubled
    assert lo2 == pytest.approx(2 * lo) and hi2 == pytest.approx(2 * hi)
    wide = median_ratio_ci(num[:5], den[:5])
    assert wide[1] - wide[0] > hi - lo  # fewer samples, wider interval
    with pytest.raises(ValueError, match="non-empty"):
        median_ratio_ci([], den)


def test_paired_median_ratio_ci_removes_shared_drift():
    """Rounds whose speed drifts twofold, both variants alike, num 5% faster: only the paired
    interval sees that num is faster."""
    rng = random.Random(2)
    drift = [rng.uniform(1.0, 2.0) for _ in range(40)]
    den = [d * (1 + 0.01 * rng.gauss(0, 1)) for d in drift]
    num = [0.95 * d * (1 + 0.01 * rng.gauss(0, 1)) for d in drift]
    lo, hi = median_ratio_ci(num, den)
    assert lo < 1.0 < hi
    plo, phi = median_ratio_ci(num, den, paired=True)
    assert plo < statistics.median(num) / statistics.median(den) < phi < 1.0
    with pytest.raises(ValueError, match="equal lengths"):
        median_ratio_ci(num, den[:-1], paired=True)
