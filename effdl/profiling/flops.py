"""FLOP counting and the hardware ceilings that FLOP/s and MFU are measured against.

Datasheet peaks are leads, not ceilings: the ceilings used in reports are measured on the GPU at
hand with :func:`measure_matmul_tflops` (a large dense GEMM) and :func:`measure_copy_bandwidth`
(a large device-to-device copy, bytes read plus bytes written).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils.flop_counter import FlopCounterMode

from effdl.profiling.timing import TimingStats, benchmark

MATMUL_OPS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm"})

# Dense (no 2:4 sparsity) BF16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s: H100 SXM 989
# (PCIe 756, NVL 835), H200 SXM 989 (the H100's compute with more and faster memory), A100 312.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H100": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.0,
    "A100": 312.0,
}


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


def _one_call(*_shapes: object, **_kwargs: object) -> int:
    """A FLOP formula that counts each call as 1: :class:`MatmulCounter`'s counts are calls."""
    return 1


class MatmulCounter:
    """Counts the aten matmuls that execute inside the region, by op name.

    A ``torch.utils.flop_counter.FlopCounterMode`` whose formula for each op of
    :data:`MATMUL_OPS` is one per call. It sits below autograd, so it sees what runs, not what
    is dispatched: the backward's GEMMs are counted, and a GEMM that
    ``torch.utils.checkpoint``'s early stop aborts before its kernel starts is not (the
    profiler's op events do list it). ``counts`` (a Counter by op name, e.g. ``"mm"``) and
    ``total`` can be read inside the region and after it; entering again starts from zero.
    The mode tracks modules too: under ``torch.inference_mode`` a module must not be given an
    input that requires grad (detach it), or torch's module tracker raises.
    """

    def __init__(self) -> None:
        mapping = {getattr(torch.ops.aten, name): _one_call for name in MATMUL_OPS}
        self._mode = FlopCounterMode(display=False, custom_mapping=mapping)

    def __enter__(self) -> MatmulCounter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    @property
    def counts(self) -> Counter[str]:
        calls = self._mode.get_flop_counts().get("Global", {})
        return Counter({op.__name__: n for op, n in calls.items() if op.__name__ in MATMUL_OPS})

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def peak_bf16_tflops(gpu_name: str) -> float | None:
    """Datasheet dense BF16 peak of the GPU ``torch.cuda.get_device_name()`` calls ``gpu_name``:
    the entry of :data:`PEAK_BF16_TFLOPS` with the longest key found in the name (so "H100 PCIe"
    wins over "H100"), None for a GPU not in the table."""
    name = gpu_name.lower()
    keys = [key for key in PEAK_BF16_TFLOPS if key.lower() in name]
    return PEAK_BF16_TFLOPS[max(keys, key=len)] if keys else None
