"""GiB a GPT-2 holds while training with the CPU-offloaded optimizer, on the GPU and the host.

Activation bytes per token per block (bf16, SDPA attention, dropout on), counted from what
autograd saves: LN1 input and output 2d+2d, qkv 6d, attention output 2d (+ its contiguous copy
2d), dropout mask d, LN2 input and output 2d+2d, MLP up-projection 8d, GELU output 8d, dropout
mask d: about 36d bytes. A checkpointed block keeps only its 2d-byte input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from effdl.profiling.timing import GIB

if TYPE_CHECKING:  # the shape is read by attribute; profiling depends on no model at run time
    from effdl.models.gpt2 import GPT2Shape

ACT_BYTES_PER_TOKEN_LAYER = 36  # x d, see module docstring
CKPT_BYTES_PER_TOKEN_LAYER = 2  # x d
ESTIMATE_HEADROOM_GIB = 0.75  # allocator fragmentation, cuBLAS workspaces, transient grads


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
    """GiB the GPU holds during training with the offloaded optimizer (an estimate).

    ``grad_accumulation``: ``"gpu"`` counts an fp32 gradient accumulator on the GPU, ``"cpu"``
    (accumulation on the host) none, ``"none"`` none either: the caller counts the optimizer's
    own GPU buffers itself (an accumulator of another dtype, update scratch).

    Keys: working weights, fp32 grad accumulation (``"gpu"`` only), stored activations,
    loss chunk (fp32 logits chunk + its low-precision copy; fp32 LM-head grad + the GEMM's
    low-precision and fp32 temporaries), and ``total``. ``act_bytes_per_token_layer`` (None:
    the module docstring's count, 36 d) can be a measured value instead.
    """
    if grad_accumulation not in ("gpu", "cpu", "none"):
        raise ValueError(
            f"grad_accumulation must be 'gpu', 'cpu' or 'none', got {grad_accumulation!r}"
        )
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
    return _in_gib(rows)


def host_budget(n_params: int, grad_accumulation: str, working_bytes: int = 2) -> dict[str, float]:
    """GiB of pinned CPU memory the offloaded optimizer allocates (keys by buffer, and ``total``)."""
    rows = {
        "master_fp32": n_params * 4,
        "exp_avg_fp32": n_params * 4,
        "exp_avg_sq_fp32": n_params * 4,
        "grad_fp32": n_params * 4,
        "weight_stage": n_params * working_bytes,
        "grad_stage": n_params * working_bytes if grad_accumulation == "cpu" else 0,
    }
    return _in_gib(rows)


def fewest_checkpointed_blocks(
    shape: GPT2Shape,
    n_params: int,
    micro_batch: int,
    seq: int,
    grad_accumulation: str,
    cap_gib: float,
    chunk_tokens: int = 1024,
    act_bytes_per_token_layer: float | None = None,
) -> int | None:
    """The fewest blocks to checkpoint so that :func:`memory_budget`'s total plus
    :data:`ESTIMATE_HEADROOM_GIB` stays within ``cap_gib``; None if even all of them do not."""
    for n in range(shape.n_layer + 1):
        est = memory_budget(
            shape, n_params, micro_batch, seq, n, grad_accumulation, chunk_tokens,
            act_bytes_per_token_layer=act_bytes_per_token_layer,
        )  # fmt: skip
        if est["total"] + ESTIMATE_HEADROOM_GIB <= cap_gib:
            return n
    return None


def _in_gib(rows: dict[str, int | float]) -> dict[str, float]:
    out = {k: v / GIB for k, v in rows.items()}
    out["total"] = sum(out.values())
    return out
