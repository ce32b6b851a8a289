"""The torchtitan peer probe: its flags refused in one line, and (where torchtitan is installed) a
CPU run of its debug model under torchrun with gloo that logs a record per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_loading import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "lm_training" / "probes" / "torchtitan_peer.py"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--steps", "2", "--timing-warmup", "2"], "--steps"),
        (["--lr", "-1"], "--lr"),
        (["--batch-size", "0"], "--batch-size"),
    ],
)
def test_bad_flags_are_refused(argv, flag, capsys):
    peer = load_script("lm_training/probes", "torchtitan_peer")
    with pytest.raises((SystemExit, peer.UsageError)) as info:
        peer.parse_args(argv)
    assert flag in str(info.value) or flag in capsys.readouterr().err


def test_two_cpu_ranks_log_every_step(tmp_path):
    pytest.importorskip("torchtitan")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT),
           "--quick", "--device", "cpu", "--out", str(tmp_path)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    records = [json.loads(line) for line in (tmp_path / "torchtitan_peer.jsonl").open()]
    assert [r["variant"] for r in records] == ["torchtitan_step"] * 4 + ["torchtitan_summary"]
    assert records[-1]["metrics"]["tokens_per_s_per_gpu"] > 0
    assert all(r["metrics"]["peak_gib"] is None for r in records[:-1])  # the CPU: not measured
