"""memory_efficient_gpt2/pipeline_parallel.py on the CPU: a --quick pipeline run logs the same
loss curve, bit for bit, as its --reference --accumulate run (single process, gradients
accumulated over the micro-batches), --long logs every micro-batch count, and bad flags are
refused in one line.

The pipeline runs are separate interpreters: the script forks its ranks, and a fork of a process
that has already run torch kernels (this test session) can hang in the child's first parallel
kernel. The single-process references run in this process (restoring its thread count after).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from effdl.cli import UsageError, run_main
from effdl.parallel.classifiers import equal_work_mlp, multiply_adds
from effdl.parallel.launch import cpu_threads
from effdl.parallel.pipeline import BACKWARD, SCHEDULES, bubble_fraction, split_sequential
from effdl.parallel.pipeline_training import PipelineConfig
from effdl.results import read_records
from tests.interrupting import interrupt_after, whole_records
from tests.script_loading import ROOT, load_script

SCRIPT = ROOT / "memory_efficient_gpt2" / "pipeline_parallel.py"
pipeline_parallel = load_script("memory_efficient_gpt2", "pipeline_parallel")


def run_script(out: Path, *flags: str) -> list[dict]:
    """``pipeline_parallel.py --quick FLAGS --out OUT`` in a new interpreter; its records."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(SCRIPT), "--quick", *flags, "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return read_records(out / pipeline_parallel.LOG)


def losses(records: list[dict], variant: str) -> list[float]:
    return [r["metrics"]["loss"] for r in records if r["variant"] == variant]


@pytest.fixture
def keep_threads():
    """A reference run sets this process's intra-op threads to one rank's; put them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def reference(out: Path, *flags: str) -> None:
    """``--quick --reference FLAGS`` in this process (no fork)."""
    pipeline_parallel.main(["--quick", "--reference", *flags, "--out", str(out)])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_every_schedule_runs_backwards_in_micro_batch_order(schedule):
    """On every rank and chunk: the order in which --reference --accumulate adds the
    micro-batches' gradients."""
    chunks = 2 if schedule == "interleaved" else 1
    for rank in range(4):
        actions = SCHEDULES[schedule](4, 8, rank, chunks)
        for chunk in range(chunks):
            order = [a.micro_batch for a in actions if a.kind == BACKWARD and a.chunk == chunk]
            assert order == list(range(8))


def test_quick_pipeline_curve_equals_the_accumulating_reference(tmp_path, keep_threads):
    run_script(tmp_path, "--schedule", "1f1b")
    reference(tmp_path, "--accumulate")
    reference(tmp_path)
    records = read_records(tmp_path / pipeline_parallel.LOG)
    got = losses(records, "1f1b")
    accumulated, whole = losses(records, "reference_accumulated"), losses(records, "reference")
    assert len(got) == len(accumulated) == len(whole) == pipeline_parallel.QUICK.steps
    assert got == accumulated  # float32: the same products, summed in the same order
    assert got == pytest.approx(whole, rel=1e-5)  # float32, whole-batch sums: another order
    assert got != whole
    record = next(r for r in records if r["variant"] == "1f1b_summary")
    summary = record["metrics"]
    assert summary["bubble_formula"] == pytest.approx(bubble_fraction(4, 8))
    assert 0 < summary["bubble_measured"] < 1
    assert 0 < summary["bubble_predicted"] <= summary["bubble_predicted_with_messages"] < 1
    assert summary["timed_steps"] == pipeline_parallel.QUICK.timed_steps
    assert summary["peak_in_flight"] == [4, 3, 2, 1]
    assert all(b > 0 for b in summary["peak_memory_bytes"])
    per_rank = summary["forward_ms_per_micro_batch"] + summary["backward_ms_per_micro_batch"]
    assert len(per_rank) == 8 and all(t > 0 for t in per_rank)
    assert summary["message_ms"] > 0 and summary["message_bytes"] == 8 * 32 * 4
    assert record["config"]["threads_per_rank"] == cpu_threads(4)
    assert len(record["config"]["cores_per_rank"]) == 4
    # the step records, written by rank 0 as it went, carry the summary's config
    assert all(r["config"] == record["config"] for r in records if r["variant"] == "1f1b")


