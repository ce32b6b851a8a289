"""Distributed checkpoints against the uninterrupted run: training 3 steps, saving, loading into a
fresh model and optimizer and training 3 more gives the losses and final weights of 6 steps in
one go, bit for bit, in one process, under DDP and under FSDP2 (gloo, 2 ranks; once with op-level
activation checkpointing under FSDP2, the order a training script uses). Each step's batch
depends on the data position, the LR on the step, and the tokens on torch's, Python's and
NumPy's generators, so every part of the train state has to come back. A checkpoint written by
FSDP2 on 2 ranks loads into one plain process and back into FSDP2; failures are one line."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from effdl.models.llama import Transformer, TransformerModelArgs, build_on_meta, materialize
from effdl.parallel import apply_activation_checkpointing, spawn, wrap_model
from effdl.parallel.checkpoint import (
    MARKER,
    TRAIN_STATE,
    checkpoint_info,
    load_checkpoint,
    rng_states,
    save_checkpoint,
    set_rng_states,
)

ARGS = TransformerModelArgs(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, seq_len=8
)
STEPS, SAVE_AT, BATCH = 6, 3, 2
FULL = StateDictOptions(full_state_dict=True)


@pytest.fixture(autouse=True)
def keep_generators():
    """The in-process tests seed and restore the global generators: leave them as found."""
    states = rng_states()
    yield
    set_rng_states(states)


def build(args: TransformerModelArgs = ARGS) -> Transformer:
    model = build_on_meta(args)
    torch.manual_seed(0)
    return materialize(model, "cpu", torch.float32)


def fresh(
    parallel: str, world: int, recompute: str = "none"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (seeded, so the same on every rank), its blocks recomputed as ``recompute``
    says, wrapped, and its AdamW."""
    model = build()
    apply_activation_checkpointing(model, recompute)
    model = wrap_model(model, parallel, False, False, torch.device("cpu"), world)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def seed_generators(rank: int) -> None:
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)


