"""Summed cross-entropy of half-precision logits without an fp32 copy of all of them.

``F.cross_entropy(logits.float(), ...)`` keeps an fp32 ``tokens x vocab`` log-softmax for
backward and builds an fp32 gradient of the same size: at a 128k vocabulary that is 4 GiB per
8k tokens each, more than the bf16 logits themselves. Here the softmax runs in fp32 one chunk of
tokens at a time, each chunk read in the logits' dtype by one fused kernel; forward keeps nothing
but the logits and labels, backward recomputes each chunk's softmax and writes the gradient
straight in the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class _CrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy of ``logits`` (N, V) against ``labels`` (N,), softmax in chunks."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, chunk: int, ignore: int) -> Tensor:
        acc = torch.promote_types(logits.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            lab = labels[s : s + chunk]
            # one kernel: reads the chunk in its dtype, writes fp32 log-probabilities
            logp = F.log_softmax(logits[s : s + chunk], dim=1, dtype=acc)
            picked = logp.gather(1, lab.clamp(min=0).unsqueeze(1)).squeeze(1)
            total -= (picked * (lab != ignore)).sum()
        ctx.save_for_backward(logits, labels)
        ctx.chunk, ctx.ignore, ctx.acc = chunk, ignore, acc
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            lab = labels[s : s + ctx.chunk]
            target = lab.clamp(min=0).unsqueeze(1)
            # d(sum of losses)/d(logits) = softmax - onehot, zero on ignored tokens
            probs = torch.softmax(logits[s : s + ctx.chunk], dim=1, dtype=ctx.acc)
            probs.scatter_add_(1, target, -torch.ones_like(target, dtype=ctx.acc))
            row_scale = (lab != ctx.ignore).unsqueeze(1) * grad_out
            torch.mul(probs, row_scale, out=grad[s : s + ctx.chunk])
        return grad, None, None, None


def cross_entropy_sum(
    logits: Tensor, labels: Tensor, chunk_tokens: int = 2048, ignore: int = -100
) -> Tensor:
    """Summed cross-entropy of ``logits`` (N, V) against ``labels`` (N,) int64, skipping
    ``ignore``; softmax and sums in fp32 at least (fp64 for fp64 logits), the gradient in the
    logits' dtype. Extra memory: one ``chunk_tokens x V`` fp32 chunk."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return _CrossEntropySum.apply(logits, labels, chunk_tokens, ignore)
