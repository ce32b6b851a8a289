"""memory_efficient_gpt2/finetune_code.py on a CPU with the tiny GPT-2: the records (held-out
loss before and after, 10 prompts x greedy/sampled x before/after as text, a record per step,
the summary), every trained row from a training file and every prompt from a held-out one, a
start from pretrain.py --corpus docs, the refusal of weights pretrained on held-out code, level
3 as the default preset, and bad flags refused in one line before anything is written."""

import contextlib
import io
import json
import math
import shutil
import sys
from collections import Counter

import pytest

from effdl.cli import run_main
from effdl.data.stdlib_code import is_heldout, stdlib_code_corpus
from effdl.data.stdlib_text import content_hash
from effdl.gpt2_offload.code_data import Codec, code_data
from effdl.gpt2_offload.config import LEVELS
from effdl.results import read_records
from tests.script_loading import load_script

finetune = load_script("memory_efficient_gpt2", "finetune_code")
pretrain = load_script("memory_efficient_gpt2", "pretrain")
QUICK = finetune.QUICK


def run_script(module, name, argv, monkeypatch, capsys) -> tuple[int, list[str]]:
    """``<name> --quick ARGV`` in this process: (exit code, stderr lines)."""
    monkeypatch.setattr(sys, "argv", [name, "--quick", *argv])
    with pytest.raises(SystemExit) as e:
        run_main(module.main)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("code_cache")


@pytest.fixture(scope="module")
def quick_run(cache, tmp_path_factory):
    """One --quick run from random init: its records, the batches it trained on, and what it
    printed."""
    out = tmp_path_factory.mktemp("finetune")
    trained = []

    def keep_batches(run, cfg, batches, *args, **kwargs):
        trained.extend(batches)
        return train(run, cfg, batches, *args, **kwargs)

    train = finetune.train_offload
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as e:
        mp.setattr(sys, "argv", ["finetune_code.py", "--quick", "--cache", str(cache), "--out",
                                 str(out)])  # fmt: skip
        mp.setattr(finetune, "train_offload", keep_batches)
        with contextlib.redirect_stdout(printed):
            run_main(finetune.main)
    assert e.value.code == 0
    return read_records(out / finetune.LOG), trained, printed.getvalue()


def test_records_hold_the_loss_and_every_continuation_before_and_after(quick_run):
    records, _, printed = quick_run
    variants = [r["variant"] for r in records]
    assert variants[:3] == ["corpus", "memory_budget", "heldout_loss"]
    assert variants[-1] == "finetune_summary"
    assert Counter(variants) == {"corpus": 1, "memory_budget": 1, "heldout_loss": 2,
                                 "before": 20, "after": 20, "finetune": QUICK.steps,
                                 "finetune_summary": 1}  # fmt: skip
    assert variants.index("finetune") > max(i for i, v in enumerate(variants) if v == "before")
    assert variants.index("after") > max(i for i, v in enumerate(variants) if v == "finetune")
    losses = {r["config"]["phase"]: r["metrics"]["loss"] for r in records
              if r["variant"] == "heldout_loss"}  # fmt: skip
    assert set(losses) == {"before", "after"} and all(math.isfinite(v) for v in losses.values())
    summary = records[-1]["metrics"]
    assert (summary["heldout_loss_before"], summary["heldout_loss_after"]) == (
        losses["before"], losses["after"]
    )  # fmt: skip
    assert summary["heldout_loss_after"] < summary["heldout_loss_before"]
    assert summary["steps"] == QUICK.steps
    # a CPU run: peak GPU memory is not measured, logged as null and printed as "-"
    assert summary["peak_gib_max"] is None
    assert all(r["metrics"]["peak_gib"] is None for r in records if r["variant"] == "finetune")
    (line,) = [x for x in printed.splitlines() if x.startswith("held-out code loss")]
    assert "peak GPU - GiB" in line and "nan" not in line
    for phase in ("before", "after"):
        made = [r for r in records if r["variant"] == phase]
        pairs = {(r["metrics"]["prompt"], r["metrics"]["mode"]) for r in made}
        assert pairs == {(i, m) for i in range(10) for m in ("greedy", "sampled")}
        for r in made:
            assert isinstance(r["metrics"]["completion"], str)
            assert 0 < r["metrics"]["new_tokens"] <= QUICK.max_new_tokens
            assert r["metrics"]["prompt_text"].lstrip().startswith(("def", "async def", "class"))


