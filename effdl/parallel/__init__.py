"""Parallel training on ``torch.distributed``: process launch (:mod:`effdl.parallel.launch`),
data parallelism (:mod:`effdl.parallel.data_parallel`, with the embedding's rows averaged by
:mod:`effdl.parallel.embedding_rows`), pipeline parallelism
(:mod:`effdl.parallel.pipeline`) and tensor parallelism (:mod:`effdl.parallel.tensor`).

The experiments on them: :mod:`effdl.parallel.classifiers` (the small models they train and
their shared batch order), :mod:`effdl.parallel.pipeline_training` and
:mod:`effdl.parallel.pipeline_measure` (a pipeline run's ranks and its bubble), and
:mod:`effdl.parallel.dtensor_comparison` (the tensor-parallel MLP against DTensor's)."""

from effdl.parallel.activation_checkpoint import apply_activation_checkpointing
from effdl.parallel.checkpoint import checkpoint_info, load_checkpoint, save_checkpoint
from effdl.parallel.data_parallel import PARALLEL_MODES, gradient_sync, wrap_model
from effdl.parallel.embedding_rows import EmbeddingRowsAverage
from effdl.parallel.launch import (
    CpuShare,
    RankFailedError,
    available_cores,
    cpu_threads,
    init_from_env,
    share_cpu,
    spawn,
)
from effdl.parallel.pipeline import (
    SCHEDULES,
    Action,
    PipelineStage,
    accumulated_backward,
    bubble_fraction,
    gpipe_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
    split_sequential,
)
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
    "PARALLEL_MODES",
    "SCHEDULES",
    "Action",
    "ColumnParallelLinear",
    "CpuShare",
    "EmbeddingRowsAverage",
    "ParallelLayerNorm",
    "ParallelMLP",
    "ParallelSelfAttention",
    "ParallelTransformerBlock",
    "PipelineStage",
    "RankFailedError",
    "RowParallelLinear",
    "accumulated_backward",
    "apply_activation_checkpointing",
    "available_cores",
    "bubble_fraction",
    "checkpoint_info",
    "copy_to_parallel",
    "cpu_threads",
    "gather_from_parallel",
    "gpipe_schedule",
    "gradient_sync",
    "init_from_env",
    "interleaved_schedule",
    "load_checkpoint",
    "one_f_one_b_schedule",
    "reduce_from_parallel",
    "save_checkpoint",
    "share_cpu",
    "spawn",
    "split_sequential",
    "split_to_parallel",
    "wrap_model",
]
