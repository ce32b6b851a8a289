"""The GPT-2-like language model of the batching assignments (seed 000 Task 2, seed 001).

``nn.Embedding`` -> sinusoidal :class:`PositionalEncoding` -> ``n_layers`` of
``nn.TransformerDecoderLayer`` (causal self-attention, padding masked as keys) -> LM head.
The defaults are the assignment's mock model: d_model 1024, 8 heads, one layer, the feed-forward
width and dropout of PyTorch's decoder layer (2048, 0.1).

The decoder layer also has cross-attention and therefore needs a ``memory`` input, which a
decoder-only LM does not have. We pass one all-zero memory vector per sequence: attention over a
single key has weight 1, so cross-attention reduces to a learned constant (``W_o b_v + b_o``)
and costs two d x d projections per token and no T^2 term. (Passing the input itself as memory
would double the attention cost and, without a causal memory mask, leak future tokens.)

Packed rows (``doc_ids``) run through FlexAttention on CUDA: every layer's ``self_attn`` is a
:class:`~effdl.ops.document_attention.DocumentMultiheadAttention`, an ``nn.MultiheadAttention``
with the same parameters that also takes a document mask, built once per batch. Unpacked
batches take PyTorch's own attention path.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from effdl.ops.document_attention import DocumentMultiheadAttention, document_mask, select_backend
from effdl.ops.document_mask import BLOCK_SIZE, DocumentBlocks


class PositionalEncoding(nn.Module):
    """Fixed sinusoidal position signal (Vaswani et al. 2017) added to (B, T, d) inputs.

    ``pe[p, 2i] = sin(p / 10000^(2i/d))``, ``pe[p, 2i+1] = cos(p / 10000^(2i/d))``.
    ``position_ids`` (B, T) lets packed sequences restart positions at every document.
    """

    def __init__(self, d_model: int, max_length: int = 640, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % 2:
            raise ValueError(f"d_model must be even, got {d_model}")
        position = torch.arange(max_length, dtype=torch.float64)[:, None]
        inv_freq = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model)
        )
        pe = torch.zeros(max_length, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(position * inv_freq)
        pe[:, 1::2] = torch.cos(position * inv_freq)
        self.register_buffer("pe", pe.float(), persistent=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            if x.shape[1] > self.pe.shape[0]:
                raise ValueError(
                    f"sequence of {x.shape[1]} tokens exceeds max_length={self.pe.shape[0]}"
                )
            pos = self.pe[: x.shape[1]]
        else:
            pos = self.pe[position_ids]
        return self.dropout(x + pos.to(x.dtype))


@dataclass(frozen=True)
class GPTLikeConfig:
    """Sizes of :class:`GPTLikeModel`; defaults are seed 000's mock model."""

    vocab_size: int = 50_000
    d_model: int = 1024
    n_heads: int = 8
    n_layers: int = 1
    d_ff: int = 2048
    dropout: float = 0.1
    max_length: int = 640
    norm_first: bool = False  # PyTorch's default post-norm; pre-norm adds a final LayerNorm
    # Packed rows: "auto" = FlexAttention on CUDA (dense while training with dropout > 0),
    # dense elsewhere; "flex" / "dense" force one (see effdl.ops.document_attention).
    doc_attention: str = "auto"
    # cuDNN's fused attention builds an execution plan for every new (batch, length) shape,
    # costlier than the forward itself, so with variable-shape batches it is left out by
    # default; once planned it is faster than flash/efficient attention: use it for fixed shapes.
    cudnn_attention: bool = False
    # Right padding + causal attention needs no key-padding mask (see GPTLikeModel).
    mask_padding_keys: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if min(self.vocab_size, self.n_layers, self.d_ff, self.max_length) < 1:
            raise ValueError("vocab_size, n_layers, d_ff and max_length must be positive")
        if self.doc_attention not in ("auto", "flex", "dense"):
            raise ValueError(
                f"doc_attention must be 'auto', 'flex' or 'dense', got {self.doc_attention!r}"
            )


SIZE_FIELDS = ("d_model", "n_heads", "n_layers", "d_ff", "max_length")


def config_from_sizes(sizes: object, vocab_size: int, **overrides: object) -> GPTLikeConfig:
    """A GPTLikeConfig whose :data:`SIZE_FIELDS` are read from ``sizes`` (a script's config with
    attributes of those names) and whose vocabulary is the tokenizer's; ``overrides`` set any
    other field (``dropout=0.0`` where seeds should change only the init)."""
    fields = {name: getattr(sizes, name) for name in SIZE_FIELDS}
    return GPTLikeConfig(vocab_size=vocab_size, **fields, **overrides)


