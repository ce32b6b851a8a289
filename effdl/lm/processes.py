"""The training script's set-up: processes, the model on its device(s), optimizer, LR schedule,
the profiler's named ranges and the FLOP/s yardsticks.

Parallelism stays out of the model: the Llama from effdl.models.llama is built on the meta
device and materialised on every rank with the same seed (so every rank starts from the same
weights as a single process would); effdl.parallel.wrap_model then compiles it block by block
and wraps it in DDP or shards it with FSDP2.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from effdl.cli import UsageError, device_from_arg
from effdl.models.llama import Transformer, TransformerModelArgs, build_on_meta, materialize
from effdl.results import read_records

CEILINGS = Path(__file__).resolve().parent.parent / "reports" / "results" / "ceilings"


@dataclass(frozen=True)
class Dist:
    """This process's place: rank, number of processes, its device."""

    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(parallel: str, device_arg: str) -> Dist:
    """Join the process group when launched by torchrun (NCCL on CUDA, gloo on the CPU).

    ``--parallel ddp|fsdp`` without torchrun runs as a group of one (FSDP2's mixed precision
    then works on a single GPU); ``--parallel none`` under torchrun with several processes is
    refused, since every process would train alone on the same data.
    """
    launched = "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", 1))
    if parallel == "none" and world > 1:
        raise UsageError(f"{world} processes with --parallel none: use --parallel ddp or fsdp")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_arg in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = device_from_arg(device_arg)
    if parallel == "none":
        return Dist(0, 1, device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launched:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def teardown_distributed(finished: bool) -> None:
    """Leave the process group; after a finished run all ranks leave together (a rank that
    exits while another still uses gloo aborts it), after an error without waiting."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def build_model(args: TransformerModelArgs, device: torch.device, seed: int) -> Transformer:
    """The model on the meta device, then materialised on ``device`` in fp32 with ``seed``."""
    model = build_on_meta(args)
    torch.manual_seed(seed)
    return materialize(model, device, torch.float32)


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


# ------------------------------------------------------------------------ profiler ranges
def _range_hooks(module: nn.Module, name: str) -> None:
    """A ``record_function`` range named ``name`` around every forward of ``module``."""
    open_ranges: list[torch.autograd.profiler.record_function] = []

    def enter(*_: object) -> None:
        rf = torch.autograd.profiler.record_function(name)
        rf.__enter__()
        open_ranges.append(rf)

    def leave(*_: object) -> None:
        open_ranges.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def add_profile_ranges(model: Transformer) -> None:
    """Named ranges for the trace: attention, each FFN GEMM (w1 gate, w3 up, w2 down), the
    norms and the output head. The backward kernels of each range are linked to it by the
    profiler's sequence numbers (shown as ``autograd::engine::evaluate_function``)."""
    for i, block in enumerate(model.layers):
        _range_hooks(block.attention, f"L{i}.attention")
        _range_hooks(block.attention_norm, f"L{i}.attention_norm")
        _range_hooks(block.ffn_norm, f"L{i}.ffn_norm")
        ffn = block.feed_forward
        for gemm, role in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            _range_hooks(getattr(ffn, gemm), f"L{i}.ffn.{gemm}_{role}")
    _range_hooks(model.norm, "final_norm")
    _range_hooks(model.output, "output_head")


@contextmanager
def profiled(
    enabled: bool, skip: int, active: int, trace: Path, device: torch.device
) -> Iterator[Callable[[], None]]:
    """torch.profiler over ``active`` steps after ``skip`` steps; yields the per-step callback
    and writes a Chrome trace (open in Perfetto or chrome://tracing) to ``trace``."""
    if not enabled:
        yield lambda: None
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    trace.parent.mkdir(parents=True, exist_ok=True)
    wait, warmup = max(0, skip - 1), min(1, skip)
    prof = profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
        record_shapes=True,
    )
    with prof:
        yield prof.step


# ------------------------------------------------------------------------ yardsticks
def measured_bf16_ceiling(gpu_name: str | None, folder: Path = CEILINGS) -> float | None:
    """The best bf16 dense-GEMM TFLOP/s measured on this GPU model by
    swiglu_checkpoint/gpu_ceilings.py (records ``matmul_bf16`` in ``folder``); None if absent."""
    if gpu_name is None or not folder.is_dir():
        return None
    found = [
        rec["metrics"]["tflops"]
        for file in sorted(folder.glob("*.jsonl"))
        for rec in read_records(file)
        if rec["variant"] == "matmul_bf16" and rec["env"].get("gpu") == gpu_name
    ]
    return max(found) if found else None


ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


def select_attention(backend: str) -> None:
    """Restrict ``F.scaled_dot_product_attention`` to one backend, process-wide ("auto": torch's
    own choice). Set before the first forward, so compiled blocks trace with it."""
    if backend == "auto":
        return
    torch.backends.cuda.enable_flash_sdp(backend == "flash")
    torch.backends.cuda.enable_cudnn_sdp(backend == "cudnn")
    torch.backends.cuda.enable_mem_efficient_sdp(backend == "efficient")
    torch.backends.cuda.enable_math_sdp(backend == "math")
