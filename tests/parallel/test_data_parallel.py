"""DDP and FSDP2 through ``wrap_model`` against one process trained on the whole batch (gloo, 2
processes; the same functions run under NCCL on two GPUs in test_multigpu.py).

Reference: the same small Llama, built from the same seed and trained with AdamW in one process
on the global batch. Each rank trains on its half of every global batch, in two micro-batches
whose gradients are communicated on the last (``gradient_sync``); the step's loss is the mean
over all ranks' tokens. Losses per step must agree to float32 rounding (the gradients are summed
in another order, and Adam carries the difference into the next step's weights).
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from effdl.models.llama import Transformer, TransformerModelArgs, build_on_meta, materialize
from effdl.parallel import gradient_sync, spawn, wrap_model
from effdl.parallel.data_parallel import average_in_all_reduce

ARGS = TransformerModelArgs(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16, seq_len=16
)
# A table whose rows looked up by both ranks in a step (2 x 64 ids) are under half of it, so the
# embedding's gradient is averaged row-wise (effdl.parallel.embedding_rows).
WIDE_VOCAB = dataclasses.replace(ARGS, vocab_size=1024)
STEPS, GLOBAL_BATCH, MICRO_BATCHES = 4, 8, 2
FP32_RTOL = 1e-5


def rank_device(rank: int, device_type: str) -> torch.device:
    """GPU ``rank`` (made current) on CUDA; on the CPU one intra-op thread per forked rank (a
    parent that ran a multi-threaded kernel leaves the child's OpenMP pool unusable)."""
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        return device
    torch.set_num_threads(1)
    return torch.device("cpu")


def build(device: torch.device, args: TransformerModelArgs = ARGS) -> Transformer:
    """The test's Llama in float32 on ``device``, the same weights on every rank and device."""
    model = build_on_meta(args)
    torch.manual_seed(0)
    return materialize(model, device, torch.float32)


def global_batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, next tokens) of every step, ``GLOBAL_BATCH`` sequences each, drawn from the first
    16 tokens of the vocabulary (so the loss falls within a few steps)."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 16, (STEPS, GLOBAL_BATCH, ARGS.seq_len + 1), generator=gen)
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]


def train(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    micro_batches: int,
    world: int,
) -> list[float]:
    """AdamW steps, one per batch, each batch in ``micro_batches`` accumulated parts; the loss
    of each step, averaged over the ``world`` ranks (equal shares of tokens)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        total = torch.zeros((), device=x.device)
        parts = list(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True))
        for i, (xs, ys) in enumerate(parts):
            with gradient_sync(model, i == len(parts) - 1):
                loss = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()) / micro_batches
                loss.backward()
            total += loss.detach()
        optimizer.step()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def watch_full_tensors(model: Transformer, seen: list[int]) -> None:
    """Make ``model.init_parts()`` append, at each part's initialisation, how many elements
    of allocated parameters are whole tensors rather than FSDP2 shards."""
    parts = model.init_parts

    def whole_elements() -> int:
        return sum(
            p.numel() for p in model.parameters() if type(p) is nn.Parameter and not p.is_meta
        )

    def watched():
        return [
            (part, lambda init=init: (init(), seen.append(whole_elements())))
            for part, init in parts()
        ]

    model.init_parts = watched


def data_parallel_losses(
    rank: int, world: int, parallel: str, device_type: str = "cpu", from_meta: bool = False
) -> dict[str, list[float]]:
    """This rank's per-step losses under ``parallel`` and the one-process reference's; with
    ``from_meta`` the model reaches ``wrap_model`` unallocated, with the reference's seed.
    ``parallel="ddp-rows"``: DDP averaging the embedding's gradient row-wise (a wider table)."""
    device = rank_device(rank, device_type)
    args = WIDE_VOCAB if parallel == "ddp-rows" else ARGS
    batches = global_batches(device)
    reference = train(build(device, args), batches, 1, 1)
    mine = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches]
    whole: list[int] = []
    wrap = dict(embedding_tokens_per_step=mine[0][0].numel()) if parallel == "ddp-rows" else {}
    parallel = parallel.removesuffix("-rows")
    if from_meta:
        model = build_on_meta(args)
        watch_full_tensors(model, whole)
        model = wrap_model(model, parallel, False, False, device, world, init_seed=0, **wrap)
    else:
        model = wrap_model(build(device, args), parallel, False, False, device, world, **wrap)
    losses = train(model, mine, MICRO_BATCHES, world)
    return {"losses": losses, "reference": reference, "whole": whole}


