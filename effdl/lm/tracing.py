"""torch.profiler for an LM training run: named ranges around the Llama's parts and a
scheduled profile over a few steps, written as a Chrome trace."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from effdl.models.llama import Transformer


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
