"""GPT-2 building blocks against Hugging Face's GPT2LMHeadModel (gelu_new, full-logits loss)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from effdl.models.gpt2 import (
    GPT2_LARGE_PARAMS,
    SHAPES,
    ModelFolderError,
    build_gpt2,
    check_model_folder,
    checkpoint_blocks,
    checkpoint_weights,
    count_params,
    expected_weights,
    gpt2_config,
    lm_loss,
    load_gpt2,
    save_gpt2_folder,
)

# fp32 on CPU; differences come only from summation order (chunking, fused GELU kernel)
TOL = {"rtol": 1e-5, "atol": 1e-5}


def test_gpt2_large_parameter_count() -> None:
    with torch.device("meta"):
        model = build_gpt2(gpt2_config("large"))
    assert count_params(model) == GPT2_LARGE_PARAMS


def _tiny_pair(seed: int = 0):
    torch.manual_seed(seed)
    ours = build_gpt2(gpt2_config("tiny", fast_gelu=True, dropout=0.0))
    ref = build_gpt2(gpt2_config("tiny", fast_gelu=False, dropout=0.0))
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def test_fast_gelu_chunked_loss_and_checkpointing_match_hf() -> None:
    ours, ref = _tiny_pair()
    checkpoint_blocks(ours, 1)
    ids = torch.randint(
        0, SHAPES["tiny"].vocab_size, (2, 33), generator=torch.Generator().manual_seed(1)
    )
    hf = ref(ids, labels=ids)
    loss = lm_loss(ours, ids, chunk_tokens=10)  # chunks that do not divide the 64 tokens
    torch.testing.assert_close(loss, hf.loss, **TOL)
    torch.testing.assert_close(ours(ids).logits, hf.logits, **TOL)
    loss.backward()
    hf.loss.backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, **TOL, msg=name)


def test_checkpointed_blocks_recompute_in_backward() -> None:
    ours, _ = _tiny_pair()
    assert checkpoint_blocks(ours, 1) == 1
    calls = [0, 0]

    def count_call(k: int):
        def hook(*_) -> None:
            calls[k] += 1

        return hook

    for k, block in enumerate(ours.transformer.h):
        block.attn.register_forward_hook(count_call(k))
    ids = torch.randint(0, SHAPES["tiny"].vocab_size, (1, 8))
    loss = lm_loss(ours, ids)
    assert calls == [1, 1]
    loss.backward()
    assert calls == [2, 1]  # only the checkpointed first block ran its forward again


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown GPT-2 size"):
        gpt2_config("huge")
    ours, _ = _tiny_pair()
    with pytest.raises(ValueError, match="checkpoint"):
        checkpoint_blocks(ours, 3)


def test_saved_folder_loads_back_with_its_tokenizer_and_notes(tmp_path) -> None:
    tok = tmp_path / "bpe"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    torch.manual_seed(0)
    model = build_gpt2(gpt2_config("tiny", dropout=0.0))
    folder = save_gpt2_folder(model, tmp_path / "out" / "model", tok, {"steps": 3})
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model"]  # no temporary left
    assert (folder / "tokenizer.json").read_text() == "{}"
    assert '"steps": 3' in (folder / "notes.json").read_text()
    loaded = build_gpt2(model_path=folder).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(loaded[name], value), name
    with pytest.raises(FileExistsError, match="not overwritten"):
        save_gpt2_folder(model, folder)


def test_an_interrupted_save_leaves_no_folder(tmp_path, monkeypatch) -> None:
    model = build_gpt2(gpt2_config("tiny"))

    def interrupted(self, directory, **kwargs):
        (Path(directory) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(type(model), "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_gpt2_folder(model, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_backward_micro_batches_gives_the_whole_batch_gradients() -> None:
    """Gradients and loss summed over micro-batches equal one backward of the mean loss over
    the whole batch."""
    from effdl.models.gpt2 import backward_micro_batches

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1).double()
    batch = torch.randn(6, 4, dtype=torch.float64)
    loss_of = lambda x: lin(x).pow(2).mean()  # noqa: E731
    losses = backward_micro_batches(loss_of, batch, 2, torch.device("cpu"))
    got = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    expected_loss = loss_of(batch)
    expected_loss.backward()
    torch.testing.assert_close(torch.stack(losses).sum(), expected_loss.detach())
    for g, p in zip(got, lin.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)
    assert len(losses) == 3


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "model"
    build_gpt2(gpt2_config("tiny")).save_pretrained(folder)
    return folder


def test_a_saved_folder_passes_its_check_and_names_its_weights(tiny_folder) -> None:
    config = check_model_folder(tiny_folder, "tiny")
    assert (config.n_layer, config.n_embd) == (SHAPES["tiny"].n_layer, SHAPES["tiny"].n_embd)
    expected = expected_weights(config)
    assert "lm_head.weight" not in expected  # tied to the token embedding
    assert "wte.weight" in expected and not any(k.startswith("transformer.") for k in expected)
    assert expected <= checkpoint_weights(tiny_folder)


def test_folder_check_refuses_what_would_load_wrongly(tiny_folder, tmp_path) -> None:
    with pytest.raises(
        ModelFolderError, match=r"describes .*, not size 'large' \(it is size 'tiny'\)"
    ):
        check_model_folder(tiny_folder, "large")
    with pytest.raises(ModelFolderError, match="is not a folder"):
        check_model_folder(tiny_folder / "config.json", "tiny")
    partial = tmp_path / "partial"
    partial.mkdir()
    with pytest.raises(ModelFolderError, match=r"has no config\.json"):
        check_model_folder(partial, "tiny")
    (partial / "config.json").write_bytes((tiny_folder / "config.json").read_bytes())
    with pytest.raises(ModelFolderError, match="has no weights"):
        check_model_folder(partial, "tiny")
    state = load_file(tiny_folder / "model.safetensors")
    save_file({k: v for k, v in state.items() if ".h.1." not in k}, partial / "model.safetensors")
    with pytest.raises(ModelFolderError, match=r"lack \d+ tensors of GPT-2 \(e.g. h\.1\."):
        check_model_folder(partial, "tiny")
    (partial / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelFolderError, match="cannot read the weights"):
        check_model_folder(partial, "tiny")


def test_load_gpt2_sets_every_dropout_and_reports_weights_that_do_not_load(
    tiny_folder, tmp_path
) -> None:
    model = load_gpt2("tiny", tiny_folder, dropout=0.25)
    rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == {0.25}
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((tiny_folder / "config.json").read_bytes())
    data = (tiny_folder / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFolderError, match=f"cannot load {re.escape(str(broken))}"):
        load_gpt2("tiny", broken)


# Run in a fresh interpreter: the resident set of the test process holds whatever ran before.
_FILE_PAGES_PROBE = """
import sys
from pathlib import Path
import torch
from transformers import GPT2LMHeadModel
from effdl.models.gpt2 import load_gpt2

def file_backed_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssFile"):
            return int(line.split()[1]) / 1024

folder = Path(sys.argv[1])
load_gpt2("tiny")  # the libraries a load maps are resident before the count starts
before = file_backed_mib()
model = load_gpt2("tiny", folder)
total = sum(float(p.double().sum()) for p in model.parameters())  # every page read
grown = file_backed_mib() - before
hf = GPT2LMHeadModel.from_pretrained(folder, local_files_only=True)
same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), hf.state_dict().values()))
tied = model.lm_head.weight is model.transformer.wte.weight
print(grown, same, tied)
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc")
def test_loaded_weights_leave_no_file_pages_resident(tmp_path) -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=512, n_head=8, vocab_size=50257)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "m")
    file_mib = (tmp_path / "m" / "model.safetensors").stat().st_size / 2**20
    out = subprocess.run(
        [sys.executable, "-c", _FILE_PAGES_PROBE, str(tmp_path / "m")],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    grown, same, tied = float(out[-3]), out[-2], out[-1]
    assert (same, tied) == ("True", "True")
    # mapped and read, the file's pages would add its whole size (about 124 MiB here)
    assert grown < 0.1 * file_mib, (grown, file_mib)
