"""A Llama-3 decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, untied head.

``tokens (B, S) -> logits (B, S, vocab)``. Each block is pre-norm::

    h = x + attention(attention_norm(x))        # causal, GQA, RoPE on q and k
    out = h + feed_forward(ffn_norm(h))         # w2(silu(w1 h) * w3 h)

The field and module names follow Meta's reference implementation (``TransformerModelArgs``,
``tok_embeddings``, ``layers[i].attention.wq`` ...), so its configurations read unchanged.

Rotary layout: the head dimension is split in halves, ``(x1, x2) -> (x1 cos - x2 sin,
x2 cos + x1 sin)`` (Hugging Face's ``rotate_half``), not Meta's interleaved pairs. The two are the
same function up to a fixed permutation of the rows of ``wq`` and ``wk`` within each head: a
Hugging Face Llama checkpoint loads through :func:`to_hf_state_dict`'s key map with plain copies,
a Meta ``consolidated.pth`` needs the row permutation that Hugging Face's conversion script applies.

Build large models on the meta device (:func:`build_on_meta`: shapes only, no memory) and
allocate them where they will run (:func:`materialize`). :func:`count_parameters` gives the
exact count in closed form.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from transformers import LlamaConfig


@dataclass(frozen=True)
class TransformerModelArgs:
    """Shape of a :class:`Transformer`; defaults are Meta's Llama 3 8B except the vocabulary.

    ``vocab_size`` has no usable default (it is the tokenizer's size) and must be set.
    ``n_kv_heads=None`` means one key/value head per query head (plain multi-head attention).
    ``seq_len`` is the longest sequence the rotary tables cover.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = -1
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(
                f"vocab_size must be set to the tokenizer's vocabulary size, got {self.vocab_size}"
            )
        if min(self.dim, self.n_layers, self.n_heads, self.multiple_of, self.seq_len) < 1:
            raise ValueError("dim, n_layers, n_heads, multiple_of and seq_len must be positive")
        for name in ("norm_eps", "rope_theta", "ffn_dim_multiplier"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dimension, got {self.head_dim}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


PRESETS: dict[str, TransformerModelArgs] = {
    # CPU tests and smoke runs.
    "tiny": TransformerModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=32, seq_len=256
    ),
    # 125.8M parameters, 75.5M of them in the blocks (GPT-2 small's width and depth).
    "125m": TransformerModelArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32768, seq_len=2048
    ),
    # Llama 3.2 1B's shape (FFN 8192 = 1.5 * int(8 * 2048 / 3) rounded up to 256), untied head.
    "1b": TransformerModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=500000.0,
        seq_len=2048,
    ),
    # Llama 3 8B's shape with the 131072-token vocabulary of the assignment's tokenizer.
    "8b": TransformerModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=131072,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        seq_len=4096,
    ),
}


def ffn_hidden_dim(args: TransformerModelArgs) -> int:
    """Meta's SwiGLU width: ``int(2 * 4 * dim / 3)``, times ``ffn_dim_multiplier`` (truncated),
    rounded up to a multiple of ``multiple_of``.

    Two thirds of 4·dim keeps the three SwiGLU matrices at the parameter count of a 4·dim GELU MLP.
    """
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * math.ceil(hidden / args.multiple_of)


