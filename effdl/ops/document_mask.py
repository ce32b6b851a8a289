"""The document-causal attention rule of packed rows, in the two forms its users need.

A packed row holds several documents; ``doc_ids`` ``(B, L)`` gives each token's document, and
token i may attend token j only when ``doc_ids[i] == doc_ids[j]`` and ``j <= i``. Padding
carries its own id (:data:`PAD_DOC_ID`), so it attends only to padding and no query row is empty.

* :func:`document_causal_mask`: the dense boolean ``(B, L, L)`` mask.
* :func:`document_blocks`: FlexAttention's block lists of the same rule (:class:`DocumentBlocks`).

Only torch here: the DataLoader workers (:mod:`effdl.data.packing`) build block lists ahead and
the attention op (:mod:`effdl.ops.document_attention`) consumes them, so both import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

PAD_DOC_ID = -1  # the document id of padding tokens
BLOCK_SIZE = 128  # FlexAttention's default sparsity block (query and key side)

_LISTS = ("kv", "full_kv", "q", "full_q")  # BlockMask's four (num_blocks, indices) pairs


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Dense block-diagonal causal mask from ``doc_ids`` of shape ``(B, L)``.

    Returns bool ``(B, L, L)``, True where query ``i`` may attend key ``j``: same document id
    and ``j <= i``. Memory is O(B * L^2): the fallback path; FlexAttention uses
    :func:`document_blocks` instead.
    """
    same_doc = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    n = doc_ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=doc_ids.device).tril_()
    return same_doc & causal


@dataclass(frozen=True)
class DocumentBlocks:
    """FlexAttention's block lists of one batch's document-causal mask, in one int32 tensor.

    ``data`` holds, contiguously, the four count tensors ``(B, 1, n_blocks)`` and then the four
    index tensors ``(B, 1, n_blocks, n_blocks)`` in :data:`_LISTS` order (partial then full
    blocks, key-major for the forward then query-major for the backward). One flat tensor so
    a DataLoader worker can build it on the CPU and the training loop moves it with one copy
    (:meth:`to`); built on the GPU per batch it costs dozens of small kernel launches.
    """

    data: torch.Tensor
    batch: int
    seq_len: int
    block_size: int

    @property
    def n_blocks(self) -> int:
        return -(-self.seq_len // self.block_size)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DocumentBlocks:
        return replace(self, data=self.data.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> DocumentBlocks:
        return replace(self, data=self.data.pin_memory())

    def block_mask(self, doc_ids: torch.Tensor) -> Any:
        """The ``BlockMask`` (views into ``data``) with the document-causal ``mask_mod``."""
        from torch.nn.attention.flex_attention import BlockMask

        if tuple(doc_ids.shape) != (self.batch, self.seq_len):
            raise ValueError(
                f"doc_ids of shape {tuple(doc_ids.shape)} do not match these block lists "
                f"(built for {(self.batch, self.seq_len)})"
            )
        if doc_ids.device != self.data.device:
            raise ValueError(
                f"doc_ids on {doc_ids.device} but block lists on {self.data.device}: move both"
            )
        b, n = self.batch, self.n_blocks
        counts = self.data[: 4 * b * n].view(4, b, 1, n)
        indices = self.data[4 * b * n :].view(4, b, 1, n, n)
        fields: dict[str, torch.Tensor] = {}
        for i, name in enumerate(_LISTS):
            fields[f"{name}_num_blocks"] = counts[i]
            fields[f"{name}_indices"] = indices[i]

        def document_causal(b, h, q_idx, kv_idx):
            return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

        return BlockMask(
            seq_lengths=(self.seq_len, self.seq_len),
            BLOCK_SIZE=(self.block_size, self.block_size),
            mask_mod=document_causal,
            **fields,
        )


def document_blocks(doc_ids: torch.Tensor, block_size: int = BLOCK_SIZE) -> DocumentBlocks:
    """The block lists of the document-causal rule for ``doc_ids`` ``(B, L)``, on their device.

    Equal to what ``create_block_mask(mask_mod, B, None, L, L, BLOCK_SIZE=block_size)`` lists
    (same partial and full blocks, same order) without evaluating ``mask_mod`` on all
    B x L x L pairs: for a key block strictly left of the query block every pair is causal,
    so the block is needed iff the two blocks share a document and needs no mask iff both lie
    inside one and the same document; the diagonal block is always needed and (for
    ``block_size > 1``) never full. Shared documents come from one batched matmul of
    per-block document indicators, O(B * L * (L / block_size)^2) work and O(B * L^2 /
    block_size) memory; no host-device sync. ``L`` need not be a multiple of ``block_size``
    (the last block is partial, never full).
    """
    if doc_ids.ndim != 2:
        raise ValueError(f"doc_ids must be (batch, seq_len), got shape {tuple(doc_ids.shape)}")
    batch, seq_len = doc_ids.shape
    device = doc_ids.device
    n_blocks = -(-seq_len // block_size)
    # Any id -> the position of its first occurrence in the sorted row: an index in [0, L).
    compact = torch.searchsorted(doc_ids.sort(dim=1).values, doc_ids)
    block_of = torch.arange(seq_len, device=device) // block_size
    present = torch.zeros(batch, n_blocks * seq_len, device=device)
    present.scatter_(1, block_of * seq_len + compact, 1.0)
    present = present.view(batch, n_blocks, seq_len)
    shares_doc = torch.bmm(present, present.mT) > 0  # (B, q block, kv block)

    blocks = torch.arange(n_blocks, device=device)
    left = blocks[:, None] > blocks[None, :]
    diagonal = blocks[:, None] == blocks[None, :]
    needed = (shares_doc & left) | diagonal

    # One document per block: extend the tail with its last id so it adds no id; a block that
    # reaches past L is excluded anyway (create_block_mask counts the overhang as masked).
    tail = n_blocks * block_size - seq_len
    padded = torch.cat([doc_ids, doc_ids[:, -1:].expand(batch, tail)], dim=1)
    lo = padded.view(batch, n_blocks, block_size).amin(-1)
    hi = padded.view(batch, n_blocks, block_size).amax(-1)
    single = (lo == hi) & ((blocks + 1) * block_size <= seq_len)
    causal_full = left | diagonal if block_size == 1 else left
    full = (
        causal_full & single[:, :, None] & single[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    )
    partial = needed & ~full
    # Per list: count per row, then the set columns first in ascending order, the unset ones
    # after (a stable descending sort), the layout create_block_mask produces. The
    # query-major lists are the transposes; stacking them copies them row-major, which the
    # compiled kernels assume whatever the strides say (a transposed view gives wrong dK/dV).
    as_int = torch.stack([partial, full, partial.mT, full.mT]).to(torch.int32)
    counts = as_int.sum(-1, dtype=torch.int32)
    indices = torch.argsort(as_int, dim=-1, descending=True, stable=True).to(torch.int32)
    data = torch.cat([counts.flatten(), indices.flatten()])
    return DocumentBlocks(data, batch, seq_len, block_size)


def document_block_mask(doc_ids: torch.Tensor, block_size: int = BLOCK_SIZE) -> Any:
    """FlexAttention ``BlockMask`` of the document-causal rule (see :func:`document_blocks`)."""
    return document_blocks(doc_ids, block_size).block_mask(doc_ids)
