"""Low-precision working weights trained through fp32 master weights on the same device.

The mixed-precision recipe of Micikevicius et al. (2018) without autocast: the model's
parameters *are* bf16, so the forward and backward read them as they are; the optimizer owns an
fp32 master copy of each, sums each micro-batch's gradient into an fp32 buffer, updates the
masters, and rounds them into the working weights once per step.

Why not autocast over fp32 parameters: autocast casts every weight to bf16 in every forward
(6 B of traffic per parameter per micro-batch), autograd casts each bf16 weight gradient back
to fp32 (6 B more) before adding it to ``.grad`` (12 B), and the embedding's fp32 output keeps
the whole residual stream in fp32. Here a micro-batch costs one fp32 add of the bf16 gradient
(10 B per parameter; the first micro-batch of a step a cast, 6 B), the step one bf16 copy of the
masters (6 B), and the residual stream is bf16. The update itself is unchanged: the same
optimizer on the same fp32 values as with fp32 parameters.

A post-accumulate-grad hook moves each working gradient into its master's ``.grad`` as soon as
autograd has it and frees it, so the device never holds more than one parameter's bf16
gradient at a time. Not for DDP or FSDP, which own ``.grad`` of the working parameters (FSDP2's
``MixedPrecisionPolicy`` is their form of this).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


class MasterWeights:
    """fp32 masters, fp32 gradient sums and the update for ``model``'s low-precision parameters.

    ``MasterWeights(model, make_optimizer, dtype=torch.bfloat16)`` copies every parameter that
    requires grad to an fp32 master, then turns the parameter itself into ``dtype`` in place (so
    build the model in fp32: the masters start exact). ``make_optimizer(masters)`` gets the list
    of masters in ``model.parameters()`` order and returns a ``torch.optim.Optimizer`` over them
    (its parameter groups are the place for weight decay rules and learning rates).

    Per step: any number of ``backward()`` calls (micro-batches; the gradients add up in fp32),
    then :meth:`step` (updates the masters, copies them into the model) and :meth:`zero_grad`.
    Clip with ``torch.nn.utils.clip_grad_norm_(masters.masters, ...)`` before :meth:`step`.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[list[Tensor]], torch.optim.Optimizer],
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.working = [p for p in model.parameters() if p.requires_grad]
        if not self.working:
            raise ValueError("the model has no parameter that requires grad")
        for p in self.working:
            if p.dtype != torch.float32:
                raise ValueError(
                    f"a parameter is {p.dtype}: build the model in float32 so that its "
                    "masters start exact"
                )
        self.masters = [p.detach().clone().requires_grad_() for p in self.working]
        with torch.no_grad():
            for p in self.working:
                p.data = p.data.to(dtype)
        self.optimizer = make_optimizer(self.masters)
        self._hooks = [
            p.register_post_accumulate_grad_hook(_grad_mover(m))
            for p, m in zip(self.working, self.masters, strict=True)
        ]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (set ``lr`` here for a schedule)."""
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        """Update the masters from their summed gradients and round them into the model."""
        self.optimizer.step()
        torch._foreach_copy_(self.working, self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the summed gradients (the next micro-batch starts a new sum)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Remove the gradient hooks (the model then trains its ``dtype`` weights directly)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _grad_mover(master: Tensor) -> Callable[[Tensor], None]:
    """The hook that adds a working parameter's fresh gradient to ``master.grad`` in fp32."""

    def move(p: Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.to(torch.float32)
        else:
            master.grad.add_(p.grad)
        p.grad = None

    return move
