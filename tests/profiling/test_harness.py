import gc
import time

import pytest
import torch

from effdl.profiling import harness
from effdl.profiling.harness import (
    HarnessConfig,
    Regions,
    Variant,
    settle,
    time_variants,
)
from effdl.profiling.timing import GIB

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_full_collections(request, monkeypatch):
    """The harness collects garbage between phases; with torch loaded a collection takes a
    large fraction of a second, and these CPU tests check the schedule, not the collector."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(gc, "collect", lambda *args: 0)


QUICK = dict(warmup_steps=1, warmup_time=0.0, min_time=0.0)


class FakeClock:
    """``time.perf_counter`` that only the fake variants advance: timings are exact."""

    def __init__(self, monkeypatch) -> None:
        self.now = 0.0
        monkeypatch.setattr(time, "perf_counter", lambda: self.now)


class Recorder:
    """Fake variants that log every call: (name, steps, timed, gc enabled) and advance the clock
    by their step time per step (dyadic, so sums stay exact)."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock
        self.calls: list[tuple[str, int, bool, bool]] = []
        self.builds: list[str] = []

    def variant(self, name: str, step_s: float = 2**-7, oom_at: str | None = None) -> Variant:
        def build():
            self.builds.append(name)
            if oom_at == "build":
                raise torch.cuda.OutOfMemoryError("fake")

            def step(steps: int, regions: Regions | None) -> None:
                timed = regions is not None
                self.calls.append((name, steps, timed, gc.isenabled()))
                if oom_at == "warm-up" or (oom_at == "timed" and timed):
                    raise torch.cuda.OutOfMemoryError("fake")
                for _ in range(steps):
                    if timed:
                        regions["fwd"].start()
                    if self.clock is not None:
                        self.clock.now += step_s
                    if timed:
                        regions["fwd"].stop()

            return step

        return Variant(name, build)

    def timed(self) -> list[str]:
        return [name for name, _, timed, _ in self.calls if timed]


def test_rounds_rotate_the_start_after_an_untimed_warm_up_round():
    rec = Recorder()
    cfg = HarnessConfig(rounds=4, min_steps=8, **QUICK)
    res = time_variants([rec.variant(n) for n in "abc"], cfg, CPU)
    assert rec.timed() == list("abcbcacababc")
    untimed = [(n, s) for n, s, timed, _ in rec.calls if not timed]
    # per variant: 1 warm-up step, 3 memory steps; then one untimed chunk each
    assert untimed == [(n, 1) for n in "aaaabbbbcccc"] + [(n, 2) for n in "abc"]
    assert all(steps == 2 for _, steps, timed, _ in rec.calls if timed)
    assert [len(r.step) for r in res.values()] == [4, 4, 4]  # paired: one chunk per round
    assert [len(r.regions["fwd"]) for r in res.values()] == [8, 8, 8]  # one per timed step


def test_timed_steps_follow_min_time_then_min_and_max_steps(monkeypatch):
    clock = FakeClock(monkeypatch)
    rec = Recorder(clock)
    cfg = HarnessConfig(
        rounds=10, min_steps=5, max_steps=500, min_time=1.0, warmup_steps=1, warmup_time=0.0
    )
    slow, fast = rec.variant("slow", 2**-7), rec.variant("fast", 2**-10)
    res = time_variants([slow, fast], cfg, CPU)
    assert (res["slow"].chunks, res["slow"].chunk_steps) == (10, 13)  # ceil(128 / 10)
    assert (res["fast"].chunks, res["fast"].chunk_steps) == (10, 50)  # 1024 capped at 500
    m = res["slow"].metrics()
    assert m["step_s_median"] == m["step_synced_s_median"] == m["fwd_s_median"] == 2**-7
    assert m["step_s_per_chunk"] == [2**-7] * 10
    assert res["fast"].metrics()["step_s_max"] == 2**-10

    assert HarnessConfig(min_steps=5, min_time=2**-7 * 3).timed_steps(2**-7) == 5
    assert HarnessConfig(min_steps=1, min_time=0.0).timed_steps(2**-7) == 1
    assert HarnessConfig(max_steps=7, min_time=1.0).timed_steps(0.0) == 7


def test_fewer_steps_than_rounds_give_one_step_chunks():
    rec = Recorder()
    res = time_variants([rec.variant("a")], HarnessConfig(rounds=100, min_steps=3, **QUICK), CPU)
    assert (res["a"].chunks, res["a"].chunk_steps) == (3, 1)
    assert rec.timed() == ["a"] * 3


def test_warm_up_runs_synchronized_steps_for_its_time_up_to_max_steps(monkeypatch):
    clock = FakeClock(monkeypatch)
    rec = Recorder(clock)
    cfg = HarnessConfig(rounds=1, min_steps=1, warmup_steps=2, warmup_time=2**-7 * 6, min_time=0)
    time_variants([rec.variant("a")], cfg, CPU)
    assert len(rec.calls) == 6 + 3 + 1 + 1  # warm-up, memory steps, warm-up round, timed
    rec.calls.clear()
    capped = HarnessConfig(rounds=1, min_steps=1, max_steps=4, warmup_time=10.0, min_time=0)
    time_variants([rec.variant("a")], capped, CPU)
    assert len(rec.calls) == 4 + 3 + 1 + 1


def test_gc_is_paused_over_the_rounds_and_restored_after():
    assert gc.isenabled()
    rec = Recorder()
    time_variants([rec.variant("a"), rec.variant("b")], HarnessConfig(rounds=3, **QUICK), CPU)
    memory_steps = [enabled for _, steps, timed, enabled in rec.calls[:8]]
    rounds = [enabled for _, _, _, enabled in rec.calls[8:]]
    assert all(memory_steps) and len(rounds) == 2 + 6 and not any(rounds)
    assert gc.isenabled()


