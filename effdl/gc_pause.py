"""Pausing Python's cyclic garbage collector over a region of code.

A cyclic collection runs whenever enough container objects have been allocated, so in a loop
of short, allocation-heavy steps it lands at a random step and stalls that step.
Both the mixed-precision region (:class:`effdl.amp.autocast.Autocast`) and timing harnesses
(as ``timeit`` does) pause it; reference counting still frees all acyclic garbage at once.
Pauses are counted process-wide, across threads and nested regions: the first one switches the
collector off (if it was on), the last one to end switches it back on; a collector the user
switched off stays off.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class GCPause:
    """The process-wide pause counter; use the module's ``GC_PAUSE`` or :func:`gc_paused`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                raise RuntimeError("GCPause.release() without a matching acquire()")
            self._holders -= 1
            if self._holders == 0 and self._was_enabled:
                gc.enable()


GC_PAUSE = GCPause()


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector stays off inside (see the module docstring)."""
    GC_PAUSE.acquire()
    try:
        yield
    finally:
        GC_PAUSE.release()
