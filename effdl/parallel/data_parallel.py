"""Data parallelism over the default process group: every rank trains on its own slice of the
global batch, with the whole model (DDP) or a shard of every block (FSDP2), and gradients are
averaged over the ranks, so a step equals one process's step on the whole batch.

:func:`wrap_model` compiles the blocks and wraps or shards the model; :func:`gradient_sync`
defers the gradients' communication to the last micro-batch of a step (gradient accumulation).
The model keeps its blocks in ``model.layers`` (as :class:`effdl.models.llama.Transformer`
does): the unit of compilation and of FSDP2's sharding. A model still on the meta device is
materialised here from a seed; under FSDP2 part by part, each block sharded as soon as it is
initialised, so no rank ever holds the whole model.
"""

import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from effdl.parallel.embedding_rows import EmbeddingRowsAverage, average_with_embedding_rows

PARALLEL_MODES = ("none", "ddp", "fsdp")


def wrap_model(
    model: nn.Module,
    parallel: str,
    fsdp_bf16: bool,
    compile_blocks: bool,
    device: torch.device,
    world: int,
    *,
    bucket_cap_mb: float | None = None,
    gradient_as_bucket_view: bool = True,
    broadcast_buffers: bool = False,
    reduce_dtype: torch.dtype = torch.float32,
    embedding_tokens_per_step: int | None = None,
    init_seed: int | None = None,
) -> nn.Module:
    """``model`` (on ``device``, the same weights on every rank) made ready for data-parallel
    training on ``world`` ranks: each block of ``model.layers`` compiled (``compile_blocks``),
    then wrapped in DDP (``parallel="ddp"``) or sharded with FSDP2 (``"fsdp"``: ``fully_shard``
    per part of ``model.init_parts()``: the embedding, each block, the final norm with the head;
    then the root); ``"none"`` returns it unwrapped. Mutates ``model`` (compilation,
    FSDP2's sharding in place); returns the module to train.

    A ``model`` on the meta device (its parameters unallocated) is materialised on ``device``
    in fp32 from ``init_seed``, through its ``init_parts()`` and ``init_buffers(device)`` (as
    :class:`effdl.models.llama.Transformer` has them): the same weights as materialising it
    whole, on every rank; under FSDP2 one part is allocated at a time and each block is sharded
    right after its initialisation.

    Per-block compilation keeps one graph per block, so the gradients of the last blocks are
    ready for communication while earlier blocks still run their backward. ``fsdp_bf16``: FSDP2
    keeps fp32 parameters (the master weights) and casts them to bf16 when it gathers them for
    compute; gradients are reduced in fp32.

    DDP's settings (ignored by FSDP2): ``bucket_cap_mb``, the size of one all-reduce bucket
    (None: torch's default, 25 MB). ``gradient_as_bucket_view``: ``.grad`` tensors are views
    into the communication buckets, so no second copy of every gradient is kept or copied.
    ``broadcast_buffers``: copy rank 0's buffers to every rank before each forward; off, since
    the Llama's only buffers, its rotary tables, are computed identically on every rank. Under
    NCCL each bucket is averaged inside its all-reduce (:func:`average_in_all_reduce`);
    ``reduce_dtype=torch.bfloat16`` sends the buckets in bf16 instead (:func:`average_in_bf16`).
    ``embedding_tokens_per_step``: the token ids each rank feeds the model's one ``nn.Embedding``
    per optimizer step (all micro-batches; the same on every rank); given, that embedding's
    gradient is averaged over the rows looked up only (:func:`average_with_embedding_rows`): the same
    mean, with a fraction of the bytes in the all-reduce that ends the backward.
    """
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel {parallel!r} is not one of {list(PARALLEL_MODES)}")
    if fsdp_bf16 and parallel != "fsdp":
        raise ValueError(f"fsdp_bf16 needs parallel='fsdp', got {parallel!r}")
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"reduce_dtype {reduce_dtype} is not torch.float32 or torch.bfloat16")
    if reduce_dtype != torch.float32 and parallel != "ddp":
        raise ValueError(f"reduce_dtype {reduce_dtype} needs parallel='ddp', got {parallel!r}")
    if embedding_tokens_per_step is not None and parallel != "ddp":
        raise ValueError(f"embedding_tokens_per_step needs parallel='ddp', got {parallel!r}")
    embedding = _the_embedding(model) if embedding_tokens_per_step is not None else None
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and init_seed is None:
        raise ValueError("a model on the meta device needs init_seed to be materialised")
    if compile_blocks:
        for block in model.layers:
            block.compile()
    if parallel == "fsdp":
        _fully_shard(model, device, world, fsdp_bf16, init_seed if on_meta else None)
        return model
    if on_meta:
        _materialize_parts(model, device, init_seed, shard=None)
    if parallel == "ddp":
        ddp = _ddp(model, device, bucket_cap_mb, gradient_as_bucket_view, broadcast_buffers)
        if embedding is not None:
            rows = EmbeddingRowsAverage(embedding, embedding_tokens_per_step, reduce_dtype)
            ddp.register_comm_hook(rows, average_with_embedding_rows)
        elif reduce_dtype == torch.bfloat16:
            ddp.register_comm_hook(None, average_in_bf16)
        elif dist.get_backend() == "nccl":
            ddp.register_comm_hook(None, average_in_all_reduce)
        return ddp
    return model


