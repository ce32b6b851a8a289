import math

import pytest
import torch

from effdl.models.gpt_like import (
    GPTLikeConfig,
    GPTLikeModel,
    PositionalEncoding,
    matmul_flops_per_token,
)
from effdl.models.lm_objective import LMCrossEntropyLoss

TINY = GPTLikeConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_length=16)


def test_positional_encoding_matches_formula():
    pe = PositionalEncoding(8, max_length=20)
    x = torch.zeros(1, 20, 8)
    out = pe(x)[0].double()
    for p in (0, 1, 7, 19):
        for i in range(4):
            angle = p / 10000 ** (2 * i / 8)
            assert out[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert out[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_positional_encoding_position_ids_and_errors():
    pe = PositionalEncoding(8, max_length=10)
    x = torch.zeros(1, 4, 8)
    restart = pe(x, torch.tensor([[0, 1, 0, 1]]))
    assert torch.equal(restart[0, 2], restart[0, 0]) and torch.equal(restart[0, 3], restart[0, 1])
    with pytest.raises(ValueError, match="exceeds max_length=10"):
        pe(torch.zeros(1, 11, 8))
    with pytest.raises(ValueError, match="even"):
        PositionalEncoding(7)


def test_default_config_is_the_assignment_model():
    cfg = GPTLikeConfig()
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.max_length) == (1024, 8, 1, 640)
    with pytest.raises(ValueError, match="not divisible"):
        GPTLikeConfig(d_model=30, n_heads=4)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPTLikeModel(TINY).eval()


def test_logits_shape_and_padding_does_not_change_real_positions(model):
    a = torch.randint(1, 50, (1, 9))
    b = torch.randint(1, 50, (1, 5))
    batch = torch.zeros(2, 9, dtype=torch.int64)
    batch[0], batch[1, :5] = a[0], b[0]
    mask = torch.arange(9) >= torch.tensor([[9], [5]])
    with torch.no_grad():
        logits = model(batch, mask)
        alone_a, alone_b = model(a), model(b)
    assert logits.shape == (2, 9, 50)
    torch.testing.assert_close(logits[0], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, :5], alone_b[0], atol=1e-5, rtol=1e-5)


def test_causal_future_tokens_do_not_leak(model):
    x = torch.randint(1, 50, (1, 8))
    y = x.clone()
    y[0, 5:] = (y[0, 5:] + 1) % 50
    with torch.no_grad():
        lx, ly = model(x), model(y)
    torch.testing.assert_close(lx[0, :5], ly[0, :5], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(lx[0, 5:], ly[0, 5:])


def test_model_trains():
    torch.manual_seed(0)
    model = GPTLikeModel(GPTLikeConfig(**{**TINY.__dict__, "dropout": 0.0}))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = LMCrossEntropyLoss()
    x = torch.randint(1, 50, (4, 12))
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[2:, 8:] = True
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = loss_fn(model(x, mask), x, mask)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None for p in model.parameters())


def test_features_skip_the_lm_head(model):
    x = torch.randint(1, 50, (2, 6))
    with torch.no_grad():
        h = model.features(x)
        torch.testing.assert_close(model.lm_head(h), model(x))
    assert h.shape == (2, 6, 32)


def test_matmul_flops_count():
    cfg = GPTLikeConfig()
    d = 1024
    expected = 12 * d * d + 4 * d * 2048 + 4 * 640 * d
    assert matmul_flops_per_token(cfg, 640, lm_head=False) == expected
    assert matmul_flops_per_token(cfg, 640) == expected + 2 * d * cfg.vocab_size


def test_doc_ids_keep_packed_documents_apart(model):
    """A packed row gives each document the logits it gets alone (positions restart)."""
    a = torch.randint(1, 50, (1, 5))
    b = torch.randint(1, 50, (1, 4))
    row = torch.cat([a, b, torch.zeros(1, 3, dtype=torch.int64)], dim=1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])
    with torch.no_grad():
        packed = model(row, position_ids=position_ids, doc_ids=doc_ids)
        alone_a, alone_b = model(a), model(b)
    assert torch.isfinite(packed).all()
    torch.testing.assert_close(packed[0, :5], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[0, 5:9], alone_b[0], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_bf16_forward_backward_and_padding_invariance():
    torch.manual_seed(0)
    model = GPTLikeModel(GPTLikeConfig(vocab_size=1000, n_layers=2, dropout=0.0)).cuda()
    ids = torch.randint(1, 1000, (4, 96), device="cuda")
    lengths = torch.tensor([96, 60, 17, 1], device="cuda")
    mask = torch.arange(96, device="cuda") >= lengths[:, None]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(ids, mask)
        loss = LMCrossEntropyLoss()(logits, ids, mask)
    loss.backward()
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        batch = model(ids, mask)
        alone = model(ids[1:2, :60])
    torch.testing.assert_close(batch[1, :60], alone[0], atol=1e-4, rtol=1e-4)
