"""memory_efficient_gpt2/pretrain.py on a CPU with the tiny GPT-2: the loss falls, the folder it
saves is one train.py --model-path loads to the very weights trained, train.py's fixed batch is
the held-out head of the identical token stream (never trained on), and bad flags are refused
in one line before anything is written."""

import dataclasses
import sys

import pytest
import torch

from effdl.cli import run_main
from effdl.gpt2_offload import config as train_config
from effdl.gpt2_offload.inputs import make_batches, model_folder_config
from effdl.models.gpt2 import gpt2_config, load_gpt2
from effdl.results import RunLog, read_records
from tests.script_loading import load_script

pretrain = load_script("memory_efficient_gpt2", "pretrain")
train = load_script("memory_efficient_gpt2", "train")
STEPS = 8


def run_pretrain(argv, monkeypatch, capsys) -> tuple[int, list[str]]:
    """``pretrain.py --quick ARGV`` in this process: (exit code, stderr lines)."""
    monkeypatch.setattr(sys, "argv", ["pretrain.py", "--quick", *argv])
    with pytest.raises(SystemExit) as e:
        run_main(pretrain.main)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("stdlib_cache")


@pytest.fixture(scope="module")
def pretrained(cache, tmp_path_factory):
    """One quick run of STEPS steps: its --out, its --save folder, and the weights it saved
    (taken from the model as it went to save_gpt2_folder)."""
    out = tmp_path_factory.mktemp("pretrain")
    folder = out / "model"
    saved = {}

    def keep_and_save(model, *args, **kwargs):
        saved.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return save(model, *args, **kwargs)

    save = pretrain.save_gpt2_folder
    argv = ["pretrain.py", "--quick", "--steps", str(STEPS), "--cache", str(cache), "--out",
            str(out), "--save", str(folder)]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as e:
        mp.setattr(sys, "argv", argv)
        mp.setattr(pretrain, "save_gpt2_folder", keep_and_save)
        run_main(pretrain.main)
    assert e.value.code == 0
    return {"out": out, "folder": folder, "weights": saved}


def test_presets_hold_out_train_pys_fixed_batch():
    for ours, theirs in ((pretrain.FULL, train_config.FULL), (pretrain.QUICK, train_config.QUICK)):
        assert ours.skip_tokens == theirs.batch * theirs.seq
        assert (ours.seq, ours.size, ours.bpe_vocab) == (theirs.seq, theirs.size, theirs.bpe_vocab)
        assert (ours.corpus_bytes, ours.cache) == (theirs.corpus_bytes, theirs.cache)


def test_loss_falls_and_every_step_is_logged(pretrained):
    records = read_records(pretrained["out"] / pretrain.LOG)
    assert [r["variant"] for r in records] == ["pretrain"] * STEPS + ["pretrain_summary"]
    steps = [r["metrics"] for r in records[:-1]]
    lrs = [m["lr"] for m in steps]
    assert lrs[:3] == pytest.approx([1e-3, 2e-3, 3e-3])  # --quick: 3 warm-up steps to 3e-3
    assert lrs[-1] == pytest.approx(3e-4)  # the cosine ends at a tenth
    summary = records[-1]["metrics"]
    assert summary["steps"] == STEPS and summary["stopped_by"] == "steps"
    assert summary["loss_first"] == pytest.approx(10.8, abs=0.3)  # ln(50257): random init
    assert summary["loss_last"] < summary["loss_first"] - 0.5  # about 1 nat in 8 steps
    assert summary["heldout_loss"] < summary["loss_first"] - 0.5
    assert records[-1]["config"]["data"].startswith("stdlib-py")
    assert records[-1]["config"]["bos_id"] == 1
    # a CPU run: peak GPU memory is not measured, logged as null
    assert all(m["peak_gib"] is None for m in steps) and summary["peak_gib_max"] is None


def test_saved_folder_loads_in_train_py_to_the_trained_weights(pretrained):
    folder = pretrained["folder"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "notes.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert not [p for p in folder.parent.iterdir() if ".tmp" in p.name]
    quick = train_config.QUICK
    assert model_folder_config(folder, quick.size, quick.seq) is not None
    loaded = load_gpt2(quick.size, folder).state_dict()
    assert loaded.keys() == pretrained["weights"].keys()
    for name, value in pretrained["weights"].items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], value), name


def test_fixed_batch_is_the_held_out_head_of_the_identical_stream(pretrained, cache):
    """train.py reads the same stream through the saved folder as through the BPE (<bos> kept),
    its fixed batch is pretraining's held-out head, and pretraining's windows are the stream
    from just past it."""
    vocab = gpt2_config("tiny").vocab_size
    cfg = dataclasses.replace(train_config.QUICK, fixed_batch=True, cache=cache)
    via_bpe, _ = make_batches(cfg, vocab, seed=0)
    via_folder, names = make_batches(
        dataclasses.replace(cfg, model_path=pretrained["folder"]), vocab, seed=0
    )
    assert names["tokenizer"] == str(pretrained["folder"])
    assert torch.equal(via_bpe[0], via_folder[0])
    data = pretrain.pretrain_data(dataclasses.replace(pretrain.QUICK, cache=cache))
    assert torch.equal(data.heldout, via_folder[0])
    long = dataclasses.replace(cfg, fixed_batch=False, steps=3)  # the stream's first 3 batches
    stream = torch.cat([b.flatten() for b in make_batches(long, vocab, seed=0)[0]])
    head = len(data.heldout.flatten())
    after = data.windows.flatten()[: len(stream) - head]
    assert torch.equal(stream[head:], after)


