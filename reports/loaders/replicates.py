"""Main logs and replicate logs kept apart.

A replicate log (``*_replicate*``) reruns a main log's command on another host, in the same record
format. A report reads it only in the appendix that sets it beside its main log: the main tables,
answers and targets never see it, and a damaged replicate log cannot break them.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Mapping, Sequence
from fnmatch import fnmatch
from pathlib import Path, PurePath
from typing import Any

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


def frame_envs(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The ``env`` of each row of a :func:`load_results` frame, as the log wrote it: the ``env.*``
    columns without their prefix, the missing values left out (a field the record has not)."""
    columns = [c for c in frame.columns if c.startswith("env.")]
    return [
        {c.removeprefix("env."): v for c, v in zip(columns, row, strict=True) if not is_missing(v)}
        for row in frame[columns].itertuples(index=False)
    ]


def envs_by_log(frame: pd.DataFrame, sort: bool = True) -> dict[str, list[dict[str, Any]]]:
    """The :func:`frame_envs` of a :func:`load_results` frame, per log (its ``source``): the logs
    sorted by name, or without ``sort`` in the frame's order."""
    if "source" not in frame:
        return {}
    return {str(source): frame_envs(f) for source, f in frame.groupby("source", sort=sort)}


def where_made(envs: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The GPU names, host ids (``gpu_id``) and commits (``git_sha``, 7 characters) of records'
    ``env``, each value once and sorted; an empty list where no record holds the field."""
    envs = list(envs)

    def values(key: str, width: int | None = None) -> list[str]:
        return sorted({str(e[key])[:width] for e in envs if not is_missing(e.get(key))})

    return {
        "GPU": sorted({device_name(e) for e in envs}),
        "host id": values("gpu_id"),
        "git sha": values("git_sha", 7),
    }


def provenance(frame: pd.DataFrame) -> dict[str, list[str]]:
    """Where a log's records were made, for an appendix's caption: :func:`where_made` of the rows
    of a :func:`load_results` frame."""
    return where_made(frame_envs(frame))


def run_key(env: Mapping[str, Any]) -> Any:
    """A run's identity from its record's ``env``: the run id, or where the log has none, the start
    time with the GPU tag (runs started together on one host share a start time)."""
    return env.get("run_id") or (env.get("time"), env.get("gpu_id"))


def log_provenance(
    logs: Mapping[str, Sequence[Mapping[str, Any]]],
    extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> pd.DataFrame:
    """The provenance appendix every report ends with, one row per log in ``logs`` (its name ->
    its records' ``env``): "log", "git sha" (7 characters), "GPU" (:func:`device_name`), "GPU
    tag(s)" (``gpu_id``; "-" where no record has one, as in a CPU run) and "runs" (distinct
    ``run_id``; a record without one counts by its start time and GPU tag), each list of values
    sorted and comma-joined. ``extra`` holds a report's own columns per log, put before "runs".
    One function, so that every report names and counts a log's origin the same way."""
    rows = []
    for log, found in logs.items():
        made = where_made(found)
        rows.append({
            "log": log,
            "git sha": ", ".join(made["git sha"]),
            "GPU": ", ".join(made["GPU"]),
            "GPU tag(s)": ", ".join(made["host id"]) or "-",
            **(extra or {}).get(log, {}),
            "runs": len({run_key(e) for e in found}),
        })  # fmt: skip
    if not rows:  # no log: the columns all the same, for the cells that index or pick them
        return pd.DataFrame(columns=["log", "git sha", "GPU", "GPU tag(s)", "runs"])
    return pd.DataFrame(rows)
