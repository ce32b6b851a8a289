"""memory_efficient_gpt2/train.py's GPT-2-XL flags: --moments / --update-on /
--grad-accumulation-dtype validated in one line, the --level presets resolved under the flags
given beside them (effdl.gpt2_offload.config) and named in the records, level 3's GPU estimate
within its cap (effdl.gpt2_offload.budget), the host and GPU memory caps failing loudly before a
record, the summary's budget beside the measured peaks, and --baseline's speed ratios."""

import re
import sys

import pytest
import torch

import effdl.gpt2_offload.budget as budget
import effdl.gpt2_offload.run as offload_run
from effdl.cli import UsageError, base_parser, run_main
from effdl.gpt2_offload.budget import gpu_estimate, optimizer_gpu_gib, pick_checkpoint_layers
from effdl.gpt2_offload.config import (
    ACCUMULATOR_DTYPES,
    LEVELS,
    QUICK,
    TrainConfig,
    parse_train_args,
)
from effdl.gpt2_offload.steps import MemoryCapExceeded, check_memory_caps
from effdl.models.gpt2 import build_gpt2, gpt2_config
from effdl.optim import plan_offload
from effdl.optim.offload import DEVICE_CHUNK_BLOCKS
from effdl.optim.quantized_state import BLOCK_SIZE, quantized_nbytes
from effdl.profiling.memory_budget import ESTIMATE_HEADROOM_GIB
from effdl.results import read_records
from tests.script_loading import load_script

train = load_script("memory_efficient_gpt2", "train")

XL_PARAMS = 1_557_611_200


