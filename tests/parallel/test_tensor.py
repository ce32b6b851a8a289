"""Tensor-parallel layers against the single-process modules they shard (gloo, 2 and 4 processes).

Reference: the same ``nn.Sequential`` built from the same seed in every rank, in float64, so
forward outputs and gradients must agree to float64 rounding (the parallel sums add the same
terms in another order). Each rank returns its parameters' gradients; the reference gradient is
cut with the sharding rule (``torch.chunk`` along the dimension whose size differs) before the
comparison. The spawn-launcher checks at the end exercise ``effdl.parallel.launch``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from effdl.parallel import (
    ColumnParallelLinear,
    ParallelLayerNorm,
    ParallelMLP,
    ParallelSelfAttention,
    ParallelTransformerBlock,
    RankFailedError,
    RowParallelLinear,
    spawn,
)

F64_TOL = {"rtol": 1e-10, "atol": 1e-12}
IN, HIDDEN, OUT, BATCH = 8, 16, 4, 6


BLOCK_KINDS = ["block_pre_causal", "block_post"]  # pre-/post-norm, causal or full attention
HEADS, SEQ = 4, 5


def reference_model(kind: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The single-process model of each case, seeded so every rank builds the same weights."""
    torch.manual_seed(0)
    if kind in BLOCK_KINDS:
        model = nn.TransformerEncoderLayer(
            IN,
            HEADS,
            HIDDEN,
            dropout=0.0,
            activation="relu" if kind == "block_pre_causal" else "gelu",
            batch_first=True,
            norm_first=kind == "block_pre_causal",
        )
    elif kind == "norm":
        layers = [nn.Linear(IN, HIDDEN), nn.LayerNorm(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)]
        model = nn.Sequential(*layers)
        with torch.no_grad():  # non-trivial affine parameters
            model[1].weight.uniform_(0.5, 1.5)
            model[1].bias.uniform_(-0.5, 0.5)
    else:
        act = nn.Tanh() if kind == "gathered" else nn.ReLU()
        model = nn.Sequential(nn.Linear(IN, HIDDEN), act, nn.Linear(HIDDEN, OUT))
    return model.to(dtype)


def parallelize(kind: str, model: nn.Module) -> nn.Module:
    """The tensor-parallel version of ``reference_model(kind)``, sharing its weights."""
    if kind in BLOCK_KINDS:
        return ParallelTransformerBlock.from_encoder_layer(model)
    first, act, last = model[0], model[-2], model[-1]
    if kind == "mlp":
        return ParallelMLP.from_linears(first, act, last)
    if kind == "gathered":  # full activations between the layers: all-gather, then split
        return nn.Sequential(
            ColumnParallelLinear.from_linear(first, gather_output=True),
            act,
            RowParallelLinear.from_linear(last, input_is_parallel=False),
        )
    return nn.Sequential(
        ColumnParallelLinear.from_linear(first, gather_output=False),
        ParallelLayerNorm.from_layer_norm(model[1]),
        act,
        RowParallelLinear.from_linear(last, input_is_parallel=True),
    )


