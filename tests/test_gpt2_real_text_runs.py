"""memory_efficient_gpt2/train.py on real text: the stdlib corpus by default (records name it),
the synthetic stream only when asked, the lr warm-up, the AdamW reference run from the same
weights (equivalence record); peer_torchao.py refused in one line when torchao is missing."""

import dataclasses
import itertools
import math
import sys

import pytest

from effdl.cli import run_main
from effdl.gpt2_offload import reference as gpt2_reference
from effdl.gpt2_offload.config import FULL
from effdl.gpt2_offload.inputs import lr_at
from effdl.results import read_records
from tests.script_loading import load_script

train = load_script("memory_efficient_gpt2", "train")
peer = load_script("memory_efficient_gpt2", "peer_torchao")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("stdlib_cache")


def run_train(argv, out, cache, monkeypatch, capsys, script=train) -> tuple[int, list[str]]:
    """``train.py --quick ARGV`` (or another script's) in this process: (exit code, stderr
    lines)."""
    name = script.__file__.rsplit("/", 1)[-1]
    argv = [name, "--quick", *argv, "--cache", str(cache), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        run_main(script.main)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_lr_warms_up_linearly_then_stays_or_decays_to_a_tenth():
    cfg = dataclasses.replace(FULL, lr=1e-3, warmup_steps=4, steps=10)
    assert [lr_at(s, cfg) for s in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert lr_at(9, cfg) == 1e-3
    cosine = dataclasses.replace(cfg, lr_schedule="cosine")
    lrs = [lr_at(s, cosine) for s in range(10)]
    assert lrs[4] == pytest.approx(1e-3) and lrs[9] == pytest.approx(1e-4)
    assert all(a > b for a, b in itertools.pairwise(lrs[4:]))
    assert lr_at(0, dataclasses.replace(cfg, warmup_steps=0)) == 1e-3


def test_default_data_is_the_stdlib_corpus_and_generated_is_asked_for(
    cache, tmp_path, monkeypatch, capsys
):
    for argv, data, tokenizer in (([], "stdlib-py", "-bpe512"), (["--data", "generated"],
                                  "synthetic", "none")):  # fmt: skip
        out = tmp_path / (argv[-1] if argv else "default")
        code, _ = run_train(["--steps", "2", *argv], out, cache, monkeypatch, capsys)
        assert code == 0
        step = read_records(out / "gpt2.jsonl")[1]
        assert step["config"]["data"].startswith(data), step["config"]
        assert step["config"]["tokenizer"].endswith(tokenizer), step["config"]
        assert step["metrics"]["lr"] == pytest.approx(1e-3)  # --quick warms up over one step


def test_reference_run_starts_from_our_weights_and_tracks_our_loss(
    cache, tmp_path, monkeypatch, capsys
):
    """Tiny GPT-2, fixed real batch: the AdamW reference (fp32 + bf16 autocast) sees the same
    first loss as ours (same initial weights and batch) and stays within the gap target."""
    argv = ["--fixed-batch", "--steps", "5", "--warmup-steps", "2", "--reference", "adamw"]
    code, _ = run_train(argv, tmp_path, cache, monkeypatch, capsys)
    assert code == 0
    records = read_records(tmp_path / "gpt2.jsonl")
    variants = [r["variant"] for r in records]
    assert variants.count("fixed_batch") == 5 and variants.count("reference_adamw") == 5
    eq = next(r for r in records if r["variant"] == "equivalence")
    m = eq["metrics"]
    assert eq["config"]["data"].startswith("stdlib-py")
    assert len(m["loss_ours"]) == len(m["loss_reference"]) == 5
    assert m["lr"] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3])
    assert m["loss_reference"][0] == pytest.approx(m["loss_ours"][0], abs=2e-3)
    assert m["loss_ours"][0] == pytest.approx(math.log(50257), abs=0.2)  # random init
    assert m["mean_abs_gap"] < 0.05 and m["gap_ok"]
    assert m["fall_reference"] > 0 and m["fall_ours"] > 0
    assert m["passed"] == (m["gap_ok"] and m["fall_ok"])


def test_a_gap_past_its_target_fails_the_run_after_the_log(cache, tmp_path, monkeypatch, capsys):
    """With the gap target below any gap (-1 nats), the equivalence prints FAIL, stderr names
    the gap in one line and the exit code is 1; the equivalence record is still written."""
    monkeypatch.setattr(gpt2_reference, "MAX_MEAN_GAP_NATS", -1.0)
    monkeypatch.setattr(train, "MAX_MEAN_GAP_NATS", -1.0)
    argv = ["--fixed-batch", "--steps", "2", "--warmup-steps", "1", "--reference", "adamw"]
    argv = ["train.py", "--quick", *argv, "--cache", str(cache), "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        run_main(train.main)
    out, err = capsys.readouterr()
    failed = [line for line in err.splitlines() if "failed" in line]  # tqdm writes there too
    assert e.value.code == 1
    assert len(failed) == 1 and failed[0].startswith(
        "train.py: failed: ours and torch AdamW apart: mean |loss gap| "
    ), failed
    assert failed[0].endswith("nats > -1.0"), failed
    assert "target <= -1.0): FAIL" in out and "loss fall: ours" in out
    eq = [r for r in read_records(tmp_path / "gpt2.jsonl") if r["variant"] == "equivalence"]
    assert len(eq) == 1 and not eq[0]["metrics"]["gap_ok"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--reference", "adamw", "--weight-decay", "0.1"],
            "--reference adamw needs --weight-decay 0",
        ),
        (["--bpe-vocab", "60000"], "--bpe-vocab 60000 exceeds the 50257 ids"),
        (["--data", "nowhere.parquet"], "--data: nowhere.parquet"),
    ],
)
def test_conflicting_flags_are_refused_in_one_line(argv, message, tmp_path, monkeypatch, capsys):
    code, err = run_train(argv, tmp_path / "out", tmp_path / "cache", monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("train.py: error: " + message), err
    assert not (tmp_path / "out").exists()


def test_torchao_missing_is_one_line_naming_the_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    code, err = run_train([], tmp_path / "out", tmp_path, monkeypatch, capsys, script=peer)
    assert (code, err) == (2, [f"peer_torchao.py: error: {peer.TORCHAO_MISSING}"])
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
def test_torchao_peer_runs_inside_the_cap(cache, tmp_path, monkeypatch, capsys):
    pytest.importorskip("torchao")
    argv = ["--device", "cuda", "--steps", "3", "--memory-cap-gib", "4"]
    code, _ = run_train(argv, tmp_path, cache, monkeypatch, capsys, script=peer)
    assert code == 0
    records = read_records(tmp_path / "gpt2.jsonl")
    assert [r["variant"] for r in records] == ["torchao"] * 3 + ["torchao_summary"]
    summary = records[-1]["metrics"]
    assert summary["peak_gib_max"] <= 4 and summary["seq_per_s_median"] > 0
    assert records[-1]["config"]["optimizer"].startswith("torchao 0.")
