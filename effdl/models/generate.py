"""Text generation with a GPT-2 (Hugging Face ``GPT2LMHeadModel``, as effdl.models.gpt2 builds
it): greedy decoding, or sampling with a temperature and top-k from a generator the caller seeds.

One forward over the prompt fills the model's key/value cache, then each new token costs one
forward of one position. Only the last position goes through the LM head. Sampling draws on the
CPU from a CPU ``torch.Generator``, so a seed draws the same tokens on any device wherever the
logits agree.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Sequence

import torch
from torch import Tensor


def _cache_keyword(model: torch.nn.Module) -> str:
    """The name of the model's key/value cache, as its ``transformer`` takes and returns it:
    ``cache`` in newer transformers releases, ``past_key_values`` before."""
    parameters = inspect.signature(model.transformer.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def next_token(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """The id chosen from one position's ``logits`` (V,): the argmax for ``temperature`` 0 (the
    lowest id among ties), else a draw from softmax(logits / temperature) restricted to the
    ``top_k`` largest (None: all), with ``generator`` (a CPU one)."""
    if temperature == 0:
        return int(logits.argmax())
    scaled = logits.float() / temperature
    if top_k is not None and top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    stop_ids: Collection[int] = (),
) -> list[int]:
    """The ids ``model`` continues ``prompt`` (a non-empty sequence of ids) with: at most
    ``max_new_tokens``, ending early after the first id in ``stop_ids`` (kept). Each id is
    :func:`next_token` of the last position's logits. The model runs in eval mode (its mode is
    restored after); ValueError when prompt and new tokens exceed its positions."""
    positions = model.config.n_positions
    if not prompt or len(prompt) + max_new_tokens > positions:
        raise ValueError(
            f"a prompt of {len(prompt)} ids and {max_new_tokens} new tokens must fit the "
            f"model's {positions} positions (and the prompt cannot be empty)"
        )
    device = next(model.parameters()).device
    inputs = torch.as_tensor(list(prompt), dtype=torch.long, device=device).view(1, -1)
    was_training = model.training
    model.eval()
    keyword, cache, out = _cache_keyword(model), None, []
    try:
        for _ in range(max_new_tokens):
            step = model.transformer(input_ids=inputs, use_cache=True, **{keyword: cache})
            cache = getattr(step, keyword)
            logits = model.lm_head(step.last_hidden_state[0, -1])
            out.append(next_token(logits, temperature, top_k, generator))
            if out[-1] in stop_ids:
                break
            inputs = torch.tensor([[out[-1]]], device=device)
    finally:
        model.train(was_training)
    return out
