"""Learning-rate schedules shared by the training scripts."""

from __future__ import annotations

import math


def warmup_cosine_lr(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """The learning rate of ``step`` (0-based): a linear warm-up to ``lr`` over ``warmup`` steps
    (step 0 gets ``lr / warmup``: no step trains at zero), then a cosine from ``lr`` down to
    ``min_lr`` at the last step (``steps - 1``). Refuses a schedule that cannot be followed:
    no steps, a negative warm-up or step, a non-finite or negative rate."""
    if steps < 1 or warmup < 0 or not step >= 0:
        raise ValueError(f"need steps >= 1, warmup >= 0 and step >= 0, got steps={steps}, "
                         f"warmup={warmup}, step={step}")  # fmt: skip
    if not (math.isfinite(lr) and math.isfinite(min_lr) and 0 <= min_lr <= lr):
        raise ValueError(f"need finite 0 <= min_lr <= lr, got lr={lr}, min_lr={min_lr}")
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
