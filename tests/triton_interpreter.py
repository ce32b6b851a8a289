"""Running a Triton kernel check under Triton's CPU interpreter, for the CPU suite.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the check runs as its own
process; it prints ``kernels ok`` at the end when every assertion held."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.script_loading import ROOT


def assert_kernels_ok_in_interpreter(code: str) -> None:
    """Run ``code`` under the interpreter; fail with its stderr unless it printed ``kernels ok``."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kernels ok" in proc.stdout
