"""Activation checkpointing of a model's blocks (``model.layers``): a chosen block keeps only its
inputs in forward and runs its forward again in backward to rebuild what its gradients need.

Policies (:meth:`ActivationCheckpointPolicy.parse`):

- ``none``: nothing is recomputed;
- ``full``: every block is recomputed;
- ``selective:K``: every K-th block is recomputed, the K-th, 2K-th, ... counted from 1 (block
  indices K-1, 2K-1, ..., as torchtitan counts);
- ``op``: every block, op-level selective: the outputs of its matmuls and of attention are kept,
  only the cheap elementwise ops between them (norms, rotary, SiLU, products, residual adds) are
  recomputed, through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

A chosen block's ``forward`` is replaced by one that runs the original under
``torch.utils.checkpoint.checkpoint`` (non-reentrant). The module tree and the parameter names
stay as they are, so state dicts and distributed checkpoints (:mod:`effdl.parallel.checkpoint`)
load the same with or without recomputation.

Order with :func:`effdl.parallel.wrap_model`: apply the checkpointing first, then let
``wrap_model`` compile each block (the compiled graph contains the checkpoint) and shard it with
FSDP2 (its hooks gather a block's parameters before its forward and, in backward, before the
recomputation). Checkpoint inside, then compile, then ``fully_shard``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

POLICY_FORMS = ("none", "full", "selective:K", "op")

# Ops whose outputs the "op" policy keeps: the GEMMs (linear layers lower to mm / addmm) and the
# attention kernels of every SDPA backend; names a torch build lacks are skipped.
_SAVED_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
SAVED_OPS = frozenset(
    getattr(torch.ops.aten, name) for name in _SAVED_OP_NAMES if hasattr(torch.ops.aten, name)
)


@dataclass(frozen=True)
class ActivationCheckpointPolicy:
    """Which blocks recompute in backward and how: ``mode`` is ``"none"``, ``"full"``,
    ``"selective"`` (every ``every``-th block) or ``"op"`` (every block, op-level)."""

    mode: str
    every: int = 1

    @classmethod
    def parse(cls, policy: str) -> ActivationCheckpointPolicy:
        """The policy a string names (``none``, ``full``, ``selective:K`` with K >= 1, ``op``);
        ValueError listing the valid forms for anything else."""
        if policy in ("none", "full", "op"):
            return cls(policy)
        match = re.fullmatch(r"selective:([0-9]+)", policy)
        if match and int(match.group(1)) >= 1:
            return cls("selective", int(match.group(1)))
        raise ValueError(
            f"activation checkpoint policy {policy!r} is not one of {', '.join(POLICY_FORMS)}"
            " (K an integer >= 1)"
        )

    def blocks(self, n_blocks: int) -> list[int]:
        """Indices of the blocks this policy recomputes, among ``n_blocks``."""
        if self.mode == "none":
            return []
        return [i for i in range(n_blocks) if (i + 1) % self.every == 0]


def save_matmul_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy of ``"op"``: keep the outputs of :data:`SAVED_OPS`, recompute
    every other op."""
    if getattr(op, "overloadpacket", None) in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _op_level_contexts() -> Any:
    return create_selective_checkpoint_contexts(save_matmul_outputs)


def _checkpointed_forward(
    forward: Callable[..., Any], options: dict[str, Any], *args: Any, **kwargs: Any
) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)


def apply_activation_checkpointing(model: nn.Module, policy: str) -> list[int]:
    """Recompute the blocks of ``model.layers`` that ``policy`` (see the module docstring)
    chooses; returns their indices. Mutates the chosen blocks (their ``forward``); parameters,
    their names and the loss and gradients are unchanged. Apply it before compiling and
    sharding (:func:`effdl.parallel.wrap_model`), once: a block whose forward was already
    replaced is refused."""
    parsed = ActivationCheckpointPolicy.parse(policy)
    chosen = parsed.blocks(len(model.layers))
    options = {"context_fn": _op_level_contexts} if parsed.mode == "op" else {}
    for i in chosen:
        block = model.layers[i]
        if "forward" in vars(block):
            raise ValueError(f"block {i} already has its forward replaced (checkpointed twice?)")
    for i in chosen:
        block = model.layers[i]
        block.forward = functools.partial(_checkpointed_forward, block.forward, options)
    return chosen
