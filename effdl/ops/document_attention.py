"""Causal self-attention that keeps packed documents apart.

A packed row holds several documents; token i may attend token j only when both belong to the
same document and j <= i (the rule of :mod:`effdl.ops.document_mask`, from per-token
``doc_ids``). Two implementations of it:

* ``"flex"``: PyTorch FlexAttention with a document-causal ``mask_mod`` and a ``BlockMask``
  that lists, per (row, query block, key block), the blocks to skip, to compute with the mask
  and to compute without it, so the cost follows the in-document (block-sparse) work.
  :func:`~effdl.ops.document_mask.document_blocks` builds its block lists from ``doc_ids``
  with a handful of tensor ops, on the GPU or ahead in the DataLoader workers.
  Compiled on CUDA; on CPU it runs eagerly, unfused and forward-only (for tests).
* ``"dense"``: ``scaled_dot_product_attention`` with a boolean (B, 1, L, L) mask. Correct
  everywhere (and the only path with attention dropout), but it materialises the mask and
  does the full L x L work.

:func:`select_backend` is the one place that picks; the choice is logged once per device type.
Build a :class:`DocumentMask` once per batch and reuse it in every layer;
:class:`DocumentMultiheadAttention` runs it inside ``nn.TransformerDecoderLayer``.
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

from effdl.ops.document_mask import (
    BLOCK_SIZE,
    DocumentBlocks,
    document_blocks,
    document_causal_mask,
)

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
def _announce(backend: Backend, device_type: str, why: str = "") -> None:
    """Log the chosen path once per (backend, device type, reason); ``cache_clear()`` resets."""
    how = (
        "FlexAttention (block-sparse document mask)"
        if backend == "flex"
        else "dense mask + scaled_dot_product_attention (O(L^2) mask per batch)"
    )
    logger.info("document attention on %s: %s%s", device_type, how, f" ({why})" if why else "")


def select_backend(
    device: torch.device | str, requested: str = "auto", dropout: float = 0.0
) -> Backend:
    """``"auto"``: FlexAttention on CUDA when this torch has it, else dense.

    ``"flex"`` or ``"dense"`` force a path (``"flex"`` raises if this torch lacks it).
    ``dropout`` is the attention-weight dropout the caller will apply (0 in eval): FlexAttention
    has none, so ``"auto"`` then takes the dense path and ``"flex"`` raises ``ValueError``.
    """
    device = torch.device(device)
    if requested not in ("auto", "flex", "dense"):
        raise ValueError(f"backend must be 'auto', 'flex' or 'dense', got {requested!r}")
    if requested == "flex" and not flex_available():
        raise RuntimeError(f"FlexAttention is not available in torch {torch.__version__}")
    if requested == "flex" and dropout > 0:
        raise ValueError(
            f"FlexAttention has no attention dropout (got dropout={dropout}): use backend "
            "'dense' or 'auto', set the dropout to 0, or call .eval()"
        )
    why = ""
    if requested != "auto":
        backend: Backend = requested  # type: ignore[assignment]
    elif device.type == "cuda" and flex_available() and dropout > 0:
        backend, why = "dense", f"attention dropout {dropout} in training: FlexAttention has none"
    else:
        backend = "flex" if device.type == "cuda" and flex_available() else "dense"
    _announce(backend, device.type, why)
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
    doc_ids: torch.Tensor,
    backend: str = "auto",
    block_size: int = BLOCK_SIZE,
    blocks: DocumentBlocks | None = None,
) -> DocumentMask:
    """Build the mask for ``doc_ids`` (``(B, L)`` ints, equal ids = same document).

    Padding should carry its own id (:data:`~effdl.ops.document_mask.PAD_DOC_ID`): it then
    attends only to padding, and no query row is empty (an empty row would give NaN). ``backend`` as in
    :func:`select_backend`; ``block_size`` is FlexAttention's sparsity block. ``blocks``:
    block lists built ahead (e.g. by the DataLoader, see ``collate_packed``), used by the flex
    backend instead of building them here; the dense backend ignores them.
    """
    if doc_ids.ndim != 2:
        raise ValueError(f"doc_ids must be (batch, seq_len), got shape {tuple(doc_ids.shape)}")
    chosen = select_backend(doc_ids.device, backend)
    if chosen == "dense":
        return DocumentMask("dense", doc_ids, dense=document_causal_mask(doc_ids).unsqueeze(1))
    if blocks is None:
        blocks = document_blocks(doc_ids, block_size)
    return DocumentMask("flex", doc_ids, block_mask=blocks.block_mask(doc_ids))


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    # Without compile FlexAttention materialises the full score matrix; compiled it is a
    # fused kernel that skips masked blocks. A new mask_mod closure per batch does not
    # recompile: dynamo guards on its code and lifts the captured doc_ids as an input.
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
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Document-causal attention of ``q, k, v`` ``(B, H, L, D)`` -> ``(B, H, L, D)``.

    Output row i equals plain causal attention over the tokens of i's document alone.
    ``dropout_p`` drops attention weights (dense backend only; ``ValueError`` on flex).
    """
    if mask.backend == "dense":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.dense, dropout_p=dropout_p, scale=scale
        )
    if dropout_p > 0:
        raise ValueError(
            f"FlexAttention has no attention dropout (dropout_p={dropout_p}): build the mask "
            "with backend 'dense', or run without dropout"
        )
    if q.is_cuda:
        return _compiled_flex()(q, k, v, block_mask=mask.block_mask, scale=scale)
    return _eager_flex(q, k, v, mask.block_mask, scale)


class DocumentMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` that also accepts a :class:`DocumentMask` as ``attn_mask``.

    Same parameters and state_dict keys (``in_proj_weight``, ``in_proj_bias``, ``out_proj``)
    so it can replace ``self_attn`` in ``nn.TransformerDecoderLayer`` (see :meth:`like`).
    Any other ``attn_mask`` goes to ``nn.MultiheadAttention.forward`` unchanged. With a
    :class:`DocumentMask` it computes batch-first self-attention only (``query is key is
    value``, no ``key_padding_mask``: padding is a document of its own, no attention
    weights returned); attention dropout applies in training on the dense backend, and the
    flex backend raises ``ValueError`` if training with dropout > 0.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            embed_dim, num_heads, dropout, bias, batch_first=batch_first, device=device, dtype=dtype
        )

    @classmethod
    def like(cls, mha: nn.MultiheadAttention) -> DocumentMultiheadAttention:
        """A copy of ``mha`` (plain q/k/v of one width, no bias_k/v) sharing its parameters.

        Built on the meta device, so no random initialisation runs and seeded models keep the
        parameter values they had with the plain module.
        """
        same_width = mha.kdim == mha.embed_dim and mha.vdim == mha.embed_dim
        if not same_width or mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("only plain self-attention MHA (same q/k/v width, no bias_k/v)")
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            mha.dropout,
            bias=mha.in_proj_bias is not None,
            batch_first=mha.batch_first,
            device="meta",
        )
        new.load_state_dict(mha.state_dict(keep_vars=True), assign=True)
        return new

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | DocumentMask | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(attn_mask, DocumentMask):
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        if key is not query or value is not query or not self.batch_first:
            raise ValueError(
                "a DocumentMask needs batch-first self-attention (query is key is value)"
            )
        if key_padding_mask is not None or need_weights:
            raise ValueError(
                "a DocumentMask takes no key_padding_mask (padding is its own document) and "
                "returns no attention weights (need_weights=False)"
            )
        b, n, d = query.shape
        qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        dropout_p = self.dropout if self.training else 0.0
        y = document_attention(q, k, v, attn_mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(b, n, d)
        return F.linear(y, self.out_proj.weight, self.out_proj.bias), None
