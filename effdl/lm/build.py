"""The Llama of an LM training run on its device, its attention backend and its optimizer.

Parallelism stays out of the model: the Llama from effdl.models.llama is built on the meta
device; effdl.parallel.wrap_model materialises it on every rank from one seed (the weights a
single process would start from), compiles it block by block and wraps it in DDP or shards it
with FSDP2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from effdl.cli import UsageError, require_fits
from effdl.models.llama import (
    PRESETS,
    Attention,
    TransformerModelArgs,
)
from effdl.optim import MasterWeights

# SDPA backends a run may restrict attention to. The memory-efficient kernel is not one: it does
# not take grouped key/value heads, and every preset has them.
ATTENTION_BACKENDS: dict[str, list[SDPBackend] | None] = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
}


def llama_args(
    preset: str, seq_len: int, vocab_size: int | None, tokenizer_vocab: int
) -> TransformerModelArgs:
    """The shape ``preset`` at ``seq_len``, with ``vocab_size`` if given (None: the preset's).
    Refuses a vocabulary smaller than the tokenizer's, naming the flags that fix it."""
    args = dataclasses.replace(PRESETS[preset], seq_len=seq_len)
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    if tokenizer_vocab > args.vocab_size:
        raise UsageError(
            f"the tokenizer has {tokenizer_vocab} tokens, more than --model {preset}'s "
            f"vocabulary of {args.vocab_size}: use --vocab-size or a smaller --bpe-vocab"
        )
    return args


def make_optimizer(
    params: Iterable[torch.Tensor], lr: float, weight_decay: float, fused: bool
) -> torch.optim.AdamW:
    """AdamW (betas 0.9/0.95) with weight decay on matrices only (not on norm gains).
    ``fused``: one kernel per parameter group for the whole update instead of torch's default
    multi-tensor (foreach) kernels per operation."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


def optimizer_and_clip(
    model: nn.Module, precision: str, lr: float, weight_decay: float, fused: bool
) -> tuple[torch.optim.Optimizer | MasterWeights, Callable[[float], torch.Tensor]]:
    """The optimizer of :func:`make_optimizer` and the gradient clipping that goes with it
    (``clip(max_norm)`` returns the total norm, a plain tensor also under FSDP2).
    ``precision == "master"``: bf16 parameters over fp32 masters (effdl.optim.MasterWeights),
    clipped inside the update's pass."""
    make = partial(make_optimizer, lr=lr, weight_decay=weight_decay, fused=fused)
    if precision == "master":
        opt = MasterWeights(model, make, torch.bfloat16)
        return opt, opt.clip_grad_norm_
    params = list(model.parameters())

    def clip(max_norm: float) -> torch.Tensor:
        norm = nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor

    return make(params), clip


def select_attention(model: nn.Module, backend: str) -> None:
    """Restricts every Llama attention of ``model`` to one SDPA backend of
    :data:`ATTENTION_BACKENDS` ("auto": torch's own choice). The choice is held by the modules
    (:class:`effdl.models.llama.Attention`), not by process-wide flags, so compiled blocks trace
    it whether or not the inductor cache already holds a graph compiled with another backend."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {list(ATTENTION_BACKENDS)}")
    for module in model.modules():
        if isinstance(module, Attention):
            module.sdpa_backends = ATTENTION_BACKENDS[backend]


def check_llama_fits(
    shape: TransformerModelArgs, vocab_size: int | None, batch_size: int, seq_len: int
) -> None:
    """UsageError naming the flags if the blocks' inputs saved for backward (bf16) and the
    embedding of ``shape`` (vocabulary ``vocab_size`` or the preset's) would not fit the host's
    free memory: a lower bound, checked before anything is allocated."""
    vocab = vocab_size or shape.vocab_size
    require_fits(
        "--batch-size --sequence-length --vocab-size",
        batch_size * seq_len * shape.dim * shape.n_layers + vocab * shape.dim,
        "the blocks' inputs saved for backward (bf16) and the embedding",
        bytes_per_element=2,
    )
