"""Loss scaling for fp16 mixed-precision training: a fixed scale and a dynamic one.

Small gradients underflow to zero in fp16. Multiplying the loss by a scale ``S`` before
``backward()`` multiplies every gradient by ``S`` and lifts them into fp16's range; dividing the
gradients by ``S`` afterwards (in their own dtype, usually fp32 master parameters) restores their
true values before the optimizer sees them. A step whose gradients contain inf/NaN (``S`` too
large) is skipped.

Both classes follow the ``torch.amp.GradScaler`` protocol, so a training loop written for torch's
scaler runs unchanged::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)        # optional: clip true gradients here
    scaler.step(optimizer)            # skipped when any gradient is inf/NaN
    scaler.update()

Cost per step: the scale is a 0-dim fp32 tensor on the loss's device (so ``scale`` never syncs)
mirrored by a host float (so ``get_scale`` and ``update`` never sync); ``unscale_`` is one
foreach max-norm plus one foreach multiply per (device, dtype) bucket; ``step`` reads the
overflow flag once (the one host sync per step, which deciding whether to call
``optimizer.step()`` needs; torch's scaler has the same one).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from effdl.amp.grads import grads_of, unscale_and_check_

FP32_MAX = float(np.finfo(np.float32).max)
# Below fp16's smallest subnormal, a scale flushes every fp16 gradient of magnitude <= 1 to zero:
# searching lower finds nothing, and a scale that reaches 0 would hide the NaN of 0 * inf.
DEFAULT_MIN_SCALE = 2.0**-24


def _as_fp32(x: float) -> float:
    """Round to the nearest float32 (the scale lives in an fp32 tensor, as in torch)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    found_inf: Tensor | None = None  # 0-dim bool on the device, set by unscale_
    found_inf_host: bool | None = None  # read back by step(): the one sync


