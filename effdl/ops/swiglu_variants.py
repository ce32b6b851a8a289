"""The SwiGLU MLP stacks a recomputation benchmark compares, by variant name, and their cost model.

Variants: ``reference`` (SwigluMLP under plain autograd), ``checkpoint`` (the same inside
torch.utils.checkpoint, per layer), ``level0/1/2`` (MemoryOptimizedSwigluMLP at each
CheckpointLevel) and ``level0_<backend>`` (level 0 with its elementwise backend forced). A
variant's cost per training step is its GEMM FLOPs and its elementwise bytes; its floor is the
first at a measured square-GEMM rate (a reference, not an upper bound) plus the second at a
measured copy bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from effdl.cli import UsageError
from effdl.models.swiglu import Checkpointed, MLPStack, SwigluMLP
from effdl.ops.swiglu import CheckpointLevel, MemoryOptimizedSwigluMLP, elementwise_ops

LEVEL_VARIANTS = {
    "level0": CheckpointLevel.SAVE_ALL,
    "level1": CheckpointLevel.RECOMPUTE_ALL,
    "level2": CheckpointLevel.RECOMPUTE_ELEMENTWISE,
    "level0_torch": CheckpointLevel.SAVE_ALL,
    "level0_jiterator": CheckpointLevel.SAVE_ALL,
    "level0_triton": CheckpointLevel.SAVE_ALL,
}
FORCED_BACKEND = {
    "level0_torch": "torch",
    "level0_jiterator": "jiterator",
    "level0_triton": "triton",
}
VARIANTS = [
    "reference",
    "checkpoint",
    "level0",
    "level2",
    "level1",
    "level0_torch",
    "level0_jiterator",
    "level0_triton",
]
# GEMMs of 2*N*H*I FLOPs per layer and step: 3 forward + 6 backward, plus the recomputed ones.
# Non-reentrant checkpointing stops re-running the forward once g exists again (all the backward
# needs), so it re-runs xW and xV but not gU (tests/profiling/test_flops.py counts them).
GEMMS = {
    "reference": 9,
    "checkpoint": 11,
    "level0": 9,
    "level2": 9,
    "level1": 11,
    "level0_torch": 9,
    "level0_jiterator": 9,
    "level0_triton": 9,
}
# Elementwise traffic per layer and step, in passes over an (N x I) tensor (one read or write).
# aten (reference): silu 2 + mul 3 forward, mul-backward 6 + silu-backward 3; checkpoint re-runs
# the forward pair. Fused Triton: gate 3; backward 5, or 6 when it also rebuilds g for dU.
# jiterator: gate 3; backward 5, after a separate gate (3) where g is rebuilt for dU.
# PyTorch path: gate = silu 2 + mul_ 3; backward = silu 2 + silu_backward 3 + 2 muls 6 (+3 for g).
PASSES = {
    "aten": {"reference": 14, "checkpoint": 19},
    "triton": {"level0": 8, "level2": 9, "level1": 9},
    "jiterator": {"level0": 8, "level2": 11, "level1": 11},
    "torch": {"level0": 16, "level2": 19, "level1": 19},
}


@dataclass(frozen=True)
class Shape:
    """One benchmark config: the input (batch_size x seq_len x hidden_dim) and the stack."""

    batch_size: int
    seq_len: int
    hidden_dim: int
    intermediate_size: int
    num_layers: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """A ``--configs`` entry ``batch,seq,hidden,intermediate,layers``; UsageError unless it
        is five positive integers."""
        try:
            values = [int(v) for v in text.split(",")]
            shape = cls(*values)
        except (TypeError, ValueError):
            raise UsageError(
                f"--configs: {text!r} is not batch,seq,hidden,intermediate,layers (5 integers)"
            ) from None
        if min(values) <= 0:
            raise UsageError(f"--configs: {text!r} has a non-positive entry")
        return shape

    def __str__(self) -> str:  # the --configs form
        return ",".join(str(v) for v in asdict(self).values())

    @property
    def tokens(self) -> int:
        """Rows of every GEMM: batch_size x seq_len."""
        return self.batch_size * self.seq_len

    @property
    def label(self) -> str:
        """A short name for tables."""
        return (
            f"{self.batch_size}x{self.seq_len} h{self.hidden_dim} "
            f"i{self.intermediate_size} L{self.num_layers}"
        )

    def gemm_flops(self, variant: str) -> int:
        """GEMM FLOPs of one training step of the whole stack."""
        n, h, i = self.tokens, self.hidden_dim, self.intermediate_size
        return GEMMS[variant] * 2 * n * h * i * self.num_layers

    def elementwise_bytes(self, variant: str, backend: str, itemsize: int) -> int:
        """Bytes the elementwise part of one training step moves, on ``backend``."""
        passes = PASSES[backend][variant.split("_")[0]]
        return passes * self.tokens * self.intermediate_size * itemsize * self.num_layers


def build_stack(
    variant: str, shape: Shape, dtype: torch.dtype, device: torch.device, residual: bool
) -> nn.Module:
    """``variant``'s stack of ``shape.num_layers`` MLPs (``x + mlp(x)`` each when ``residual``)."""
    kw = {"device": device, "dtype": dtype}
    h, i = shape.hidden_dim, shape.intermediate_size
    if variant in LEVEL_VARIANTS:
        backend = FORCED_BACKEND.get(variant, "auto")
        layers = [
            MemoryOptimizedSwigluMLP(h, i, LEVEL_VARIANTS[variant], elementwise=backend, **kw)
            for _ in range(shape.num_layers)
        ]
    else:
        layers = [SwigluMLP(h, i, **kw) for _ in range(shape.num_layers)]
        if variant == "checkpoint":
            layers = [Checkpointed(layer) for layer in layers]
    return MLPStack(layers, residual=residual)


