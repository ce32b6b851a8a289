"""GPT-2 (Hugging Face ``GPT2LMHeadModel``) built from its config, and what fits it in 11 GiB.

* :func:`gpt2_config` / :func:`build_gpt2`: GPT-2-Large is 36 layers, d=1280, 20 heads, vocab
  50257, 1024 positions: 774,030,080 parameters (the LM head is tied to the token embedding).
  Random init by default; pretrained weights only from a local folder. ``fast_gelu`` swaps
  HF's python ``gelu_new`` (eight elementwise kernels, four saved 4d-wide tensors) for
  ``gelu_pytorch_tanh``: the same tanh formula in one kernel (tests compare logits and grads).
* :func:`checkpoint_blocks`: activation checkpointing of the first ``n`` blocks (each keeps only
  its input and recomputes its forward in backward), so memory can be traded layer by layer.
* :func:`lm_loss`: the next-token loss through :func:`effdl.ops.chunked_lm_loss.chunked_lm_loss`,
  without the ``tokens x 50257`` logits.
* :func:`save_gpt2_folder`: a trained model as the local folder :func:`build_gpt2` loads, with
  its tokenizer beside it, written whole or not at all.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from effdl.ops.chunked_lm_loss import chunked_lm_loss

GPT2_LARGE_PARAMS = 774_030_080
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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


def backward_micro_batches(
    loss_of: Callable[[Tensor], Tensor], batch: Tensor, micro_batch: int, device: torch.device
) -> list[Tensor]:
    """Backward of ``loss_of`` on each ``micro_batch`` rows of ``batch`` (moved to ``device``;
    ``len(batch)`` a multiple of ``micro_batch``), each loss divided by the number of
    micro-batches, so the gradients summed in ``.grad`` are those of the whole batch's mean
    loss; returns those scaled losses, detached (their sum is the batch's loss; nothing is read
    back to the host)."""
    n_micro = len(batch) // micro_batch
    losses = []
    for mb in batch.split(micro_batch):
        loss = loss_of(mb.to(device, non_blocking=True)) / n_micro
        loss.backward()
        losses.append(loss.detach())
    return losses


def save_gpt2_folder(
    model: torch.nn.Module,
    folder: Path,
    tokenizer_dir: Path | None = None,
    notes: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` (a ``GPT2LMHeadModel``) as a Hugging Face folder that
    :func:`build_gpt2` loads: ``config.json`` and ``model.safetensors`` in the parameters' dtype
    (the tied LM head stored once), the :data:`TOKENIZER_FILES` of ``tokenizer_dir`` that exist,
    and ``notes`` as ``notes.json`` (provenance; loaders ignore it). ``model`` is not modified.

    Built in a temporary sibling folder and renamed to ``folder`` at the end, so an interrupted
    write leaves nothing under that name; ``FileExistsError`` if ``folder`` exists and is not
    empty (nothing is overwritten)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp"))
    try:
        model.save_pretrained(tmp)  # safetensors, the default
        for name in TOKENIZER_FILES:
            if tokenizer_dir is not None and (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
        if notes is not None:
            (tmp / "notes.json").write_text(json.dumps(notes, indent=1, default=str))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users
        try:
            tmp.rename(folder)
        except OSError:
            if folder.exists():
                raise FileExistsError(f"{folder} exists: not overwritten") from None
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
