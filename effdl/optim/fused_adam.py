"""torch's fused Adam/AdamW kernel on lists of tensors, through torch's functional optimizer API.

Optimizers that keep their own state (fp32 masters and moments in host buffers, 8-bit moments
dequantized a chunk at a time) still want ``torch.optim.Adam(fused=True)``'s exact arithmetic.
``torch.optim.adam.adam`` and ``torch.optim.adamw.adamw`` run that kernel on tensors the caller
owns, with no ``torch.optim.Optimizer`` object and no ``.grad`` fields.
"""

from __future__ import annotations

from torch import Tensor
from torch.optim.adam import adam
from torch.optim.adamw import adamw as adamw_update


def fused_adam_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    adamw: bool,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One Adam (``adamw=False``) or AdamW step, in place, with torch's fused kernel.

    ``params``, ``grads``, ``exp_avgs`` and ``exp_avg_sqs`` are fp32 tensors, matching shapes per
    parameter; ``steps`` holds one fp32 scalar tensor per parameter on the parameters' device,
    the count of steps taken so far. Each count is incremented, then the update uses it, as
    ``torch.optim.Adam(fused=True)`` does. Mutates ``params``, ``exp_avgs``, ``exp_avg_sqs``
    and ``steps``; no amsgrad, no maximize.
    """
    update = adamw_update if adamw else adam
    update(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        fused=True,
        amsgrad=False,
        maximize=False,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
    )
