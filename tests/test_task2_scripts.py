import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from effdl.cli import run_main
from effdl.profiling.epoch import EpochTiming
from effdl.results import read_records
from tests.script_loading import load_script as load_task_script


def load_script(name: str):
    return load_task_script("task2_batching", name)


def test_epoch_is_set_against_the_run_yardstick_and_the_adjacent_one():
    mock_epoch = load_script("mock_epoch")
    timing = EpochTiming(
        batch_s=[0.5, 0.25, 0.25],
        epoch_s=1.5,
        real_tokens=3000,
        slots=4000,
        widths=[10, 20, 30],
        peak_mem_gib=None,
        first_batch_s=0.1,
        wait_s=0.2,
        launch_s=0.3,
    )
    m = mock_epoch.epoch_metrics(timing, dense_tps=3000.0, adjacent_tps=6000.0)
    # ideal: 3000 real tokens at 3000 tok/s = 1 s (run yardstick), at 6000 tok/s = 0.5 s (adjacent)
    assert m["ideal_s"] == pytest.approx(1.0)
    assert m["compute_over_ideal"] == pytest.approx(1.0)  # compute = 0.5 + 0.25 + 0.25 s
    assert m["epoch_over_ideal"] == pytest.approx(1.5)
    assert m["dense_tokens_per_s_adjacent"] == 6000.0
    assert m["compute_over_ideal_adjacent"] == pytest.approx(2.0)
    assert m["epoch_over_ideal_adjacent"] == pytest.approx(3.0)
    assert m["padding_fraction"] == pytest.approx(0.25)


