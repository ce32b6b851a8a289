"""Spans of work on one time axis, host (``perf_counter``) and CUDA (timing events) alike.

A profiling aid for pipelines that overlap host threads and CUDA streams, such as the
offloaded optimizer's step: each span is ``(kind, index, start, end)`` and :meth:`Timeline.spans`
puts them all in seconds since the last :meth:`Timeline.reset`.
"""

from __future__ import annotations

import time
from typing import Any

from effdl.profiling.timing import Clock, Stamp


class Timeline:
    """Spans of one step (of an optimizer, a training loop) on one time axis.

    Host spans use ``perf_counter``; CUDA spans use the device's :class:`Clock` and are placed
    relative to a stamp taken on the current stream at :meth:`reset` (exact when the host had
    just synchronized, as a training loop does after reading the loss). Appends are
    thread-safe. Off (no events, no cost) until ``enabled`` is set; call :meth:`reset` at each
    step start.
    """

    def __init__(self, cuda: bool, enabled: bool = False) -> None:
        self.cuda = cuda
        self.enabled = enabled
        self._clock: Clock | None = None  # made on the first CUDA stamp
        self.reset()

    def _device_clock(self) -> Clock:
        if self._clock is None:
            self._clock = Clock("cuda")
        return self._clock

    def reset(self) -> None:
        self._spans: list[tuple[str, int, Stamp, Stamp]] = []
        self._t0 = time.perf_counter()
        self._ev0 = self._device_clock().mark() if self.cuda and self.enabled else None

    def mark(self, stream: Any = None) -> Stamp:
        """A time stamp: a CUDA event on ``stream`` (or the current one) while on, else a float."""
        if not (self.cuda and self.enabled):
            return time.perf_counter()
        return self._device_clock().mark(stream)

    def add(self, kind: str, index: int, start: Stamp, end: Stamp) -> None:
        """Record a span from two :meth:`mark` stamps (or two ``perf_counter`` floats)."""
        if self.enabled:
            self._spans.append((kind, index, start, end))

    def spans(self) -> list[dict[str, Any]]:
        """All spans as ``{kind, index, start_s, end_s}`` (synchronizes on CUDA)."""
        spans = list(self._spans)
        if self._clock is not None and any(not isinstance(a, float) for _, _, a, _ in spans):
            self._clock.wait()
        out = []
        for kind, index, a, b in spans:
            if isinstance(b, float):
                start, end = a - self._t0, b - self._t0
            else:
                start, end = self._clock.seconds(self._ev0, a), self._clock.seconds(self._ev0, b)
            out.append({"kind": kind, "index": index, "start_s": start, "end_s": end})
        return out

    def totals(self) -> dict[str, float]:
        """Summed duration per kind, in seconds."""
        out: dict[str, float] = {}
        for s in self.spans():
            out[s["kind"]] = out.get(s["kind"], 0.0) + s["end_s"] - s["start_s"]
        return out
