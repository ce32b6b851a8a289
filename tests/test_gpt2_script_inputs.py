"""memory_efficient_gpt2/train.py refuses a bad --model-path, --data or --device in one line
(exit 2) before the log is opened, and honours the flags given beside --quick."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import save_file

from effdl.cli import run_main
from effdl.models.gpt2 import build_gpt2, gpt2_config
from effdl.results import read_records
from tests.script_loading import ROOT, load_script

train = load_script("memory_efficient_gpt2", "train")


def run_train(argv, out: Path, monkeypatch, capsys) -> tuple[int, list[str]]:
    """``train.py --quick ARGV --out OUT`` in this process, as run_main runs it: (exit code,
    stderr lines)."""
    monkeypatch.setattr(sys, "argv", ["train.py", "--quick", *argv, "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        run_main(train.main)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny GPT-2 folder and broken copies of it, by name."""
    root = tmp_path_factory.mktemp("models")
    good = root / "good"
    model = build_gpt2(gpt2_config("tiny"))
    model.save_pretrained(good)
    config = json.loads((good / "config.json").read_text())

    def variant(name, config_text=None, weights=True):
        folder = root / name
        folder.mkdir()
        if config_text is not None:
            (folder / "config.json").write_text(config_text)
        if weights:
            shutil.copy(good / "model.safetensors", folder)
        return folder

    found = {"good": good, "empty": variant("empty", weights=False)}
    found["config_only"] = variant("config_only", json.dumps(config), weights=False)
    found["corrupt_config"] = variant("corrupt_config", "{not json")
    found["bert"] = variant("bert", json.dumps({**config, "model_type": "bert"}))
    found["positions_32"] = variant("positions_32", json.dumps({**config, "n_positions": 32}))
    found["other_shape"] = variant("other_shape", json.dumps({**config, "n_layer": 3}))
    missing = variant("missing", json.dumps(config), weights=False)
    kept = {k: v for k, v in model.state_dict().items() if ".h.1." not in k and "lm_head" not in k}
    save_file({k: v.contiguous() for k, v in kept.items()}, missing / "model.safetensors")
    found["missing"] = missing
    truncated = variant("truncated", json.dumps(config), weights=False)
    data = (good / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    found["truncated"] = truncated
    text_file = root / "notes.txt"
    text_file.write_text("not a folder\n")
    found["text_file"] = text_file
    return found


@pytest.mark.parametrize(
    ("folder", "message"),
    [
        ("empty", "--model-path: {path} has no config.json (expected a local Hugging Face GPT-2"),
        ("config_only", "--model-path: {path} has no weights (expected"),
        (
            "corrupt_config",
            "--model-path: {path}/config.json is not a readable JSON config (Expecting",
        ),
        ("bert", "--model-path: {path}/config.json has model_type 'bert', expected 'gpt2'"),
        ("positions_32", "--seq 64 exceeds the 32 positions of {path}/config.json"),
        ("other_shape", "--model-path: {path}/config.json describes {{'n_layer': 3"),
        ("missing", "--model-path: the weights in {path} lack 12 tensors of GPT-2"),
        ("truncated", "--model-path: cannot read the weights {path}/model.safetensors"),
        ("text_file", "--model-path: {path} is not a folder"),
    ],
)
def test_bad_model_folder_is_refused_before_the_log(
    folders, folder, message, tmp_path, monkeypatch, capsys
):
    path = folders[folder]
    code, err = run_train(["--model-path", str(path)], tmp_path / "out", monkeypatch, capsys)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("train.py: error: " + message.format(path=path))
    assert not (tmp_path / "out").exists()  # refused before the log was opened


@pytest.fixture(scope="module")
def data_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    (root / "wrong_layout").mkdir()
    (root / "wrong_layout" / "readme.md").write_text("no wikitext here\n")
    (root / "empty.txt").write_bytes(b"")
    (root / "random.bin").write_bytes(bytes(range(256)) * 64)
    (root / "bad_line.raw").write_bytes(b"a fine line\n" * 5 + b"\xff\xfe broken\n")
    pq.write_table(pa.table({"text": pa.array([None, None], pa.string())}), root / "null.parquet")
    pq.write_table(
        pa.table({"text": ["three short rows", "of text", "only"]}), root / "few.parquet"
    )
    return {p.name: p for p in root.iterdir()}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("wrong_layout", "{path}: folder holds neither wiki.train.raw nor wiki.train.tokens"),
        ("empty.txt", "{path}: no non-empty lines"),
        ("random.bin", "{path}:2: not UTF-8 text"),
        ("bad_line.raw", "{path}:6: not UTF-8 text"),
        ("null.parquet", "{path}"),  # the message is the reader's or the script's
        ("few.parquet", "{path} gives 30 tokens, need 2048"),
    ],
)
def test_bad_data_is_refused_before_the_model_and_the_log(
    data_files, name, message, tmp_path, monkeypatch, capsys
):
    path = data_files[name]
    code, err = run_train(["--data", str(path)], tmp_path / "out", monkeypatch, capsys)
    assert code == 2
    assert len(err) == 1
    assert err[0].startswith("train.py: error: --data: " + message.format(path=path)), err
    assert not (tmp_path / "out").exists()


