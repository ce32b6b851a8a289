"""Saving and resuming a training run with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a folder::

    .metadata, __*_*.distcp    DCP's files: the model's and the optimizer's state, each rank
                               writing its own shards (FSDP2) or one copy of replicated tensors
    train_state.pt             the caller's train state and every rank's RNG states
    effdl_checkpoint.json      written last: the checkpoint is complete

The model may be plain, DDP or FSDP2 (:func:`effdl.parallel.wrap_model`); its state dict and the
optimizer's are taken and set through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict`` / ``set_state_dict``), which name every tensor by the unwrapped module's
parameter names. A checkpoint saved by N ranks therefore loads on M ranks, under another wrapping
too: DCP reads each rank's part of FSDP2's sharded tensors (DTensors) or the whole tensor of a
plain or DDP model from whatever shards were written.

The train state is the caller's dict (step, data position, LR-schedule position, ...), stored as
given; rank 0's is the one saved. Its values must be what ``torch.load(weights_only=True)`` reads
back (Python numbers, strings, lists, tuples, dicts, tensors; a NumPy scalar is refused before
anything is written). Beside it, each rank's Python, NumPy, torch CPU and CUDA
generator states are kept (CUDA's only where the rank had initialised CUDA), and they are
restored only when the checkpoint is loaded by as many ranks as saved it: rank r gets rank r's
states. On another world size the data each rank draws differs anyway; the generators are then
left as they are and a warning says so.

Saving writes into ``.NAME.saving`` beside ``folder`` and renames it to ``folder`` once the
completion marker is in it (an older checkpoint there is moved to ``.NAME.old`` and deleted after
the rename), so an interrupted save never leaves a folder that passes as a checkpoint; a save that
fails removes its temporary folder, and the next save clears what a killed one left. Every rank
must see the same file system (one host, or a shared one).

Order in a training script: build the model, :func:`effdl.parallel.apply_activation_checkpointing`,
:func:`effdl.parallel.wrap_model`, the optimizer, then :func:`load_checkpoint` to resume (it loads
into the wrapped model and the optimizer in place and restores the generators last, so draw
nothing random between loading and training that the uninterrupted run would not draw).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

MARKER = "effdl_checkpoint.json"
TRAIN_STATE = "train_state.pt"
FORMAT = "effdl-dcp-1"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def rng_states() -> dict[str, Any]:
    """This process's generator states: Python's ``random``, NumPy's legacy global generator,
    torch's CPU generator and (where CUDA is initialised) the current CUDA device's."""
    np_state = np.random.get_state(legacy=False)
    np_state["state"]["key"] = np_state["state"]["key"].tolist()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return {
        "python": random.getstate(),
        "numpy": np_state,
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` returned (the CUDA state on the current device)."""
    random.setstate(states["python"])
    np_state = dict(states["numpy"])
    np_state["state"] = {
        **np_state["state"],
        "key": np.asarray(np_state["state"]["key"], np.uint32),
    }
    np.random.set_state(np_state)
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"])


@contextmanager
def _one_process_quietly() -> Iterator[None]:
    """Drops DCP's warning that it runs in one process: without a process group that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_synced(path: Path, write: Any) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def checkpoint_info(folder: str | Path) -> dict[str, Any]:
    """The completion marker of the checkpoint in ``folder``: ``format``, ``world_size`` (ranks
    that saved it), ``optimizer`` (whether optimizer state is in it), ``train_state_keys``.
    FileNotFoundError when the folder does not exist, ValueError when it holds no complete
    checkpoint."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint at {folder}: the folder does not exist")
    marker = folder / MARKER
    if not marker.is_file():
        raise ValueError(
            f"{folder} is not a complete checkpoint: {MARKER} is missing (an interrupted save,"
            " or a folder of something else)"
        )
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{folder} is not a complete checkpoint: unreadable {MARKER} ({e})"
        ) from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"{folder}: {MARKER} is not of format {FORMAT!r}")
    return info


def save_checkpoint(
    folder: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    train_state: dict[str, Any],
) -> float:
    """Save ``model``'s and ``optimizer``'s state (sharded as they are), ``train_state`` and every
    rank's RNG states into ``folder``; returns the seconds it took. Every rank of the default
    process group calls it (or the one process, without a group). A complete checkpoint already
    at ``folder`` is replaced; a folder that holds anything else is refused (ValueError).
    Reads the model and optimizer; changes neither."""
    start = time.perf_counter()
    rng = rng_states()
    folder = Path(folder)
    rank, world = _rank_and_world()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file: refusing to overwrite it")
    if folder.is_dir() and not (folder / MARKER).is_file() and any(folder.iterdir()):
        raise ValueError(f"{folder} exists and holds no checkpoint: refusing to overwrite it")
    _check_loadable(train_state)
    tmp = folder.with_name(f".{folder.name}.saving")
    _on_rank0(rank, lambda: _fresh_folder(tmp))
    try:
        model_sd, optim_sd = _state_dicts(model, optimizer)
        state = {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}
        with _one_process_quietly():
            dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())
        rngs = [rng]
        if _distributed():
            rngs = [None] * world if rank == 0 else None
            dist.gather_object(rng, rngs, dst=0)
        record = {"train_state": train_state, "rng": rngs, "world_size": world}
        info = {
            "format": FORMAT,
            "world_size": world,
            "optimizer": optimizer is not None,
            "train_state_keys": sorted(map(str, train_state)),
        }
        _on_rank0(rank, lambda: _complete(tmp, folder, record, info))
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing behind
        raise
    return time.perf_counter() - start


