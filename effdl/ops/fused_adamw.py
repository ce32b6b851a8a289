"""One AdamW step over flat fp32 masters that also scales the gradient and writes the working copy.

With flat fp32 masters (:mod:`effdl.optim.master_weights`) a step is: scale the gradients by the
clipping coefficient, the AdamW update, and the rounding of the masters into the low-precision
working weights. torch does these as three passes (``_foreach_mul_``, the fused AdamW kernel,
a copy); here they are one pass: per element it reads the master, the gradient and both
moments (16 B) and writes the master, the moments and the working copy (12 B + 2 B for bf16):
30 B per parameter, the floor for this update.

The arithmetic is ``torch.optim.AdamW``'s (decoupled weight decay, bias corrections, ``eps``
added to the bias-corrected RMS), in fp32; results agree with torch to rounding, not bit for bit.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path serves every input
    triton = None

BLOCK = 2048  # elements per program


if triton is not None:

    @triton.jit
    def _adamw_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, scale_ptr, n,
        decay, beta1, beta2, step_size, bc2_sqrt, eps,
        HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        g = tl.load(g_ptr + offsets, mask=mask)
        if HAS_SCALE:
            g = g * tl.load(scale_ptr)
        p = tl.load(p_ptr + offsets, mask=mask) * decay
        m = tl.load(m_ptr + offsets, mask=mask)
        v = tl.load(v_ptr + offsets, mask=mask)
        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + offsets, p, mask=mask)
        tl.store(m_ptr + offsets, m, mask=mask)
        tl.store(v_ptr + offsets, v, mask=mask)
        tl.store(w_ptr + offsets, p.to(w_ptr.dtype.element_ty), mask=mask)


def uses_triton(*tensors: torch.Tensor) -> bool:
    """Whether :func:`adamw_step_` runs the Triton kernel: triton imports and every tensor is a
    contiguous CUDA tensor."""
    return triton is not None and all(t.is_cuda and t.is_contiguous() for t in tensors)


def adamw_step_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    working: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """AdamW step number ``step`` (counted from 1) on fp32 ``master`` with fp32 ``grad`` times
    ``grad_scale`` (a one-element fp32 tensor, or None), in place on ``master``, ``exp_avg`` and
    ``exp_avg_sq``; ``working`` (any float dtype) receives the new master. All of one shape.
    ``grad`` itself is not changed."""
    decay = 1.0 - lr * weight_decay
    step_size = lr / (1.0 - beta1**step)
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    if uses_triton(master, grad, exp_avg, exp_avg_sq, working):
        n = master.numel()
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            master, grad, exp_avg, exp_avg_sq, working,
            grad_scale if grad_scale is not None else master, n,
            decay, beta1, beta2, step_size, bc2_sqrt, eps,
            HAS_SCALE=grad_scale is not None, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip
        return
    g = grad * grad_scale if grad_scale is not None else grad
    master.mul_(decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    master.addcdiv_(exp_avg, exp_avg_sq.sqrt().div_(bc2_sqrt).add_(eps), value=-step_size)
    working.copy_(master)