def case_input(kind: str) -> torch.Tensor:
    shape = (2, SEQ, IN) if kind in BLOCK_KINDS else (BATCH, IN)
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def run(kind: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward, telling the reference encoder layer about causality its own way."""
    if kind != "block_pre_causal":
        return model(x)
    if isinstance(model, ParallelTransformerBlock):
        return model(x, is_causal=True)
    mask = nn.Transformer.generate_square_subsequent_mask(SEQ, device=x.device, dtype=x.dtype)
    return model(x, src_mask=mask, is_causal=True)


def expected_shard(name: str, full: torch.Tensor, local: torch.Tensor, rank: int, world: int):
    """``full``'s part that this rank's ``local``-shaped shard should hold: this rank's heads of
    each of q, k, v for the packed projection, else the ``torch.chunk`` along the dimension
    whose size differs (the whole tensor for replicated parameters)."""
    if ".qkv." in name:
        return torch.cat([part.chunk(world)[rank] for part in full.chunk(3)])
    differing = [d for d in range(full.dim()) if full.shape[d] != local.shape[d]]
    return full.chunk(world, dim=differing[0])[rank] if differing else full


def loss_of(out: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1, 2, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    return (out * weights).sum() + out.pow(2).mean()


def compare_with_reference(
    rank: int, world: int, kinds: list[str], device: str = "cpu"
) -> list[tuple]:
    """Per case: (what, parallel tensor, reference tensor), on the CPU, for the output, input
    grad, and every parameter's grad as this rank holds it."""
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    pairs = []
    for kind in kinds:
        ref = reference_model(kind).to(device)
        par = parallelize(kind, reference_model(kind).to(device))
        x = case_input(kind).to(device)
        x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out_par = run(kind, ref, x_ref), run(kind, par, x_par)
        loss_of(out_ref).backward()
        loss_of(out_par).backward()
        pairs += [
            (f"{kind} output", out_par, out_ref),
            (f"{kind} input grad", x_par.grad, x_ref.grad),
        ]
        ref_params = [p for p in ref.parameters()]
        for (name, p), p_ref in zip(par.named_parameters(), ref_params, strict=True):
            expected = expected_shard(name, p_ref.grad, p.grad, rank, world)
            pairs.append((f"{kind} {name}.grad", p.grad.detach(), expected))
    return [(what, got.detach().cpu(), expected.detach().cpu()) for what, got, expected in pairs]


@pytest.mark.parametrize("world", [2, 4])
def test_outputs_and_gradients_equal_the_single_process_module(world):
    results = spawn(compare_with_reference, world, ["mlp", "gathered", "norm"])
    for rank_pairs in results:
        assert len(rank_pairs) == 3 * 2 + 4 + 4 + 6  # output, input grad, every parameter
        for what, got, expected in rank_pairs:
            torch.testing.assert_close(got, expected, **F64_TOL, msg=what)


@pytest.mark.parametrize("world", [2, 4])
def test_transformer_block_equals_the_encoder_layer(world):
    for rank_pairs in spawn(compare_with_reference, world, BLOCK_KINDS):
        assert len(rank_pairs) == 2 * (2 + 12)  # output, input grad, 12 parameters per block
        for what, got, expected in rank_pairs:
            torch.testing.assert_close(got, expected, **F64_TOL, msg=what)


def refusals(rank: int, world: int) -> list[str]:
    """The error message of each misuse, in the order of ``test_misuse_is_refused_in_words``."""
    attempts = [
        lambda: ColumnParallelLinear(4, 5),
        lambda: RowParallelLinear(3, 4),
        lambda: ParallelLayerNorm.from_layer_norm(nn.LayerNorm((2, 4))),
        lambda: ParallelMLP(ColumnParallelLinear(4, 8), nn.ReLU(), RowParallelLinear(8, 4)),
        lambda: ParallelTransformerBlock.from_encoder_layer(
            nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        ),
        lambda: ParallelTransformerBlock.from_encoder_layer(
            nn.TransformerEncoderLayer(6, 3, 12, dropout=0.0, batch_first=True)
        ),
        lambda: ParallelTransformerBlock.from_encoder_layer(
            nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False)
        ),
        lambda: ParallelSelfAttention.from_attention(
            nn.MultiheadAttention(8, 2, batch_first=True, add_zero_attn=True)
        ),
        lambda: ParallelLayerNorm(8)(torch.randn(3, 8)),  # the full width, not this rank's 4
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("accepted")
    return messages


def test_misuse_is_refused_in_words():
    messages = spawn(refusals, 2)[0]
    assert messages[0] == "out_features=5 does not divide evenly across 2 ranks"
    assert messages[1] == "in_features=3 does not divide evenly across 2 ranks"
    assert "over the last dimension" in messages[2]
    assert "gather_output=False" in messages[3]
    assert messages[4] == "dropout must be 0 for tensor parallelism, got (0.1, 0.1, 0.1)"
    assert messages[5] == "num_heads=3 does not divide evenly across 2 ranks"
    assert "batch-first" in messages[6]
    assert "add_zero_attn" in messages[7]
    assert messages[8] == "x ends in 8 features; this rank's shard of 8 is 4"


def shards_of_linears(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    column_full, row_full = nn.Linear(6, 8), nn.Linear(8, 6)
    col, row = (
        ColumnParallelLinear.from_linear(column_full),
        RowParallelLinear.from_linear(row_full),
    )
    return {"column_full": column_full, "row_full": row_full, "col": col, "row": row}


@pytest.mark.parametrize("world", [2, 4])
def test_from_linear_keeps_this_ranks_chunk(world):
    for rank, got in enumerate(spawn(shards_of_linears, world)):
        column_full, row_full, col, row = (
            got["column_full"],
            got["row_full"],
            got["col"],
            got["row"],
        )
        assert torch.equal(col.weight, column_full.weight.chunk(world, dim=0)[rank])
        assert torch.equal(col.bias, column_full.bias.chunk(world)[rank])
        assert torch.equal(row.weight, row_full.weight.chunk(world, dim=1)[rank])
        assert torch.equal(row.bias, row_full.bias)  # the full bias, added once after the sum


def count_collectives(rank: int, world: int, kind: str) -> dict[str, dict[str, int]]:
    """Collectives one forward and one backward of a case issue (dist's functions wrapped)."""
    torch.set_num_threads(1)
    counts = dict.fromkeys(["all_reduce", "all_gather", "all_gather_into_tensor", "broadcast"], 0)
    for name in counts:
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    model = parallelize(kind, reference_model(kind))
    out = run(kind, model, case_input(kind).requires_grad_())
    forward = dict(counts)
    loss_of(out).backward()
    backward = {name: counts[name] - forward[name] for name in counts}
    return {"forward": forward, "backward": backward}


@pytest.mark.parametrize(("kind", "all_reduces"), [("mlp", 1), ("block_pre_causal", 2)])
def test_one_all_reduce_per_direction_per_parallel_mlp_or_attention(kind, all_reduces):
    expected = {
        "all_reduce": all_reduces,
        "all_gather": 0,
        "all_gather_into_tensor": 0,
        "broadcast": 0,
    }
    for result in spawn(count_collectives, 2, kind):
        assert result == {"forward": expected, "backward": expected}


def norm_far_from_zero(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's float32 ParallelLayerNorm output, the float64 nn.LayerNorm shard) for rows
    whose mean is 1000 standard deviations from zero."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = 1000 + torch.randn(16, 64, generator=g, dtype=torch.float64)
    expected = nn.functional.layer_norm(x, (64,)).chunk(world, -1)[rank]
    norm = ParallelLayerNorm.from_layer_norm(nn.LayerNorm(64))
    return norm(x.float().chunk(world, -1)[rank]).detach(), expected


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layer_norm_keeps_float32_precision_far_from_zero(world):
    # x**2 ~ 1e6 here: E[x**2] - mean**2 in float32 would lose the variance (~1) to rounding.
    for got, expected in spawn(norm_far_from_zero, world):
        assert (got.double() - expected).abs().max() < 1e-3


def learning_problem() -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """(inputs, targets, loss): scikit-learn's bundled 8x8 digits (real images, 10 classes) when
    scikit-learn is importable, else a seeded nonlinear regression with 10 outputs."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 64, generator=g)
        y = torch.tanh(x @ torch.randn(64, 10, generator=g) / 8)
        return x, y, nn.MSELoss()
    digits = load_digits()
    x = torch.as_tensor(digits.data, dtype=torch.float32) / 16
    return x, torch.as_tensor(digits.target), nn.CrossEntropyLoss()


def training_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 10))


def train(model: nn.Module, steps: int = 20) -> list[float]:
    """Full-batch SGD on ``learning_problem()``; the loss before each step."""
    x, y, loss_fn = learning_problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_parallel(rank: int, world: int) -> list[float]:
    torch.set_num_threads(1)
    reference = training_model()
    return train(parallelize("norm", reference))


def test_parallel_training_follows_the_single_process_loss_curve():
    reference = train(training_model())
    assert reference[-1] < 0.8 * reference[0]  # it learns: the comparison is not of flat curves
    for curve in spawn(train_parallel, 2):
        torch.testing.assert_close(curve, reference, rtol=1e-5, atol=0)


def ranks_seen(rank: int, world: int, tag: str) -> tuple[int, int, int, str]:
    return rank, world, dist.get_rank(), tag


def test_spawn_returns_results_in_rank_order():
    assert spawn(ranks_seen, 3, "x") == [(r, 3, r, "x") for r in range(3)]


def fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("no data for rank 1")
    dist.barrier()  # blocks until terminated: rank 1 never arrives


def exit_on_rank_one(rank: int, world: int, code: int = 3) -> None:
    if rank == 1:
        os._exit(code)
    dist.barrier()


def test_spawn_raises_with_the_failing_ranks_traceback():
    with pytest.raises(RankFailedError, match="--- rank 1 ---") as failed:
        spawn(fail_on_rank_one, 2)
    assert "ValueError: no data for rank 1" in failed.value.failures[1]


def test_spawn_raises_when_a_rank_dies_without_reporting():
    with pytest.raises(RankFailedError) as failed:
        spawn(exit_on_rank_one, 2)
    assert failed.value.failures[1] == "process exited with code 3 before reporting"


def test_spawn_raises_when_a_rank_exits_cleanly_without_reporting():
    with pytest.raises(RankFailedError) as failed:
        spawn(exit_on_rank_one, 2, 0)
    assert failed.value.failures[1] == "process exited with code 0 before reporting"