def test_minutes_stop_the_run_before_the_steps(cache, tmp_path):
    cfg = dataclasses.replace(pretrain.QUICK, cache=cache, steps=50, minutes=1e-6)
    data = pretrain.pretrain_data(cfg)
    model = pretrain.new_model(cfg, torch.device("cpu"))
    log = RunLog(tmp_path / "log.jsonl", task="gpt2")
    rows, stopped = pretrain.pretrain(model, cfg, data, torch.device("cpu"), log, 0, {})
    assert (len(rows), stopped) == (1, "minutes")
    assert len(read_records(tmp_path / "log.jsonl")) == 1


def test_windows_are_drawn_once_per_pass_in_a_seeded_order():
    windows = torch.arange(40).view(10, 4)
    draws = pretrain.step_windows(windows, 4, seed=0)
    rows = torch.cat([next(draws) for _ in range(5)])  # two passes, the third batch straddles
    for one_pass in (rows[:10], rows[10:]):
        assert sorted(one_pass[:, 0].tolist()) == list(range(0, 40, 4))
    assert not torch.equal(rows[:10], rows[10:])
    again = pretrain.step_windows(windows, 4, seed=0)
    assert torch.equal(torch.cat([next(again) for _ in range(5)]), rows)


def test_train_py_starts_from_the_pretrained_loss(pretrained, cache, tmp_path, monkeypatch, capsys):
    """The fixed batch's first loss in train.py is pretraining's held-out loss (bf16 working
    weights in train.py, fp32 here)."""
    argv = ["train.py", "--quick", "--model-path", str(pretrained["folder"]), "--fixed-batch",
            "--steps", "1", "--cache", str(cache), "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        run_main(train.main)
    assert e.value.code == 0
    first = next(r for r in read_records(tmp_path / "gpt2.jsonl") if r["variant"] == "fixed_batch")
    summary = read_records(pretrained["out"] / pretrain.LOG)[-1]["metrics"]
    assert first["metrics"]["loss"] == pytest.approx(summary["heldout_loss"], abs=0.05)


def test_no_held_out_head_leaves_its_figures_unmeasured(cache, tmp_path, monkeypatch, capsys):
    """--skip-tokens 0 holds nothing out: the held-out loss and entropies are null in the
    summary and printed as "-", not NaN."""
    argv = ["--skip-tokens", "0", "--steps", "1", "--cache", str(cache), "--out", str(tmp_path),
            "--save", str(tmp_path / "model")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["pretrain.py", "--quick", *argv])
    with pytest.raises(SystemExit) as e:
        run_main(pretrain.main)
    assert e.value.code == 0
    printed = capsys.readouterr().out
    summary = read_records(tmp_path / pretrain.LOG)[-1]["metrics"]
    assert summary["heldout_loss"] is None and summary["peak_gib_max"] is None
    assert summary["heldout_unigram_entropy"] is None and summary["heldout_bigram_entropy"] is None
    assert "held-out head - (unigram -, bigram -)" in printed and "nan" not in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch", "10"], "--batch 10 is not a multiple of --micro-batch 4"),
        (["--minutes", "0"], "--minutes must be a finite number > 0, got 0.0"),
        (["--grad-clip", "nan"], "--grad-clip must be a finite number > 0, got nan"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--skip-tokens", "-1"], "--skip-tokens must be >= 0, got -1"),
        (["--seq", "2048"], "--seq 2048 exceeds GPT-2's 1024 positions"),
        (["--checkpoint-layers", "3"], "--checkpoint-layers must be 0..2 for --size tiny"),
        (["--bpe-vocab", "60000"], "--bpe-vocab 60000 exceeds the 50257 ids"),
        (["--batch", "40000"], "fewer than --batch 40000 (raise --corpus-bytes)"),
    ],
)
def test_bad_flags_are_refused_in_one_line(argv, message, cache, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    code, err = run_pretrain([*argv, "--cache", str(cache), "--out", str(out)], monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("pretrain.py: error: "), err
    assert message in err[0], err
    assert not out.exists()


def test_an_existing_save_folder_is_refused_before_the_work(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    out = tmp_path / "out"
    code, err = run_pretrain(["--save", str(folder), "--out", str(out)], monkeypatch, capsys)
    assert (code, err) == (
        2, [f"pretrain.py: error: --save: {folder} exists (a model folder is never overwritten)"]
    )  # fmt: skip
    assert not out.exists() and not any(folder.iterdir())
