"""Run logs: one JSON line per measurement, and loading a folder of them into pandas.

A record is ``{"task", "variant", "config", "metrics", "env"}`` (DESIGN.md). Lines are written
whole in a single ``write`` on a file opened for appending and flushed at once, so a run that
crashes leaves every earlier line intact and no partial line behind; a write cut short (a full
disk) is truncated back before the error is raised. Should a damaged last line still appear (a
killed writer on a file system without atomic appends), the loader warns, naming file and line,
and loads the rest; a damaged line anywhere else is an error. The readers also take a
gzip-compressed log (``<name>.jsonl.gz``, how large committed logs are kept) wherever they take
``<name>.jsonl``.
"""

from __future__ import annotations

import datetime as _dt
import errno
import gzip
import hashlib
import json
import math
import os
import platform
import secrets
import subprocess
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import torch

REQUIRED_KEYS = ("task", "variant", "config", "metrics", "env")
RESULTS_ENV_VAR = "EFFDL_RESULTS"


class ResultsFormatError(ValueError):
    """A run-log line that is not a valid record; the message names file and line."""


class DamagedLastLineWarning(UserWarning):
    """The last line of a run log is not valid JSON (a write cut short); it was skipped."""


def _git(*args: str) -> str:
    """Output of ``git args`` run in this package's folder (raises when git fails)."""
    here = Path(__file__).resolve().parent
    run = subprocess.run(
        ["git", *args], cwd=here, capture_output=True, text=True, timeout=5, check=True
    )
    return run.stdout.strip()


def _git_sha() -> str:
    # A copy of the tree without .git (e.g. one copied to another machine) gets the sha from the caller.
    if os.environ.get("EFFDL_GIT_SHA"):
        return os.environ["EFFDL_GIT_SHA"]
    try:
        sha = _git("rev-parse", "--short=12", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def _gpu_id() -> str | None:
    """A short stable tag of the current GPU (hash of its UUID), so runs on two hosts with the
    same GPU model can be told apart without publishing the device's identity."""
    if not torch.cuda.is_available():
        return None
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return hashlib.sha256(uuid.encode()).hexdigest()[:8]


# environment variables that change how a run computes or communicates (NCCL's algorithms and
# channels, the CUDA allocator), recorded with every measurement taken under them
SETTINGS_PREFIXES = ("NCCL_", "TORCH_NCCL_", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_SYMM_MEM_")


def environment() -> dict[str, Any]:
    """Where a measurement was taken: GPU name and tag (or CPU), versions, git sha, UTC time,
    and the environment ``settings`` (see :data:`SETTINGS_PREFIXES`) that were set."""
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_id": _gpu_id(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_sha": _git_sha(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTINGS_PREFIXES)
        },
    }


def _jsonable(value: Any) -> Any:
    """Turn tensors, numpy scalars, paths and non-finite floats into plain JSON values."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan" / "inf": JSON has no literal for them
    return value


def make_record(
    task: str,
    variant: str,
    config: Mapping[str, Any],
    metrics: Mapping[str, Any],
    env: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build one record; ``env`` defaults to :func:`environment`."""
    return {
        "task": task,
        "variant": variant,
        "config": _jsonable(dict(config)),
        "metrics": _jsonable(dict(metrics)),
        "env": _jsonable(dict(env if env is not None else environment())),
    }


def append_record(path: str | os.PathLike, record: Mapping[str, Any]) -> None:
    """Append ``record`` as one line to ``path`` (created with its folders if missing)."""
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise ValueError(f"record for {path} lacks keys {missing}")
    line = json.dumps(_jsonable(dict(record)), allow_nan=False) + "\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = line.encode()
        written = os.write(fd, data)
        if written != len(data):
            # A full disk: take the partial line back so the file keeps only whole lines.
            end = os.lseek(fd, 0, os.SEEK_CUR)
            os.ftruncate(fd, end - written)
            raise OSError(
                errno.ENOSPC,
                f"short write to {path}: {written} of {len(data)} bytes (removed again)",
            )
    finally:
        os.close(fd)


def new_run_id() -> str:
    """A run's identity: UTC time, process id and a random part (two runs started in the same
    second by one process still differ)."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{os.getpid()}-{secrets.token_hex(3)}"


def probe_writable(path: Path) -> None:
    """Raise OSError unless ``path`` (a file, its folders created) can be written, leaving no
    file behind: a run refused after the probe leaves no empty log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if path.exists():
        if not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    path.unlink()


