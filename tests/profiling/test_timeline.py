"""Timeline on the host clock, driven by a fake ``perf_counter`` so times are exact."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from effdl.profiling import timeline
from effdl.profiling.timeline import Timeline


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """A fake perf_counter that reads ``clock["now"]``; a test advances it by hand."""
    now = {"now": 100.0}
    monkeypatch.setattr(timeline.time, "perf_counter", lambda: now["now"])
    return now


def span(tl: Timeline, clock: dict[str, float], kind: str, index: int, gap: float, dur: float):
    clock["now"] += gap
    start = tl.mark()
    clock["now"] += dur
    tl.add(kind, index, start, tl.mark())


def test_spans_in_order_relative_to_reset(clock: dict[str, float]) -> None:
    tl = Timeline(cuda=False, enabled=True)
    clock["now"] += 5.0  # time before the reset does not count
    tl.reset()
    span(tl, clock, "compute", 0, gap=0.5, dur=1.0)
    span(tl, clock, "update", 3, gap=0.25, dur=0.125)
    span(tl, clock, "compute", 1, gap=0.0, dur=2.0)
    assert tl.spans() == [
        {"kind": "compute", "index": 0, "start_s": 0.5, "end_s": 1.5},
        {"kind": "update", "index": 3, "start_s": 1.75, "end_s": 1.875},
        {"kind": "compute", "index": 1, "start_s": 1.875, "end_s": 3.875},
    ]
    assert tl.totals() == {"compute": 3.0, "update": 0.125}


def test_disabled_records_nothing(clock: dict[str, float]) -> None:
    tl = Timeline(cuda=False)
    span(tl, clock, "compute", 0, gap=0.0, dur=1.0)
    assert tl.spans() == [] and tl.totals() == {}
    assert tl.mark() == clock["now"]  # a host stamp even when off (no CUDA event made)


def test_reset_drops_spans_and_moves_the_origin(clock: dict[str, float]) -> None:
    tl = Timeline(cuda=False, enabled=True)
    span(tl, clock, "compute", 0, gap=0.0, dur=1.0)
    tl.reset()
    span(tl, clock, "update", 0, gap=2.0, dur=1.0)
    assert tl.spans() == [{"kind": "update", "index": 0, "start_s": 2.0, "end_s": 3.0}]


def test_appends_from_threads_are_all_kept(clock: dict[str, float]) -> None:
    tl = Timeline(cuda=False, enabled=True)
    t0 = clock["now"]

    def worker(k: int) -> None:
        for i in range(500):
            tl.add(f"w{k}", i, t0, t0 + 1.0)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tl.totals() == {f"w{k}": 500.0 for k in range(4)}
    for k in range(4):  # each thread's spans keep their order
        assert [s["index"] for s in tl.spans() if s["kind"] == f"w{k}"] == list(range(500))


@pytest.mark.gpu
def test_cuda_spans_follow_the_stream() -> None:
    tl = Timeline(cuda=True, enabled=True)
    torch.cuda.synchronize()
    tl.reset()
    for i in range(3):
        start = tl.mark()
        torch.cuda._sleep(1_000_000)  # about a millisecond of GPU time
        tl.add("sleep", i, start, tl.mark())
    spans = tl.spans()
    assert [s["index"] for s in spans] == [0, 1, 2]
    assert all(s["end_s"] > s["start_s"] >= 0 for s in spans)
    for prev, s in itertools.pairwise(spans):
        assert s["start_s"] >= prev["end_s"]  # one stream: spans never overlap
