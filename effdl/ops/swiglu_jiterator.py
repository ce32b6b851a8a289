"""The elementwise half of the SwiGLU MLP as ``torch.cuda.jiterator`` kernels (CUDA only).

Same contract as :class:`effdl.ops.swiglu.ElementwiseOps`, with two differences that come from
jiterator allocating its own outputs: nothing is written in place (``inplace`` and
``ab_scratch`` are allowed, not required, to overwrite inputs), and ``gate_backward`` cannot hand
out ``g`` from its own pass without holding two more (N x I) buffers at once, so the caller
builds ``g`` with :func:`gate` first and drops it before the backward's outputs exist
(``ElementwiseOps.gate_backward_gives_g`` is False).

Why a third backend: where the host bounds the step (small tensors), what counts is the number
of launches and their host cost. Each call here is one kernel, like the Triton ones, but it is
launched from C++ through TensorIterator, at about the host cost of an aten op and well below a
Triton launch's. Bytes are those of the Triton kernels:
``gate`` reads a, b and writes g (3 passes over N x I), ``gate_backward`` reads a, b, dg and
writes da, db (5 passes). The math runs in fp32 and rounds once on store, so float64 is not
served here. Each kernel is compiled by NVRTC on its first call per dtype, then cached by PyTorch.
"""

from __future__ import annotations

import torch
from torch.cuda.jiterator import _create_jit_fn, _create_multi_output_jit_fn

# silu(a) = a * sigmoid(a); silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a)))
_gate = _create_jit_fn(
    """
    template <typename T> T effdl_swiglu_gate(T a, T b) {
        float x = static_cast<float>(a);
        return static_cast<T>(x / (1.0f + ::expf(-x)) * static_cast<float>(b));
    }
    """
)
_gate_backward = _create_multi_output_jit_fn(
    """
    template <typename T> void effdl_swiglu_gate_backward(T a, T b, T dg, T& da, T& db) {
        float x = static_cast<float>(a), y = static_cast<float>(b), d = static_cast<float>(dg);
        float s = 1.0f / (1.0f + ::expf(-x));
        da = static_cast<T>(d * y * s * (1.0f + x * (1.0f - s)));
        db = static_cast<T>(d * x * s);
    }
    """,
    num_outputs=2,
)


def gate(a: torch.Tensor, b: torch.Tensor, *, inplace: bool) -> torch.Tensor:
    """``silu(a) * b`` in one pass, into a new tensor whatever ``inplace`` says."""
    del inplace  # allowed to overwrite a, never required to
    return _gate(a, b)


def gate_backward(
    a: torch.Tensor, b: torch.Tensor, dg: torch.Tensor, *, want_g: bool, ab_scratch: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(da, db, g or None)``: da and db in one pass into new tensors; ``g``, where wanted, by a
    second launch (callers that watch memory build it beforehand instead)."""
    del ab_scratch  # inputs are never overwritten
    da, db = _gate_backward(a, b, dg)
    return da, db, (_gate(a, b) if want_g else None)
