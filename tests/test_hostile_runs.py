"""Values the argument checks used to pass that then failed deep in the run (a division by
zero, a shape error, an allocation, a folder where a file is): each is refused before any work,
exit code 2 and one line naming the flag on stderr, nothing written in --out."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.script_loading import ROOT

CASES = [
    ("memory_efficient_gpt2/probes/int8_update_speed.py", ["--tensor-numel", "0"], "--tensor-numel must be >= 1"),
    ("swiglu_checkpoint/probes/gemm_kernel_count.py", ["--layers", "0"], "--layers must be >= 1"),
    ("memory_efficient_gpt2/probes/optimizer_equivalence.py", ["--heads", "3"], "--d-model 32 must divide by --heads 3"),
    ("swiglu_checkpoint/gpu_ceilings.py", ["--copy-gib", "1e12"], "--copy-gib: the copy's source and target needs"),
    ("lm_training/speedup_stages.py", ["--trace-dir", "{file}"], "--trace-dir: {file} is a file"),
    ("lm_training/train.py", ["--resume", "{empty}"], "--resume: {empty} is not a complete checkpoint"),
    ("lm_training/train.py", ["--resume", "{empty}", "--save", "{empty}"], "--resume: {empty} is not a complete checkpoint"),
]  # fmt: skip


@pytest.mark.parametrize(("script", "flags", "message"), CASES)
def test_a_value_the_run_cannot_use_is_refused_before_any_work(tmp_path, script, flags, message):
    names = {"file": tmp_path / "a-file", "empty": tmp_path / "empty"}
    names["file"].write_text("not a folder\n")
    names["empty"].mkdir()
    out = tmp_path / "out"
    argv = [a.format(**names) for a in flags]
    done = subprocess.run(
        [sys.executable, str(ROOT / script), "--quick", "--device", "cpu", "--out", str(out), *argv],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert message.format(**names) in line
    assert not out.exists() or not any(p.is_file() for p in out.rglob("*"))
