"""Cross-entropy of an LM head that never materialises the whole ``tokens x vocab`` logits.

Per chunk of tokens the forward computes the logits, the loss and, right away, the gradients
w.r.t. the hidden states and the head weight (same math and FLOPs as the plain loss); backward
only scales them. GEMMs run in the inputs' dtype, softmax and sums in fp32 (fp64 for fp64
inputs), as Hugging Face's GPT-2 loss does.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _ChunkedLMLoss(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T``; gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int, ignore: int):
        acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax and sums: fp32 at least
        n_valid = (labels != ignore).sum().clamp(min=1)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h, lab = hidden[s : s + chunk], labels[s : s + chunk]
            valid = (lab != ignore).unsqueeze(1)
            target = lab.clamp(min=0).unsqueeze(1)
            logits = (h @ weight.t()).to(acc)
            lse = torch.logsumexp(logits, dim=1, keepdim=True)
            total += ((lse - logits.gather(1, target)) * valid).sum()
            # d(sum of losses)/d(logits) = softmax - onehot, built in place to save memory
            probs = logits.sub_(lse).exp_()
            probs.scatter_add_(1, target, -torch.ones_like(target, dtype=probs.dtype))
            probs.mul_(valid)
            g = probs.to(h.dtype)
            grad_h[s : s + chunk] = g @ weight
            grad_w += (g.t() @ h).to(acc)
        ctx.save_for_backward(grad_h, grad_w, n_valid)
        ctx.weight_dtype = weight.dtype
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w, n_valid = ctx.saved_tensors
        scale = grad_out / n_valid
        return (
            grad_h * scale.to(grad_h.dtype),
            (grad_w * scale).to(ctx.weight_dtype),
            None,
            None,
            None,
        )


def chunked_lm_loss(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int = 1024, ignore: int = -100
) -> Tensor:
    """Mean cross-entropy of logits ``hidden @ weight.T`` against ``labels`` (``ignore`` skipped).

    ``hidden`` (N, d), ``weight`` (V, d), ``labels`` (N,) int64. Peak extra memory is one chunk of
    fp32 logits (``chunk_tokens x V x 4`` bytes) plus an fp32 ``V x d`` weight-gradient buffer,
    instead of ``N x V`` logits kept for backward. The loss is 0 when every label is ``ignore``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return _ChunkedLMLoss.apply(hidden, weight, labels, chunk_tokens, ignore)
