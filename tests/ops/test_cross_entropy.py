"""cross_entropy_sum (Triton kernels on CUDA, torch ops elsewhere) against F.cross_entropy on
fp32-upcast logits, and autograd's gradcheck.

Reference: ``F.cross_entropy(logits.to(fp32 at least), labels, reduction="sum")``, the path the
op replaces; loss and the gradient w.r.t. the logits (in the logits' dtype) are compared.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from effdl.ops.cross_entropy import cross_entropy_sum
from tests.triton_interpreter import assert_kernels_ok_in_interpreter

N_TOKENS, VOCAB = 37, 50
TOL = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1e-2, "atol": 1e-3},
    torch.float16: {"rtol": 1e-3, "atol": 1e-4},
}


def make_inputs(dtype: torch.dtype, ignored: tuple[int, ...] = (5, 20), seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(N_TOKENS, VOCAB, generator=g, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, VOCAB, (N_TOKENS,), generator=g)
    labels[list(ignored)] = -100
    return logits.requires_grad_(), labels


def reference(logits: torch.Tensor, labels: torch.Tensor, ignore: int = -100):
    x = logits.detach().clone().requires_grad_()
    upcast = x.to(torch.promote_types(x.dtype, torch.float32))
    return F.cross_entropy(upcast, labels, ignore_index=ignore, reduction="sum"), x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_tokens", [1, 8, 10, 37, 1024])  # 8, 10 leave a short last chunk
@pytest.mark.parametrize("ignored", [(), (5, 20), (0, 36)])
def test_matches_cross_entropy(dtype, chunk_tokens: int, ignored: tuple[int, ...]) -> None:
    logits, labels = make_inputs(dtype, ignored)
    loss = cross_entropy_sum(logits, labels, chunk_tokens=chunk_tokens)
    ref, x = reference(logits, labels)
    (loss * 0.3).backward()  # a non-unit upstream gradient
    (ref * 0.3).backward()
    assert loss.dtype == ref.dtype
    torch.testing.assert_close(
        loss, ref, **TOL[torch.float64 if dtype == torch.float64 else torch.float32]
    )
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad, x.grad, **TOL[dtype])


def test_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 7, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 6, -100, 3, 3, 1, -100, 5, 2])
    assert torch.autograd.gradcheck(
        lambda x: cross_entropy_sum(x, labels, chunk_tokens=4), (logits,)
    )


def test_every_label_ignored_gives_zero_loss_and_gradient() -> None:
    logits, labels = make_inputs(torch.float32, ignored=tuple(range(N_TOKENS)))
    loss = cross_entropy_sum(logits, labels, chunk_tokens=8)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_other_ignore_index() -> None:
    logits, labels = make_inputs(torch.float64, ignored=())
    labels[labels == 3] = 7
    loss = cross_entropy_sum(logits, labels, chunk_tokens=8, ignore=7)
    torch.testing.assert_close(loss, reference(logits, labels, ignore=7)[0], **TOL[torch.float64])


def test_no_grad_gives_the_loss() -> None:
    logits, labels = make_inputs(torch.bfloat16)
    with torch.no_grad():
        loss = cross_entropy_sum(logits, labels, chunk_tokens=8)
    torch.testing.assert_close(loss, reference(logits, labels)[0].detach(), **TOL[torch.float32])


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_a_label_outside_the_vocabulary_is_refused(bad: int) -> None:
    logits, labels = make_inputs(torch.float32)
    labels[3] = bad
    with pytest.raises(ValueError, match=rf"labels must be in \[0, {VOCAB}\) or -100; got"):
        cross_entropy_sum(logits, labels)


def test_chunk_tokens_must_be_positive() -> None:
    logits, labels = make_inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens must be positive, got 0"):
        cross_entropy_sum(logits, labels, chunk_tokens=0)


# The Triton kernels under the CPU interpreter: several loop steps per row (block 16, vocabulary
# 50), ignored rows, fp32 and bf16 logits, against the torch path of the same op.
_INTERPRETED_KERNEL_CHECK = """
import torch
from effdl.ops import cross_entropy_triton as k
from effdl.ops.cross_entropy import cross_entropy_sum
g = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
    logits = (3 * torch.randn(37, 50, generator=g)).to(dtype)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[[0, 20]] = -100
    loss, lse = k.forward(logits, labels, -100, block=16)
    x = logits.clone().requires_grad_()
    ref = cross_entropy_sum(x, labels, chunk_tokens=8)
    (ref * 0.3).backward()
    torch.testing.assert_close(loss.sum(), ref.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), 1), rtol=1e-5, atol=1e-5)
    assert loss[0] == 0 and loss[20] == 0
    grad = k.backward(logits, labels, lse, torch.tensor(0.3), -100, block=16)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, x.grad, rtol=tol, atol=tol)
labels[3] = 50  # outside the vocabulary: NaN, not a read past the row
loss, _ = k.forward(logits, labels, -100, block=16)
assert loss[3].isnan() and not loss[4].isnan()
print("kernels ok")
"""


def test_triton_kernels_match_the_torch_path_in_the_interpreter() -> None:
    assert_kernels_ok_in_interpreter(_INTERPRETED_KERNEL_CHECK)


@pytest.mark.gpu
def test_cuda_bf16_matches_and_keeps_no_fp32_copy() -> None:
    """On the GPU: same loss and gradient as the upcast path, and a peak of the logits, their
    gradient and a chunk, well under the upcast path's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, v, chunk = 4096, 32768, 512
    logits = torch.randn(n, v, device="cuda", generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    peaks = []
    for fn in (
        lambda x: cross_entropy_sum(x, labels, chunk_tokens=chunk),
        lambda x: F.cross_entropy(x.float(), labels, reduction="sum"),
    ):
        x = logits.detach().clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn(x)
        loss.backward()
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - base, loss.detach(), x.grad))
    (ours, loss, grad), (theirs, ref_loss, ref_grad) = peaks
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-2)
    torch.testing.assert_close(grad, ref_grad, **TOL[torch.bfloat16])
    logits_bytes = n * v * 2
    # ours: the gradient and one fp32 chunk; theirs: an fp32 copy and an fp32 log-softmax
    assert ours <= 2 * logits_bytes, (ours, theirs, logits_bytes)
    assert theirs >= 3 * logits_bytes, (ours, theirs, logits_bytes)


def test_the_trainers_eager_loss_equals_its_upcast_loss():
    """effdl.lm.loss: the eager runs' loss and the one compiled runs compile, on (B, S, V)
    logits with ignored labels, equal in value and gradient."""
    from effdl.lm.loss import token_loss_sum, upcast_token_loss_sum

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 9, VOCAB, generator=g).bfloat16()
    labels = torch.randint(0, VOCAB, (2, 9), generator=g)
    labels[0, :3] = -100
    grads = []
    for fn in (token_loss_sum, upcast_token_loss_sum):
        x = logits.clone().requires_grad_()
        loss = fn(x, labels)
        loss.backward()
        grads.append((loss.detach(), x.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grads[0][1], grads[1][1], **TOL[torch.bfloat16])
