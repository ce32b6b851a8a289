"""The GPU and host memory of an offloaded GPT-2 run, estimated before it trains: the model's
share (effdl.profiling.memory_budget) plus the optimizer's own buffers
(:func:`effdl.optim.plan_offload`), the checkpointed blocks that make it fit the cap, the
activation bytes measured on the GPU that sharpen the estimate, and the check that the host
can hold the run at all (:func:`require_run_fits`), made before anything is allocated."""

from __future__ import annotations

import torch

from effdl.cli import UsageError, require_memory
from effdl.gpt2_offload.config import ACCUMULATOR_DTYPES, TrainConfig
from effdl.models.gpt2 import SHAPES, build_gpt2, lm_loss
from effdl.optim import CPUOffloadAdam, OffloadPlan, plan_offload
from effdl.profiling.memory_budget import (
    ACT_BYTES_PER_TOKEN_LAYER,
    fewest_checkpointed_blocks,
    memory_budget,
)
from effdl.profiling.timing import GIB

# memory_budget counts the model's share only: the optimizer's own GPU buffers (accumulator in
# its dtype, device-update scratch) come from the OffloadPlan
WITHOUT_OPTIMIZER_BUFFERS = "none"
BUCKET_NUMEL = 2**25  # parameters per optimizer bucket (a larger tensor gets its own)


def offload_options(cfg: TrainConfig) -> dict:
    """The CPUOffloadAdam keywords of ``cfg`` (what plan_offload takes too)."""
    return {
        "working_dtype": torch.bfloat16,
        "grad_accumulation": cfg.grad_accumulation,
        "grad_accumulation_dtype": ACCUMULATOR_DTYPES[cfg.grad_accumulation_dtype],
        "moments": cfg.moments,
        "update_on": cfg.update_on,
        "bucket_numel": BUCKET_NUMEL,
    }


def param_numels(model_config) -> list[int]:
    """The sizes of the parameters of the GPT-2 of ``model_config`` (a GPT2Config), from the
    model built on the meta device: nothing is allocated."""
    with torch.device("meta"):
        model = build_gpt2(model_config)
    return [p.numel() for p in model.parameters()]


def host_bytes_needed(plan: OffloadPlan, device: torch.device) -> int:
    """Host bytes an offloaded run holds at least: the plan's host buffers, its device buffers
    too where the device is the CPU, and the fp32 model the run builds on the host before the
    optimizer takes its weights over."""
    fp32_model = next(b.bytes for b in plan.buffers if b.state == "master_weights")
    on_host = plan.bytes_on("host") + (plan.bytes_on("gpu") if device.type == "cpu" else 0)
    return on_host + fp32_model


def require_run_fits(cfg: TrainConfig, model_config, device: torch.device) -> OffloadPlan:
    """Refuse, in one line and before anything is allocated, a run this machine cannot hold:
    a ``--level`` preset (a GPU memory target) or the 8-bit update on the device off a CUDA
    device, or a run whose host bytes
    (:func:`host_bytes_needed` of its plan) exceed the host's available memory. Returns the
    plan."""
    if cfg.level is not None and device.type != "cuda":
        raise UsageError(
            f"--level {cfg.level} is a GPU preset (peak GPU memory under --memory-cap-gib "
            f"{cfg.memory_cap_gib:g}): it needs --device cuda (this run is on {device})"
        )
    if cfg.update_on == "device" and device.type != "cuda":
        raise UsageError(
            f"--update-on device runs the 8-bit Adam step on the GPU: it needs --device cuda "
            f"(this run is on {device})"
        )
    plan = plan_offload(param_numels(model_config), **offload_options(cfg))
    need = host_bytes_needed(plan, device)
    require_memory(
        "--size --moments --update-on", need, "cpu",
        f"GPT-2-{cfg.size}'s fp32 model and offloaded optimizer state (plan_offload)",
    )  # fmt: skip
    return plan