def test_device_other_than_cpu_or_cuda_is_refused(tmp_path, monkeypatch, capsys):
    code, err = run_train(["--device", "meta"], tmp_path, monkeypatch, capsys)
    assert (code, err) == (2, ["train.py: error: --device meta: expected cpu or cuda (or auto)"])


def test_given_flags_win_over_quick_and_pretrained_weights_load(
    folders, tmp_path, monkeypatch, capsys
):
    text = tmp_path / "wiki.train.raw"
    text.write_text("= Title =\n\n" + "the cat sat on the mat .\n" * 40)
    argv = ["--model-path", str(folders["good"]), "--data", str(text), "--steps", "1",
            "--batch", "2", "--micro-batch", "1", "--seq", "16"]  # fmt: skip
    code, _ = run_train(argv, tmp_path / "out", monkeypatch, capsys)
    assert code == 0
    records = read_records(tmp_path / "out" / "gpt2.jsonl")
    assert [r["variant"] for r in records] == ["memory_budget", "corpus", "corpus_summary"]
    config = records[1]["config"]
    assert (config["seq"], config["batch"], config["micro_batch"]) == (16, 2, 1)
    assert config["pretrained"] is True and config["data"] == str(text)


def test_the_command_line_exits_2_with_one_line(folders, tmp_path):
    res = subprocess.run(
        [sys.executable, str(ROOT / "memory_efficient_gpt2" / "train.py"), "--quick",
         "--model-path", str(folders["bert"]), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"train.py: error: --model-path: {folders['bert']}/config.json has model_type 'bert', "
        "expected 'gpt2'"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--micro-batch", "0"], "--micro-batch"),
        (["--seq", "0"], "--seq"),
        (["--batch", "3", "--micro-batch", "2"], "--batch 3 is not a multiple of --micro-batch 2"),
        (["--batch", "-4"], "--batch"),
        (["--checkpoint-layers", "99"], "--checkpoint-layers"),
        (["--chunk-tokens", "0"], "--chunk-tokens"),
        (["--cpu-threads", "-3"], "--cpu-threads"),
        (["--lr", "-1"], "--lr"),
        (["--weight-decay", "nan"], "--weight-decay"),
    ],
)
def test_nonsense_flags_are_refused_in_one_line(argv, flag, tmp_path, monkeypatch, capsys):
    code, err = run_train(argv, tmp_path / "out", monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("train.py: error: ") and flag in err[0], err
    assert not (tmp_path / "out" / "gpt2.jsonl").exists() or not read_records(
        tmp_path / "out" / "gpt2.jsonl"
    )