def count_parameters(args: TransformerModelArgs) -> int:
    """Exact parameter count of ``Transformer(args)`` (the rotary tables are buffers, not counted).

    Per block: ``wq, wo`` (dim x dim each), ``wk, wv`` (dim x kv_heads·head_dim each), three FFN
    matrices (dim x hidden), two norm weights (dim). Plus embedding and head (vocab x dim each)
    and the final norm (dim).
    """
    d, kv = args.dim, args.kv_heads * args.head_dim
    attention = 2 * d * d + 2 * d * kv
    block = attention + 3 * d * ffn_hidden_dim(args) + 2 * d
    return args.n_layers * block + 2 * args.vocab_size * d + d


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, normalised in float32
    (or wider) and cast back before the weight: bf16 activations lose too much in the mean."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(
    args: TransformerModelArgs, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary ``cos, sin`` tables, each (seq_len, head_dim) float32, halves repeated.

    Frequency ``i`` (of head_dim/2) is ``rope_theta ** (-2i / head_dim)``; position ``p`` is
    rotated by ``p * frequency``. Computed in float32 like Meta's and Hugging Face's references.
    """
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    angles = torch.arange(args.seq_len, device=device).float()[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates (B, H, S, head_dim) queries or keys by the (S, head_dim) tables, in ``x``'s dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention: ``n_heads`` query heads share ``kv_heads`` key/value
    heads in groups of ``n_heads / kv_heads``.

    SDPA's ``enable_gqa`` lets the flash kernel read the shared heads in place instead of copying
    each of them ``n_heads / kv_heads`` times.

    ``sdpa_backends`` (None: torch's choice) restricts SDPA to those kernels inside the forward
    itself, so torch.compile traces the choice into the graph. Process-wide backend flags are not
    enough there: a compiled graph loaded from the inductor cache keeps the kernel it was first
    compiled with.
    """

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.sdpa_backends: list[SDPBackend] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        backends = self.sdpa_backends
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                apply_rotary(q, cos, sin),
                apply_rotary(k, cos, sin),
                v,
                is_causal=True,
                enable_gqa=self.kv_heads != self.n_heads,
            )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``, bias-free, hidden width :func:`ffn_hidden_dim`."""

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        hidden = ffn_hidden_dim(args)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then feed-forward."""

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder: ``forward(tokens (B, S) int64) -> logits (B, S, vocab_size)``, S <= seq_len.

    The rotary tables are non-persistent buffers (not in ``state_dict``), recomputed by
    :meth:`init_weights`. Built under ``torch.device("meta")`` nothing is allocated or computed.
    """

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # The rotary tables, filled by init_weights.
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.init_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if s > self.args.seq_len:
            raise ValueError(f"sequence of {s} tokens exceeds seq_len={self.args.seq_len}")
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialises every parameter in place and recomputes the rotary tables (float32) on the
        parameters' device. Draws from the device's default generator: seed it for a fixed init.

        Embedding and linears: N(0, 0.02). The residual-branch outputs (``wo``, ``w2``) are scaled
        by 1/sqrt(2·n_layers), as in GPT-2: the 2·n_layers branches add into the residual stream,
        which then keeps its scale at any depth. The head is N(0, 1/dim): the final norm gives
        unit-RMS features, so the initial logits have unit variance at any width. Norms: ones.
        """
        self.init_buffers(self.output.weight.device)
        for _, init in self.init_parts():
            init()

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the rotary tables (float32) on ``device``."""
        self.rope_cos, self.rope_sin = rope_tables(self.args, device)

    def init_parts(self) -> list[tuple[nn.Module, Callable[[], None]]]:
        """The parts :meth:`init_weights` initialises, in its order (the embedding, each block,
        then the final norm and the head), each with the call that initialises that part alone.
        Materialising and initialising them one at a time, in this order and from the same seed,
        gives the weights :meth:`init_weights` gives, with one part allocated at a time."""
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        parts = [(self.tok_embeddings, self._init_embedding)]
        parts += [(b, functools.partial(_init_block, b, residual_std)) for b in self.layers]
        parts.append((nn.ModuleList([self.norm, self.output]), self._init_head))
        return parts

    # Each init looks its parameters up when called: materialising a part replaces them.
    def _init_embedding(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)

    @torch.no_grad()
    def _init_head(self) -> None:
        self.norm.reset_parameters()
        nn.init.normal_(self.output.weight, std=self.args.dim**-0.5)


@torch.no_grad()
def _init_block(layer: TransformerBlock, residual_std: float) -> None:
    for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
        nn.init.normal_(linear.weight, std=0.02)
    nn.init.normal_(layer.attention.wo.weight, std=residual_std)
    nn.init.normal_(layer.feed_forward.w1.weight, std=0.02)
    nn.init.normal_(layer.feed_forward.w3.weight, std=0.02)
    nn.init.normal_(layer.feed_forward.w2.weight, std=residual_std)
    layer.attention_norm.reset_parameters()
    layer.ffn_norm.reset_parameters()


def build_on_meta(args: TransformerModelArgs) -> Transformer:
    """``Transformer(args)`` on the meta device: every shape, no storage (any size, instantly)."""
    with torch.device("meta"):
        return Transformer(args)


def materialize(
    model: Transformer, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> Transformer:
    """Allocates a meta-built ``model`` on ``device`` with parameters in ``dtype`` and initialises
    it (:meth:`Transformer.init_weights`). In place; returns ``model``.

    The dtype is set while still on meta, so only the final storage is ever allocated. The rotary
    tables stay float32 whatever ``dtype`` is.
    """
    model.to(dtype=dtype)
    model.to_empty(device=device)
    model.init_weights()
    return model


_HF_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_key(name: str) -> str:
    """The Hugging Face ``LlamaForCausalLM`` name of one of our parameter names."""
    if name.startswith("tok_embeddings."):
        return "model.embed_tokens." + name.removeprefix("tok_embeddings.")
    if name.startswith("norm."):
        return "model." + name
    if name.startswith("output."):
        return "lm_head." + name.removeprefix("output.")
    _, index, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    return f"model.layers.{index}.{_HF_NAMES[module]}.{leaf}"


def to_hf_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our ``state_dict`` under Hugging Face ``LlamaForCausalLM`` names (same tensors, no copy).

    Both use the half-split rotary layout, so no tensor needs permuting.
    """
    return {hf_key(name): tensor for name, tensor in state_dict.items()}


