"""Run a picklable function over many jobs in worker processes (image decoding, data sets
written to disk): one place that picks the start method and the worker count."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def worker_count(workers: int | None) -> int:
    """``workers``, or up to 16 CPUs when None; at least 1."""
    return max(1, workers if workers is not None else min(os.cpu_count() or 1, 16))


def map_in_processes(
    fn: Callable[[Any], Any],
    jobs: list,
    workers: int | None = None,
    chunksize: int = 8,
    ordered: bool = True,
) -> Iterator:
    """``fn(job)`` for every job, in ``worker_count(workers)`` processes (in this process when
    that is 1 or there is one job). ``ordered=False`` yields results as they finish."""
    n = min(worker_count(workers), len(jobs))
    if n <= 1:
        yield from map(fn, jobs)
        return
    # fork: workers need no re-import and the parent has not touched CUDA at this point.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with mp.get_context(method).Pool(n) as pool:
        results: Iterable = (pool.imap if ordered else pool.imap_unordered)(fn, jobs, chunksize)
        yield from results
