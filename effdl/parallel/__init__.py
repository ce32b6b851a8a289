"""Parallel training on ``torch.distributed``: process launch (:mod:`effdl.parallel.launch`) and
tensor parallelism (:mod:`effdl.parallel.tensor`)."""

from effdl.parallel.launch import RankFailedError, init_from_env, spawn
from effdl.parallel.tensor import (
    ColumnParallelLinear,
    ParallelLayerNorm,
    ParallelMLP,
    ParallelSelfAttention,
    ParallelTransformerBlock,
    RowParallelLinear,
    copy_to_parallel,
    gather_from_parallel,
    reduce_from_parallel,
    split_to_parallel,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelLayerNorm",
    "ParallelMLP",
    "ParallelSelfAttention",
    "ParallelTransformerBlock",
    "RankFailedError",
    "RowParallelLinear",
    "copy_to_parallel",
    "gather_from_parallel",
    "init_from_env",
    "reduce_from_parallel",
    "spawn",
    "split_to_parallel",
]
