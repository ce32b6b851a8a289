import gzip
import json
import re
from pathlib import Path

import pytest

# The report pipeline's packages may be missing where `pytest -m gpu` collects this file.
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

from effdl.notebooks import REPORTS, execute_notebook, main  # noqa: E402
from effdl.results import append_record, make_record, read_records  # noqa: E402

ENV = {
    "gpu": "Test GPU",
    "cpu": "x",
    "torch": "t",
    "python": "p",
    "git_sha": "s",
    "time": "2026-01-01",
}


def fake_ceilings(folder: Path, env: dict = ENV) -> None:
    log = folder / "ceilings" / "c.jsonl"
    for dtype, tf in [("bf16", 700.0), ("fp32", 50.0)]:
        append_record(
            log,
            make_record(
                "ceilings",
                f"matmul_{dtype}",
                {"op": "matmul", "dtype": dtype, "n": 64},
                {"tflops": tf, "time_s_median": 1e-3},
                env,
            ),
        )
    append_record(
        log,
        make_record(
            "ceilings",
            "copy",
            {"op": "copy", "bytes": 2**30},
            {"gb_per_s": 3000.0, "time_s_median": 1e-3},
            env,
        ),
    )


@pytest.mark.slow
def test_ceilings_notebook_executes_against_given_results(tmp_path):
    fake_ceilings(tmp_path / "results")
    ipynb, html = execute_notebook(
        REPORTS / "gpu_ceilings.ipynb", tmp_path / "results", tmp_path / "out"
    )
    assert html.read_text().count("Test GPU") > 0
    outputs = json.dumps(nbformat.read(ipynb, as_version=4).cells[-1].outputs)
    assert "700" in outputs and "3000" in outputs  # the fake numbers, not the committed ones


@pytest.mark.slow
def test_ceilings_notebook_sets_no_datasheet_against_cpu_numbers(tmp_path):
    fake_ceilings(tmp_path / "results", env={**ENV, "gpu": None, "cpu": "x86_64"})
    ipynb, _ = execute_notebook(
        REPORTS / "gpu_ceilings.ipynb", tmp_path / "results", tmp_path / "out"
    )
    cells = nbformat.read(ipynb, as_version=4).cells
    text = json.dumps([c.outputs for c in cells if c.cell_type == "code"])
    assert "CPU (x86_64)" in text and "None" not in text  # the device that ran, named
    assert "not comparable" in text  # said once ...
    assert "fraction of datasheet" not in text and "of datasheet" not in text  # ... and not set


def test_runner_fails_cleanly_on_missing_results_folder(tmp_path, capsys):
    assert main(["--results", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.slow
def test_runner_reports_failing_notebook_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("raise RuntimeError('boom')")]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, bad)
    (tmp_path / "results").mkdir()
    assert (
        main(["--results", str(tmp_path / "results"), "--out", str(tmp_path / "out"), str(bad)])
        == 1
    )
    assert not (tmp_path / "out" / "bad.ipynb").exists()


def test_committed_notebooks_are_executed():
    for nb_path in sorted(REPORTS.glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(c.get("execution_count") for c in code), (
            f"{nb_path.name} is not executed"
        )


RESULTS_LIMIT_BYTES = 10 * 2**20  # DESIGN.md: reports/results/ within 10 MB
PLAIN_LOG_LIMIT_BYTES = 64 * 2**10  # a larger committed log is kept gzip-compressed
HOST_ID = re.compile(r"(?<![0-9a-z])(?=[a-f]*[0-9])[0-9a-f]{8}(?![0-9a-z])", re.I)


def test_committed_results_are_run_logs_named_by_what_they_measure():
    files = sorted(p for p in (REPORTS / "results").rglob("*") if p.is_file())
    assert files
    total = sum(p.stat().st_size for p in files)
    assert total <= RESULTS_LIMIT_BYTES, f"reports/results holds {total / 2**20:.1f} MiB (> 10)"
    for path in files:
        rel = path.relative_to(REPORTS / "results")
        name = str(rel)
        assert "archive" not in rel.parts[:-1], f"{name}: superseded runs are deleted, not archived"
        assert not re.search(r"session|stop[0-9_]|round[0-9_]|_[0-9a-f]{7}\b", name, re.I), (
            f"{name}: named after when it was made"
        )
        assert not HOST_ID.search(path.name), (
            f"{name}: named after a host (a record's env.gpu_id tells hosts apart)"
        )
        if "traces" in rel.parts[:-1]:  # profiler traces
            assert name.endswith(".json.gz"), f"{name}: traces are gzipped trace-event JSON"
            with gzip.open(path, "rt") as f:
                assert json.load(f)["traceEvents"], f"{name}: no trace events"
            continue
        assert name.endswith((".jsonl", ".jsonl.gz")), (
            f"{name}: results hold JSONL run logs and traces/"
        )
        if path.suffix == ".jsonl":
            assert path.stat().st_size <= PLAIN_LOG_LIMIT_BYTES, (
                f"{name}: a log over 64 KB is committed gzipped ({name}.gz)"
            )
        assert read_records(path), f"{name}: no records"


def test_host_id_pattern_tells_host_ids_from_measured_quantities():
    assert HOST_ID.search("speedup_stages_replicate_8ac832b2.jsonl")
    assert HOST_ID.search("vit_profile_49203efc.jsonl")
    for name in ("pipeline_bubble_h200x2.jsonl", "gpt2_large_fixed_batch_16_lr3e-4.jsonl",
                 "pipeline_memory_1000_microbatches_cpu.jsonl", "speedup_stages_replicate.jsonl"):  # fmt: skip
        assert not HOST_ID.search(name), name
