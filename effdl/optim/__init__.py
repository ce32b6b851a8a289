"""Optimizers: :class:`CPUOffloadAdam` / :class:`CPUOffloadAdamW` keep fp32 master weights and
Adam moments in CPU memory while the device holds low-precision working weights;
:func:`warmup_cosine_lr` is the learning-rate schedule of the training scripts."""

from effdl.optim.offload import CPUOffloadAdam, CPUOffloadAdamW
from effdl.optim.schedule import warmup_cosine_lr

__all__ = ["CPUOffloadAdam", "CPUOffloadAdamW", "warmup_cosine_lr"]
