"""Fused Triton kernels for the elementwise half of the SwiGLU MLP (CUDA only).

Same contract as :class:`effdl.ops.swiglu.ElementwiseOps` (which selects these on CUDA). Each
kernel reads every input element once and writes every output once, computing in fp32 and
rounding once on store. Per (N x I) element, in passes over the tensor:

- ``gate``: reads a, b; writes g (3 passes; PyTorch's silu-then-mul takes 5);
- ``gate_backward``: reads a, b, dg; writes da, db and optionally g (5-6 passes; the PyTorch
  fallback takes 14-15 and one extra buffer).

Every program loads its block of all inputs before it stores, and each element belongs to one
program, so outputs may reuse the storage of inputs element for element; that is how the
recomputing levels of :class:`effdl.ops.swiglu.MemoryOptimizedSwigluMLPFunction` keep the
backward within three (N x I) buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _gate_kernel(a_ptr, b_ptr, g_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    g = a * tl.sigmoid(a) * b
    tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_backward_kernel(
    a_ptr, b_ptr, dg_ptr, da_ptr, db_ptr, g_ptr, n, WANT_G: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    dg = tl.load(dg_ptr + offs, mask=mask).to(tl.float32)
    sig = tl.sigmoid(a)
    s = a * sig
    da = dg * b * sig * (1.0 + a * (1.0 - sig))
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, (dg * s).to(db_ptr.dtype.element_ty), mask=mask)
    if WANT_G:
        tl.store(g_ptr + offs, (s * b).to(g_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def gate(a: torch.Tensor, b: torch.Tensor, *, inplace: bool) -> torch.Tensor:
    """``silu(a) * b`` in one pass; with ``inplace`` the result overwrites ``a``."""
    g = a if inplace else torch.empty_like(a)
    n = a.numel()
    if n:
        _gate_kernel[_grid(n)](a, b, g, n, BLOCK=BLOCK, num_warps=8)
    return g


def gate_backward(
    a: torch.Tensor, b: torch.Tensor, dg: torch.Tensor, *, want_g: bool, ab_scratch: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(da, db, g or None)`` in one pass. Outputs go to ``dg``'s storage and, when
    ``ab_scratch``, to ``a``'s and ``b``'s; otherwise new buffers are allocated for the rest."""
    if ab_scratch:
        da, db, g = a, b, (dg if want_g else None)
    else:
        da, db = torch.empty_like(a), dg
        g = torch.empty_like(a) if want_g else None
    n = a.numel()
    if n:
        _gate_backward_kernel[_grid(n)](
            a, b, dg, da, db, g if g is not None else da, n, WANT_G=want_g, BLOCK=BLOCK, num_warps=8
        )
    return da, db, g