def _fresh_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # what an interrupted save left
    path.mkdir(parents=True)


def _complete(tmp: Path, folder: Path, record: dict[str, Any], info: dict[str, Any]) -> None:
    """Write the train state, then the marker, into ``tmp``; rename it to ``folder``."""
    _write_synced(tmp / TRAIN_STATE, lambda f: torch.save(record, f))
    _write_synced(tmp / MARKER, lambda f: f.write(json.dumps(info, indent=1).encode()))
    _replace(folder, tmp)


def _check_loadable(train_state: dict[str, Any]) -> None:
    """ValueError unless ``torch.load(weights_only=True)`` reads ``train_state`` back."""
    buffer = io.BytesIO()
    torch.save(train_state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
        why = next((line for line in lines if line.startswith("WeightsUnpickler")), lines[0])
        why = why.split(". Please")[0]  # torch's advice to allow-list classes
        raise ValueError(
            f"train_state holds a value that torch.load(weights_only=True) refuses ({why})"
        ) from None


def _on_rank0(rank: int, action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0 while the others wait; every rank raises if it failed (rather
    than rank 0 alone, leaving the others blocked in the next collective)."""
    failure = None
    if rank == 0:
        try:
            action()
        except Exception as e:
            failure = e
    outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    if _distributed():
        dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise RuntimeError(f"rank 0 failed to write the checkpoint: {outcome[0]}")


def _replace(folder: Path, tmp: Path) -> None:
    """Rename ``tmp`` to ``folder``, deleting what ``folder`` held (an older checkpoint or
    nothing) only once the new one is in place."""
    old = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    try:
        tmp.rename(folder)
    except OSError:
        if old.exists():
            old.rename(folder)
        raise
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], float]:
    """Load the checkpoint in ``folder`` into ``model`` and ``optimizer`` (wrapped as they will
    train, on any number of ranks; ``optimizer`` None loads the model alone) and restore this
    rank's RNG states when the world size equals the saving one's (else a warning); returns the
    saved train state and the seconds it took. Every rank calls it.

    FileNotFoundError when ``folder`` does not exist; ValueError when it holds no complete
    checkpoint, no optimizer state but an optimizer is given, or a model whose parameter names
    or shapes differ from ``model``'s. Mutates ``model``, ``optimizer`` and the generators."""
    start = time.perf_counter()
    folder = Path(folder)
    info = checkpoint_info(folder)
    if optimizer is not None and not info["optimizer"]:
        raise ValueError(f"checkpoint {folder} holds no optimizer state")
    rank, world = _rank_and_world()
    try:
        record = torch.load(folder / TRAIN_STATE, weights_only=True)
        metadata = dcp.FileSystemReader(folder).read_metadata()
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        raise ValueError(f"{folder} is not a complete checkpoint: {_first_line(e)}") from None
    model_sd, optim_sd = _state_dicts(model, optimizer)
    _check_model_shapes(folder, metadata, model_sd)
    state = {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}
    try:
        with _one_process_quietly():
            dcp.load(state, checkpoint_id=folder, no_dist=not _distributed())
    except (Exception, dcp.CheckpointException) as e:
        raise ValueError(f"cannot load checkpoint {folder}: {_first_line(e)}") from e
    if optimizer is None:
        set_model_state_dict(model, model_sd)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    if record["world_size"] == world:
        set_rng_states(record["rng"][rank])
    elif rank == 0:
        warnings.warn(
            f"checkpoint {folder} was saved by {record['world_size']} ranks and is loaded by"
            f" {world}: the RNG states are not restored",
            stacklevel=2,
        )
    _barrier()
    return record["train_state"], time.perf_counter() - start


def _state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimizer's state dicts as DCP sees them (names of the unwrapped model,
    FSDP2's shards as DTensors); the optimizer's is empty when there is none."""
    if optimizer is None:
        return get_model_state_dict(model), {}
    return get_state_dict(model, optimizer)


def _first_line(error: BaseException) -> str:
    """The line of ``error``'s message that says what failed: the first, or for DCP's
    CheckpointException (the ranks' tracebacks) the last, the failure itself."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[-1] if isinstance(error, dcp.CheckpointException) else lines[0]


def _check_model_shapes(folder: Path, metadata: Metadata, model_sd: dict[str, Any]) -> None:
    """ValueError naming the first difference between the saved model's tensors (DCP's
    ``metadata``) and ``model_sd``'s: names and global shapes."""
    saved = {
        name.removeprefix("model."): tuple(meta.size)
        for name, meta in metadata.state_dict_metadata.items()
        if name.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    wanted = {name: tuple(t.shape) for name, t in model_sd.items() if isinstance(t, torch.Tensor)}
    missing = sorted(wanted.keys() - saved.keys())
    extra = sorted(saved.keys() - wanted.keys())
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which the model lacks"
        raise ValueError(
            f"checkpoint {folder} is of another model: it {what}"
            f" ({len(missing)} missing, {len(extra)} unexpected tensors)"
        )
    for name, shape in wanted.items():
        if saved[name] != shape:
            raise ValueError(
                f"checkpoint {folder} is of another model: {name} has shape {list(saved[name])},"
                f" the model's is {list(shape)}"
            )
