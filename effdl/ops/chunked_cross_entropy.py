"""Summed cross-entropy of half-precision logits without an fp32 copy of all of them.

``F.cross_entropy(logits.float(), ...)`` keeps an fp32 ``tokens x vocab`` log-softmax for
backward and builds an fp32 gradient of the same size: at a 128k vocabulary that is 4 GiB per
8k tokens each, more than the bf16 logits themselves. Here the softmax runs in fp32 one chunk of
tokens at a time; forward keeps only the per-token log-sum-exp, backward recomputes each chunk's
softmax from the logits and writes the gradient straight in the logits' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _CrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy of ``logits`` (N, V) against ``labels`` (N,), softmax in chunks."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, chunk: int, ignore: int) -> Tensor:
        acc = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(logits.shape[0], dtype=acc, device=logits.device)
        total = torch.zeros((), dtype=acc, device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            x, lab = logits[s : s + chunk].to(acc), labels[s : s + chunk]
            lse[s : s + chunk] = torch.logsumexp(x, dim=1)
            picked = x.gather(1, lab.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((lse[s : s + chunk] - picked) * (lab != ignore)).sum()
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk, ctx.ignore = chunk, ignore
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            lab = labels[s : s + ctx.chunk]
            valid = (lab != ctx.ignore).unsqueeze(1)
            # d(sum of losses)/d(logits) = softmax - onehot on the labels that count; an
            # ignored token's log-sum-exp is made infinite so that its softmax row is zero
            lse_rows = lse[s : s + ctx.chunk, None].masked_fill(~valid, float("inf"))
            probs = torch.sub(logits[s : s + ctx.chunk], lse_rows).exp_()  # fp32 at least
            probs.scatter_add_(1, lab.clamp(min=0).unsqueeze(1), -valid.to(probs.dtype))
            torch.mul(probs, grad_out, out=grad[s : s + ctx.chunk])
        return grad, None, None, None


def cross_entropy_sum(
    logits: Tensor, labels: Tensor, chunk_tokens: int = 2048, ignore: int = -100
) -> Tensor:
    """Summed cross-entropy of ``logits`` (N, V) against ``labels`` (N,) int64, skipping
    ``ignore``; softmax and sums in fp32 at least (fp64 for fp64 logits), the gradient in the
    logits' dtype. Extra memory: one ``chunk_tokens x V`` fp32 chunk and N fp32 log-sum-exps."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return _CrossEntropySum.apply(logits, labels, chunk_tokens, ignore)