def run_train(argv, out, monkeypatch, capsys) -> tuple[int, list[str]]:
    """``train.py --quick ARGV --out OUT`` in this process: (exit code, stderr lines)."""
    monkeypatch.setattr(sys, "argv", ["train.py", "--quick", *argv, "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        run_main(train.main)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def parsed(argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    return parse_train_args(base_parser("train.py", "runs/gpt2"))[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--update-on", "device"], "--update-on device runs the 8-bit Adam step on the GPU: "
         "it needs --moments int8"),
        (["--moments", "int8", "--update-on", "device"], "--update-on device runs the 8-bit "
         "Adam step on the GPU: it needs --device cuda (this run is on cpu)"),
        (["--host-memory-cap-gib", "0"], "--host-memory-cap-gib must be > 0, got 0.0"),
        (["--moments", "int8", "--update-on", "device", "--size", "tiny"], "--update-on device "
         "runs the 8-bit Adam step on the GPU: it needs --device cuda"),
        (["--grad-accumulation", "cpu", "--grad-accumulation-dtype", "bf16"],
         "--grad-accumulation-dtype bf16 is the GPU accumulator's dtype: it needs "
         "--grad-accumulation gpu"),
    ],
)  # fmt: skip
def test_device_update_needs_int8_and_cuda(argv, message, tmp_path, monkeypatch, capsys):
    code, err = run_train(argv, tmp_path / "out", monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("train.py: error: " + message), err
    log = tmp_path / "out" / "gpt2.jsonl"
    assert not log.exists() or not read_records(log)


def test_level_presets_resolve_as_stated_and_given_flags_win(monkeypatch):
    plain = parsed([], monkeypatch)
    assert (plain.level, plain.moments, plain.update_on, plain.host_memory_cap_gib,
            plain.grad_accumulation_dtype) == (None, "fp32", "host", None, "fp32")  # fmt: skip
    level_1 = parsed(["--level", "1"], monkeypatch)
    expected_1 = {"size": "xl", "memory_cap_gib": 16.0, "moments": "fp32", "update_on": "host",
                  "host_memory_cap_gib": None, "level": 1,
                  "grad_accumulation_dtype": "fp32"}  # fmt: skip
    assert {k: getattr(level_1, k) for k in expected_1} == expected_1
    level_2 = parsed(["--level", "2"], monkeypatch)
    expected_2 = {**expected_1, "level": 2, "moments": "int8", "update_on": "device",
                  "grad_accumulation_dtype": "bf16"}  # fmt: skip
    assert {k: getattr(level_2, k) for k in expected_2} == expected_2
    level_3 = parsed(["--level", "3"], monkeypatch)
    expected_3 = {"size": "xl", "memory_cap_gib": 11.0, "host_memory_cap_gib": 16.0,
                  "moments": "int8", "update_on": "device", "grad_accumulation": "gpu",
                  "grad_accumulation_dtype": "bf16"}  # fmt: skip
    assert {k: getattr(level_3, k) for k in expected_3} == expected_3
    given = parsed(["--level", "3", "--memory-cap-gib", "12", "--update-on", "host"], monkeypatch)
    assert (given.memory_cap_gib, given.update_on, given.moments) == (12.0, "host", "int8")
    assert (given.batch, given.seq) == (64, 1024)  # 64 x 1024 tokens per step


def test_every_level_sets_the_same_flags_and_its_records_name_it():
    assert len({frozenset(preset) for preset in LEVELS.values()}) == 1
    data = {"data": "stdlib", "tokenizer": "bpe"}
    for level in LEVELS:
        config = offload_run.run_config(parsed_level(level), XL_PARAMS, 10, 4, data)
        assert config["level"] == level
        assert {k: config[k] for k in LEVELS[level] if k in config} == {
            k: v for k, v in LEVELS[level].items() if k in config
        }


def test_baseline_after_the_run_logs_each_model_and_the_speed_ratios(tmp_path, monkeypatch, capsys):
    code, _ = run_train(["--steps", "2", "--baseline"], tmp_path, monkeypatch, capsys)
    assert code == 0
    records = read_records(tmp_path / "gpt2.jsonl")
    assert [r["variant"] for r in records] == [
        "memory_budget", "corpus", "corpus", "corpus_summary", "baseline", "baseline",
        "baseline_best", "baseline_own", "baseline_own", "baseline_own_best", "speed_ratio",
    ]  # fmt: skip
    summary, ratio = records[3], records[-1]
    assert ratio["config"] == summary["config"]
    assert [r["config"]["micro_batch"] for r in records[4:6]] == list(QUICK.baseline_micro_batches)
    ours = summary["metrics"]["seq_per_s_median"]
    for variant in ("baseline", "baseline_own"):
        best = next(r["metrics"] for r in records if r["variant"] == f"{variant}_best")
        assert ratio["metrics"][f"ratio_to_{variant}"] == pytest.approx(ours / best["seq_per_s"])
        assert ratio["metrics"][f"{variant}_micro_batch"] == best["micro_batch"]
    assert ratio["metrics"]["baseline_is"].startswith("Hugging Face")


@pytest.fixture
def nothing_built(monkeypatch):
    """A refused run must stop before its data and its model are made."""

    def built(*args, **kwargs):
        raise AssertionError("the run was not refused before building")

    monkeypatch.setattr(train, "make_batches", built)
    monkeypatch.setattr(offload_run, "initial_model", built)


@pytest.mark.parametrize("level", sorted(LEVELS))
@pytest.mark.parametrize("device", [[], ["--device", "cpu"]])
def test_a_level_off_a_gpu_is_refused_up_front(
    level, device, tmp_path, monkeypatch, capsys, nothing_built
):
    if torch.cuda.is_available() and not device:
        pytest.skip("--device auto is CUDA here")
    argv = ["--level", str(level), *device]
    code, err = run_train(argv, tmp_path / "out", monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        f"train.py: error: --level {level} is a GPU preset (peak GPU memory under "
        f"--memory-cap-gib {LEVELS[level]['memory_cap_gib']:g}): it needs --device cuda "
        "(this run is on cpu)"
    )
    assert not (tmp_path / "out").exists()


def test_a_run_the_host_cannot_hold_is_refused_naming_the_estimate(
    tmp_path, monkeypatch, capsys, nothing_built
):
    import psutil

    available = psutil.virtual_memory()._replace(available=2**20)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: available)
    code, err = run_train(["--size", "tiny"], tmp_path / "out", monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    plan = plan_offload(budget.param_numels(gpt2_config("tiny")), **budget.offload_options(QUICK))
    need = budget.host_bytes_needed(plan, torch.device("cpu"))
    assert err[0] == (
        "train.py: error: --size --moments --update-on: GPT-2-tiny's fp32 model and offloaded "
        f"optimizer state (plan_offload) needs at least {need / 2**30:,.1f} GiB, the host has "
        "0.0 GiB free"
    )
    assert not (tmp_path / "out").exists()


def test_host_bytes_are_the_plans_and_the_fp32_model(xl_numels):
    """Level 1 on a GPU: 18 B per parameter of the optimizer on the host (fp32 master and
    moments, the gradient copy, the bf16 staging) and the fp32 model built first; on the CPU the
    device's bf16 weights and fp32 accumulator are the host's too."""
    plan = xl_plan(xl_numels, parsed_level(1))
    assert budget.host_bytes_needed(plan, torch.device("cuda", 0)) == 22 * XL_PARAMS
    assert budget.host_bytes_needed(plan, torch.device("cpu")) == 28 * XL_PARAMS
    assert budget.param_numels(gpt2_config("xl")) == xl_numels


def parsed_level(level: int, **flags) -> TrainConfig:
    return TrainConfig(**{**LEVELS[level], "level": level, **flags})


@pytest.fixture(scope="module")
def xl_numels() -> list[int]:
    with torch.device("meta"):
        model = build_gpt2(gpt2_config("xl"))
    numels = [p.numel() for p in model.parameters()]
    assert sum(numels) == XL_PARAMS
    return numels


def xl_plan(numels: list[int], cfg: TrainConfig):
    """The optimizer's plan for GPT-2-XL under ``cfg``, as train.py builds it."""
    return plan_offload(
        numels,
        grad_accumulation=cfg.grad_accumulation,
        grad_accumulation_dtype=ACCUMULATOR_DTYPES[cfg.grad_accumulation_dtype],
        moments=cfg.moments,
        update_on=cfg.update_on,
    )


def test_level_3_keeps_the_host_under_16_gib_and_level_1_does_not(xl_numels):
    host = xl_plan(xl_numels, parsed_level(3)).bytes_on("host")
    assert host == 4 * XL_PARAMS + 2 * quantized_nbytes(XL_PARAMS) < 16 * 2**30
    assert xl_plan(xl_numels, parsed_level(1)).bytes_on("host") == 18 * XL_PARAMS


def level_3_estimate(numels: list[int], accumulator: str) -> tuple[int | None, dict, dict]:
    """XL at level 3 with the given accumulator dtype, without a GPU (activations: the
    estimate's 36 d bytes per token and block): (automatic checkpoint choice, or None where
    nothing fits; GPU estimate at that choice; GPU estimate with all 48 blocks checkpointed)."""
    cfg = parsed_level(3, grad_accumulation_dtype=accumulator)
    plan = xl_plan(numels, cfg)
    every = gpu_estimate(cfg, XL_PARAMS, 48, None, plan)
    try:
        ckpt = pick_checkpoint_layers(cfg, XL_PARAMS, None, optimizer_gpu_gib(plan))
    except UsageError:
        return None, {}, every
    return ckpt, gpu_estimate(cfg, XL_PARAMS, ckpt, None, plan), every


def test_level_3_gpu_estimate_fits_11_gib_with_the_bf16_accumulator(xl_numels):
    """With the fp32 accumulator even 48 checkpointed blocks overrun the cap; with the bf16 one the automatic choice fits
    within the cap less the estimate's headroom, and every block checkpointed fits easily. The
    two differ by the accumulator's 2 B per parameter, less the device step's fp32 copy of a
    chunk of bf16 gradients."""
    headroom = ESTIMATE_HEADROOM_GIB
    ckpt, auto, every = level_3_estimate(xl_numels, "bf16")
    assert auto["grad_accumulation"] == pytest.approx(2 * XL_PARAMS / 2**30)
    assert ckpt < 48 and auto["total"] + headroom <= 11.0
    assert auto["total"] == pytest.approx(sum(v for k, v in auto.items() if k != "total"))
    assert every["total"] + headroom < 10.0
    fp32_ckpt, _, fp32_every = level_3_estimate(xl_numels, "fp32")
    assert fp32_ckpt is None and fp32_every["total"] > 11.0
    chunk_copy = 4 * DEVICE_CHUNK_BLOCKS * BLOCK_SIZE
    assert (fp32_every["total"] - every["total"]) * 2**30 == pytest.approx(
        2 * XL_PARAMS - chunk_copy
    )


def test_host_cap_below_the_resident_set_fails_loudly_before_any_record(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(
        sys, "argv",
        ["train.py", "--quick", "--host-memory-cap-gib", "0.01", "--out", str(tmp_path)],
    )  # fmt: skip
    with pytest.raises(MemoryCapExceeded, match=r"after set-up: host resident set "
                       r"\d+\.\d{3} GiB exceeds --host-memory-cap-gib 0\.01"):  # fmt: skip
        train.main()
    log = tmp_path / "gpt2.jsonl"
    assert not log.exists() or read_records(log) == []


def test_caps_are_checked_against_the_measured_peaks():
    cfg = TrainConfig(memory_cap_gib=11.0, host_memory_cap_gib=16.0)
    check_memory_caps(cfg, "step 3", 10.9, 15.9)
    check_memory_caps(cfg, "step 3", None, 15.9)  # no GPU: nothing to check
    with pytest.raises(MemoryCapExceeded, match=r"step 3: peak GPU memory 11\.200 GiB"):
        check_memory_caps(cfg, "step 3", 11.2, 1.0)
    with pytest.raises(MemoryCapExceeded, match=r"16\.500 GiB exceeds --host-memory-cap-gib"):
        check_memory_caps(cfg, "step 3", 1.0, 16.5)


def test_int8_run_records_the_budget_beside_the_measured_peaks(tmp_path, monkeypatch, capsys):
    argv = ["--moments", "int8", "--steps", "2", "--host-memory-cap-gib", "64"]
    monkeypatch.setattr(sys, "argv", ["train.py", "--quick", *argv, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        run_main(train.main)
    assert e.value.code == 0
    printed = capsys.readouterr().out
    records = read_records(tmp_path / "gpt2.jsonl")
    assert [r["variant"] for r in records] == [
        "memory_budget",
        "corpus",
        "corpus",
        "corpus_summary",
    ]
    budget, summary = records[0]["metrics"], records[-1]["metrics"]
    assert records[-1]["config"]["moments"] == "int8" and records[-1]["config"]["level"] is None
    n_params = records[-1]["config"]["n_params"]
    assert budget["host_exp_avg_gib"] == pytest.approx(quantized_nbytes(n_params) / 2**30)
    # the optimizer's moments, measured, are the computed ones plus alignment padding
    assert budget["measured_moment_gib"] == pytest.approx(2 * budget["host_exp_avg_gib"], rel=0.05)
    steps = records[1:3]
    assert steps[1]["metrics"]["host_rss_peak_gib"] == max(
        budget["measured_setup_host_rss_gib"], *(s["metrics"]["host_rss_gib"] for s in steps)
    )
    assert summary["host_rss_peak_gib"] == steps[1]["metrics"]["host_rss_peak_gib"]
    assert summary["host_rss_high_water_gib"] >= summary["host_rss_peak_gib"]
    assert summary["host_budget_gib"] == budget["host_total_gib"]
    assert summary["state"] == budget["state"]
    assert summary["step_s_median"] == steps[1]["metrics"]["step_s"]
    # no GPU: its peak, static memory and activation bytes are not measured, logged as null
    assert budget["measured_static_gib"] is None
    assert budget["measured_act_bytes_per_token_layer"] is None
    assert all(s["metrics"]["peak_gib"] is None for s in steps)
    assert summary["peak_gib_max"] is None
    assert "GPU: peak - GiB measured" in printed and not re.search(r"\bnan\b", printed)


def test_bf16_accumulator_run_records_its_dtype_and_bytes(tmp_path, monkeypatch, capsys):
    code, _ = run_train(["--grad-accumulation-dtype", "bf16", "--steps", "1"], tmp_path,
                        monkeypatch, capsys)  # fmt: skip
    assert code == 0
    budget, *_, summary = read_records(tmp_path / "gpt2.jsonl")
    assert summary["config"]["grad_accumulation_dtype"] == "bf16"
    n_params = summary["config"]["n_params"]
    state = {r["state"]: r for r in budget["metrics"]["state"]}
    for row in ("grad_accumulation", "grad"):  # on the GPU, and its copy for the host update
        assert (state[row]["dtype"], state[row]["bytes"]) == ("bf16", 2 * n_params)
    assert budget["metrics"]["gpu_grad_accumulation_gib"] == pytest.approx(2 * n_params / 2**30)


@pytest.mark.gpu
def test_level_2_runs_on_cuda_and_is_timed_against_the_baselines(tmp_path, monkeypatch, capsys):
    argv = ["--level", "2", "--size", "tiny", "--device", "cuda", "--steps", "3", "--baseline"]
    code, _ = run_train(argv, tmp_path, monkeypatch, capsys)
    assert code == 0
    records = read_records(tmp_path / "gpt2.jsonl")
    summary = next(r for r in records if r["variant"] == "corpus_summary")
    ratio = records[-1]
    assert ratio["variant"] == "speed_ratio"
    for record in (summary, ratio):
        assert record["config"]["level"] == 2 and record["config"]["memory_cap_gib"] == 16.0
        assert record["config"]["update_on"] == "device"
    assert 0 < summary["metrics"]["peak_gib_max"] <= 16
    assert (
        ratio["metrics"]["ratio_to_baseline"] > 0 and ratio["metrics"]["ratio_to_baseline_own"] > 0
    )


@pytest.mark.gpu
def test_level_3_runs_on_cuda_within_both_caps(tmp_path, monkeypatch, capsys):
    argv = ["--level", "3", "--size", "tiny", "--device", "cuda", "--steps", "3",
            "--memory-cap-gib", "2", "--host-memory-cap-gib", "16"]  # fmt: skip
    code, _ = run_train(argv, tmp_path, monkeypatch, capsys)
    assert code == 0
    summary = read_records(tmp_path / "gpt2.jsonl")[-1]
    assert summary["variant"] == "corpus_summary"
    assert summary["config"]["level"] == 3 and summary["config"]["update_on"] == "device"
    assert summary["config"]["grad_accumulation_dtype"] == "bf16"
    assert 0 < summary["metrics"]["peak_gib_max"] <= 2
    assert 0 < summary["metrics"]["host_rss_peak_gib"] <= 16
    assert "device_update_scratch" in {r["state"] for r in summary["metrics"]["state"]}
