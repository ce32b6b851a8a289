"""Forward+backward speed of GPT-2 without offload: the baselines an offloaded run's speed is
held against (baseline.py alone, or train.py ``--baseline`` right after its run, on the same
host in the same process).

Two models, each timed at every micro-batch size on random token ids: Hugging Face's
``GPT2LMHeadModel`` as shipped (fp32 weights, ``gelu_new``, its own full-logits loss) under fp16
autocast (bf16 on the CPU), and ours as train.py computes (bf16 weights, tanh GELU, the chunked
loss), without the offload, a memory cap or checkpointing. One record per model and micro-batch
size (``baseline``, ``baseline_own``), then each model's fastest (``*_best``); a size that runs
out of GPU memory is shown as OOM and not logged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from effdl.cli import UsageError, require_choices, require_fits, require_path, require_positive
from effdl.gpt2_offload.inputs import load_model
from effdl.gpt2_offload.steps import gpu_peak_gib, hf_loss
from effdl.models.gpt2 import MODEL_FOLDER, SHAPES, lm_loss
from effdl.profiling.timing import benchmark
from effdl.results import RunLog

COLUMNS = ("micro_batch", "seq_per_s", "peak_gib")
# what each baseline variant times, for the speed-ratio record
BASELINES = {
    "baseline": "Hugging Face GPT2LMHeadModel, fp32 weights, fp16 autocast, full-logits loss",
    "baseline_own": "our GPT-2 as the offloaded run computes it, bf16 weights, chunked loss",
}


@dataclass(frozen=True)
class BaselineConfig:
    """Settings of the baseline runs."""

    size: str = "large"
    seq: int = 1024
    micro_batches: tuple[int, ...] = (4, 8, 16)  # sequences per forward/backward, each timed
    warmup: int = 2  # untimed calls before each measurement
    iters: int = 5  # timed calls (their median is the result)
    chunk_tokens: int = 1024  # of our chunked loss
    dropout: float = 0.0
    model_path: Path | None = None

    def validate(self) -> None:
        require_choices(self, "size", sorted(SHAPES))
        require_positive(self, "seq", "micro_batches", "iters", "chunk_tokens")
        require_positive(self, "warmup", "dropout", minimum=0)
        if not self.dropout < 1:
            raise UsageError(f"--dropout must be < 1, got {self.dropout}")
        positions = SHAPES[self.size].n_positions
        if self.seq > positions:
            raise UsageError(f"--seq {self.seq} exceeds GPT-2's {positions} positions")
        require_fits("--micro-batches --seq", max(self.micro_batches) * self.seq,
                     "a micro-batch's token ids (int64)", 8)  # fmt: skip
        if self.model_path is not None:
            require_path(self.model_path, MODEL_FOLDER, "--model-path")


def time_fwd_bwd(
    model: torch.nn.Module,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    cfg: BaselineConfig,
    micro_batch: int,
    device: torch.device,
) -> dict | None:
    """Metrics of one micro-batch's fwd+bwd (``loss_of(ids)`` then backward); None when it runs
    out of memory."""
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, cfg.seq), device=device)

    def fwd_bwd() -> None:
        loss_of(ids).backward()

    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        stats = benchmark(
            fwd_bwd,
            warmup=cfg.warmup,
            iters=cfg.iters,
            device=device,
            setup=lambda: model.zero_grad(set_to_none=True),
        )
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return None
    return {
        "micro_batch": micro_batch,
        "seq_per_s": micro_batch / stats.median,
        "peak_gib": gpu_peak_gib(device),
        **stats.as_dict("fwd_bwd_s_"),
    }


def baseline_models(cfg: BaselineConfig, device: torch.device) -> Iterator[tuple]:
    """(variant, model, loss_of, amp, weights) of each baseline, one model alive at a time:
    Hugging Face's model as shipped (fp32 weights, gelu_new) under fp16 autocast, and ours as
    the offloaded run computes (bf16 weights, tanh GELU, the chunked loss)."""
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    # random weights are drawn where the model runs (drawing GPT-2-XL's on a CPU is slow)
    where = device if cfg.model_path is None else torch.device("cpu")
    with where:
        hf = load_model(cfg.size, cfg.model_path, cfg.dropout, fast_gelu=False)
    hf = hf.to(device).train()
    yield (
        "baseline",
        hf,
        functools.partial(hf_loss, hf, amp_dtype=amp_dtype),
        str(amp_dtype),
        "fp32",
    )
    del hf
    with where:
        own = load_model(cfg.size, cfg.model_path, cfg.dropout)
    own = own.to(device, torch.bfloat16).train()
    own_loss = functools.partial(lm_loss, own, chunk_tokens=cfg.chunk_tokens)
    yield "baseline_own", own, own_loss, "none", "bf16"


def run_baseline(
    cfg: BaselineConfig, device: torch.device, log: RunLog
) -> tuple[list[dict], dict[str, dict]]:
    """Forward+backward speed of each baseline model at every micro-batch size, and the best:
    (a row per model and size, OOM included; the ``*_best`` metrics by variant)."""
    if device.type == "cuda":  # no cap: the baselines run as they would alone
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    rows, bests = [], {}
    for variant, model, loss_of, amp, weights in baseline_models(cfg, device):
        found = []
        for mb in cfg.micro_batches:
            metrics = time_fwd_bwd(model, loss_of, cfg, mb, device)
            if metrics is None:
                found.append({"micro_batch": mb, "seq_per_s": None, "note": "OOM"})
                continue
            config = {"size": cfg.size, "seq": cfg.seq, "micro_batch": mb, "amp": amp,
                      "weights": weights}  # fmt: skip
            log.log(variant, config, metrics)
            found.append({k: metrics[k] for k in COLUMNS})
        ok = [r for r in found if r["seq_per_s"] is not None]
        if not ok:
            raise RuntimeError(f"{variant}: every micro-batch size ran out of memory")
        bests[variant] = max(ok, key=lambda r: r["seq_per_s"])
        log.log(f"{variant}_best", {"size": cfg.size, "seq": cfg.seq}, bests[variant])
        rows += [{"variant": variant, **r} for r in found]
        del model, loss_of
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, bests


def speed_ratios(seq_per_s: float, bests: dict[str, dict]) -> dict:
    """An offloaded run's median ``seq_per_s`` over each baseline's best micro-batch, with what
    each baseline times (:data:`BASELINES`)."""
    metrics: dict = {"seq_per_s_median": seq_per_s}
    for variant, best in bests.items():
        metrics[f"{variant}_seq_per_s"] = best["seq_per_s"]
        metrics[f"{variant}_micro_batch"] = best["micro_batch"]
        metrics[f"ratio_to_{variant}"] = seq_per_s / best["seq_per_s"]
        metrics[f"{variant}_is"] = BASELINES[variant]
    return metrics
