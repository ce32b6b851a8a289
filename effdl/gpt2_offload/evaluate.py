"""What a GPT-2 run measures on text it never trained on: the mean next-token loss over held-out
rows, and the model's continuations of fixed prompts, greedy and sampled from a fixed seed
(:func:`effdl.models.generate.generate`), as text."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from effdl.models.generate import generate
from effdl.models.gpt2 import lm_loss

MODES = ("greedy", "sampled")


def amp_context(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; plain fp32 on the CPU (its bf16 matmuls are slow, and it only
    runs smoke tests)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module,
    rows: torch.Tensor,
    micro_batch: int,
    chunk_tokens: int,
    device: torch.device,
) -> float | None:
    """Mean next-token loss over ``rows`` ((n, seq) token ids; None for none: nothing was
    measured), in micro-batches, in eval mode (the model's mode is restored after)."""
    if len(rows) == 0:
        return None
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for mb in rows.split(micro_batch):
        with amp_context(device):
            total += lm_loss(model, mb.to(device), chunk_tokens).float() * len(mb)
    model.train(was_training)
    return float(total) / len(rows)


@dataclass(frozen=True)
class Sampling:
    """How the prompts are continued: ``max_new_tokens`` each, greedy and sampled at
    ``temperature`` from the ``top_k`` most likely ids, prompt ``i`` drawn from a generator
    seeded ``seed + i`` (the same draws before and after training wherever the logits agree)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    seed: int


def continuations(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    decode: Callable[[Sequence[int]], str],
    stop_ids: Collection[int] = (),
) -> Iterator[dict]:
    """For each prompt (token ids) and each of :data:`MODES`, as it is made: ``prompt`` (its
    index), ``mode``, ``completion`` (the new ids decoded), ``new_tokens``, ``stopped`` (it
    ended at a stop id) and ``seconds``."""
    for i, ids in enumerate(prompts):
        for mode in MODES:
            start = time.perf_counter()
            if mode == "greedy":
                out = generate(model, ids, sampling.max_new_tokens, stop_ids=stop_ids)
            else:
                g = torch.Generator().manual_seed(sampling.seed + i)
                out = generate(model, ids, sampling.max_new_tokens, temperature=sampling.temperature,
                               top_k=sampling.top_k, generator=g, stop_ids=stop_ids)  # fmt: skip
            yield {
                "prompt": i,
                "mode": mode,
                "completion": decode(out),
                "new_tokens": len(out),
                "stopped": bool(out) and out[-1] in stop_ids,
                "seconds": time.perf_counter() - start,
            }
