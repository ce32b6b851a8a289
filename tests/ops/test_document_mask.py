import pytest
import torch

from effdl.ops.document_attention import flex_available
from effdl.ops.document_mask import (
    PAD_DOC_ID,
    DocumentBlocks,
    document_block_mask,
    document_blocks,
    document_causal_mask,
)

BLOCK_FIELDS = [
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
]


needs_flex = pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention")


def random_doc_ids(rows, seq_len, max_doc, seed=0):
    """Rows of consecutive documents of random lengths, then 0 .. seq_len/4 padding tokens."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((rows, seq_len), PAD_DOC_ID, dtype=torch.int32)
    for r in range(rows):
        room = seq_len - int(torch.randint(0, seq_len // 4 + 1, (1,), generator=g))
        start, doc = 0, 0
        while start < room:
            n = min(int(torch.randint(1, max_doc + 1, (1,), generator=g)), room - start)
            out[r, start : start + n] = doc
            start, doc = start + n, doc + 1
    return out


def reference_block_mask(doc_ids, block_size):
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    batch, seq_len = doc_ids.shape
    return create_block_mask(
        document_causal, batch, None, seq_len, seq_len, device=doc_ids.device, BLOCK_SIZE=block_size
    )


def assert_same_block_mask(mine, ref):
    assert mine.seq_lengths == ref.seq_lengths
    assert tuple(mine.BLOCK_SIZE) == tuple(ref.BLOCK_SIZE)
    for name in BLOCK_FIELDS:
        assert torch.equal(getattr(mine, name), getattr(ref, name)), name
        # The compiled kernels read the lists as row-major: a transposed view breaks dK/dV.
        assert getattr(mine, name).is_contiguous(), name


def test_document_causal_mask_matches_definition():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 1, 2, 2, -1, -1]])
    mask = document_causal_mask(doc_ids)
    for b in range(2):
        for i in range(6):
            for j in range(6):
                want = bool(doc_ids[b, i] == doc_ids[b, j]) and j <= i
                assert bool(mask[b, i, j]) == want
    assert mask.diagonal(dim1=1, dim2=2).all()  # no empty rows, padding included


def test_document_blocks_layout_and_errors():
    doc_ids = random_doc_ids(3, 100, max_doc=40, seed=1)
    blocks = document_blocks(doc_ids, 16)
    n = -(-100 // 16)
    assert (blocks.batch, blocks.seq_len, blocks.block_size, blocks.n_blocks) == (3, 100, 16, n)
    assert blocks.data.dtype == torch.int32 and blocks.data.shape == (4 * 3 * n * (1 + n),)
    assert isinstance(blocks.to("cpu"), DocumentBlocks)
    assert torch.equal(blocks.to("cpu").data, blocks.data)
    with pytest.raises(ValueError, match=r"\(batch, seq_len\)"):
        document_blocks(doc_ids[0])
    if flex_available():
        with pytest.raises(ValueError, match="do not match these block lists"):
            blocks.block_mask(doc_ids[:2])


@needs_flex
@pytest.mark.parametrize(
    ("seq_len", "block_size"), [(640, 128), (600, 128), (300, 128), (100, 16), (37, 8), (9, 1)]
)
def test_block_mask_equals_create_block_mask(seq_len, block_size):
    doc_ids = random_doc_ids(6, seq_len, max_doc=max(2, seq_len // 3), seed=seq_len)
    mine = document_block_mask(doc_ids, block_size)
    assert_same_block_mask(mine, reference_block_mask(doc_ids, block_size))


@needs_flex
def test_block_mask_equals_create_block_mask_for_any_ids():
    # Not only packing's layout: ids that repeat after a gap, large and negative ids.
    g = torch.Generator().manual_seed(3)
    doc_ids = torch.tensor([-7, 0, 3, 10**9]).index_select(
        0, torch.randint(0, 4, (5 * 200,), generator=g)
    )
    doc_ids = doc_ids.view(5, 200)
    doc_ids[0] = 4  # one document filling the row: full blocks left of the diagonal
    assert_same_block_mask(document_block_mask(doc_ids, 32), reference_block_mask(doc_ids, 32))


@needs_flex
def test_block_mask_skips_blocks_between_documents():
    # Two documents of 256 tokens in a 512-token row: blocks of different documents are
    # skipped, blocks inside one are full, diagonal blocks are masked.
    doc_ids = torch.tensor([[0] * 256 + [1] * 256])
    bm = document_block_mask(doc_ids, 128)
    dense_partial = torch.zeros(4, 4, dtype=torch.int32)
    for i in range(4):
        dense_partial[i, bm.kv_indices[0, 0, i, : bm.kv_num_blocks[0, 0, i]].long()] = 1
    dense_full = torch.zeros(4, 4, dtype=torch.int32)
    for i in range(4):
        dense_full[i, bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]].long()] = 1
    assert torch.equal(dense_partial, torch.eye(4, dtype=torch.int32))
    assert dense_full.tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]]


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_cuda_block_mask_equals_create_block_mask(seed):
    doc_ids = random_doc_ids(8, 640, max_doc=300, seed=seed).cuda()
    assert_same_block_mask(document_block_mask(doc_ids), reference_block_mask(doc_ids, 128))


@pytest.mark.gpu
def test_blocks_built_on_the_cpu_equal_blocks_built_on_cuda():
    doc_ids = random_doc_ids(8, 640, max_doc=300, seed=5)
    ahead = document_blocks(doc_ids, 128).pin_memory().to("cuda", non_blocking=True)
    here = document_blocks(doc_ids.cuda(), 128)
    assert torch.equal(ahead.data, here.data)
    doc_ids = doc_ids.cuda()
    assert_same_block_mask(ahead.block_mask(doc_ids), reference_block_mask(doc_ids, 128))
