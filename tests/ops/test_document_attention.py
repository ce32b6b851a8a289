import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from effdl.data.packing import collate_packed, pack_row
from effdl.ops import document_attention as da
from effdl.ops.document_attention import (
    DocumentMultiheadAttention,
    document_attention,
    document_mask,
    flex_available,
    select_backend,
)
from effdl.ops.document_mask import document_blocks, document_causal_mask

LAYOUTS = [[5, 3, 8], [16], [1, 1, 6, 2], [4, 7]]  # doc lengths per row; the rest is padding
SEQ_LEN = 16
needs_flex = pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention")


def packed_doc_ids(layouts=LAYOUTS, seq_len=SEQ_LEN):
    rows = [pack_row([np.ones(n, dtype=np.int64) for n in lens], seq_len, 0) for lens in layouts]
    return collate_packed(rows).doc_ids


def random_packed_doc_ids(rows, seq_len, max_doc, seed=0):
    """Packed rows of random document lengths, each ending in 0 .. seq_len/4 padding tokens."""
    rng = np.random.default_rng(seed)
    layouts = []
    for _ in range(rows):
        room = seq_len - int(rng.integers(0, seq_len // 4 + 1))
        lens = []
        while sum(lens) < room:
            lens.append(min(int(rng.integers(1, max_doc + 1)), room - sum(lens)))
        layouts.append(lens)
    return packed_doc_ids(layouts, seq_len)


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


def mha_blocked_mask(doc_ids, heads):
    """The reference: nn.MultiheadAttention's boolean (B * heads, L, L) mask (True = blocked)."""
    return (~document_causal_mask(doc_ids)).repeat_interleave(heads, dim=0)


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


@needs_flex
@pytest.mark.parametrize(("seq_len", "block_size"), [(300, 128), (100, 16)])
def test_flex_over_several_blocks_equals_each_document_alone(seq_len, block_size):
    # Several blocks, the last one partial: exercises skipped, full and masked blocks.
    doc_ids = random_packed_doc_ids(4, seq_len, max_doc=seq_len // 2, seed=1)
    q, k, v = qkv((4, 2, seq_len, 8), dtype=torch.float32, seed=1)
    out = document_attention(q, k, v, document_mask(doc_ids, "flex", block_size=block_size))
    torch.testing.assert_close(out, per_document_reference(q, k, v, doc_ids), rtol=1e-5, atol=1e-5)


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


@needs_flex
def test_blocks_built_by_the_collate_drive_the_same_attention():
    layouts = [[40, 3, 50], [100], [1, 1, 70], [33, 33]]
    rows = [pack_row([np.ones(n, dtype=np.int64) for n in lens], 100, 0) for lens in layouts]
    batch = collate_packed(rows, attention_block_size=16)
    blocks = batch.blocks
    assert (blocks.batch, blocks.seq_len, blocks.block_size) == (4, 100, 16)
    assert torch.equal(blocks.data, document_blocks(batch.doc_ids, 16).data)
    q, k, v = qkv((4, 2, 100, 8), dtype=torch.float32, seed=2)
    mask = document_mask(batch.doc_ids, "flex", blocks=blocks)
    torch.testing.assert_close(
        document_attention(q, k, v, mask),
        per_document_reference(q, k, v, batch.doc_ids),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="do not match these block lists"):
        blocks.block_mask(batch.doc_ids[:2])
    assert document_mask(batch.doc_ids, "dense", blocks=blocks).backend == "dense"


def test_multihead_attention_with_document_mask_equals_dense_mha_mask():
    torch.manual_seed(0)
    d_model, heads = 32, 4
    doc_ids = packed_doc_ids()
    x = torch.randn(len(LAYOUTS), SEQ_LEN, d_model, dtype=torch.float64)
    mha = nn.MultiheadAttention(d_model, heads, batch_first=True).double()
    mine = DocumentMultiheadAttention.like(mha)
    want, _ = mha(x, x, x, attn_mask=mha_blocked_mask(doc_ids, heads), need_weights=False)
    got, weights = mine(x, x, x, attn_mask=document_mask(doc_ids, "dense"), need_weights=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert weights is None
    if flex_available():
        with torch.no_grad():  # eager FlexAttention on CPU is forward-only
            xf = x.float()
            flex, _ = mine.float()(
                xf, xf, xf, attn_mask=document_mask(doc_ids, "flex"), need_weights=False
            )
        torch.testing.assert_close(flex, want.float(), rtol=1e-5, atol=1e-5)


def test_multihead_attention_dense_dropout_equals_nn_multihead_attention():
    # Same seed, same attention-weight dropout draws as PyTorch's MHA with the dense mask.
    d_model, heads = 32, 4
    doc_ids = packed_doc_ids()
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(d_model, heads, dropout=0.3, batch_first=True).double()
    mine = DocumentMultiheadAttention.like(mha).train()
    x = torch.randn(len(LAYOUTS), SEQ_LEN, d_model, dtype=torch.float64)
    torch.manual_seed(1)
    want, _ = mha(x, x, x, attn_mask=mha_blocked_mask(doc_ids, heads), need_weights=False)
    torch.manual_seed(1)
    got, _ = mine(x, x, x, attn_mask=document_mask(doc_ids, "dense"), need_weights=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    mine.eval()
    torch.manual_seed(1)
    assert not torch.allclose(
        mine(x, x, x, attn_mask=document_mask(doc_ids, "dense"), need_weights=False)[0], got
    )


def test_multihead_attention_like_shares_parameters_and_defers_other_masks():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)
    rng_before = torch.get_rng_state()
    mine = DocumentMultiheadAttention.like(mha)
    assert torch.equal(torch.get_rng_state(), rng_before)  # built on meta: no random init
    assert list(mine.state_dict()) == list(mha.state_dict())
    assert all(a is b for a, b in zip(mine.parameters(), mha.parameters(), strict=True))
    assert (mine.dropout, mine.batch_first, mine.num_heads) == (0.1, True, 2)
    mha.eval(), mine.eval()
    x = torch.randn(3, 7, 16)
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    for kwargs in ({"attn_mask": causal}, {"key_padding_mask": pad}, {}):
        want = mha(x, x, x, **kwargs)
        got = mine(x, x, x, **kwargs)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="plain self-attention"):
        DocumentMultiheadAttention.like(nn.MultiheadAttention(16, 2, kdim=8, vdim=8))


def test_multihead_attention_document_mask_errors():
    mine = DocumentMultiheadAttention(16, 2)
    doc_ids = packed_doc_ids()
    x = torch.randn(len(LAYOUTS), SEQ_LEN, 16)
    mask = document_mask(doc_ids, "dense")
    with pytest.raises(ValueError, match="self-attention"):
        mine(x, x.clone(), x, attn_mask=mask, need_weights=False)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mine(x, x, x, attn_mask=mask, key_padding_mask=doc_ids < 0, need_weights=False)
    with pytest.raises(ValueError, match="need_weights=False"):
        mine(x, x, x, attn_mask=mask)
    if flex_available():
        drop = DocumentMultiheadAttention(16, 2, dropout=0.1).train()
        with pytest.raises(ValueError, match="no attention dropout"):
            drop(x, x, x, attn_mask=document_mask(doc_ids, "flex"), need_weights=False)


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


@needs_flex
def test_backend_with_attention_dropout(caplog):
    # Device objects only: no CUDA needed to check the choice.
    da._announce.cache_clear()
    with caplog.at_level(logging.INFO, logger=da.__name__):
        assert select_backend("cuda") == ("flex" if flex_available() else "dense")
        assert select_backend("cuda", dropout=0.1) == "dense"
        assert select_backend("cuda", dropout=0.1) == "dense"
    assert sum("attention dropout 0.1" in r.message for r in caplog.records) == 1
    assert select_backend("cuda", "dense", dropout=0.1) == "dense"
    with pytest.raises(ValueError, match="no attention dropout"):
        select_backend("cuda", "flex", dropout=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len", [640, 600])
def test_flex_on_cuda_matches_dense(dtype, seq_len):
    lens = [[200, 50, 300, 40], [seq_len], [1, seq_len - 1], [128, 128, 128, 100]]
    doc_ids = packed_doc_ids(lens, seq_len).cuda()
    q, k, v = (
        t.to(dtype).requires_grad_(True) for t in qkv((4, 8, seq_len, 64), torch.float32, "cuda")
    )
    out = document_attention(q, k, v, document_mask(doc_ids, backend="flex"))
    ref = document_attention(q, k, v, document_mask(doc_ids, backend="dense"))
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    g_flex = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    g_dense = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    for name, a, b in zip("qkv", g_flex, g_dense, strict=True):
        torch.testing.assert_close(a, b, rtol=10 * tol, atol=10 * tol, msg=f"d{name}")


@pytest.mark.gpu
def test_cuda_flex_equals_each_document_alone_and_does_not_recompile():
    from torch._dynamo.utils import counters

    q, k, v = qkv((8, 4, 640, 64), torch.bfloat16, "cuda")
    graphs = None
    for seed in range(4):
        doc_ids = random_packed_doc_ids(8, 640, max_doc=300, seed=seed).cuda()
        mask = document_mask(doc_ids)
        assert mask.backend == "flex"
        out = document_attention(q, k, v, mask)
        ref = per_document_reference(q.float(), k.float(), v.float(), doc_ids)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs  # a new doc_ids closure: no recompile
