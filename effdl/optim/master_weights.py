"""Low-precision working weights trained through flat fp32 master weights on the same device.

The mixed-precision recipe of Micikevicius et al. (2018) without autocast: the model's
parameters *are* bf16, so the forward and backward read them as they are; the optimizer owns an
fp32 master copy of each, sums each micro-batch's gradient into an fp32 buffer, updates the
masters, and rounds them into the working weights once per step. With ``torch.optim.AdamW``
the clipping scale, the update and that rounding are one pass over memory
(:mod:`effdl.ops.fused_adamw`); other optimizers run their own ``step`` and a copy. Unlike
autocast over fp32 parameters, no weight is cast in every forward, no weight gradient is cast
back to fp32 before a separate add, and the residual stream stays bf16.

Masters, gradient sums and working weights are each one flat buffer per parameter group (as
Megatron-LM's contiguous gradient buffer), every parameter a view into them, so the update, a
gradient norm and the copy into the model are a few kernels over contiguous memory instead of
one launch per parameter. This is exact for optimizers that act element by element (SGD, Adam,
AdamW...), not for ones with per-tensor statistics (LAMB, Adafactor).

A post-accumulate-grad hook adds each working gradient into its slice of the fp32 sum as soon
as autograd has it (:mod:`effdl.ops.fp32_accumulate`) and frees it, so the device holds at most
one parameter's bf16 gradient at a time. Not for DDP or FSDP, which own ``.grad`` of the working
parameters (FSDP2's ``MixedPrecisionPolicy`` is their form of this).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from effdl.amp.grads import total_norm
from effdl.ops.fp32_accumulate import accumulate_fp32_
from effdl.ops.fused_adamw import adamw_step_


class MasterWeights:
    """fp32 masters, fp32 gradient sums and the update for ``model``'s low-precision parameters.

    ``MasterWeights(model, make_optimizer, dtype=torch.bfloat16)`` takes every parameter that
    requires grad (build the model in fp32, so the masters start exact) and calls
    ``make_optimizer(params)`` on them: the optimizer it returns, with its parameter groups and
    their hyper-parameters (weight decay rules, learning rates), then has each group's
    parameters replaced by one flat fp32 master, before its first step. The model's parameters
    become ``dtype`` views into flat working buffers.

    Per step: any number of ``backward()`` calls (micro-batches; the gradients add up in fp32),
    then :meth:`step` (updates the masters, copies them into the model) and :meth:`zero_grad`.
    :attr:`masters` (the flat fp32 buffers) carry the step's gradients in ``.grad``; clip with
    :meth:`clip_grad_norm_` before :meth:`step`. A parameter that got no gradient in a step is
    updated with a zero gradient (torch's optimizers skip it). Frozen floating-point parameters
    are cast to ``dtype`` (the forward then runs in one dtype) and have no master.
    :meth:`state_dict` holds the fp32 masters and the optimizer's state, so a resumed run
    continues exactly where it stopped.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[list[Tensor]], torch.optim.Optimizer],
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not callable(make_optimizer):
            raise TypeError(f"make_optimizer must be callable, got {type(make_optimizer).__name__}")
        working = [p for p in model.parameters() if p.requires_grad]
        if not working:
            raise ValueError("the model has no parameter that requires grad")
        for p in working:
            if p.dtype != torch.float32:
                raise ValueError(
                    f"a parameter is {p.dtype}: build the model in float32 so that its "
                    "masters start exact"
                )
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(dtype)
        self.masters: list[Tensor] = []
        self._working_flat: list[Tensor] = []
        self._grads: list[Tensor] = []  # per working parameter, its slice of the fp32 sum
        self._fresh: set[int] = set()  # the parameters whose slice holds this step's sum
        self._hooks = []
        optimizer = make_optimizer(working)
        for group in optimizer.param_groups:
            params = group["params"]
            parts = [p.detach().reshape(-1) for p in params]
            master = (torch.cat(parts) if parts else working[0].new_zeros(0)).requires_grad_()
            master.grad = torch.zeros_like(master)
            flat = master.detach().to(dtype)
            offset = 0
            for p in params:
                n = p.numel()
                p.data = flat[offset : offset + n].view_as(p)
                self._grads.append(master.grad[offset : offset + n].view_as(p))
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(self._adder(len(self._hooks)))
                )
                offset += n
            self.masters.append(master)
            self._working_flat.append(flat)
            group["params"] = [master]  # before any step: the optimizer holds no state yet
        if len(self._hooks) != len(working):
            raise ValueError(
                f"make_optimizer left {len(working) - len(self._hooks)} of the model's "
                f"{len(working)} trainable parameters out of its groups"
            )
        self.optimizer = optimizer
        # torch.optim.AdamW in its plain form: its update runs as one pass with the clipping
        # scale and the copy into the model (effdl.ops.fused_adamw); any other optimizer steps
        # itself.
        self._adamw = type(optimizer) is torch.optim.AdamW and not any(
            g["amsgrad"] or g["maximize"] or g["capturable"] or g["differentiable"]
            for g in optimizer.param_groups
        )
        self._grad_scale: Tensor | None = None

    def _adder(self, i: int) -> Callable[[Tensor], None]:
        """The hook that adds parameter ``i``'s fresh gradient into its fp32 slice (the step's
        first one overwrites what the last step left)."""
        grad, fresh = self._grads[i], self._fresh

        def add(p: Tensor) -> None:
            accumulate_fp32_(grad, p.grad, overwrite=i not in fresh)
            fresh.add(i)
            p.grad = None

        return add

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (set ``lr`` here for a schedule)."""
        return self.optimizer.param_groups

    def _complete_sums(self) -> None:
        """Zero the slices of the parameters that got no gradient this step."""
        for i, grad in enumerate(self._grads):
            if i not in self._fresh:
                grad.zero_()
                self._fresh.add(i)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the summed gradients: returns their total L2
        norm; the scaling by ``min(1, max_norm / (norm + 1e-6))`` is applied by the next
        :meth:`step` (inside the update's own pass for AdamW)."""
        self._complete_sums()
        norm = total_norm([m.grad for m in self.masters])
        self._grad_scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        return norm

    @torch.no_grad()
    def step(self) -> None:
        """Update the masters from their summed gradients and round them into the model."""
        self._complete_sums()
        if self._adamw:
            self._adamw_step()
        else:
            if self._grad_scale is not None:
                for master in self.masters:
                    master.grad.mul_(self._grad_scale)
            self.optimizer.step()
            for working, master in zip(self._working_flat, self.masters, strict=True):
                working.copy_(master)
        self._grad_scale = None

    def _adamw_step(self) -> None:
        """torch.optim.AdamW's update, its state kept in the optimizer's own layout."""
        groups = zip(self.optimizer.param_groups, self.masters, self._working_flat, strict=True)
        for group, master, working in groups:
            state = self.optimizer.state[master]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(master)
                state["exp_avg_sq"] = torch.zeros_like(master)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            adamw_step_(
                master.detach(), master.grad, state["exp_avg"], state["exp_avg_sq"], working,
                step=int(state["step"]), lr=group["lr"], beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=self._grad_scale,
            )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The fp32 masters (copies) and the optimizer's state; the working weights are their
        rounding and the gradient sums start afresh each step, so neither is saved."""
        return {
            "optimizer_class": type(self.optimizer).__name__,
            "masters": [m.detach().clone() for m in self.masters],
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s masters and optimizer state and round the masters into
        the model. Raises ValueError if the optimizer class or the masters' shapes differ."""
        saved_class, mine = state.get("optimizer_class"), type(self.optimizer).__name__
        if saved_class != mine:
            raise ValueError(f"the state is of a {saved_class} optimizer, this one is a {mine}")
        saved = state["masters"]
        shapes = [tuple(m.shape) for m in self.masters]
        if [tuple(m.shape) for m in saved] != shapes:
            raise ValueError(
                f"saved masters of shapes {[tuple(m.shape) for m in saved]} do not match this "
                f"model's {shapes}"
            )
        for master, working, value in zip(self.masters, self._working_flat, saved, strict=True):
            master.copy_(value)
            working.copy_(master)
        self.optimizer.load_state_dict(state["optimizer"])

    def zero_grad(self) -> None:
        """Start a new gradient sum (the next micro-batch's gradients overwrite the buffers)."""
        self._fresh.clear()

    def close(self) -> None:
        """Remove the gradient hooks (the model then trains its ``dtype`` weights directly)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