class GPTLikeModel(nn.Module):
    """Decoder-only LM: ``forward(input_ids, padding_mask) -> logits`` of shape (B, T, V).

    ``padding_mask`` (B, T) bool is True on padding. Padding is on the right (every effdl
    collator pads that way), so under causal attention a real query at position t only sees
    keys 0..t, all real: masking the padding keys would change nothing at real positions. By
    default the mask is therefore not passed to attention, which keeps it on the flash kernel
    (an explicit mask forces a slower masked kernel);
    ``cfg.mask_padding_keys=True`` passes it (needed for left or interior padding). Logits at
    padded positions are computed but meaningless; :mod:`effdl.models.lm_objective` ignores
    them.
    """

    def __init__(self, cfg: GPTLikeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = PositionalEncoding(cfg.d_model, cfg.max_length, cfg.dropout)
        layer = nn.TransformerDecoderLayer(
            cfg.d_model,
            cfg.n_heads,
            dim_feedforward=cfg.d_ff,
            dropout=cfg.dropout,
            batch_first=True,
            norm_first=cfg.norm_first,
        )
        # Same parameters and state_dict keys as the plain layer; the layers are deep copies.
        layer.self_attn = DocumentMultiheadAttention.like(layer.self_attn)
        self.decoder = nn.TransformerDecoder(layer, cfg.n_layers)
        self.final_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def features(
        self,
        input_ids: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        doc_blocks: DocumentBlocks | None = None,
    ) -> torch.Tensor:
        """Hidden states (B, T, d_model) before the LM head (what seed 000's mock times).

        ``doc_ids`` (B, T) int, for packed rows: a token attends only to earlier tokens of its
        own document; pass ``position_ids`` restarting per document with it, and no
        ``padding_mask`` (padding is a document of its own). The document mask is built once
        per batch (backend: :meth:`doc_attention_backend`) and shared by all layers;
        ``doc_blocks`` (FlexAttention block lists of ``doc_ids`` built ahead, e.g. by the
        DataLoader) saves building them here.
        """
        t = input_ids.shape[1]
        x = self.pos(self.embed(input_ids), position_ids)
        if doc_ids is None:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu_(1)
        else:
            if padding_mask is not None:
                raise ValueError("pass either padding_mask or doc_ids (padding has doc id -1)")
            backend = self.doc_attention_backend(doc_ids.device)
            mask = document_mask(doc_ids, backend, blocks=doc_blocks)
        memory = x.new_zeros(x.shape[0], 1, x.shape[2])
        # An explicit tgt_is_causal keeps nn.TransformerDecoder from inspecting the mask (it
        # would compare a tensor mask with a causal one); a DocumentMask then reaches each
        # layer's self_attn untouched.
        with self._attention_backends():
            h = self.decoder(
                x,
                memory,
                tgt_mask=mask,
                tgt_key_padding_mask=padding_mask if self.cfg.mask_padding_keys else None,
                tgt_is_causal=doc_ids is None,
            )
        return self.final_norm(h)

    def _attention_backends(self) -> contextlib.AbstractContextManager:
        """The scaled-dot-product-attention kernels this model may use (see ``cudnn_attention``)."""
        if self.cfg.cudnn_attention:
            return contextlib.nullcontext()
        return sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        )

    def doc_attention_backend(self, device: torch.device) -> str:
        """The document-attention backend packed rows use now (``cfg.doc_attention``, the
        device, and attention dropout in training: FlexAttention has none)."""
        dropout = self.cfg.dropout if self.training else 0.0
        return select_backend(device, self.cfg.doc_attention, dropout)

    def loader_block_size(self, device: torch.device) -> int | None:
        """The ``attention_block_size`` a packed loader should build block lists for (see
        ``effdl.data.packing.packed_loader``): FlexAttention's block size when packed rows
        take the flex path now, else ``None`` (the dense path does not use them)."""
        return BLOCK_SIZE if self.doc_attention_backend(device) == "flex" else None

    def forward(
        self,
        input_ids: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        doc_blocks: DocumentBlocks | None = None,
    ) -> torch.Tensor:
        return self.lm_head(
            self.features(input_ids, padding_mask, position_ids, doc_ids, doc_blocks)
        )


def matmul_flops_per_token(cfg: GPTLikeConfig, seq_len: int, lm_head: bool = True) -> float:
    """Forward matmul FLOPs per token position of a (B, seq_len) batch (padding included).

    Per layer: self-attention projections 8 d^2, cross-attention query/output 4 d^2 (its
    key/value projections act on one memory vector per sequence: negligible), feed-forward
    4 d d_ff, attention scores and weighted sum 4 T d. Plus 2 d V for the LM head. Multiply
    by 3 for forward + backward.

    The attention term is the dense convention: every query against all T keys, as a dense
    kernel computes it, causal or not. Packed rows under FlexAttention do only the 128 x 128
    blocks that touch their own document (about 4 d x the mean document length, rounded up to
    blocks), so for them this count overstates the work done and the derived TFLOP/s is an
    upper bound; it stays exact for the projections and feed-forward, which dominate here.
    """
    d = cfg.d_model
    per_layer = 12 * d * d + 4 * d * cfg.d_ff + 4 * seq_len * d
    return cfg.n_layers * per_layer + (2 * d * cfg.vocab_size if lm_head else 0)
