"""GPT-2 (Hugging Face ``GPT2LMHeadModel``) built from its config, plus what fits it in 11 GiB.

* :func:`gpt2_config` / :func:`build_gpt2`: GPT-2-Large is 36 layers, d=1280, 20 heads, vocab
  50257, 1024 positions: 774,030,080 parameters (the LM head is tied to the token embedding).
  Random init by default; pretrained weights only from a local folder. ``fast_gelu`` swaps
  HF's python ``gelu_new`` (eight elementwise kernels, four saved 4d-wide tensors) for
  ``gelu_pytorch_tanh``: the same tanh formula in one kernel (tests compare logits and grads).
* :func:`checkpoint_blocks`: activation checkpointing of the first ``n`` blocks (each keeps only
  its input and recomputes its forward in backward), so memory can be traded layer by layer.
* :func:`chunked_lm_loss`: next-token cross-entropy that never materialises the whole
  ``tokens x 50257`` logits: per chunk of tokens it computes logits, the loss and, right away,
  the gradients w.r.t. the hidden states and the LM-head weight (same math, same FLOPs).
* :func:`memory_budget`: bytes of everything the GPU holds in the offloaded training setup.

Activation bytes per token per block (bf16, SDPA attention, dropout on) counted from what
autograd saves: LN1 input and output 2d+2d, qkv 6d, attention output 2d (+ its contiguous
copy 2d), dropout mask d, LN2 input and output 2d+2d, MLP up-projection 8d, GELU output 8d,
dropout mask d: about 36d bytes; a checkpointed block keeps only its 2d-byte input.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from effdl.profiling.timing import GIB

GPT2_LARGE_PARAMS = 774_030_080
ACT_BYTES_PER_TOKEN_LAYER = 36  # x d, see module docstring
CKPT_BYTES_PER_TOKEN_LAYER = 2  # x d


@dataclass(frozen=True)
class GPT2Shape:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int = 50257
    n_positions: int = 1024


SHAPES = {
    "large": GPT2Shape(n_layer=36, n_embd=1280, n_head=20),
    "xl": GPT2Shape(n_layer=48, n_embd=1600, n_head=25),
    "tiny": GPT2Shape(n_layer=2, n_embd=64, n_head=2),
}


def gpt2_config(size: str = "large", *, fast_gelu: bool = True, dropout: float = 0.1):
    """A ``transformers.GPT2Config`` for ``size`` in :data:`SHAPES` (SDPA attention)."""
    from transformers import GPT2Config

    if size not in SHAPES:
        raise ValueError(f"unknown GPT-2 size {size!r}; expected one of {sorted(SHAPES)}")
    s = SHAPES[size]
    return GPT2Config(
        n_layer=s.n_layer,
        n_embd=s.n_embd,
        n_head=s.n_head,
        vocab_size=s.vocab_size,
        n_positions=s.n_positions,
        activation_function="gelu_pytorch_tanh" if fast_gelu else "gelu_new",
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        attn_implementation="sdpa",
    )


def build_gpt2(config=None, model_path: Path | None = None, *, fast_gelu: bool = True):
    """``GPT2LMHeadModel`` in fp32 on the CPU: random init from ``config`` (default: large),
    or local pretrained weights from ``model_path`` (never downloads)."""
    from transformers import GPT2LMHeadModel

    if model_path is not None:
        act = "gelu_pytorch_tanh" if fast_gelu else "gelu_new"
        return GPT2LMHeadModel.from_pretrained(
            model_path,
            local_files_only=True,
            torch_dtype=torch.float32,
            activation_function=act,
            attn_implementation="sdpa",
            use_cache=False,
        )
    return GPT2LMHeadModel(config if config is not None else gpt2_config("large"))


def count_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once, as ``model.parameters()`` does)."""
    return sum(p.numel() for p in model.parameters())


def _checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: torch.nn.Module, n: int) -> int:
    """Recompute the first ``n`` transformer blocks in backward; returns how many are wrapped.

    The early blocks are the ones to checkpoint: their recomputation in backward happens last,
    and their parameters' gradients arrive last anyway. State-dict keys are unchanged.
    """
    blocks = model.transformer.h
    if not 0 <= n <= len(blocks):
        raise ValueError(f"can checkpoint 0..{len(blocks)} blocks, got {n}")
    for block in list(blocks)[:n]:
        block.forward = functools.partial(_checkpointed_forward, block.forward)
    return n