class _LossScaler:
    """What both scalers share: scaling outputs, unscaling and checking grads, skipping steps.

    Subclasses decide the next scale from the step's overflow flag in :meth:`_next_scale`.
    With ``enabled=False`` every method is a pass-through (``step`` just calls
    ``optimizer.step()``), so one loop serves fp32 and AMP runs.
    """

    def __init__(self, init_scale: float, enabled: bool = True) -> None:
        _check_scale("init_scale", init_scale)
        self.enabled = enabled
        self._scale_value = _as_fp32(init_scale)
        self._scale: Tensor | None = None  # device copy, created on the first scale()
        self._per_optimizer: dict[int, _OptimizerState] = {}
        self.steps = 0  # update() calls
        self.skipped_steps = 0  # update() calls that saw an inf/NaN gradient
        self.last_found_inf = False

    # ---- the GradScaler protocol -------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``outputs * scale`` for a tensor or a (nested) list/tuple of tensors.

        The factor is a 0-dim fp32 tensor, so a 0-dim fp16 loss is promoted to fp32 (as with
        torch's scaler) instead of overflowing in fp16.
        """
        if not self.enabled:
            return outputs
        if isinstance(outputs, Tensor):
            return outputs * self._scale_on(outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"scale() expects a tensor or a list/tuple of tensors, got {type(outputs)}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place, and record
        (on the device, no sync) whether any was inf/NaN. At most once per optimizer per step.
        """
        if not self.enabled:
            return
        state = self._per_optimizer.setdefault(id(optimizer), _OptimizerState())
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()"
            )
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step()")
        params = (p for group in optimizer.param_groups for p in group["params"])
        inv_scale = 1.0 / self._scale_value if self._scale_value > 0 else math.inf
        state.found_inf = unscale_and_check_(grads_of(params), inv_scale)
        state.stage = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done already) and call ``optimizer.step(*args, **kwargs)`` unless a
        gradient was inf/NaN. Returns what ``optimizer.step`` returned, or None when skipped.
        """
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("closure use is not supported: step() must see the gradients first")
        state = self._per_optimizer.setdefault(id(optimizer), _OptimizerState())
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update()")
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        if state.found_inf is None:
            raise RuntimeError("no gradients were found for this optimizer's parameters")
        state.found_inf_host = bool(state.found_inf)  # the step's one host sync
        state.stage = _Stage.STEPPED
        if state.found_inf_host:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """End the step: choose the next scale (or set ``new_scale``) and reset per-step state."""
        if not self.enabled:
            return
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(new_scale, Tensor) else new_scale)
            self._set_scale(value)
        else:
            found = self._found_inf_this_step()
            self.steps += 1
            self.skipped_steps += int(found)
            self.last_found_inf = found
            self._set_scale(self._next_scale(found))
        self._per_optimizer.clear()

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled); a host value, no sync."""
        return self._scale_value if self.enabled else 1.0

    def is_enabled(self) -> bool:
        return self.enabled

    def state_dict(self) -> dict[str, Any]:
        """Scale and counters (empty when disabled, as with torch's scaler)."""
        if not self.enabled:
            return {}
        return {
            "scale": self._scale_value,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            **self._extra_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the values are checked as the constructor
        checks its arguments (ValueError, nothing changed) before any is applied."""
        if not self.enabled:
            return
        if not state_dict:
            raise RuntimeError(
                "the state dict is empty, possibly because it was saved from a disabled scaler"
            )
        try:
            scale = float(state_dict["scale"])
            _check_scale("scale", scale)
            steps = int(state_dict.get("steps", 0))
            skipped = int(state_dict.get("skipped_steps", 0))
            if not 0 <= skipped <= steps:
                raise ValueError(f"need 0 <= skipped_steps <= steps, got {skipped}, {steps}")
            extra = self._checked_extra_state(state_dict, scale)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"invalid scaler state_dict: {e}") from None
        self._set_scale(scale)
        self.steps, self.skipped_steps = steps, skipped
        self._load_extra_state(extra)

    # ---- for subclasses ------------------------------------------------------------------
    def _next_scale(self, found_inf: bool) -> float:
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _checked_extra_state(self, state_dict: dict[str, Any], scale: float) -> dict[str, Any]:
        """The subclass's part of ``state_dict``, validated (ValueError); nothing is set yet."""
        return {}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        pass

    # ---- internals -------------------------------------------------------------------------
    def _scale_on(self, device: torch.device) -> Tensor:
        if self._scale is None or self._scale.device != device:
            # torch.full launches a fill kernel: no host-to-device copy, no sync.
            self._scale = torch.full((), self._scale_value, dtype=torch.float32, device=device)
        return self._scale

    def _set_scale(self, value: float) -> None:
        value = _as_fp32(value)
        if value != self._scale_value and self._scale is not None:
            self._scale.fill_(value)
        self._scale_value = value

    def _found_inf_this_step(self) -> bool:
        states = [s for s in self._per_optimizer.values() if s.found_inf is not None]
        if not states:
            raise RuntimeError("no inf checks were recorded prior to update()")
        if any(s.found_inf_host for s in states):
            return True
        unread = [s.found_inf for s in states if s.found_inf_host is None]
        if not unread:
            return False
        # Optimizers that were unscaled but not stepped: read their flags with one sync.
        home = unread[0].device
        return bool(torch.stack([f.to(home) for f in unread]).any())


class StaticGradScaler(_LossScaler):
    """Loss scaling with one fixed factor for the whole run.

    Steps whose gradients contain inf/NaN are still skipped (and counted in
    ``skipped_steps``), but the scale never changes; pick it so that overflows are rare
    (2**10 .. 2**16 for typical fp16 training).
    """

    def __init__(self, scale: float = 2.0**16, enabled: bool = True) -> None:
        super().__init__(scale, enabled)

    def _next_scale(self, found_inf: bool) -> float:
        return self._scale_value


class DynamicGradScaler(_LossScaler):
    """Loss scaling that searches for the largest scale that does not overflow.

    After an overflow the scale is multiplied by ``backoff_factor`` (and the step skipped);
    after ``growth_interval`` consecutive clean steps it is multiplied by ``growth_factor``.
    Defaults and the update rule are torch.amp.GradScaler's, so with the defaults the scale
    trajectory is identical to torch's.

    Extensions: ``min_scale``/``max_scale`` clamp the scale (``max_scale=None`` keeps torch's
    rule of not growing past the largest fp32; ``min_scale`` must be positive, default 2**-24,
    so that, unlike torch's, a long run of overflows never drives the scale to 0, where the
    NaN gradients of the next step would go undetected); ``hysteresis=h`` tolerates ``h - 1`` overflows
    before backing off (each still skips its step), and the budget refills whenever the scale
    grows, as in Megatron-LM; ``hysteresis=1`` is torch's behaviour.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = DEFAULT_MIN_SCALE,
        max_scale: float | None = None,
        hysteresis: int = 1,
        enabled: bool = True,
    ) -> None:
        _check_scale("init_scale", init_scale)
        _check_dynamic(
            init_scale, growth_factor, backoff_factor, growth_interval, min_scale, max_scale,
            hysteresis,
        )  # fmt: skip
        super().__init__(init_scale, enabled)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.hysteresis = hysteresis
        self._growth_tracker = 0  # clean steps since the last overflow or growth
        self._hysteresis_left = hysteresis

    def _next_scale(self, found_inf: bool) -> float:
        scale = self._scale_value
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left > 0:
                return scale
            self._hysteresis_left = self.hysteresis
            return max(scale * self.backoff_factor, self.min_scale)
        self._growth_tracker += 1
        if self._growth_tracker < self.growth_interval:
            return scale
        self._growth_tracker = 0
        self._hysteresis_left = self.hysteresis
        grown = scale * self.growth_factor
        if self.max_scale is not None:
            return min(grown, self.max_scale)
        return grown if _as_fp32(grown) <= FP32_MAX else scale

    def _extra_state(self) -> dict[str, Any]:
        return {
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.hysteresis,
            "growth_tracker": self._growth_tracker,
            "hysteresis_left": self._hysteresis_left,
        }

    def _checked_extra_state(self, state_dict: dict[str, Any], scale: float) -> dict[str, Any]:
        hysteresis = int(state_dict.get("hysteresis", 1))
        max_scale = state_dict.get("max_scale")
        extra = {
            "growth_factor": float(state_dict["growth_factor"]),
            "backoff_factor": float(state_dict["backoff_factor"]),
            "growth_interval": int(state_dict["growth_interval"]),
            "min_scale": float(state_dict.get("min_scale", DEFAULT_MIN_SCALE)),
            "max_scale": None if max_scale is None else float(max_scale),
            "hysteresis": hysteresis,
            "growth_tracker": int(state_dict["growth_tracker"]),
            "hysteresis_left": int(state_dict.get("hysteresis_left", hysteresis)),
        }
        _check_dynamic(
            scale, extra["growth_factor"], extra["backoff_factor"], extra["growth_interval"],
            extra["min_scale"], extra["max_scale"], hysteresis, what="scale",
        )  # fmt: skip
        if not 0 <= extra["growth_tracker"] < extra["growth_interval"]:
            raise ValueError(
                f"need 0 <= growth_tracker < growth_interval, got {extra['growth_tracker']}"
            )
        if not 1 <= extra["hysteresis_left"] <= hysteresis:
            raise ValueError(
                f"need 1 <= hysteresis_left <= hysteresis, got {extra['hysteresis_left']}"
            )
        return extra

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        self.growth_factor = extra["growth_factor"]
        self.backoff_factor = extra["backoff_factor"]
        self.growth_interval = extra["growth_interval"]
        self.min_scale = extra["min_scale"]
        self.max_scale = extra["max_scale"]
        self.hysteresis = extra["hysteresis"]
        self._growth_tracker = extra["growth_tracker"]
        self._hysteresis_left = extra["hysteresis_left"]


def _check_scale(name: str, scale: float) -> None:
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"{name} must be positive and finite, got {scale}")


def _check_dynamic(
    scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float,
    max_scale: float | None,
    hysteresis: int,
    what: str = "init_scale",
) -> None:
    """The rules :class:`DynamicGradScaler` holds its settings to (ValueError otherwise)."""
    if not growth_factor > 1.0:  # also refuses NaN
        raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
    if growth_interval < 1 or hysteresis < 1:
        raise ValueError(
            f"growth_interval and hysteresis must be >= 1, got {growth_interval}, {hysteresis}"
        )
    if not (min_scale > 0 and math.isfinite(min_scale)):
        raise ValueError(f"min_scale must be positive and finite, got {min_scale}")
    top = math.inf if max_scale is None else max_scale
    if not min_scale <= scale <= top:
        raise ValueError(
            f"need min_scale <= {what} <= max_scale, got {min_scale}, {scale}, {max_scale}"
        )