class RunLog:
    """Appends records of one task to one JSONL file, taking the environment once per run; every
    record's ``env`` carries ``run_id`` (one per run, :func:`new_run_id` by default) and
    ``seed``, so runs appended to one file stay apart.

    With ``create`` the path is probed now (:func:`probe_writable`), so a path that cannot be
    written raises OSError before the run's work; the file appears with the first record.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        task: str,
        *,
        create: bool = False,
        run_id: str | None = None,
        seed: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.task = task
        self.env = {**environment(), "run_id": run_id or new_run_id(), "seed": seed}
        if create:
            probe_writable(self.path)

    def log(self, variant: str, config: Mapping[str, Any], metrics: Mapping[str, Any]) -> dict:
        record = make_record(self.task, variant, config, metrics, self.env)
        append_record(self.path, record)
        return record


def find_log(path: str | os.PathLike) -> Path:
    """``path``, or its gzip-compressed form ``<path>.gz`` where only that one exists (committed
    logs over 64 KB are kept compressed; a script writes the plain form)."""
    path = Path(path)
    gz = path.with_name(path.name + ".gz")
    return gz if not path.exists() and gz.exists() else path


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of one JSONL file (read through gzip when its name ends in ``.gz``).

    A last line that is not valid JSON (a write cut short) is skipped with a
    :class:`DamagedLastLineWarning` naming file and line; any other malformed line, and a file
    that is not UTF-8 text (or not gzip, for ``.gz``), raises :class:`ResultsFormatError`.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, start=1) if line.strip()]
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:  # not text, or gzip cut short
        raise ResultsFormatError(f"{path}: not a JSONL run log ({e})") from None
    records = []
    for i, (lineno, line) in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            where = f"{path}:{lineno}: not valid JSON ({e.msg})"
            if i == len(lines) - 1:
                warnings.warn(
                    f"{where}; skipped this damaged last line, loaded the {i} before it",
                    DamagedLastLineWarning,
                    stacklevel=2,
                )
                break
            raise ResultsFormatError(where) from None
        if not isinstance(rec, dict):
            raise ResultsFormatError(
                f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}"
            )
        missing = [k for k in REQUIRED_KEYS if k not in rec]
        if missing:
            raise ResultsFormatError(f"{path}:{lineno}: record lacks keys {missing}")
        records.append(rec)
    return records


def _flatten(rec: Mapping[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"task": rec["task"], "variant": rec["variant"]}
    for section in ("config", "metrics", "env"):
        for k, v in rec[section].items():
            row[f"{section}.{k}"] = v
    return row


def load_results(
    folder: str | os.PathLike, pattern: str = "**/*.jsonl", flatten: bool = True
) -> pd.DataFrame:
    """Every record under ``folder`` as a DataFrame.

    With ``flatten`` the nested sections become columns ``config.x``, ``metrics.y``, ``env.z``;
    a column ``source`` names the file each row came from. A missing folder, or one whose logs
    hold no record, raises FileNotFoundError, so a report never silently shows an empty table.
    A damaged last line of a file is skipped with a warning naming file and line
    (:func:`read_records`). A pattern also matches the gzip-compressed form of the logs it names
    (``lm.jsonl`` finds ``lm.jsonl.gz``).
    """
    folder = Path(folder)
    patterns = [pattern] if pattern.endswith(".gz") else [pattern, pattern + ".gz"]
    files = sorted({f for p in patterns for f in folder.glob(p)}) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no run logs matching {pattern!r} under {folder}")
    rows: list[dict[str, Any]] = []
    for file in files:
        for rec in read_records(file):
            row = _flatten(rec) if flatten else dict(rec)
            row["source"] = str(file.relative_to(folder))
            rows.append(row)
    if not rows:
        raise FileNotFoundError(f"the run logs matching {pattern!r} under {folder} hold no records")
    return pd.DataFrame(rows)


def _named(value: Any) -> str | None:
    """``value`` as text, or None where it names nothing (None, NaN, pandas' NA, blank)."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    text = str(value).strip()
    return text if text and text.lower() not in ("nan", "none") else None


def device_name(env: Any) -> str:
    """The device a record was measured on, as a report names it: the GPU's name where the
    record's env names one, else the CPU, ``"CPU (x86_64)"`` (``"CPU"`` where the env names no
    processor either); never ``"None"``. ``env`` is a record's ``env`` (keys ``gpu``, ``cpu``) or
    a row of :func:`load_results` (keys ``env.gpu``, ``env.cpu``)."""

    def get(key: str) -> str | None:
        for k in (key, f"env.{key}"):
            try:
                found = _named(env.get(k))
            except (TypeError, ValueError):  # an ambiguous value (a list, an array) names nothing
                found = None
            if found is not None:
                return found
        return None

    gpu, cpu = get("gpu"), get("cpu")
    if gpu is not None:
        return gpu
    return f"CPU ({cpu})" if cpu is not None else "CPU"


def on_gpu(env: Any) -> bool:
    """Whether a record (its ``env``, or a :func:`load_results` row) was measured on a GPU."""
    return not device_name(env).startswith("CPU")


def results_dir(default: str | os.PathLike = "results") -> Path:
    """The results folder a report reads: ``$EFFDL_RESULTS`` if set, else ``default``."""
    return Path(os.environ.get(RESULTS_ENV_VAR, default))
