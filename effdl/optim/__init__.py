"""Optimizers: :class:`CPUOffloadAdam` / :class:`CPUOffloadAdamW` keep fp32 master weights and
Adam moments in CPU memory while the device holds low-precision working weights."""

from effdl.optim.offload import CPUOffloadAdam, CPUOffloadAdamW

__all__ = ["CPUOffloadAdam", "CPUOffloadAdamW"]