def test_no_held_out_file_is_trained_on(quick_run, cache):
    records, trained, _ = quick_run
    corpus_record = records[0]["metrics"]
    train_files, heldout_files = corpus_record["train_files"], corpus_record["heldout_files"]
    assert heldout_files and not set(train_files) & set(heldout_files)
    corpus = stdlib_code_corpus(QUICK.corpus_bytes)
    assert train_files == [f.path for f in corpus.train]
    assert corpus_record["train_sha256"] == content_hash(f.text for f in corpus.train)
    assert not any(map(is_heldout, train_files)) and all(map(is_heldout, heldout_files))
    assert {p["path"] for p in corpus_record["prompts"]} <= set(heldout_files)
    # every row trained on is a window of the training files' stream
    tokenizer = records[0]["config"]["tokenizer"]
    data = code_data(corpus, Codec(cache / tokenizer, tokenizer), QUICK.seq, 50257, 10, 1000)
    windows = {tuple(row) for row in data.windows.tolist()}
    assert len(trained) == QUICK.steps
    assert all(tuple(row) in windows for batch in trained for row in batch.tolist())


def test_a_start_from_pretrain_docs_and_the_refusal_of_held_out_code(
    cache, tmp_path, monkeypatch, capsys
):
    folder = tmp_path / "docs-model"
    argv = ["--corpus", "docs", "--steps", "3", "--cache", str(cache), "--out",
            str(tmp_path / "pre"), "--save", str(folder)]  # fmt: skip
    assert run_script(pretrain, "pretrain.py", argv, monkeypatch, capsys)[0] == 0
    notes = json.loads((folder / "notes.json").read_text())
    assert notes["config"]["corpus"] == "docs" and notes["config"]["data"].endswith("-docs")
    out = tmp_path / "ft"
    argv = ["--model-path", str(folder), "--steps", "1", "--prompts", "3", "--cache", str(cache),
            "--out", str(out)]  # fmt: skip
    assert run_script(finetune, "finetune_code.py", argv, monkeypatch, capsys)[0] == 0
    corpus_record = read_records(out / finetune.LOG)[0]
    assert corpus_record["config"]["pretrained_on"] == "docs"
    assert corpus_record["config"]["tokenizer"] == str(folder)
    stdlib_folder = tmp_path / "stdlib-model"
    shutil.copytree(folder, stdlib_folder)
    notes["config"]["corpus"] = "stdlib"
    (stdlib_folder / "notes.json").write_text(json.dumps(notes))
    argv[1], argv[-1] = str(stdlib_folder), str(tmp_path / "refused")
    code, err = run_script(finetune, "finetune_code.py", argv, monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        f"finetune_code.py: error: --model-path: {stdlib_folder} was pretrained on the stdlib "
        "corpus, whose code files include held-out ones; pretrain with pretrain.py --corpus docs"
    )
    assert not (tmp_path / "refused").exists()


def test_level_3_is_the_default_and_a_level_applies_whole(monkeypatch):
    assert finetune.FULL.level == 3
    assert {k: getattr(finetune.FULL, k) for k in LEVELS[3]} == LEVELS[3]
    monkeypatch.setattr(sys, "argv", ["finetune_code.py", "--level", "1"])
    _, cfg = finetune.parse_args()
    assert cfg.level == 1 and {k: getattr(cfg, k) for k in LEVELS[1]} == LEVELS[1]
    assert (cfg.steps, cfg.lr_schedule) == (finetune.FULL.steps, "cosine")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "0"], "--temperature must be > 0, got 0.0"),
        (["--max-new-tokens", "600"], "--max-new-tokens 600: at most 512"),
        (["--heldout-percent", "100"], "--heldout-percent must be in 1..99, got 100"),
        (["--heldout-windows", "0"], "--heldout-windows must be >= 1, got 0"),
        (["--prompts", "300"], "--prompts 300: the files hold"),
        (["--level", "3"], "--level 3 is a GPU preset"),
    ],
)
def test_bad_flags_are_refused_in_one_line(argv, message, cache, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = [*argv, "--device", "cpu", "--cache", str(cache), "--out", str(out)]
    code, err = run_script(finetune, "finetune_code.py", argv, monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("finetune_code.py: error: ") and message in err[0], err
    assert not out.exists()


@pytest.mark.gpu
def test_level_3_fine_tune_runs_on_cuda_within_both_caps(cache, tmp_path, monkeypatch, capsys):
    argv = ["finetune_code.py", "--device", "cuda", "--size", "tiny", "--steps", "3", "--batch",
            "8", "--micro-batch", "4", "--seq", "128", "--max-new-tokens", "8",
            "--heldout-windows", "16", "--memory-cap-gib", "2", "--bpe-vocab", "512",
            "--corpus-bytes", str(1 << 20), "--cache", str(cache), "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        run_main(finetune.main)
    assert e.value.code == 0, capsys.readouterr().err
    records = read_records(tmp_path / finetune.LOG)
    summary = records[-1]
    assert summary["variant"] == "finetune_summary"
    assert summary["config"]["level"] == 3 and summary["config"]["update_on"] == "device"
    assert 0 < summary["metrics"]["peak_gib_max"] <= 2
    assert 0 < summary["metrics"]["host_rss_peak_gib"] <= 16
    assert math.isfinite(summary["metrics"]["heldout_loss_after"])
    assert Counter(r["variant"] for r in records)["after"] == 20
