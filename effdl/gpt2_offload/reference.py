"""The reference a GPT-2 offload run is held against: the same initial weights trained on the
same batches by ``torch.optim.AdamW(fused=True)`` on fp32 weights under bf16 autocast, and the
gap between the two loss curves."""

from __future__ import annotations

import functools

import torch

from effdl.gpt2_offload.config import TrainConfig
from effdl.gpt2_offload.inputs import initial_model
from effdl.gpt2_offload.steps import run_plain
from effdl.models.gpt2 import lm_loss
from effdl.results import RunLog

# equivalence targets: mean |loss gap| per step between ours and the reference, and each run's
# fall (1 - last / first) on a fixed batch
MAX_MEAN_GAP_NATS = 0.05
MIN_FALL = 0.5


def autocast_lm_loss(model: torch.nn.Module, ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The chunked LM loss under bf16 autocast (fp32 weights, bf16 matmuls)."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        return lm_loss(model, ids, chunk_tokens)


def run_reference(
    cfg: TrainConfig,
    batches: list[torch.Tensor],
    device: torch.device,
    log: RunLog,
    seed: int,
    config: dict,
    betas: tuple[float, float] = (0.9, 0.999),
) -> list[dict]:
    """The same model from the same initial weights (``seed``) trained on ``batches`` by
    ``torch.optim.AdamW(fused=True)``: fp32 weights on ``device``, bf16 autocast, no memory cap
    and no checkpointing, the same micro-batches and learning rates as ours, ``betas`` as ours
    by default (records ``reference_adamw``)."""
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    model = initial_model(cfg, seed).to(device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay, fused=True
    )
    loss_of = functools.partial(autocast_lm_loss, model, chunk_tokens=cfg.chunk_tokens)
    ref_config = {**config, "optimizer": "torch.optim.AdamW(fused=True)", "weights": "fp32",
                  "amp": "bf16", "checkpoint_layers": 0, "memory_cap_gib": None}  # fmt: skip
    return run_plain("reference_adamw", opt, loss_of, batches, cfg, device, log, ref_config, False)


def equivalence_summary(ours: list[dict], reference: list[dict]) -> dict:
    """Both loss curves, their |gap| per step with its mean and max, each run's fall
    (1 - last / first), and the pass flags against :data:`MAX_MEAN_GAP_NATS` and
    :data:`MIN_FALL`."""
    loss_ours = [r["loss"] for r in ours]
    loss_ref = [r["loss"] for r in reference]
    gap = [abs(a - b) for a, b in zip(loss_ours, loss_ref, strict=True)]
    fall_ours = 1.0 - loss_ours[-1] / loss_ours[0]
    fall_ref = 1.0 - loss_ref[-1] / loss_ref[0]
    mean_gap = sum(gap) / len(gap)
    gap_ok, fall_ok = mean_gap <= MAX_MEAN_GAP_NATS, min(fall_ours, fall_ref) >= MIN_FALL
    return {
        "steps": len(gap),
        "lr": [r["lr"] for r in ours],
        "loss_ours": loss_ours,
        "loss_reference": loss_ref,
        "abs_gap": gap,
        "mean_abs_gap": mean_gap,
        "max_abs_gap": max(gap),
        "fall_ours": fall_ours,
        "fall_reference": fall_ref,
        "max_mean_gap_nats": MAX_MEAN_GAP_NATS,
        "min_fall": MIN_FALL,
        "gap_ok": gap_ok,
        "fall_ok": fall_ok,
        "passed": gap_ok and fall_ok,
    }
