"""Interrupting a script mid-run, as Ctrl-C does, for the tests that check a run log keeps what
was measured before the interruption: whole records, in the order they were measured."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.script_loading import ROOT


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C's default disposition, so that the script's Python
    installs its KeyboardInterrupt handler even where the test runner was started with SIGINT
    ignored (a background job of a non-interactive shell is)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_after(
    script: Path,
    args: list[str],
    log: Path,
    records: int,
    delay: float = 0.0,
    timeout: float = 180,
) -> tuple[int, str]:
    """Run ``script args`` in a new interpreter and session, send SIGINT to its whole process
    group (its forked ranks too) ``delay`` seconds after ``log`` holds ``records`` lines (or at
    ``timeout``), and return its exit status and stderr. A delay lets a script that forks right
    after a record finish forking: a SIGINT during a fork can be lost in Python's fork hooks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    err_path = log.parent / f"{log.name}.stderr"
    log.parent.mkdir(parents=True, exist_ok=True)
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if log.exists() and log.read_bytes().count(b"\n") >= records:
                time.sleep(delay)
                break
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
        proc.wait()
    return proc.returncode, err_path.read_text()


def whole_records(log: Path) -> list[dict]:
    """Every line of ``log`` as a record; fails unless each line is whole JSON."""
    text = log.read_text()
    assert text.endswith("\n"), "the last record is cut short"
    return [json.loads(line) for line in text.splitlines()]