class _ChunkedLMLoss(torch.autograd.Function):
    """Mean next-token cross-entropy of ``hidden @ weight.T``; gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int, ignore: int):
        n_valid = (labels != ignore).sum().clamp(min=1)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h, lab = hidden[s : s + chunk], labels[s : s + chunk]
            valid = (lab != ignore).unsqueeze(1)
            target = lab.clamp(min=0).unsqueeze(1)
            logits = (h @ weight.t()).float()  # as HF: low-precision GEMM, fp32 softmax
            lse = torch.logsumexp(logits, dim=1, keepdim=True)
            total += ((lse - logits.gather(1, target)) * valid).sum()
            # d(sum of losses)/d(logits) = softmax - onehot, built in place to save memory
            probs = logits.sub_(lse).exp_()
            probs.scatter_add_(1, target, -torch.ones_like(target, dtype=probs.dtype))
            probs.mul_(valid)
            g = probs.to(h.dtype)
            grad_h[s : s + chunk] = g @ weight
            grad_w += (g.t() @ h).float()
        ctx.save_for_backward(grad_h, grad_w, n_valid)
        ctx.weight_dtype = weight.dtype
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w, n_valid = ctx.saved_tensors
        scale = grad_out / n_valid
        return (
            grad_h * scale.to(grad_h.dtype),
            (grad_w * scale).to(ctx.weight_dtype),
            None,
            None,
            None,
        )


def chunked_lm_loss(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int = 1024, ignore: int = -100
) -> Tensor:
    """Mean cross-entropy of logits ``hidden @ weight.T`` against ``labels`` (``ignore`` skipped).

    ``hidden`` (N, d), ``weight`` (V, d), ``labels`` (N,) int64. Peak extra memory is one chunk of
    fp32 logits (``chunk_tokens x V x 4`` bytes) plus an fp32 ``V x d`` weight-gradient buffer,
    instead of ``N x V`` logits kept for backward. Call backward at most once.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return _ChunkedLMLoss.apply(hidden, weight, labels, chunk_tokens, ignore)


def lm_loss(model: torch.nn.Module, input_ids: Tensor, chunk_tokens: int = 1024) -> Tensor:
    """Next-token loss of a ``GPT2LMHeadModel`` on ``input_ids`` (B, T): the same value as
    ``model(input_ids, labels=input_ids).loss``, without the (B, T, V) logits."""
    hidden = model.transformer(input_ids=input_ids, use_cache=False).last_hidden_state
    d = hidden.shape[-1]
    return chunked_lm_loss(
        hidden[:, :-1].reshape(-1, d),
        model.lm_head.weight,
        input_ids[:, 1:].reshape(-1),
        chunk_tokens,
    )


def memory_budget(
    shape: GPT2Shape,
    n_params: int,
    micro_batch: int,
    seq: int,
    checkpointed: int,
    grad_accumulation: str,
    chunk_tokens: int = 1024,
    working_bytes: int = 2,
    act_bytes_per_token_layer: float | None = None,
) -> dict[str, float]:
    """GiB the GPU holds during training with the offloaded optimizer (estimate, see docstring).

    Keys: working weights, fp32 grad accumulation (``"gpu"`` mode only), stored activations,
    loss chunk (fp32 logits chunk + its low-precision copy; fp32 LM-head grad + the GEMM's
    low-precision and fp32 temporaries), and ``total``. ``act_bytes_per_token_layer`` (None:
    the module docstring's count, 36 d) can be a measured value instead.
    """
    d, tokens = shape.n_embd, micro_batch * seq
    if act_bytes_per_token_layer is None:
        act_bytes_per_token_layer = ACT_BYTES_PER_TOKEN_LAYER * d
    plain = shape.n_layer - checkpointed
    acts = tokens * (
        plain * act_bytes_per_token_layer + checkpointed * CKPT_BYTES_PER_TOKEN_LAYER * d
    )
    # the block being recomputed/back-propagated holds one layer's activations on top
    acts += tokens * act_bytes_per_token_layer if checkpointed else 0
    rows = {
        "working_weights": n_params * working_bytes,
        "grad_accumulation_fp32": n_params * 4 if grad_accumulation == "gpu" else 0,
        "activations": acts,
        "loss_chunk": chunk_tokens * shape.vocab_size * (4 + working_bytes)
        + shape.vocab_size * d * (4 + working_bytes + 4),
    }
    out = {k: v / GIB for k, v in rows.items()}
    out["total"] = sum(out.values())
    return out


def host_budget(n_params: int, grad_accumulation: str, working_bytes: int = 2) -> dict[str, float]:
    """GiB of pinned CPU memory the offloaded optimizer allocates."""
    rows = {
        "master_fp32": n_params * 4,
        "exp_avg_fp32": n_params * 4,
        "exp_avg_sq_fp32": n_params * 4,
        "grad_fp32": n_params * 4,
        "weight_stage": n_params * working_bytes,
        "grad_stage": n_params * working_bytes if grad_accumulation == "cpu" else 0,
    }
    out = {k: v / GIB for k, v in rows.items()}
    out["total"] = sum(out.values())
    return out
