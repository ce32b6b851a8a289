"""tools/stand_in_data.py: it writes the three logs, measures the data the committed runs used,
and the reports' table (effdl.data.stand_in) shows measured against published."""

import re
import sys

import pytest

from effdl.cli import run_main
from effdl.data.stand_in import NOT_PUBLISHED, UNITS, stand_in_table
from effdl.results import RunLog, load_results, read_records
from tests.script_loading import ROOT, load_script

COMMITTED = ROOT / "reports" / "results"
STDLIB_SAMPLE = r"stdlib-py3\.\d+-[0-9a-f]{{12}} paragraphs \({n} lines\)"


@pytest.fixture(scope="module")
def script():
    return load_script("tools", "stand_in_data")


def test_quick_run_writes_the_three_logs(script, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["stand_in_data.py", "--quick", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        run_main(script.main)
    assert e.value.code == 0
    sources = {}
    for task in ("task1", "task2", "vit"):
        records = read_records(tmp_path / task / "stand_in_data.jsonl")
        assert records and all(r["task"] == "stand_in_data" for r in records)
        for r in records:
            assert set(r["metrics"]) == {"measured", "published"}
            assert r["metrics"]["published"] is not None or r["config"]["published_note"]
            assert r["config"]["unit"] in UNITS
        sources[task] = {r["config"]["source"] for r in records}
    paragraphs = {s for s in sources["task1"] if s != "synthetic:40"}
    assert len(paragraphs) == 1 and re.fullmatch(STDLIB_SAMPLE.format(n=2500), paragraphs.pop())
    assert {**sources, "task1": None} == {
        "task1": None,
        "task2": {"synthetic(quick, seed=0)"},
        "vit": {"clothing_like:120:160-400px"},
    }
    by_variant = {r["variant"]: r for r in read_records(tmp_path / "vit" / "stand_in_data.jsonl")}
    assert by_variant["clothing_like/images"]["metrics"] == {"measured": 120, "published": 5403}
    counts = [v["metrics"]["measured"] for k, v in by_variant.items() if "/count_" in k]
    assert len(counts) == 20 and sum(counts) == 120


def test_full_sizes_are_those_of_the_committed_runs(script):
    """The data sets measured at full size are the ones the committed GPU logs name."""
    full = script.FULL
    lm = load_results(COMMITTED / "task1", "lm_precision.jsonl")
    (corpus,) = set(lm["config.corpus"])
    assert re.fullmatch(STDLIB_SAMPLE.format(n=full.lm_samples), corpus)
    assert set(lm["config.max_length"]) == {full.lm_max_length}
    unet = load_results(COMMITTED / "task1", "unet_runs.jsonl")
    assert set(unet["config.size"]) == {full.unet_size}
    mock = load_results(COMMITTED / "task2", "*mock_epoch*.jsonl")
    assert set(mock["config.corpus"]) == {"synthetic(wikitext103-size, seed=0)"}
    assert not full.corpus_quick and set(mock["config.max_length"]) == {full.corpus_max_length}
    vit = load_results(COMMITTED / "vit", "vit_pipeline*.jsonl")
    n, lo, hi = full.vit
    assert f"clothing_like:{n}:{lo}-{hi}px" in set(vit["config.source"])


def test_table_sets_measured_against_published_for_the_newest_run(tmp_path):
    for run_id, value in (("old", 1.0), ("new", 2.0)):
        log = RunLog(tmp_path / "s.jsonl", "stand_in_data", run_id=run_id)
        base = {"data_set": "d", "source": "s", "unit": "count"}
        log.log("d/n", {**base, "statistic": "n", "published_note": "Kaggle"},
                {"measured": 1000 * value, "published": 4000})  # fmt: skip
        log.log("d/share", {**base, "statistic": "share", "unit": "share",
                            "published_note": NOT_PUBLISHED}, {"measured": 0.125, "published": None})  # fmt: skip
    table = stand_in_table(load_results(tmp_path))
    assert table.to_dict("index") == {
        "n": {"stand-in": "2,000", "real set": "4,000", "stand-in / real": "0.5",
              "real figure": "Kaggle"},
        "share": {"stand-in": "12.50%", "real set": "", "stand-in / real": "",
                  "real figure": NOT_PUBLISHED},
    }  # fmt: skip
