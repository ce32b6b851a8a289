"""Precision setups for experiments: which autocast wraps the forward, which scaler the backward.

A setup is a pair (autocast: none | torch | own, scaler: none | torch | static | dynamic), so a
training loop is written once::

    prec = build_precision(PrecisionSpec("own", "dynamic"), device, torch.float16)
    with prec.autocast():
        loss = loss_fn(model(x), y)
    prec.backward(loss)
    prec.step(optimizer)
    scale, skipped = prec.scale_and_skipped()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from effdl.amp.autocast import Autocast
from effdl.amp.scaler import DynamicGradScaler, StaticGradScaler

LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
AUTOCASTS = ("none", "torch", "own")
SCALERS = ("none", "torch", "static", "dynamic")


@dataclass(frozen=True)
class PrecisionSpec:
    autocast: str = "none"
    scaler: str = "none"

    def __post_init__(self) -> None:
        if self.autocast not in AUTOCASTS:
            raise ValueError(f"autocast must be one of {AUTOCASTS}, got {self.autocast!r}")
        if self.scaler not in SCALERS:
            raise ValueError(f"scaler must be one of {SCALERS}, got {self.scaler!r}")


@dataclass
class Precision:
    """A built setup: ``autocast()`` returns a fresh context; ``scaler`` has the GradScaler API
    (a disabled one when the spec has no scaler, so the loop needs no branches).
    ``last_scale``: torch's scaler's scale before the step that :meth:`scale_and_skipped`
    reports on next (its initial scale at first)."""

    spec: PrecisionSpec
    autocast: Callable[[], AbstractContextManager]
    scaler: Any
    last_scale: float = 1.0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the scaled loss: the gradients come out multiplied by the scale."""
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale, step ``optimizer`` unless a gradient is inf/NaN, then adjust the scale."""
        self.scaler.step(optimizer)
        self.scaler.update()

    def scale_and_skipped(self) -> tuple[float, bool]:
        """After ``update()``: the scale for the next step and whether this step was skipped.

        torch's scaler keeps no skip flag; it backs off exactly when it skips, so a smaller
        scale means a skipped step (its ``get_scale()`` is a host sync; ours are not).
        """
        if isinstance(self.scaler, torch.amp.GradScaler):
            scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
            skipped = scale < self.last_scale
            self.last_scale = scale
            return scale, skipped
        return self.scaler.get_scale(), bool(getattr(self.scaler, "last_found_inf", False))


def build_precision(
    spec: PrecisionSpec,
    device: torch.device,
    dtype: torch.dtype = torch.float16,
    *,
    static_scale: float = 2.0**16,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
) -> Precision:
    """Build ``spec`` for ``device`` with low-precision ``dtype``.

    ``static_scale`` is the StaticGradScaler's factor; ``init_scale`` and ``growth_interval``
    configure both dynamic scalers (torch's and ours) identically.
    """
    dev = device.type
    if spec.autocast == "torch":
        autocast: Callable[[], AbstractContextManager] = lambda: torch.autocast(dev, dtype)  # noqa: E731
    elif spec.autocast == "own":
        autocast = lambda: Autocast(dev, dtype)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    if spec.scaler == "torch":
        scaler: Any = torch.amp.GradScaler(
            dev, init_scale=init_scale, growth_interval=growth_interval
        )
    elif spec.scaler == "static":
        scaler = StaticGradScaler(static_scale)
    elif spec.scaler == "dynamic":
        scaler = DynamicGradScaler(init_scale, growth_interval=growth_interval)
    else:
        scaler = StaticGradScaler(enabled=False)
    last_scale = init_scale if spec.scaler == "torch" else 1.0
    return Precision(spec, autocast, scaler, last_scale)


PRECISION_NAMES = ("bf16", "fp16", "tf32", "fp32")


def forward_precision(device: torch.device, name: str) -> Callable[[], AbstractContextManager]:
    """A factory of the context for a forward pass in precision ``name`` on ``device``.

    ``"bf16"``/``"fp16"``: ``torch.autocast`` to that dtype; ``"tf32"``/``"fp32"``: no autocast,
    with TF32 matmuls switched on for ``"tf32"`` and off otherwise (a process-wide setting).
    """
    if name not in PRECISION_NAMES:
        raise ValueError(f"precision must be one of {PRECISION_NAMES}, got {name!r}")
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    low = LOW_DTYPES.get(name)
    if low is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=low)
