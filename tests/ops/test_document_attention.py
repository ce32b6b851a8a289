import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from effdl.data.packing import collate_packed, pack_row
from effdl.ops import document_attention as da
from effdl.ops.document_attention import (
    DocumentSelfAttention,
    document_attention,
    document_mask,
    flex_available,
    mha_attn_mask,
    select_backend,
)

LAYOUTS = [[5, 3, 8], [16], [1, 1, 6, 2], [4, 7]]  # doc lengths per row; the rest is padding
SEQ_LEN = 16


def packed_doc_ids(layouts=LAYOUTS, seq_len=SEQ_LEN):
    rows = [pack_row([np.ones(n, dtype=np.int64) for n in lens], seq_len, 0) for lens in layouts]
    return collate_packed(rows).doc_ids


def per_document_reference(q, k, v, doc_ids):
    """Run every document (and the padded tail) alone through plain causal attention."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        for d in doc_ids[b].unique():
            idx = (doc_ids[b] == d).nonzero().squeeze(1)
            out[b, :, idx] = F.scaled_dot_product_attention(
                q[b, :, idx], k[b, :, idx], v[b, :, idx], is_causal=True
            )
    return out


def qkv(shape, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype).to(device) for _ in range(3)]


BACKENDS = ["dense"] + (["flex"] if flex_available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_each_document_alone(backend):
    doc_ids = packed_doc_ids()
    q, k, v = qkv(
        (len(LAYOUTS), 2, SEQ_LEN, 8), dtype=torch.float32 if backend == "flex" else torch.float64
    )
    out = document_attention(q, k, v, document_mask(doc_ids, backend=backend))
    ref = per_document_reference(q, k, v, doc_ids)
    tol = 1e-5 if backend == "flex" else 1e-12
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert torch.isfinite(out).all()  # padding rows are not empty


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_attention_across_documents(backend):
    # Changing every key/value of document 1 in row 0 must leave documents 0 and 2 untouched,
    # bit for bit, and (dense path) the gradient from the other documents into 1 must be zero.
    doc_ids = packed_doc_ids()
    mask = document_mask(doc_ids, backend=backend)
    q, k, v = qkv((len(LAYOUTS), 2, SEQ_LEN, 8), dtype=torch.float32)
    other = doc_ids[0] != 1
    k2, v2 = k.clone(), v.clone()
    k2[0, :, ~other] += 3.0
    v2[0, :, ~other] -= 5.0
    a = document_attention(q, k, v, mask)
    b = document_attention(q, k2, v2, mask)
    assert torch.equal(a[0, :, other], b[0, :, other])
    assert not torch.allclose(a[0, :, ~other], b[0, :, ~other])
    if backend == "flex":
        return  # FlexAttention has no backward on CPU; the CUDA test compares gradients
    v.requires_grad_(True)
    document_attention(q, k, v, mask)[0, :, other].sum().backward()
    assert (v.grad[0, :, ~other] == 0).all()


def test_mha_mask_matches_document_self_attention():
    torch.manual_seed(0)
    d_model, heads = 32, 4
    doc_ids = packed_doc_ids()
    x = torch.randn(len(LAYOUTS), SEQ_LEN, d_model, dtype=torch.float64)
    mine = DocumentSelfAttention(d_model, heads).double()
    mha = nn.MultiheadAttention(d_model, heads, batch_first=True).double()
    with torch.no_grad():
        mha.in_proj_weight.copy_(mine.qkv.weight)
        mha.in_proj_bias.copy_(mine.qkv.bias)
        mha.out_proj.weight.copy_(mine.out.weight)
        mha.out_proj.bias.copy_(mine.out.bias)
    want, _ = mha(x, x, x, attn_mask=mha_attn_mask(doc_ids, heads), need_weights=False)
    got = mine(x, document_mask(doc_ids, backend="dense"))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="not divisible"):
        DocumentSelfAttention(30, 4)


def test_backend_choice_is_logged_once(caplog):
    da._announce.cache_clear()
    with caplog.at_level(logging.INFO, logger=da.__name__):
        assert select_backend("cpu") == "dense"
        assert select_backend("cpu") == "dense"
    assert [r.message for r in caplog.records].count(
        "document attention on cpu: dense mask + scaled_dot_product_attention (O(L^2) mask per batch)"
    ) == 1
    with pytest.raises(ValueError, match="backend must be"):
        select_backend("cpu", "flash")
    with pytest.raises(ValueError, match=r"\(batch, seq_len\)"):
        document_mask(torch.zeros(4, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_on_cuda_matches_dense(dtype):
    assert select_backend("cuda") == "flex"
    lens = [[200, 50, 300, 90], [640], [1, 639], [128, 128, 128, 100]]
    doc_ids = packed_doc_ids(lens, 640).cuda()
    q, k, v = (
        t.to(dtype).requires_grad_(True) for t in qkv((4, 8, 640, 64), torch.float32, "cuda")
    )
    out = document_attention(q, k, v, document_mask(doc_ids))
    ref = document_attention(q, k, v, document_mask(doc_ids, backend="dense"))
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    (g_flex,) = torch.autograd.grad(out.float().square().sum(), v)
    (g_dense,) = torch.autograd.grad(ref.float().square().sum(), v)
    torch.testing.assert_close(g_flex, g_dense, rtol=10 * tol, atol=10 * tol)


def test_mha_mask_as_decoder_layer_tgt_mask_equals_documents_alone():
    # How a model built from nn.TransformerDecoderLayer (effdl.models.gpt_like) runs packed rows.
    torch.manual_seed(0)
    d_model, heads = 32, 4
    layer = nn.TransformerDecoderLayer(d_model, heads, 64, dropout=0.0, batch_first=True).double()
    doc_ids = packed_doc_ids()
    x = torch.randn(len(LAYOUTS), SEQ_LEN, d_model, dtype=torch.float64)
    memory = x.new_zeros(len(LAYOUTS), 1, d_model)
    packed = layer(x, memory, tgt_mask=mha_attn_mask(doc_ids, heads))
    for b in range(len(LAYOUTS)):
        for d in doc_ids[b].unique():
            idx = (doc_ids[b] == d).nonzero().squeeze(1)
            causal = nn.Transformer.generate_square_subsequent_mask(len(idx), dtype=torch.float64)
            alone = layer(x[b : b + 1, idx], memory[b : b + 1], tgt_mask=causal)
            torch.testing.assert_close(packed[b : b + 1, idx], alone, rtol=1e-10, atol=1e-10)
