"""GPT-2 building blocks against Hugging Face's GPT2LMHeadModel and F.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from effdl.models.gpt2 import (
    GPT2_LARGE_PARAMS,
    SHAPES,
    build_gpt2,
    checkpoint_blocks,
    chunked_lm_loss,
    count_params,
    gpt2_config,
    lm_loss,
    memory_budget,
)

# fp32 on CPU; differences come only from summation order (chunking, fused GELU kernel)
TOL = {"rtol": 1e-5, "atol": 1e-5}


def test_gpt2_large_parameter_count() -> None:
    with torch.device("meta"):
        model = build_gpt2(gpt2_config("large"))
    assert count_params(model) == GPT2_LARGE_PARAMS == 774_030_080


def _tiny_pair(seed: int = 0):
    torch.manual_seed(seed)
    ours = build_gpt2(gpt2_config("tiny", fast_gelu=True, dropout=0.0))
    ref = build_gpt2(gpt2_config("tiny", fast_gelu=False, dropout=0.0))
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def test_fast_gelu_chunked_loss_and_checkpointing_match_hf() -> None:
    ours, ref = _tiny_pair()
    checkpoint_blocks(ours, 1)
    ids = torch.randint(
        0, SHAPES["tiny"].vocab_size, (2, 33), generator=torch.Generator().manual_seed(1)
    )
    hf = ref(ids, labels=ids)
    loss = lm_loss(ours, ids, chunk_tokens=10)  # chunks that do not divide the 64 tokens
    torch.testing.assert_close(loss, hf.loss, **TOL)
    torch.testing.assert_close(ours(ids).logits, hf.logits, **TOL)
    loss.backward()
    hf.loss.backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, **TOL, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_matches_cross_entropy(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(37, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[5] = labels[20] = -100  # ignored positions
    loss = chunked_lm_loss(h, w, labels, chunk_tokens=8)
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy((h2 @ w2.t()).float(), labels, ignore_index=-100)
    (loss * 3).backward()
    (ref * 3).backward()
    tol = TOL if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(loss, ref, **TOL)  # fp32 softmax in both
    torch.testing.assert_close(h.grad, h2.grad, **tol)
    torch.testing.assert_close(w.grad, w2.grad, **tol)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown GPT-2 size"):
        gpt2_config("huge")
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_lm_loss(torch.zeros(2, 2), torch.zeros(3, 2), torch.zeros(2, dtype=torch.long), 0)
    ours, _ = _tiny_pair()
    with pytest.raises(ValueError, match="checkpoint"):
        checkpoint_blocks(ours, 3)


def test_memory_budget_counts_bytes() -> None:
    b = memory_budget(SHAPES["large"], GPT2_LARGE_PARAMS, 4, 1024, 0, "gpu")
    assert b["working_weights"] == pytest.approx(GPT2_LARGE_PARAMS * 2 / 2**30)
    assert b["grad_accumulation_fp32"] == pytest.approx(GPT2_LARGE_PARAMS * 4 / 2**30)
    ck = memory_budget(SHAPES["large"], GPT2_LARGE_PARAMS, 4, 1024, 12, "cpu")
    assert ck["grad_accumulation_fp32"] == 0 and ck["activations"] < b["activations"]
    assert b["total"] == pytest.approx(sum(v for k, v in b.items() if k != "total"))