@pytest.mark.parametrize("oom_at", ["build", "warm-up", "timed"])
def test_a_variant_out_of_memory_is_dropped_and_the_others_finish(oom_at):
    rec = Recorder()
    variants = [rec.variant("a"), rec.variant("big", oom_at=oom_at), rec.variant("c")]
    res = time_variants(variants, HarnessConfig(rounds=3, **QUICK), CPU)
    assert res["big"].metrics() == {"oom": True}
    assert rec.builds == ["a", "big", "c"]
    assert rec.timed().count("big") == (1 if oom_at == "timed" else 0)
    for name in "ac":
        assert res[name].metrics()["chunks"] == 3 and len(res[name].step) == 3
    # the rounds went on without it, still rotating over all three
    assert [n for n in rec.timed() if n != "big"] == list("accaca")


def test_settle_runs_untimed_for_its_seconds(monkeypatch):
    clock = FakeClock(monkeypatch)
    rec = Recorder(clock)
    settle(rec.variant("ref", 2**-4), 1.0, CPU)
    assert rec.builds == ["ref"] and len(rec.calls) == 16 and rec.timed() == []
    settle(rec.variant("ref"), 0.0, CPU)
    assert rec.builds == ["ref"]  # no settle: nothing built


def test_bad_settings_and_names_are_refused():
    with pytest.raises(ValueError, match="rounds"):
        HarnessConfig(rounds=0)
    with pytest.raises(ValueError, match="warmup_time"):
        HarnessConfig(warmup_time=-1.0)
    rec = Recorder()
    with pytest.raises(ValueError, match="unique"):
        time_variants([rec.variant("a"), rec.variant("a")], HarnessConfig(**QUICK), CPU)
    with pytest.raises(ValueError, match="reserved"):
        Regions(CPU)["step"]


def test_metrics_without_memory_statistics_are_none():
    rec = Recorder()
    m = time_variants([rec.variant("a")], HarnessConfig(rounds=2, **QUICK), CPU)["a"].metrics()
    assert m["peak_gib"] is None and m["base_gib"] is None and m["activation_peak_gib"] is None
    assert m["chunks"] == 2 and m["chunk_steps"] == 3 and m["step_s_n"] == 2


@pytest.mark.gpu
def test_own_peak_excludes_what_the_idle_variants_hold():
    """Two variants holding 64 and 256 MiB between steps, each step allocating 32 MiB more:
    each one's peak is its own base plus its step's tensor, not the other's bytes."""
    mib = 2**20
    device = torch.device("cuda", torch.cuda.current_device())

    def holder(held: int) -> Variant:
        def build():
            base = torch.zeros(held, dtype=torch.uint8, device=device)

            def step(steps: int, regions: Regions | None) -> None:
                for _ in range(steps):
                    tmp = base[: 32 * mib] + 1  # 32 MiB more; the closure keeps base alive
                    del tmp

            return step

        return Variant(f"held{held // mib}", build)

    res = time_variants(
        [holder(64 * mib), holder(256 * mib)], HarnessConfig(rounds=2, **QUICK), device
    )
    for name, held in (("held64", 64), ("held256", 256)):
        m = res[name].metrics()
        assert m["base_gib"] == held * mib / GIB
        assert m["peak_gib"] * GIB == pytest.approx((held + 32) * mib, abs=2 * mib)
        assert m["activation_peak_gib"] * GIB == pytest.approx(32 * mib, abs=2 * mib)


@pytest.mark.gpu
def test_a_gpu_bound_variant_leaves_no_queued_work_in_the_next_ones_chunk():
    """A variant that queues about 20 ms of GPU work per step (4e7 cycles at 2 GHz or less) runs
    beside one whose step is 2 ms of host time and a tiny kernel: the host-bound variant's steps
    still take at least its 2 ms (queued work carried into its chunk would let its host time
    pass unseen)."""
    device = torch.device("cuda", torch.cuda.current_device())
    cycles = 40_000_000

    def gpu_bound():
        def step(steps: int, regions: Regions | None) -> None:
            for _ in range(steps):
                torch.cuda._sleep(cycles)

        return step

    def host_bound():
        x = torch.zeros(1, device=device)

        def step(steps: int, regions: Regions | None) -> None:
            for _ in range(steps):
                time.sleep(0.002)
                x.add_(1)

        return step

    cfg = HarnessConfig(rounds=3, min_steps=10, **QUICK)
    res = time_variants([Variant("gpu", gpu_bound), Variant("host", host_bound)], cfg, device)
    assert min(res["host"].step) >= 0.002
    assert min(res["gpu"].step) >= 0.01


def test_host_timed_books_device_and_host_time_only_in_timed_steps(monkeypatch):
    """On a fake clock: the region's code is timed on both clocks when regions are given, and
    an untimed step (regions None) records nothing."""
    clock = {"now": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    regions, host = Regions(torch.device("cpu")), {"fwd": []}
    with harness.host_timed(regions, "fwd", host):
        clock["now"] += 0.5
    with harness.host_timed(None, "fwd", host):
        clock["now"] += 1.0
    assert host == {"fwd": [0.5]}
    assert regions.times() == {"fwd": [0.5]}


@pytest.mark.gpu
def test_a_captured_graph_replays_its_step_and_is_timed_per_replay():
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.zeros(1024, device=device)
    graph = harness.capture_graph(lambda: x.add_(1), device, warmup=2, before_capture=x.zero_)
    assert x.sum().item() == 0  # captured, not run
    times = harness.graph_replay_times({"add": graph}, rounds=3, replays=4)
    assert len(times["add"]) == 3 and all(t > 0 for t in times["add"])
    assert x[0].item() == 1 + 3 * 4  # one untimed replay, then three rounds of four
