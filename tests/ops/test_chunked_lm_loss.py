"""chunked_lm_loss against F.cross_entropy over the full logits, and autograd's gradcheck.

Reference: ``F.cross_entropy`` of the full logits ``hidden @ weight.T`` (upcast to fp32 at least,
as the op's softmax is) with ``ignore_index=-100``; loss and gradients w.r.t. the hidden states
and the head weight are compared.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from effdl.ops.chunked_lm_loss import chunked_lm_loss

N_TOKENS, DIM, VOCAB = 37, 16, 50
# Chunking only reorders the sums; bf16 gradients carry ~3 significant digits.
TOL = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def make_inputs(dtype: torch.dtype, ignored: tuple[int, ...] = (5, 20), seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N_TOKENS, DIM, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(VOCAB, DIM, generator=g, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, VOCAB, (N_TOKENS,), generator=g)
    labels[list(ignored)] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def reference(hidden, weight, labels):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logits = (h @ w.t()).to(torch.promote_types(h.dtype, torch.float32))
    return F.cross_entropy(logits, labels, ignore_index=-100), h, w


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 8, 10, 37, 1024])  # 8, 10 leave a short last chunk
@pytest.mark.parametrize("ignored", [(), (5, 20), (0, 36)])
def test_matches_cross_entropy(dtype, chunk_tokens: int, ignored: tuple[int, ...]) -> None:
    hidden, weight, labels = make_inputs(dtype, ignored)
    loss = chunked_lm_loss(hidden, weight, labels, chunk_tokens=chunk_tokens)
    ref, h, w = reference(hidden, weight, labels)
    (loss * 3).backward()  # a non-unit upstream gradient
    (ref * 3).backward()
    loss_tol = TOL[torch.float64 if dtype == torch.float64 else torch.float32]
    torch.testing.assert_close(loss, ref, **loss_tol)
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    torch.testing.assert_close(hidden.grad, h.grad, **TOL[dtype])
    torch.testing.assert_close(weight.grad, w.grad, **TOL[dtype])


def test_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 6, -100, 3, 3, 1, -100, 5, 2])
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_lm_loss(h, w, labels, chunk_tokens=4), (hidden, weight)
    )


def test_every_label_ignored_gives_zero_loss_and_gradients() -> None:
    hidden, weight, labels = make_inputs(torch.float32, ignored=tuple(range(N_TOKENS)))
    loss = chunked_lm_loss(hidden, weight, labels, chunk_tokens=8)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_other_ignore_index() -> None:
    hidden, weight, labels = make_inputs(torch.float64, ignored=())
    labels[labels == 3] = 7
    loss = chunked_lm_loss(hidden, weight, labels, chunk_tokens=8, ignore=7)
    ref = F.cross_entropy(hidden.detach() @ weight.detach().t(), labels, ignore_index=7)
    torch.testing.assert_close(loss, ref, **TOL[torch.float64])


def test_chunk_tokens_must_be_positive() -> None:
    hidden, weight, labels = make_inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens must be positive, got 0"):
        chunked_lm_loss(hidden, weight, labels, chunk_tokens=0)