def test_an_interrupted_run_keeps_the_records_of_its_steps(tmp_path):
    """Ctrl-C (SIGINT to the script and its ranks) once the log has two steps: exit 130, and
    the log holds whole records of the first steps in order, written as they were measured;
    no summary (the run did not finish)."""
    log = tmp_path / pipeline_parallel.LOG
    args = ["--quick", "--steps", "100000", "--out", str(tmp_path)]
    code, err = interrupt_after(SCRIPT, args, log, records=2, timeout=90)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == "pipeline_parallel.py: interrupted"
    records = whole_records(log)  # every line a whole record
    assert len(records) >= 2 and {r["variant"] for r in records} == {"1f1b"}
    assert [r["metrics"]["step"] for r in records] == list(range(len(records)))
    assert all(math.isfinite(r["metrics"]["loss"]) and r["metrics"]["step_s"] > 0 for r in records)
    config = records[0]["config"]
    assert config["data"].startswith("scikit-learn digits") and len(config["cores_per_rank"]) == 4


def test_stages_of_the_model_do_equal_work():
    """The formula assumes equal stage times: every block holds two hidden x hidden layers, the
    input projection and the classifier add only features x hidden and hidden x classes."""
    model = equal_work_mlp(64, 1024, 10, 4)
    work = [multiply_adds(piece) for piece in split_sequential(model, 4)]
    assert work == [2 * 1024**2 + 64 * 1024, 2 * 1024**2, 2 * 1024**2, 2 * 1024**2 + 1024 * 10]


def test_long_run_logs_each_micro_batch_count(tmp_path):
    records = run_script(tmp_path, "--long")
    rows = [r["metrics"] for r in records if r["variant"] == "long_1f1b"]
    assert [row["micro_batches"] for row in rows] == [10, 100]
    for row in rows:  # 1F1B: at most S activations whatever the count
        assert row["peak_in_flight"] == [4, 3, 2, 1]
        assert len(row["peak_memory_bytes"]) == len(row["growth_bytes"]) == 4


def test_torch_pipelining_reference_trains_the_same_curve(tmp_path, keep_threads):
    run_script(tmp_path, "--compare-torch", "--schedule", "gpipe")
    reference(tmp_path)
    records = read_records(tmp_path / pipeline_parallel.LOG)
    got, expected = losses(records, "torch_gpipe"), losses(records, "reference")
    assert len(got) == len(expected) == pipeline_parallel.QUICK.steps
    assert got == pytest.approx(expected, rel=1e-5)
    summary = next(r["metrics"] for r in records if r["variant"] == "torch_gpipe_summary")
    assert summary["median_step_s"] > 0 and "bubble_measured" not in summary


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch", "60"], "--batch 60 is not a multiple of --micro-batches 8"),
        (["--schedule", "interleaved", "--micro-batches", "6", "--batch", "60"], "multiples"),
        (["--stages", "1"], "--stages must be >= 2"),
        (["--compare-torch", "--schedule", "interleaved"], "--compare-torch needs --schedule"),
        (["--timed-steps", "12"], "--timed-steps 12 must be below --steps 12"),
        (["--threads", "-1"], "--threads must be >= 0"),
        (["--accumulate"], "--accumulate applies to --reference only"),
    ],
)
def test_bad_flags_are_refused_in_one_line(tmp_path, monkeypatch, capsys, flags, message):
    argv = ["pipeline_parallel.py", "--quick", *flags, "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        run_main(pipeline_parallel.main)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / pipeline_parallel.LOG).exists()


@pytest.mark.parametrize(
    "settings, gpus, message",
    [
        ({"stages": 4, "compare_torch": True, "schedule": "gpipe"}, 2, "needs a GPU per stage"),
        (
            {"stages": 3, "schedule": "interleaved", "micro_batches": 6, "batch": 60},
            2,
            "NCCL refuses",
        ),
        ({"stages": 2}, 1, "NCCL refuses"),
        ({"stages": 2}, 0, "needs CUDA GPUs"),
    ],
)
def test_nccl_layouts_that_share_a_gpu_between_peers_are_refused(settings, gpus, message):
    cfg = PipelineConfig(backend="nccl", **settings)
    with pytest.raises(UsageError, match=message):
        cfg.check_gpu_layout(gpus)


@pytest.mark.parametrize(
    "settings, gpus",
    [
        ({"stages": 4, "schedule": "1f1b"}, 2),
        ({"stages": 4, "schedule": "interleaved"}, 2),
        ({"stages": 2, "compare_torch": True, "schedule": "1f1b"}, 2),
    ],
)
def test_nccl_layouts_with_peers_on_distinct_gpus_are_accepted(settings, gpus):
    PipelineConfig(backend="nccl", **settings).check_gpu_layout(gpus)