@dataclass(frozen=True)
class Cost:
    """A variant's work per step and its floor: GEMM FLOPs at the measured square-GEMM rate
    plus elementwise bytes at the measured copy bandwidth."""

    backend: str
    gemm_flops: int
    elementwise_bytes: int
    floor_s: float


def cost_of(
    variant: str,
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
    ceiling: float,
    bandwidth: float,
) -> Cost:
    """``variant``'s work per step at ``shape`` and its floor at ``ceiling`` TFLOP/s and
    ``bandwidth`` GB/s."""
    backend = backend_of(variant, shape, dtype, device)
    flops = shape.gemm_flops(variant)
    ew_bytes = shape.elementwise_bytes(
        variant, backend, torch.empty((), dtype=dtype).element_size()
    )
    return Cost(backend, flops, ew_bytes, flops / (ceiling * 1e12) + ew_bytes / (bandwidth * 1e9))


def with_costs(metrics: dict, shape: Shape, cost: Cost, ceiling: float, bandwidth: float) -> dict:
    """``metrics`` of one variant with its achieved TFLOP/s and its cost model added."""
    if "step_s_median" in metrics:
        step = metrics["step_s_median"]
        metrics.update(
            tflops_model=shape.gemm_flops("reference") / step / 1e12,  # useful FLOPs (9 GEMMs)
            tflops_executed=cost.gemm_flops / step / 1e12,  # incl. recomputed GEMMs
            frac_ceiling=cost.gemm_flops / step / 1e12 / ceiling,
            floor_s=cost.floor_s,
            floor_frac=cost.floor_s / step,
        )
    metrics.update(
        elementwise=cost.backend,
        gemm_flops=cost.gemm_flops,
        elementwise_bytes=cost.elementwise_bytes,
        ceiling_tflops=ceiling,
        copy_gb_per_s=bandwidth,
    )
    return metrics


def backend_of(variant: str, shape: Shape, dtype: torch.dtype, device: torch.device) -> str:
    """Which elementwise code a variant runs: aten (autograd's own kernels), or the name of its
    effdl backend (torch, jiterator, triton)."""
    if variant not in LEVEL_VARIANTS:
        return "aten"
    numel = shape.tokens * shape.intermediate_size
    return elementwise_ops(device, numel, dtype, FORCED_BACKEND.get(variant, "auto")).name