def measure_activation_bytes(
    model: torch.nn.Module, opt: CPUOffloadAdam, device: torch.device, cfg: TrainConfig
) -> float:
    """Bytes autograd keeps per token per block, measured on one sequence with no block
    checkpointed (also a warm-up); the gradients it makes are discarded. CUDA only."""
    ids = torch.randint(0, model.config.vocab_size, (1, cfg.seq), device=device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    loss = lm_loss(model, ids, cfg.chunk_tokens)
    held = torch.cuda.memory_allocated(device) - before
    # the loss function keeps its fp32 LM-head gradient and the hidden-state gradient
    held -= model.lm_head.weight.numel() * 4 + cfg.seq * model.config.n_embd * 2
    opt.backward(loss)
    opt.zero_grad()
    return held / (cfg.seq * model.config.n_layer)


def optimizer_gpu_gib(plan: OffloadPlan) -> float:
    """GiB of the optimizer's own GPU buffers (what memory_budget is not given)."""
    return sum(plan.optimizer_gpu_bytes().values()) / GIB


def pick_checkpoint_layers(
    cfg: TrainConfig, n_params: int, act_bytes: float | None, optimizer_gib: float
) -> int:
    """``--checkpoint-layers`` if given, else the fewest blocks whose estimate (weights,
    activations, loss chunk) fits the cap less ``optimizer_gib`` (:func:`optimizer_gpu_gib`)."""
    if cfg.checkpoint_layers >= 0:
        return cfg.checkpoint_layers
    n = fewest_checkpointed_blocks(
        SHAPES[cfg.size], n_params, cfg.micro_batch, cfg.seq, WITHOUT_OPTIMIZER_BUFFERS,
        cfg.memory_cap_gib - optimizer_gib, cfg.chunk_tokens, act_bytes_per_token_layer=act_bytes,
    )  # fmt: skip
    if n is None:
        raise UsageError(
            f"--micro-batch {cfg.micro_batch}: does not fit {cfg.memory_cap_gib} GiB even with "
            "every block checkpointed; use a smaller micro-batch"
        )
    return n


def gpu_estimate(
    cfg: TrainConfig, n_params: int, ckpt: int, act_bytes: float | None, plan: OffloadPlan
) -> dict[str, float]:
    """GiB the GPU holds, by row: memory_budget's working weights, activations and loss chunk
    (``ckpt`` blocks checkpointed), then the optimizer's own GPU buffers, and ``total``."""
    rows = memory_budget(
        SHAPES[cfg.size], n_params, cfg.micro_batch, cfg.seq, ckpt, WITHOUT_OPTIMIZER_BUFFERS,
        cfg.chunk_tokens, act_bytes_per_token_layer=act_bytes,
    )  # fmt: skip
    rows = {k: v for k, v in rows.items() if k not in ("grad_accumulation_fp32", "total")}
    rows.update({k: v / GIB for k, v in plan.optimizer_gpu_bytes().items()})
    return {**rows, "total": sum(rows.values())}


def budget_metrics(
    cfg: TrainConfig,
    n_params: int,
    ckpt: int,
    plan: OffloadPlan,
    measured: dict[str, float | None],
    act_bytes: float | None,
) -> dict:
    """The ``memory_budget`` record's metrics: the GPU estimate (:func:`gpu_estimate`) and the
    host state by buffer, the plan's buffers (``state``), beside what was ``measured`` after
    set-up and the activation bytes measured and estimated."""
    gpu = gpu_estimate(cfg, n_params, ckpt, act_bytes, plan)
    host = [b for b in plan.buffers if b.where == "host"]
    return {
        **{f"gpu_{k}_gib": v for k, v in gpu.items()},
        **{f"host_{b.state}_gib": b.bytes / GIB for b in host},
        "host_total_gib": plan.bytes_on("host") / GIB,
        "state": plan.records(),
        **measured,
        "measured_act_bytes_per_token_layer": act_bytes,  # None off CUDA: not measured
        "estimated_act_bytes_per_token_layer": ACT_BYTES_PER_TOKEN_LAYER * SHAPES[cfg.size].n_embd,
    }