@pytest.mark.parametrize(
    ("parallel", "from_meta"),
    [("ddp", False), ("fsdp", False), ("ddp", True), ("fsdp", True), ("ddp-rows", True)],
)
def test_training_equals_one_process_on_the_whole_batch(parallel, from_meta):
    results = spawn(data_parallel_losses, 2, parallel, "cpu", from_meta)
    if from_meta and parallel == "fsdp":  # each part is sharded before the next is allocated
        block = sum(p.numel() for p in build(torch.device("cpu")).layers[0].parameters())
        head = ARGS.dim + ARGS.vocab_size * ARGS.dim  # the final norm and the output
        embedding = ARGS.vocab_size * ARGS.dim
        for got in results:
            assert got["whole"] == [embedding] + [block] * ARGS.n_layers + [head]
    for rank, got in enumerate(results):
        assert got["reference"][-1] < 0.8 * got["reference"][0]  # not a flat comparison
        torch.testing.assert_close(
            got["losses"], got["reference"], rtol=FP32_RTOL, atol=0, msg=f"rank {rank}"
        )


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()


def ddp_gradients(rank: int, world: int, device_type: str = "cpu") -> dict:
    """Gradients of a DDP model after a first micro-batch outside sync and after a second one
    inside it, beside a plain model's local gradients after each; DDP's settings as set."""
    device = rank_device(rank, device_type)
    x, y = global_batches(device)[0]
    parts = list(zip(x.chunk(world)[rank].chunk(2), y.chunk(world)[rank].chunk(2), strict=True))
    plain = build(device)
    ddp = wrap_model(build(device), "ddp", False, False, device, world)
    out = {"settings": (ddp.gradient_as_bucket_view, ddp.broadcast_buffers)}
    for last, (xs, ys) in enumerate(parts):
        for model in (plain, ddp):
            with gradient_sync(model, bool(last)):
                F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()).backward()
        out[f"plain_{last}"], out[f"ddp_{last}"] = flat_grad(plain), flat_grad(ddp)
    return out


def test_gradient_sync_keeps_ddp_gradients_local_until_the_last_micro_batch():
    got = spawn(ddp_gradients, 2)
    for rank_got in got:
        assert rank_got["settings"] == (True, False)
        torch.testing.assert_close(rank_got["ddp_0"], rank_got["plain_0"])  # not averaged
        torch.testing.assert_close(
            rank_got["ddp_1"], (got[0]["plain_1"] + got[1]["plain_1"]) / 2, rtol=1e-5, atol=1e-7
        )
    assert not torch.allclose(got[0]["ddp_0"], got[1]["ddp_0"])  # the ranks' data differ


def bf16_reduced_gradients(rank: int, world: int) -> dict:
    device = rank_device(rank, "cpu")
    x, y = global_batches(device)[0]
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    plain = build(device)
    ddp = wrap_model(build(device), "ddp", False, False, device, world, reduce_dtype=torch.bfloat16)
    for model in (plain, ddp):
        F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()).backward()
    return {"plain": flat_grad(plain), "ddp": flat_grad(ddp)}


def test_ddp_can_send_its_gradients_in_bf16():
    got = spawn(bf16_reduced_gradients, 2)
    exact = (got[0]["plain"] + got[1]["plain"]) / 2
    rounded = (got[0]["plain"].bfloat16().float() + got[1]["plain"].bfloat16().float()) / 2
    for rank_got in got:
        assert rank_got["ddp"].dtype == torch.float32  # written back into the fp32 buckets
        torch.testing.assert_close(rank_got["ddp"], rounded.bfloat16().float(), rtol=0, atol=0)
        scale = (got[0]["plain"].abs() + got[1]["plain"].abs()) / 2  # bf16 keeps 8 bits of each
        assert ((rank_got["ddp"] - exact).abs() <= 2**-7 * scale).all()
    torch.testing.assert_close(got[0]["ddp"], got[1]["ddp"], rtol=0, atol=0)  # one mean


def embedding_rows_gradients(
    rank: int, world: int, device_type: str = "cpu", args: TransformerModelArgs = WIDE_VOCAB
) -> dict:
    """Gradients after two micro-batches (synchronized on the second) under DDP averaging the
    embedding whole and row-wise, beside a plain model's local ones; the row-wise hook's
    gathers of token ids counted."""
    device = rank_device(rank, device_type)
    x, y = global_batches(device)[0]
    parts = list(zip(x.chunk(world)[rank].chunk(2), y.chunk(world)[rank].chunk(2), strict=True))
    plain, dense = build(device, args), wrap_model(build(device, args), "ddp", False, False, device, world)  # fmt: skip
    rows = wrap_model(build(device, args), "ddp", False, False, device, world, embedding_tokens_per_step=x.numel() // world)  # fmt: skip
    gathers = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    gather = getattr(dist, name)

    def counted(*args, **kwargs):
        gathers.append(1)
        return gather(*args, **kwargs)

    setattr(dist, name, counted)
    for last, (xs, ys) in enumerate(parts):
        for model in (plain, dense, rows):
            with gradient_sync(model, bool(last)):
                F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()).backward()
    setattr(dist, name, gather)
    return {
        "plain": flat_grad(plain),
        "dense": flat_grad(dense),
        "rows": flat_grad(rows),
        "table": rows.module.tok_embeddings.weight.grad.cpu(),
        "gathers": len(gathers),
    }


