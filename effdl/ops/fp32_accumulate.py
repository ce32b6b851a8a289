"""Adding a low-precision tensor into an fp32 buffer in one vectorized pass.

``fp32.add_(bf16)`` and ``fp32.copy_(bf16)`` mix dtypes, which sends them to torch's dynamically
casting elementwise path: one element per thread, no wide loads. Summing each micro-batch's bf16
gradients into fp32 master gradients is such an add, once per parameter per micro-batch. The
Triton kernel here loads both operands at full width and widens in registers.

Traffic per element: 4 B read + 2 B read + 4 B written for the add (10 B), 6 B for the copy.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's ops serve every input
    triton = None

BLOCK = 4096  # elements per program: 16 KiB of fp32, enough in flight per SM at 8 warps

if triton is not None:

    @triton.jit
    def _accumulate_kernel(dst_ptr, src_ptr, n, OVERWRITE: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        value = tl.load(src_ptr + offsets, mask=mask).to(tl.float32)
        if not OVERWRITE:
            value += tl.load(dst_ptr + offsets, mask=mask)
        tl.store(dst_ptr + offsets, value, mask=mask)


def _triton_accumulate(dst: torch.Tensor, src: torch.Tensor, overwrite: bool) -> None:
    n = dst.numel()
    _accumulate_kernel[(triton.cdiv(n, BLOCK),)](
        dst, src, n, OVERWRITE=overwrite, BLOCK=BLOCK, num_warps=8
    )


def accumulate_fp32_(dst: torch.Tensor, src: torch.Tensor, overwrite: bool = False) -> None:
    """``dst += src`` (``dst = src`` with ``overwrite``), ``dst`` float32, ``src`` any floating
    dtype of the same shape, the sum rounded once to fp32. One Triton kernel where both are
    contiguous CUDA tensors; torch's ``add_``/``copy_`` elsewhere."""
    if dst.dtype != torch.float32 or dst.shape != src.shape:
        raise ValueError(
            f"accumulate_fp32_ needs a float32 dst of src's shape; got dst {dst.dtype} "
            f"{tuple(dst.shape)}, src {tuple(src.shape)}"
        )
    if (
        triton is not None
        and dst.is_cuda
        and src.device == dst.device
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.numel() > 0
    ):
        _triton_accumulate(dst, src, overwrite)
    elif overwrite:
        dst.copy_(src)
    else:
        dst.add_(src)