def run_script(name: str, argv: list[str], out: Path, monkeypatch, capsys):
    """``<name>.py --quick ARGV --out OUT`` in this process, as run_main runs it: (exit code,
    stderr lines)."""
    module = load_script(name)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--quick", *argv, "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        run_main(module.main)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def no_records(out: Path) -> bool:
    return not out.exists() or all(read_records(log) == [] for log in out.iterdir())


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpora")
    null, few = root / "null.parquet", root / "few.parquet"
    pq.write_table(pa.table({"text": pa.array([None, None, None], pa.string())}), null)
    pq.write_table(pa.table({"text": ["the cat sat on the mat", "a dog ran", "hello"]}), few)
    return {"null": null, "few": few}


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("mock_epoch", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("mock_epoch", ["--max-length", "1"], "--max-length must be >= 2, got 1"),
        ("mock_epoch", ["--max-batches", "0"], "--max-batches must be >= 1, got 0"),
        ("mock_epoch", ["--max-batches", "-1"], "--max-batches must be >= 1, got -1"),
        ("mock_epoch", ["--workers", "-1"], "--workers must be >= 0, got -1"),
        ("mock_epoch", ["--dense-iters", "0"], "--dense-iters must be >= 1, got 0"),
        ("mock_epoch", ["--n-layers", "0"], "--n-layers must be >= 1, got 0"),
        (
            "mock_epoch",
            ["--batch-size", "1000000000"],
            "--batch-size 1000000000 x --max-length 128: needs at least ",
        ),
        ("mock_epoch", ["--data", "{null}"], "--data"),
        ("train_pipelines", ["--max-length", "1"], "--max-length must be >= 2, got 1"),
        ("train_pipelines", ["--data", "{null}"], "--data"),
        (
            "train_pipelines",
            ["--data", "{few}"],
            "--token-budget 40,000 needs 4,000 epochs of {few} (10 tokens), at most 100",
        ),
        ("sampler_costs", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
        ("sampler_costs", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("packing_costs", ["--corpus", "{null}"], "--corpus: {null}"),
        (
            "packing_costs",
            ["--capacity", "1", "--overlong", "drop"],
            "--capacity 1 --overlong drop: all 1,000 documents are longer than the capacity",
        ),
    ],
)
def test_refused_in_one_line_without_records(
    corpora, script, argv, message, tmp_path, monkeypatch, capsys
):
    argv = [a.format(**corpora) for a in argv]
    code, err = run_script(script, argv, tmp_path / "out", monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"{script}.py: error: {message.format(**corpora)}"), err
    if "{null}" in argv or str(corpora["null"]) in argv:
        assert str(corpora["null"]) in err[0]
    assert no_records(tmp_path / "out")


@pytest.mark.parametrize("size", ["nan", "inf", "1.5", "ten"])
def test_packing_sizes_must_be_whole_counts(size, tmp_path, monkeypatch, capsys):
    code, err = run_script("packing_costs", ["--sizes", size], tmp_path, monkeypatch, capsys)
    assert code == 2
    assert err[-1] == (
        "packing_costs.py: error: argument --sizes: expected a whole number such as 1000 or "
        f"1.8e6, got '{size}'"
    )


def test_concatenation_packs_the_documents_drop_keeps(tmp_path, monkeypatch, capsys):
    argv = ["--sizes", "2000", "--capacity", "100", "--overlong", "drop"]
    code, _ = run_script("packing_costs", argv, tmp_path, monkeypatch, capsys)
    assert code == 0
    by = {r["config"]["algorithm"]: r["metrics"] for r in read_records(tmp_path / "packing.jsonl")}
    assert by["ffd"]["n_dropped"] > 0
    assert by["concat"]["lower_bound"] == by["ffd"]["lower_bound"] == by["bfd"]["lower_bound"]


@pytest.mark.parametrize("met", [True, False])
def test_a_missed_bfd_target_exits_1_after_the_log(met, tmp_path, monkeypatch, capsys):
    """The target is checked from n = TARGET_N (lowered here, so a small run reaches it): met,
    exit 0; missed (a time limit of 0 s), the verdict on stdout, one line on stderr naming the
    target and exit 1, with every record logged."""
    module = load_script("packing_costs")
    monkeypatch.setattr(module, "TARGET_N", 2000)
    monkeypatch.setattr(module, "BFD_TARGET_S", 1e9 if met else 0.0)
    argv = ["packing_costs.py", "--quick", "--sizes", "2000", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        run_main(module.main)
    out, err = capsys.readouterr()
    assert [r["variant"] for r in read_records(tmp_path / "packing.jsonl")] == [
        "packing_concat", "packing_ffd", "packing_bfd",
    ]  # fmt: skip
    failed = [line for line in err.splitlines() if "failed" in line]  # tqdm writes there too
    if met:
        assert e.value.code == 0 and "-> met" in out and not failed
    else:
        assert e.value.code == 1 and "-> NOT met" in out
        assert failed == [
            "packing_costs.py: failed: BFD target (< 0 s, fill >= 99%) not met at n=2000"
        ]


def test_training_never_spins_on_an_empty_loader():
    endless = load_script("train_pipelines").endless([])
    with pytest.raises(RuntimeError, match="no batch in a whole epoch"):
        next(endless)


def test_an_interrupt_mid_training_logs_the_steps_finished(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the fourth step of the first pipeline: exit 130, and the log holds that
    pipeline's record of its three finished steps, marked interrupted, and nothing after."""
    module = load_script("train_pipelines")
    step, calls = module.train_step, []

    def train_step(model, opt, inputs, autocast):
        calls.append(1)
        if len(calls) == 3 + 4:  # the three warm-up steps, then the fourth trained one
            raise KeyboardInterrupt
        return step(model, opt, inputs, autocast)

    monkeypatch.setattr(module, "train_step", train_step)
    monkeypatch.setattr(sys, "argv", ["train_pipelines.py", "--quick", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        run_main(module.main)
    assert e.value.code == 130
    (record,) = read_records(tmp_path / "train_pipelines.jsonl")
    assert record["config"]["interrupted"] is True
    assert record["metrics"]["steps"] == 3 and record["metrics"]["real_tokens"] > 0
    # the CPU has no allocator statistics: peak memory is not measured, logged as null
    assert record["metrics"]["peak_mem_gib"] is None
    assert record["metrics"]["step_peak_gib_median"] is None