def test_ddp_averages_the_embedding_row_wise_to_the_dense_mean():
    got = spawn(embedding_rows_gradients, 2)
    looked_up = global_batches(torch.device("cpu"))[0][0].unique()
    for rank_got in got:
        assert rank_got["gathers"] == 1  # the row-wise path ran, once, at the synchronization
        torch.testing.assert_close(rank_got["rows"], rank_got["dense"], rtol=0, atol=0)
        torch.testing.assert_close(
            rank_got["rows"], (got[0]["plain"] + got[1]["plain"]) / 2, rtol=1e-5, atol=1e-7
        )
        touched = rank_got["table"].abs().sum(1) > 0
        assert touched.nonzero().flatten().tolist() == looked_up.tolist()


def test_ddp_sends_a_table_whole_where_the_looked_up_rows_are_half_of_it_or_more():
    got = spawn(embedding_rows_gradients, 2, "cpu", ARGS)  # 2 x 64 ids, 96 rows
    for rank_got in got:
        assert rank_got["gathers"] == 0
        torch.testing.assert_close(rank_got["rows"], rank_got["dense"], rtol=0, atol=0)


def wrong_token_count(rank: int, world: int) -> str:
    device = rank_device(rank, "cpu")
    x, y = global_batches(device)[0]
    model = wrap_model(build(device, WIDE_VOCAB), "ddp", False, False, device, world, embedding_tokens_per_step=7)  # fmt: skip
    try:
        F.cross_entropy(model(x[:1]).flatten(0, 1), y[:1].flatten()).backward()
    except Exception as e:  # raised inside DDP's hook, before any collective of the bucket
        return str(e)
    return "no error"


def test_ddp_row_wise_averaging_refuses_another_token_count():
    for message in spawn(wrong_token_count, 2):
        assert "looked up 16 tokens since the last gradient synchronization, expected " \
            "tokens_per_step=7" in message  # fmt: skip


def register_average_hook(rank: int, world: int) -> bool:
    ddp = nn.parallel.DistributedDataParallel(build(rank_device(rank, "cpu")))
    ddp.register_comm_hook(None, average_in_all_reduce)  # DDP checks the hook's signature
    return True


def test_ddp_accepts_the_averaging_hook_that_nccl_runs_use():
    assert spawn(register_average_hook, 1) == [True]


# The two tests below run in pytest's own process: no autograd there, which on a CUDA host starts
# the driver, after which the gloo ranks that spawn() forks fail at torch's CUDA checks.


def test_wrap_model_refuses_what_it_cannot_do():
    model, cpu = nn.Linear(2, 2), torch.device("cpu")
    with pytest.raises(
        ValueError, match=r"parallel 'zero' is not one of \['none', 'ddp', 'fsdp'\]"
    ):
        wrap_model(model, "zero", False, False, cpu, 1)
    with pytest.raises(ValueError, match="fsdp_bf16 needs parallel='fsdp', got 'ddp'"):
        wrap_model(model, "ddp", True, False, cpu, 1)
    with pytest.raises(ValueError, match="needs parallel='ddp', got 'fsdp'"):
        wrap_model(model, "fsdp", False, False, cpu, 1, reduce_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"is not torch\.float32 or torch\.bfloat16"):
        wrap_model(model, "ddp", False, False, cpu, 1, reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match="embedding_tokens_per_step needs parallel='ddp'"):
        wrap_model(model, "fsdp", False, False, cpu, 1, embedding_tokens_per_step=8)
    with pytest.raises(ValueError, match=r"needs a model with one nn\.Embedding, found 0"):
        wrap_model(model, "ddp", False, False, cpu, 1, embedding_tokens_per_step=8)
    assert wrap_model(model, "none", False, False, cpu, 1) is model


def test_gradient_sync_does_nothing_to_a_plain_module():
    for last in (False, True):
        assert isinstance(gradient_sync(nn.Linear(2, 2), last), nullcontext)


def fsdp_units(rank: int, world: int) -> dict[str, bool]:
    """Which of the model's parts ``wrap_model`` made FSDP2 modules of their own."""
    from torch.distributed.fsdp import FSDPModule

    model = wrap_model(build_on_meta(ARGS), "fsdp", False, False, torch.device("cpu"), world, init_seed=0)  # fmt: skip
    parts = {"embedding": model.tok_embeddings, "block": model.layers[0], "norm": model.norm,
             "head": model.output, "root": model}  # fmt: skip
    return {name: isinstance(m, FSDPModule) for name, m in parts.items()}


def test_fsdp_shards_the_embedding_and_the_head_apart_from_the_root():
    """The head's gradients are reduced while the blocks' backward runs, not with the root's
    at the very end."""
    for got in spawn(fsdp_units, 2):
        assert got == dict.fromkeys(("embedding", "block", "norm", "head", "root"), True)
