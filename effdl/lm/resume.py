"""Stopping a training run and resuming it where it stopped, through a distributed checkpoint.

A run saved after ``step`` steps holds the model, the optimizer, every rank's RNG states and the
step (:mod:`effdl.parallel.checkpoint`); the data position is the step times the micro-batches
per step, and the learning rate is recomputed from the step. A run resumed from it on the same
number of processes continues with the losses of the run that was never interrupted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from effdl.parallel.activation_checkpoint import ActivationCheckpointPolicy
from effdl.parallel.checkpoint import (
    checkpoint_info,
    load_checkpoint,
    rng_states,
    save_checkpoint,
    set_rng_states,
)


def flag_problem(
    activation_checkpoint: str, precision: str, save: Path | None, resume: Path | None
) -> str | None:
    """What is wrong with a run's recomputation and checkpoint flags, in one line (None: fine)."""
    try:
        ActivationCheckpointPolicy.parse(activation_checkpoint)
    except ValueError as e:
        return f"--activation-checkpoint: {e}"
    if precision == "master" and (save or resume):
        return "--save and --resume need torch's optimizer (not --precision master)"
    if resume is not None:
        try:
            checkpoint_info(resume)
        except FileNotFoundError:
            return f"--resume {resume}: no such checkpoint folder"
        except ValueError as e:
            return f"--resume: {e}"
    return None


def save_training(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> float:
    """Save the state after ``step`` steps into ``folder``; returns the seconds it took."""
    return save_checkpoint(folder, model, optimizer, {"step": step})


def resume_training(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Iterator,
    micro_batches_per_step: int,
) -> tuple[int, float]:
    """Load ``folder`` into ``model`` and ``optimizer`` and move ``micro_batches`` past the
    ones the saved steps consumed; returns (steps done, seconds the load took). The RNG states
    are those saved: skipping the consumed batches does not advance them."""
    state, seconds = load_checkpoint(folder, model, optimizer)
    saved_rng = rng_states()
    for _ in range(state["step"] * micro_batches_per_step):
        next(micro_batches)
    set_rng_states(saved_rng)
    return int(state["step"]), seconds
