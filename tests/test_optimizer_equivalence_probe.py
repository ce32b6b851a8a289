"""memory_efficient_gpt2/probes/optimizer_equivalence.py: the four runs and their summary in
--quick mode (CPUOffloadAdam with fp32 moments reproduces torch.optim.Adam bit for bit on the
CPU, so the reference comparison is exact there), and the lr schedule."""

import itertools
import sys

import pytest
import torch

from effdl.cli import run_main
from effdl.results import read_records
from tests.interrupting import whole_records
from tests.script_loading import load_script

probe = load_script("memory_efficient_gpt2/probes", "optimizer_equivalence")


def run_quick(tmp_path, monkeypatch, *argv: str) -> list[dict]:
    """The probe's --quick run in this process; its log records."""
    monkeypatch.setattr(sys, "argv", ["optimizer_equivalence.py", "--quick", "--out",
                                      str(tmp_path), "--cache", str(tmp_path / "cache"), *argv])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        run_main(probe.main)
    assert e.value.code == 0
    return read_records(tmp_path / "optimizer_equivalence.jsonl")


def test_quick_run_logs_four_runs_and_their_gaps_to_the_reference(tmp_path, monkeypatch):
    records = run_quick(tmp_path, monkeypatch, "--device", "cpu")
    steps = probe.QUICK.steps
    assert [r["variant"] for r in records] == [
        *(v for name in probe.RUNS for v in [f"{name}_step"] * steps + [name]),
        "summary",
    ]
    step_records = [r for r in records if r["variant"].endswith("_step")]
    records = [r for r in records if not r["variant"].endswith("_step")]
    runs = {r["variant"]: r["metrics"] for r in records[:-1]}
    ref = runs[probe.REFERENCE]
    steps = records[0]["config"]["steps"]
    assert all(len(m["tracking_loss"]) == len(m["train_loss"]) == steps for m in runs.values())
    assert runs["offload_fp32"]["tracking_loss"] == ref["tracking_loss"]
    assert runs["offload_fp32"]["train_loss"] == ref["train_loss"]
    assert runs[probe.REORDERED]["tracking_loss"][0] == ref["tracking_loss"][0]  # same init
    assert ref["final_tracking_loss"] < ref["tracking_loss"][0]
    summary = records[-1]["metrics"]
    for name, metrics in runs.items():
        gap = (torch.tensor(metrics["tracking_loss"]) - torch.tensor(ref["tracking_loss"])).abs()
        assert summary[name]["mean_abs_gap"] == pytest.approx(float(gap.mean()))
        assert summary[name]["max_abs_gap"] == pytest.approx(float(gap.max()))
        assert summary[name]["heldout_loss"] == metrics["heldout_loss"]
    assert summary["offload_fp32"]["max_abs_gap"] == 0
    level3 = records[probe.RUNS.index("offload_level3")]["config"]
    assert (level3["moments"], level3["grad_accumulation_dtype"]) == ("int8", "bf16")
    assert summary[probe.REORDERED]["mean_abs_gap"] > 0 < summary["offload_level3"]["mean_abs_gap"]
    for name, metrics in runs.items():  # the step records carry the run's curves, step by step
        logged = [r["metrics"] for r in step_records if r["variant"] == f"{name}_step"]
        assert [m["step"] for m in logged] == list(range(steps))
        assert [m["tracking_loss"] for m in logged] == metrics["tracking_loss"]
        assert [m["train_loss"] for m in logged] == metrics["train_loss"]


def test_an_interrupted_run_keeps_the_steps_and_runs_it_finished(tmp_path, monkeypatch):
    """Ctrl-C in the second run's third step: exit 130, and the log holds every step of the
    first run, its run record, and the second run's first two steps, as whole records."""
    lr_at, calls = probe.lr_at, itertools.count(1)

    def interrupted_lr_at(step, cfg):
        if next(calls) == probe.QUICK.steps + 3:
            raise KeyboardInterrupt
        return lr_at(step, cfg)

    monkeypatch.setattr(probe, "lr_at", interrupted_lr_at)
    monkeypatch.setattr(sys, "argv", ["optimizer_equivalence.py", "--quick", "--device", "cpu",
                                      "--out", str(tmp_path), "--cache", str(tmp_path / "cache")])  # fmt: skip
    with pytest.raises(SystemExit) as e:
        run_main(probe.main)
    assert e.value.code == 130
    records = whole_records(tmp_path / "optimizer_equivalence.jsonl")
    first, second = probe.RUNS[:2]
    assert [r["variant"] for r in records] == (
        [f"{first}_step"] * probe.QUICK.steps + [first] + [f"{second}_step"] * 2
    )
    assert [r["metrics"]["step"] for r in records[-2:]] == [0, 1]
    assert records[probe.QUICK.steps]["metrics"]["tracking_loss"] == [
        r["metrics"]["tracking_loss"] for r in records[: probe.QUICK.steps]
    ]


def test_lr_warms_up_linearly_then_decays_to_a_tenth():
    cfg = probe.ProbeConfig(steps=100, warmup=10, lr=1e-3)
    lrs = [probe.lr_at(step, cfg) for step in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] > 1e-4 and probe.lr_at(cfg.steps, cfg) == pytest.approx(1e-4)


@pytest.mark.gpu
def test_quick_run_on_cuda_puts_level_3_update_on_the_device(tmp_path, monkeypatch):
    records = run_quick(tmp_path, monkeypatch, "--device", "cuda")
    level3 = next(r for r in records if r["variant"] == "offload_level3")
    assert level3["config"]["device"].startswith("cuda")
    assert level3["config"]["update_on"] == "device" and level3["config"]["moments"] == "int8"
    summary = records[-1]["metrics"]
    assert summary["offload_fp32"]["mean_abs_gap"] < summary[probe.REORDERED]["mean_abs_gap"]
    assert all(torch.isfinite(torch.tensor(s["heldout_loss"])) for s in summary.values())
