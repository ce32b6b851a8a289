"""Triton kernels of the summed cross-entropy (CUDA only): one program per token row.

Forward reads each row of logits once (an online max and sum of exponentials in fp32) and
writes the row's loss and log-sum-exp; backward reads the row once more and writes its
gradient ``(softmax - onehot) * scale`` in the logits' dtype. No ``tokens x vocab`` buffer
besides the gradient itself is ever allocated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries per step of a row's loop
NUM_WARPS = 8


@triton.jit
def _forward_kernel(
    logits_ptr, labels_ptr, loss_ptr, lse_ptr, V, stride, ignore, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    label = tl.load(labels_ptr + row)
    valid = label != ignore
    in_range = (label >= 0) & (label < V)
    picked = tl.load(base + tl.where(valid & in_range, label, 0)).to(tl.float32)
    loss = tl.where(valid, lse - picked, 0.0)
    # a label outside the vocabulary makes the loss NaN instead of reading past the row
    tl.store(loss_ptr + row, tl.where(valid & ~in_range, float("nan"), loss))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _backward_kernel(
    logits_ptr, labels_ptr, lse_ptr, scale_ptr, grad_ptr, V, stride, grad_stride, ignore,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.where(label != ignore, tl.load(scale_ptr).to(tl.float32), 0.0)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse) - tl.where(offs == label, 1.0, 0.0)
        out = grad_ptr + row * grad_stride + offs
        tl.store(out, (p * scale).to(grad_ptr.dtype.element_ty), mask=mask)


def forward(logits: torch.Tensor, labels: torch.Tensor, ignore: int, block: int = BLOCK):
    """Per-row losses and log-sum-exps (fp32, (N,) each) of ``logits`` (N, V), rows contiguous."""
    n, v = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    if n:
        _forward_kernel[(n,)](
            logits, labels, loss, lse, v, logits.stride(0), ignore, BLOCK=block, num_warps=NUM_WARPS
        )
    return loss, lse


def backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    ignore: int,
    block: int = BLOCK,
) -> torch.Tensor:
    """The gradient of ``scale`` (a 0-d tensor) times the summed loss w.r.t. ``logits``."""
    n, v = logits.shape
    grad = torch.empty_like(logits)
    if n:
        _backward_kernel[(n,)](
            logits, labels, lse, scale, grad, v, logits.stride(0), grad.stride(0), ignore,
            BLOCK=block, num_warps=NUM_WARPS,
        )  # fmt: skip
    return grad
