"""Main logs and replicate logs kept apart.

A replicate log (``*_replicate*``) reruns a main log's command on another host, in the same record
format. A report reads it only in the appendix that sets it beside its main log: the main tables,
answers and targets never see it, and a damaged replicate log cannot break them.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable
from fnmatch import fnmatch
from pathlib import Path, PurePath

import pandas as pd

from effdl.results import device_name, load_results
from effdl.tables import is_missing

REPLICATE = "*_replicate*"


def is_replicate(source: str) -> bool:
    """Whether a log's file name marks it as a replicate log."""
    return fnmatch(PurePath(source).name, REPLICATE)


def log_records(folder: Path, patterns: Iterable[str], replicate: bool = False) -> list[dict]:
    """The records of the logs in ``folder`` matching any of ``patterns``: of the main logs, or
    with ``replicate`` of the replicate logs only (the other kind is not even read). A log with
    both a plain and a ``.gz`` form is read once; a log holding no records adds none."""
    found = {f for p in patterns for f in folder.glob(p)} if folder.is_dir() else set()
    files = [
        f
        for f in sorted(found)
        if is_replicate(f.name) == replicate
        and not (f.suffix == ".gz" and f.with_suffix("") in found)  # read with its plain form
    ]
    rows: list[dict] = []
    for f in files:
        try:  # one log at a time: its plain and .gz forms, as load_results reads them
            part = load_results(folder, pattern=glob.escape(str(f.relative_to(folder))))
        except FileNotFoundError:  # a log that holds no records
            continue
        rows += part.to_dict("records")
    return rows


def provenance(frame: pd.DataFrame) -> dict[str, list[str]]:
    """Where a log's records were made, for an appendix's caption: the GPU names, host ids
    (``env.gpu_id``) and commits (``env.git_sha``, 7 characters), each value once and sorted; an
    empty list where no record logs the field."""

    def values(column: str, width: int | None = None) -> list[str]:
        found = frame.get(column, [])
        return sorted({str(v)[:width] for v in found if not is_missing(v)})

    return {
        "GPU": sorted({device_name(row) for _, row in frame.iterrows()}),
        "host id": values("env.gpu_id"),
        "git sha": values("env.git_sha", 7),
    }
