"""Optimizers: :class:`CPUOffloadAdam` / :class:`CPUOffloadAdamW` keep fp32 master weights and
Adam moments in CPU memory while the device holds low-precision working weights
(:func:`plan_offload` lists what they allocate, where); :class:`MasterWeights` keeps flat fp32
masters on the device for a model of bf16 parameters; :func:`warmup_cosine_lr` is the
learning-rate schedule of the training scripts."""

from effdl.optim.master_weights import MasterWeights
from effdl.optim.offload import CPUOffloadAdam, CPUOffloadAdamW, OffloadPlan, plan_offload
from effdl.optim.schedule import warmup_cosine_lr

__all__ = [
    "CPUOffloadAdam",
    "CPUOffloadAdamW",
    "MasterWeights",
    "OffloadPlan",
    "plan_offload",
    "warmup_cosine_lr",
]
