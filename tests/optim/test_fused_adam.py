"""fused_adam_ against torch.optim.Adam/AdamW(fused=True), bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from effdl.optim.fused_adam import fused_adam_

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}
SHAPES = [(7,), (3, 5), (2048 + 3,)]


@pytest.mark.parametrize("adamw", [False, True])
def test_matches_torch_fused_adam_over_several_steps(adamw: bool) -> None:
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    ref_params = [nn.Parameter(p.clone()) for p in params]
    torch_adam = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = torch_adam(ref_params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                     eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], fused=True)  # fmt: skip
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]
    for _ in range(3):
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        for p, grad in zip(ref_params, grads, strict=True):
            p.grad = grad
        ref.step()
        fused_adam_(params, grads, exp_avgs, exp_avg_sqs, steps, adamw=adamw, **HYPER)
    for i, p in enumerate(ref_params):
        state = ref.state[p]
        assert torch.equal(params[i], p)
        assert torch.equal(exp_avgs[i], state["exp_avg"])
        assert torch.equal(exp_avg_sqs[i], state["exp_avg_sq"])
        assert steps[i].item() == state["step"].item() == 3
