"""Causal self-attention that keeps packed documents apart.

A packed row holds several documents; token i may attend token j only when both belong to the
same document and j <= i (a block-diagonal causal mask built from per-token ``doc_ids``, see
:mod:`effdl.data.packing`). Two implementations of that one rule:

* ``"flex"``: PyTorch FlexAttention with a document-causal ``mask_mod``; ``create_block_mask``
  skips the blocks outside every document, so cost follows the real (block-sparse) work.
  Compiled on CUDA; on CPU it runs eagerly, unfused and forward-only (for tests).
* ``"dense"``: ``scaled_dot_product_attention`` with a boolean (B, 1, L, L) mask. Correct
  everywhere, but it materialises the mask and does the full L x L work.

:func:`select_backend` is the one place that picks; the choice is logged once per device type.
Build a :class:`DocumentMask` once per batch and reuse it in every layer.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from effdl.data.packing import document_causal_mask

logger = logging.getLogger(__name__)

Backend = Literal["flex", "dense"]


def flex_available() -> bool:
    """Whether this torch has ``torch.nn.attention.flex_attention`` (2.5+)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _announce(backend: Backend, device_type: str) -> None:
    """Log the chosen path once per (backend, device type); ``_announce.cache_clear()`` resets."""
    how = (
        "FlexAttention (block-sparse document mask)"
        if backend == "flex"
        else ("dense mask + scaled_dot_product_attention (O(L^2) mask per batch)")
    )
    logger.info("document attention on %s: %s", device_type, how)


def select_backend(device: torch.device | str, requested: str = "auto") -> Backend:
    """``"auto"``: FlexAttention on CUDA when available, else the dense fallback.

    ``"flex"`` or ``"dense"`` force a path (``"flex"`` raises if this torch lacks it).
    """
    device = torch.device(device)
    if requested not in ("auto", "flex", "dense"):
        raise ValueError(f"backend must be 'auto', 'flex' or 'dense', got {requested!r}")
    if requested == "flex" and not flex_available():
        raise RuntimeError(f"FlexAttention is not available in torch {torch.__version__}")
    if requested == "auto":
        backend: Backend = "flex" if device.type == "cuda" and flex_available() else "dense"
    else:
        backend = requested  # type: ignore[assignment]
    _announce(backend, device.type)
    return backend


@dataclass(frozen=True)
class DocumentMask:
    """The document-causal mask of one batch, in the form its backend needs.

    ``block_mask`` (a FlexAttention ``BlockMask``) for ``"flex"``, ``dense`` (bool
    ``(B, 1, L, L)``, True = may attend) for ``"dense"``.
    """

    backend: Backend
    doc_ids: torch.Tensor
    block_mask: Any = None
    dense: torch.Tensor | None = None


def document_mask(
    doc_ids: torch.Tensor, backend: str = "auto", block_size: int = 128
) -> DocumentMask:
    """Build the mask for ``doc_ids`` (``(B, L)`` ints, equal ids = same document).

    Padding should carry its own id (``-1`` in :mod:`effdl.data.packing`): it then attends only
    to padding, and no query row is empty (an empty row would give NaN).
    """
    if doc_ids.ndim != 2:
        raise ValueError(f"doc_ids must be (batch, seq_len), got shape {tuple(doc_ids.shape)}")
    chosen = select_backend(doc_ids.device, backend)
    if chosen == "dense":
        return DocumentMask("dense", doc_ids, dense=document_causal_mask(doc_ids).unsqueeze(1))
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    batch, seq_len = doc_ids.shape
    block_mask = create_block_mask(
        document_causal, batch, None, seq_len, seq_len, device=doc_ids.device, BLOCK_SIZE=block_size
    )
    return DocumentMask("flex", doc_ids, block_mask=block_mask)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    # Without compile FlexAttention materialises the full score matrix; compiled it is a
    # fused kernel that skips masked blocks.
    return torch.compile(flex_attention, dynamic=False)


def _eager_flex(q, k, v, block_mask, scale):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask,
    scale: float | None = None,
) -> torch.Tensor:
    """Document-causal attention of ``q, k, v`` ``(B, H, L, D)`` -> ``(B, H, L, D)``.

    Output row i equals plain causal attention over the tokens of i's document alone.
    """
    if mask.backend == "dense":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, scale=scale)
    if q.is_cuda:
        return _compiled_flex()(q, k, v, block_mask=mask.block_mask, scale=scale)
    return _eager_flex(q, k, v, mask.block_mask, scale)


def mha_attn_mask(doc_ids: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Mask for ``nn.MultiheadAttention`` / ``nn.TransformerDecoderLayer(tgt_mask=...)``.

    Returns bool ``(B * num_heads, L, L)`` where True means *blocked* (the MHA convention, the
    opposite of SDPA's). A dense path: use it where the model is built from ``nn.Transformer*``.
    """
    blocked = ~document_causal_mask(doc_ids)
    return blocked.repeat_interleave(num_heads, dim=0)


class DocumentSelfAttention(nn.Module):
    """Multi-head causal self-attention over packed rows: qkv projection, document attention, out.

    ``forward(x, mask)`` with ``x`` ``(B, L, d_model)`` and a :class:`DocumentMask` built once per
    batch by :func:`document_mask`.
    """

    def __init__(self, d_model: int, n_heads: int, bias: bool = True) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = document_attention(q, k, v, mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d))
