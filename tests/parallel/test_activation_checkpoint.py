"""Activation checkpointing against the same model without it: loss and gradients equal in
float64, the chosen blocks run their forward twice (a pre-hook on each block's first submodule
counts the runs, recomputation included), the "op" policy recomputes no matmul, and the
checkpointed blocks compose with compilation and FSDP2 applied after them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from effdl.models.llama import Transformer, TransformerModelArgs, build_on_meta, materialize
from effdl.parallel import spawn, wrap_model
from effdl.parallel.activation_checkpoint import (
    ActivationCheckpointPolicy,
    apply_activation_checkpointing,
)
from effdl.profiling.flops import MatmulCounter

ARGS = TransformerModelArgs(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, seq_len=16
)
POLICIES = {  # policy -> the blocks it recomputes
    "none": [],
    "full": [0, 1, 2, 3],
    "selective:1": [0, 1, 2, 3],
    "selective:2": [1, 3],
    "selective:3": [2],
    "selective:5": [],
    "op": [0, 1, 2, 3],
}


def build(dtype: torch.dtype = torch.float64) -> Transformer:
    model = build_on_meta(ARGS)
    torch.manual_seed(0)
    return materialize(model, "cpu", dtype)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, ARGS.vocab_size, (2, ARGS.seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def count_block_runs(model: Transformer) -> list[int]:
    """A list, filled as the model runs, of how often each block's forward began (a forward
    pre-hook on its first submodule, which a recomputation calls too)."""
    runs = [0] * len(model.layers)
    for i, block in enumerate(model.layers):
        block.attention_norm.register_forward_pre_hook(
            lambda *_, i=i: runs.__setitem__(i, runs[i] + 1)
        )
    return runs


@pytest.mark.parametrize("policy", list(POLICIES))
def test_policy_keeps_loss_and_gradients_and_recomputes_its_blocks(policy):
    x, y = batch()
    want_loss, want_grads = loss_and_grads(build(), x, y)
    model = build()
    assert apply_activation_checkpointing(model, policy) == POLICIES[policy]
    runs = count_block_runs(model)
    loss, grads = loss_and_grads(model, x, y)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grads, want_grads)
    assert runs == [2 if i in POLICIES[policy] else 1 for i in range(ARGS.n_layers)]
    assert list(dict(model.named_parameters())) == list(want_grads)  # names unchanged


def backward_matmuls(policy: str) -> int:
    model = build(torch.float32)
    apply_activation_checkpointing(model, policy)
    x, y = batch()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    with MatmulCounter() as counter:
        loss.backward()
    return counter.total


def test_op_policy_recomputes_no_matmul_and_full_recomputes_them_all():
    plain, op, full = (backward_matmuls(p) for p in ("none", "op", "full"))
    assert op == plain
    # q, k, v, o, w1, w3 rerun; not w2: checkpoint's early stop ends the recomputation once the
    # tensors the backward needs are back, and w2's output is not one of them
    assert full == plain + ARGS.n_layers * 6


@pytest.mark.parametrize(
    "policy",
    ["", "Full", "full ", "selective", "selective:", "selective:0", "selective:-1", "selective:x"],
)
def test_bad_policy_is_refused_in_one_line(policy):
    with pytest.raises(ValueError) as err:
        ActivationCheckpointPolicy.parse(policy)
    assert str(err.value) == (
        f"activation checkpoint policy {policy!r} is not one of none, full, selective:K, op"
        " (K an integer >= 1)"
    )
    with pytest.raises(ValueError, match="activation checkpoint policy"):
        apply_activation_checkpointing(build(), policy)


def test_applying_twice_is_refused():
    model = build()
    apply_activation_checkpointing(model, "selective:2")
    with pytest.raises(ValueError, match=r"^block 1 already has its forward replaced"):
        apply_activation_checkpointing(model, "full")


@pytest.mark.parametrize("policy", ["full", "op"])
def test_composes_with_per_block_compile(policy):
    x, y = batch()
    want_loss, want_grads = loss_and_grads(build(), x, y)
    model = build()
    apply_activation_checkpointing(model, policy)
    for block in model.layers:
        block.compile(backend="aot_eager")  # inductor would need a C++ toolchain
    loss, grads = loss_and_grads(model, x, y)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grads, want_grads)


def fsdp_losses(rank: int, world: int, policy: str) -> list[float]:
    """Three AdamW steps of FSDP2 on this rank's half of a fixed batch, the blocks checkpointed
    by ``policy`` before sharding."""
    torch.set_num_threads(1)
    model = build()
    apply_activation_checkpointing(model, policy)
    model = wrap_model(model, "fsdp", False, False, torch.device("cpu"), world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch()
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_composes_with_fsdp2_applied_after_it():
    want = spawn(fsdp_losses, 2, "none")
    for policy in ("full", "op"):
        torch.testing.assert_close(spawn(fsdp_losses, 2, policy), want, msg=policy)
