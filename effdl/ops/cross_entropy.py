"""Summed cross-entropy of half-precision logits without an fp32 copy of all of them.

``F.cross_entropy(logits.float(), ...)`` keeps an fp32 ``tokens x vocab`` log-softmax for
backward and builds an fp32 gradient of the same size: at a 128k vocabulary that is 4 GiB per
8k tokens each, more than the bf16 logits themselves. Here the softmax is recomputed in
backward instead, in fp32, from the logits in their own dtype:

- on CUDA, Triton kernels (:mod:`effdl.ops.cross_entropy_triton`) read each row once in
  forward and once in backward, writing only the gradient;
- elsewhere (the CPU, fp64, no Triton), torch ops take the tokens a chunk at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from effdl.ops import cross_entropy_triton
except ImportError:  # CPU-only installs: the torch path serves every input
    cross_entropy_triton = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def uses_triton(logits: Tensor) -> bool:
    """True where :func:`cross_entropy_sum` runs the Triton kernels: a CUDA tensor of fp16,
    bf16 or fp32 with Triton installed."""
    return logits.is_cuda and logits.dtype in TRITON_DTYPES and cross_entropy_triton is not None


class _CrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy of ``logits`` (N, V) against ``labels`` (N,)."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, chunk: int, ignore: int) -> Tensor:
        ctx.chunk, ctx.ignore, ctx.triton = chunk, ignore, uses_triton(logits)
        if ctx.triton:
            logits = logits.contiguous()
            loss, lse = cross_entropy_triton.forward(logits, labels, ignore)
            ctx.save_for_backward(logits, labels, lse)
            return loss.sum()
        counted = labels[labels != ignore]
        if len(counted) and (counted.min() < 0 or counted.max() >= logits.shape[1]):
            raise ValueError(
                f"labels must be in [0, {logits.shape[1]}) or {ignore}; got "
                f"{counted.min().item()} to {counted.max().item()}"
            )
        acc = torch.promote_types(logits.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            lab = labels[s : s + chunk]
            logp = F.log_softmax(logits[s : s + chunk], dim=1, dtype=acc)
            picked = logp.gather(1, lab.clamp(min=0).unsqueeze(1)).squeeze(1)
            total -= (picked * (lab != ignore)).sum()
        ctx.save_for_backward(logits, labels)
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        if ctx.triton:
            logits, labels, lse = ctx.saved_tensors
            grad = cross_entropy_triton.backward(logits, labels, lse, grad_out, ctx.ignore)
            return grad, None, None, None
        logits, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            lab = labels[s : s + ctx.chunk]
            target = lab.clamp(min=0).unsqueeze(1)
            # d(sum of losses)/d(logits) = softmax - onehot, zero on ignored tokens
            probs = torch.softmax(logits[s : s + ctx.chunk], dim=1, dtype=grad_out.dtype)
            probs.scatter_add_(1, target, -torch.ones_like(target, dtype=probs.dtype))
            row_scale = (lab != ctx.ignore).unsqueeze(1) * grad_out
            torch.mul(probs, row_scale, out=grad[s : s + ctx.chunk])
        return grad, None, None, None


def cross_entropy_sum(
    logits: Tensor, labels: Tensor, chunk_tokens: int = 2048, ignore: int = -100
) -> Tensor:
    """Summed cross-entropy of ``logits`` (N, V) against ``labels`` (N,) int64, skipping
    ``ignore``; softmax and sums in fp32 at least (fp64 for fp64 logits), the gradient in the
    logits' dtype. Extra memory: N fp32 values on CUDA, one ``chunk_tokens x V`` fp32 chunk
    on the torch path. A label outside ``[0, V)`` (not ``ignore``) is a ValueError on the
    torch path and makes the loss NaN in the Triton kernels (checking would wait for the GPU)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return _CrossEntropySum.apply(logits, labels, chunk_tokens, ignore)