def to_hf_config(args: TransformerModelArgs) -> LlamaConfig:
    """The ``transformers.LlamaConfig`` of the same architecture (untied head, no biases)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=ffn_hidden_dim(args),
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )


def llama_matmul_params(args: TransformerModelArgs) -> int:
    """Parameters of :class:`Transformer` that multiply activations in a GEMM:
    every Linear weight, output head included. The input embedding (a lookup) and the norm
    weights (elementwise) are left out."""
    return count_parameters(args) - args.vocab_size * args.dim - (2 * args.n_layers + 1) * args.dim


def llama_train_flops_per_token(
    args: TransformerModelArgs, seq_len: int, causal: bool = True
) -> float:
    """Training FLOPs (forward + backward) per token of a Llama model on ``seq_len``-token rows.

    ``6 N + attention``, N = :func:`llama_matmul_params`: a token costs 2 N in the forward GEMMs
    and 4 N in the backward (gradients of activations and of weights). Attention scores and the
    weighted sum of values are two more GEMMs per layer, 2·S·d FLOPs each per token in the
    forward when every query meets all S keys, so 12·L·d·S for training
    (L = n_layers, d = n_heads·head_dim = dim). Elementwise work (norms, RoPE, SiLU, softmax) and
    flash attention's recomputation in the backward are not counted: MFU counts the model's
    FLOPs, not the kernels'.

    Conventions for the attention term: torchtitan (``12·L·H·Q·T``) and the PaLM paper's
    appendix (``6N + 12·L·H·Q·T``) count the full S x S score matrix (``causal=False`` here), and
    so does ``torch.utils.flop_counter.FlopCounterMode`` for ``is_causal=True`` attention (adding,
    for the fused kernels, their recomputation of the scores in the backward). A causal mask leaves only half of it to compute, and causal kernels
    skip the masked blocks: ``causal=True`` (the default) counts that half, ``6·L·d·S``. It is the
    convention of FlashAttention's benchmarks and of the ``6N + 6·L·d·S`` Hugging Face baselines
    this project's MFU is compared with. The two differ by 6·L·d·S per token: 5% of the 1b
    preset's FLOPs at S = 2048, 10% at S = 4096.
    """
    attention = 12 * args.n_layers * args.dim * seq_len
    return 6.0 * llama_matmul_params(args) + (attention / 2 if causal else attention)