def draw_batch(position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of the global generators (torch's tokens, Python's shift, NumPy's offset) and of
    the data position."""
    tokens = torch.randint(0, 16, (BATCH, ARGS.seq_len + 1))
    tokens = tokens.roll(random.randrange(ARGS.seq_len), dims=1)
    tokens = (tokens + int(np.random.randint(0, 4)) + position) % ARGS.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, steps: int
) -> list[float]:
    """``steps`` AdamW steps from ``state`` (step, data position; advanced in place), the LR
    warming up with the step; this rank's loss of each."""
    losses = []
    for _ in range(steps):
        x, y = draw_batch(state["data_position"])
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * (state["step"] + 1) / STEPS
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        state["step"] += 1
        state["data_position"] += 2
        losses.append(loss.item())
    return losses


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (FSDP2's shards gathered), under the unwrapped model's names."""
    return {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}


def resume_run(rank: int, world: int, parallel: str, folder: str, recompute: str = "none") -> dict:
    """The uninterrupted run, the run saved at step 3 and resumed, and a resumption whose
    generators are re-seeded instead of restored."""
    torch.set_num_threads(1)
    model, optimizer = fresh(parallel, world, recompute)
    seed_generators(rank)
    whole = train(model, optimizer, {"step": 0, "data_position": 0}, STEPS)
    out = {"whole": whole, "whole_weights": full_weights(model)}

    model, optimizer = fresh(parallel, world, recompute)
    seed_generators(rank)
    state = {"step": 0, "data_position": 0}
    first = train(model, optimizer, state, SAVE_AT)
    out["save_s"] = save_checkpoint(folder, model, optimizer, state)

    # build() re-seeds torch's generator: only load_checkpoint brings the saved state back
    model, optimizer = fresh(parallel, world, recompute)
    state, out["load_s"] = load_checkpoint(folder, model, optimizer)
    out["state"] = dict(state)
    out["resumed"] = first + train(model, optimizer, state, STEPS - SAVE_AT)
    out["resumed_weights"] = full_weights(model)

    model, optimizer = fresh(parallel, world, recompute)
    state, _ = load_checkpoint(folder, model, optimizer)
    seed_generators(rank)
    out["reseeded"] = first + train(model, optimizer, state, STEPS - SAVE_AT)
    return out


def check_resume(got: dict) -> None:
    assert got["state"] == {"step": SAVE_AT, "data_position": 2 * SAVE_AT}
    assert got["resumed"] == got["whole"]  # bit for bit
    assert got["whole_weights"].keys() == got["resumed_weights"].keys()
    for name, weight in got["whole_weights"].items():
        assert torch.equal(got["resumed_weights"][name], weight), name
    assert got["reseeded"][SAVE_AT:] != got["whole"][SAVE_AT:]  # the generators matter
    assert got["save_s"] > 0 and got["load_s"] > 0


def test_resume_equals_the_uninterrupted_run_in_one_process(tmp_path):
    check_resume(resume_run(0, 1, "none", str(tmp_path / "ckpt")))


@pytest.mark.parametrize(
    ("parallel", "recompute"), [("ddp", "none"), ("fsdp", "none"), ("fsdp", "op")]
)
def test_resume_equals_the_uninterrupted_run_on_two_ranks(tmp_path, parallel, recompute):
    folder = tmp_path / "ckpt"
    got = spawn(resume_run, 2, parallel, str(folder), recompute)
    for rank_got in got:
        check_resume(rank_got)
    assert got[0]["whole"] != got[1]["whole"]  # each rank drew its own batches
    assert checkpoint_info(folder)["world_size"] == 2
    saved_names = {
        name.removeprefix("model.")
        for name in dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        if name.startswith("model.")
    }
    assert saved_names == set(build().state_dict())  # the unwrapped model's names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left


def fsdp_save(rank: int, world: int, folder: str) -> dict:
    """Two FSDP2 steps, saved; the whole weights and optimizer state that were saved."""
    torch.set_num_threads(1)
    model, optimizer = fresh("fsdp", world)
    seed_generators(rank)
    state = {"step": 0, "data_position": 0}
    train(model, optimizer, state, 2)
    save_checkpoint(folder, model, optimizer, state)
    return {
        "weights": full_weights(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=FULL)["state"],
    }


def fsdp_load(rank: int, world: int, folder: str) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    model, optimizer = fresh("fsdp", world)
    load_checkpoint(folder, model, optimizer)
    return full_weights(model)


def test_checkpoint_of_two_fsdp_ranks_loads_into_one_process_and_into_fsdp(tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = spawn(fsdp_save, 2, folder)[0]

    model, optimizer = fresh("none", 1)
    with pytest.warns(UserWarning, match="saved by 2 ranks and is loaded by 1: the RNG states"):
        state, _ = load_checkpoint(folder, model, optimizer)
    assert state == {"step": 2, "data_position": 4}
    for name, weight in saved["weights"].items():
        assert torch.equal(model.get_parameter(name).detach(), weight), name
    loaded = get_optimizer_state_dict(model, optimizer)["state"]
    for name, moments in saved["optim"].items():
        for key, value in moments.items():
            assert torch.equal(loaded[name][key], value), (name, key)

    for rank_weights in spawn(fsdp_load, 2, folder):
        for name, weight in saved["weights"].items():
            assert torch.equal(rank_weights[name], weight), name


def test_checkpoint_of_one_process_loads_into_fsdp_on_two_ranks(tmp_path):
    folder = str(tmp_path / "ckpt")
    model, optimizer = fresh("none", 1)
    train(model, optimizer, {"step": 0, "data_position": 0}, 1)
    save_checkpoint(folder, model, optimizer, {"step": 1})
    for rank_weights in spawn(fsdp_load, 2, folder):
        for name, weight in model.state_dict().items():
            assert torch.equal(rank_weights[name], weight), name


def saved(folder, optimizer: bool = True) -> None:
    model, opt = fresh("none", 1)
    save_checkpoint(folder, model, opt if optimizer else None, {"step": 0})


def one_line_error(kind: type, call, *args) -> str:
    with pytest.raises(kind) as err:
        call(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_missing_or_incomplete_checkpoint_is_refused(tmp_path):
    model, optimizer = fresh("none", 1)
    folder = tmp_path / "ckpt"
    message = one_line_error(FileNotFoundError, load_checkpoint, folder, model, optimizer)
    assert message == f"no checkpoint at {folder}: the folder does not exist"

    saved(folder)
    (folder / MARKER).unlink()
    message = one_line_error(ValueError, load_checkpoint, folder, model, optimizer)
    assert message.startswith(f"{folder} is not a complete checkpoint: {MARKER} is missing")

    (folder / MARKER).write_text(json.dumps({"format": "other"}))
    message = one_line_error(ValueError, load_checkpoint, folder, model, optimizer)
    assert message == f"{folder}: {MARKER} is not of format 'effdl-dcp-1'"

    saved(folder, optimizer=False)
    message = one_line_error(ValueError, load_checkpoint, folder, model, optimizer)
    assert message == f"checkpoint {folder} holds no optimizer state"
    load_checkpoint(folder, model, None)


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    model, optimizer = fresh("none", 1)
    save_checkpoint(folder, model, optimizer, {"step": 1})

    real_save = torch.save

    def interrupted(obj, f, *args, **kwargs):  # the train state's file fails, after DCP's
        if str(getattr(f, "name", "")).endswith(TRAIN_STATE):
            raise OSError("no space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(OSError, match="no space left"):
        save_checkpoint(folder, model, optimizer, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(folder, model, optimizer)[0] == {"step": 1}

    fresh_folder = tmp_path / "never_completed"
    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(OSError, match="no space left"):
        save_checkpoint(fresh_folder, model, optimizer, {"step": 1})
    monkeypatch.undo()
    one_line_error(FileNotFoundError, load_checkpoint, fresh_folder, model, optimizer)
    save_checkpoint(fresh_folder, model, optimizer, {"step": 1})  # over what the failure left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "never_completed"]


def test_saving_over_a_folder_of_something_else_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    model, optimizer = fresh("none", 1)
    message = one_line_error(ValueError, save_checkpoint, tmp_path, model, optimizer, {})
    assert message == f"{tmp_path} exists and holds no checkpoint: refusing to overwrite it"
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_checkpoint_of_another_model_shape_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    saved(folder)
    wider = build(TransformerModelArgs(**{**vars(ARGS), "dim": 48}))
    message = one_line_error(ValueError, load_checkpoint, folder, wider, None)
    assert message == (
        f"checkpoint {folder} is of another model: tok_embeddings.weight has shape [64, 32],"
        " the model's is [64, 48]"
    )
    deeper = build(TransformerModelArgs(**{**vars(ARGS), "n_layers": 3}))
    message = one_line_error(ValueError, load_checkpoint, folder, deeper, None)
    assert message.startswith(f"checkpoint {folder} is of another model: it lacks layers.2.")
    assert message.endswith("(9 missing, 0 unexpected tensors)")


def test_checkpoint_of_another_optimizer_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    model = build()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, sgd, {"step": 0, "data_position": 0}, 1)
    save_checkpoint(folder, model, sgd, {"step": 1})
    model, adamw = fresh("none", 1)
    message = one_line_error(ValueError, load_checkpoint, folder, model, adamw)
    assert message.startswith(f"cannot load checkpoint {folder}: RuntimeError: Missing key")


def test_train_state_that_would_not_load_is_refused_before_saving(tmp_path):
    model, optimizer = fresh("none", 1)
    message = one_line_error(
        ValueError, save_checkpoint, tmp_path / "ckpt", model, optimizer, {"step": np.int64(3)}
    )
    assert message.startswith("train_state holds a value that torch.load(weights_only=True)")
    assert not any(tmp_path.iterdir())