def _the_embedding(model: nn.Module) -> nn.Embedding:
    found = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if len(found) != 1:
        raise ValueError(
            f"embedding_tokens_per_step needs a model with one nn.Embedding, found {len(found)}"
        )
    return found[0]


def _materialize_parts(
    model: nn.Module, device: torch.device, seed: int, shard: Callable[[nn.Module], None] | None
) -> None:
    """Allocate and initialise the meta ``model``'s parts one by one in fp32 from ``seed``,
    calling ``shard`` on each part once it is initialised."""
    torch.manual_seed(seed)
    for part, init in model.init_parts():
        part.to(dtype=torch.float32)
        part.to_empty(device=device)
        init()
        if shard is not None:
            shard(part)
    model.init_buffers(device)


def _ddp(
    model: nn.Module,
    device: torch.device,
    bucket_cap_mb: float | None,
    gradient_as_bucket_view: bool,
    broadcast_buffers: bool,
) -> DistributedDataParallel:
    # torch >= 2.13 renames broadcast_buffers to forward_sync_buffers (the old name warns).
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    buffers_flag = (
        "forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"
    )
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        **{buffers_flag: broadcast_buffers},
    )


def average_in_all_reduce(
    group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over the ranks by one all-reduce with
    ``ReduceOp.AVG`` (NCCL divides as it sums). DDP's own reduction first divides every gradient
    by the world size in a separate pass over all of them, then sums."""
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def average_in_bf16(
    group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over the ranks, sent in bf16 and written back
    into the fp32 bucket. Each all-reduce moves half the bytes; each rank's gradient is rounded
    to bf16 (8 significant bits) before the ranks are summed."""
    buffer = bucket.buffer()
    sent = buffer.to(torch.bfloat16)
    nccl = dist.get_backend(group) == "nccl"  # NCCL averages as it sums; others sum
    op = dist.ReduceOp.AVG if nccl else dist.ReduceOp.SUM
    work = dist.all_reduce(sent, op=op, group=group, async_op=True)
    ranks = dist.get_world_size(group)

    def written_back(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer if nccl else buffer.div_(ranks)  # NCCL's AVG has divided already

    return work.get_future().then(written_back)


def _fully_shard(
    model: nn.Module, device: torch.device, world: int, bf16: bool, init_seed: int | None
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=policy)

    def shard_part(part: nn.Module) -> None:
        # The final norm and the head come as a ModuleList, which has no forward of its own:
        # sharded as one group of modules, kept gathered from forward to backward, whose
        # gradients are reduced while the blocks' backward runs.
        if isinstance(part, nn.ModuleList):
            shard(list(part), reshard_after_forward=False)
        else:
            shard(part)

    if init_seed is None:
        for part, _ in model.init_parts():
            shard_part(part)
    else:
        _materialize_parts(model, device, init_seed, shard_part)
    shard(model)


def gradient_sync(model: nn.Module, last_micro_batch: bool) -> AbstractContextManager:
    """Context for one micro-batch's forward and backward: gradients are communicated only on
    the step's last micro-batch; before it they accumulate locally (DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync``, which it sets on ``model`` right away). A plain module gets
    a context that does nothing."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last_micro_batch)
        return nullcontext()
    if hasattr(model, "no_sync") and not last_micro_batch:  # DDP
        return model.no_sync()
    return nullcontext()
