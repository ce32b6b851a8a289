"""FLOP counting and the hardware ceilings that FLOP/s and MFU are measured against.

Datasheet peaks are leads, not ceilings: the ceilings used in reports are measured on the GPU at
hand with :func:`measure_matmul_tflops` (a large dense GEMM) and :func:`measure_copy_bandwidth`
(a large device-to-device copy, bytes read plus bytes written).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from effdl.profiling.timing import TimingStats, benchmark

MATMUL_OPS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm"})


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of one (m x k) @ (k x n) product: a multiply and an add per term."""
    return 2 * m * n * k


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def measure_matmul_tflops(
    size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    warmup: int = 3,
    iters: int = 10,
) -> tuple[float, TimingStats]:
    """TFLOP/s of a square ``size``-cubed GEMM on random data (median of ``iters`` calls).

    Random inputs, not zeros: on Hopper a GEMM of zeros runs measurably faster than real data.
    Returns (median TFLOP/s, timing stats).
    """
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(size, size, device=dev, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=dev, dtype=dtype, generator=gen)
    out = torch.empty(size, size, device=dev, dtype=dtype)
    stats = benchmark(lambda: torch.matmul(a, b, out=out), warmup=warmup, iters=iters, device=dev)
    return tflops(matmul_flops(size, size, size), stats.median), stats


def measure_copy_bandwidth(
    nbytes: int,
    device: str | torch.device,
    *,
    warmup: int = 3,
    iters: int = 10,
) -> tuple[float, TimingStats]:
    """Memory bandwidth in GB/s (1e9 B/s) of copying ``nbytes``, counting bytes read + written."""
    dev = torch.device(device)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    stats = benchmark(lambda: dst.copy_(src), warmup=warmup, iters=iters, device=dev)
    return 2 * nbytes / stats.median / 1e9, stats


class MatmulCounter(TorchDispatchMode):
    """Counts the aten matmuls that execute inside the region, by op name.

    It sits below autograd, so it sees what runs, not what is dispatched: a GEMM that
    ``torch.utils.checkpoint``'s early stop aborts before its kernel starts is not counted (the
    profiler's op events do list it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMUL_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))
