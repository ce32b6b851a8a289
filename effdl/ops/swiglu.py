"""SwiGLU MLP as one autograd Function that chooses what to keep for backward.

``MemoryOptimizedSwigluMLPFunction.apply(x, W, V, U, checkpoint_level)`` computes
``(silu(x W) * (x V)) U`` for ``x`` of shape ``(..., hidden)``, ``W``, ``V`` of shape
``(hidden, intermediate)`` and ``U`` of shape ``(intermediate, hidden)`` (the transposes of the
``nn.Linear`` weights of :class:`effdl.models.swiglu.SwigluMLP`). ``checkpoint_level`` trades
memory for recomputation (:class:`CheckpointLevel`). The elementwise part (``silu(a) * b`` and
its backward) runs as one fused Triton kernel on CUDA for large tensors, as one
``torch.cuda.jiterator`` kernel (cheaper to launch) for small ones on CUDA, and as a short chain of
in-place PyTorch ops elsewhere; :func:`elementwise_ops` is the one place that chooses, and the
``elementwise`` argument (``"auto"`` or a backend name) can force one.

At small sizes a training step is bound by CPU dispatch, not by the GPU, so the per-call Python
work is kept to the minimum: autocast is switched off only when it is on, the level and the
backend are looked up once per forward (the backward reuses them), and validation compares
attributes without building collections.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

if TYPE_CHECKING:
    from effdl.models.swiglu import SwigluMLP

ELEMENTWISE_BACKENDS = ("auto", "torch", "jiterator", "triton")


class CheckpointLevel(IntEnum):
    """What the forward keeps for backward. The numbers are names, not an order of savings.

    Per layer, with ``N`` tokens and ``I`` intermediate units, the kept activations are:

    - ``SAVE_ALL`` (0): ``x`` and the weights plus ``a = xW``, ``b = xV``, ``g = silu(a) * b``
      (three ``N x I`` tensors); backward runs no GEMM twice.
    - ``RECOMPUTE_ALL`` (1): ``x`` and the weights only; backward re-runs the two GEMMs
      ``xW``, ``xV`` (2 of the 9 GEMMs of a step, +22% GEMM FLOPs) and the elementwise part.
    - ``RECOMPUTE_ELEMENTWISE`` (2): ``x``, the weights, ``a`` and ``b`` (two ``N x I``
      tensors); backward recomputes only ``g``, fused into the elementwise backward pass, so it
      costs memory traffic but no FLOPs worth counting.

    Where ``ctx.needs_input_grad`` shows that a gradient is not wanted, tensors needed only for it
    are not kept either (for example frozen weights: ``x`` is not kept at levels 0 and 2).
    """

    SAVE_ALL = 0
    RECOMPUTE_ALL = 1
    RECOMPUTE_ELEMENTWISE = 2

    @classmethod
    def parse(cls, level: int) -> CheckpointLevel:
        """``level`` as a CheckpointLevel; anything else is a ValueError naming the choices."""
        try:
            # a dict lookup, cheaper than calling the enum, on every forward
            return _LEVEL_OF_VALUE[level]
        except (KeyError, TypeError):
            choices = ", ".join(f"{m.value} ({m.name})" for m in cls)
            raise ValueError(f"checkpoint_level must be one of {choices}; got {level!r}") from None


_LEVEL_OF_VALUE = {m.value: m for m in CheckpointLevel}


# --------------------------------------------------------------------------- elementwise part


@dataclass(frozen=True)
class ElementwiseOps:
    """The elementwise half of the layer, one implementation per backend.

    ``gate(a, b, inplace)`` returns ``g = silu(a) * b``; with ``inplace`` it may be written into
    ``a``'s storage. ``gate_backward(a, b, dg, want_g, ab_scratch)`` returns
    ``(da, db, g or None)`` with ``da = dg * b * silu'(a)``, ``db = dg * silu(a)``; ``dg`` is
    always consumed (its storage may hold an output), and ``a``, ``b`` may be consumed too when
    ``ab_scratch`` (otherwise they are left untouched, e.g. because they are saved tensors that a
    second backward may read). Inputs are contiguous tensors of one shape and dtype.
    ``gate_backward_gives_g`` is False for a backend that writes nothing in place: its
    ``(da, db, g)`` would hold two more (N x I) buffers at once, so the caller builds ``g`` with
    ``gate`` beforehand and drops it before calling ``gate_backward``.
    """

    name: str
    gate: Callable[..., torch.Tensor]
    gate_backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    gate_backward_gives_g: bool = True


def _torch_gate(a: torch.Tensor, b: torch.Tensor, *, inplace: bool) -> torch.Tensor:
    return F.silu(a, inplace=inplace).mul_(b)


def _torch_gate_backward(
    a: torch.Tensor, b: torch.Tensor, dg: torch.Tensor, *, want_g: bool, ab_scratch: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    # Five passes and at most one extra (N x I) buffer: s; b * silu'(a) via aten's fused
    # silu_backward (written over a when a is scratch); then three in-place products.
    s = F.silu(a)
    if ab_scratch:
        da = torch.ops.aten.silu_backward.grad_input(b, a, grad_input=a)
    else:
        da = torch.ops.aten.silu_backward(b, a)
    da.mul_(dg)
    db = dg.mul_(s)
    g = s.mul_(b) if want_g else None
    return da, db, g


TORCH_OPS = ElementwiseOps("torch", _torch_gate, _torch_gate_backward)

# Smallest (N x I) element count per dtype at which ``auto`` takes the fused Triton kernels on
# CUDA; below it, jiterator: both move the same bytes at level 0, but a Triton launch costs more
# host time, which bounds small steps. From here up Triton also serves levels 1 and 2 better (it
# writes outputs over inputs and returns g from the backward). Both compute in fp32, so dtypes
# not listed (float64) stay on the PyTorch path.
TRITON_MIN_ELEMENTS: dict[torch.dtype, int] = {
    torch.bfloat16: 1 << 25,
    torch.float16: 1 << 25,
    torch.float32: 1 << 22,
}


@functools.cache
def _jiterator_ops() -> ElementwiseOps | None:
    """The ``torch.cuda.jiterator`` backend, or None where this PyTorch build lacks jiterator."""
    try:
        from effdl.ops import swiglu_jiterator
    except ImportError:
        return None
    return ElementwiseOps(
        "jiterator",
        swiglu_jiterator.gate,
        swiglu_jiterator.gate_backward,
        gate_backward_gives_g=False,
    )


@functools.cache
def _triton_ops() -> ElementwiseOps | None:
    """The fused Triton backend, or None where Triton does not import (tried once, then cached:
    a failed import is not cached by Python and would search the path again on every call)."""
    try:
        from effdl.ops import swiglu_triton
    except ImportError:
        return None
    return ElementwiseOps("triton", swiglu_triton.gate, swiglu_triton.gate_backward)


def elementwise_ops(
    device: torch.device,
    numel: int | None = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> ElementwiseOps:
    """The elementwise backend for ``numel`` elements of ``dtype`` on ``device``: the only place
    that chooses.

    ``backend`` is one of ``ELEMENTWISE_BACKENDS``: ``auto``, or ``torch``, ``jiterator``,
    ``triton`` (forced; an ImportError if that backend is missing). ``auto`` takes, on CUDA,
    Triton where it imports and the (N x I) tensors hold at least ``TRITON_MIN_ELEMENTS[dtype]``
    elements, jiterator below that, and PyTorch ops for dtypes not listed there (float64) and off
    CUDA; ``numel`` or ``dtype`` left None drops that part of the test (the answer for large
    tensors of a dtype Triton serves).
    """
    choice = backend
    if choice == "auto":
        if device.type != "cuda":
            return TORCH_OPS
        threshold = 0 if dtype is None else TRITON_MIN_ELEMENTS.get(dtype)
        if threshold is None:
            return TORCH_OPS
        small = numel is not None and numel < threshold
        return (None if small else _triton_ops()) or _jiterator_ops() or TORCH_OPS
    if choice == "torch":
        return TORCH_OPS
    if choice not in ELEMENTWISE_BACKENDS:
        raise ValueError(f"elementwise must be one of {ELEMENTWISE_BACKENDS}; got {choice!r}")
    ops = _jiterator_ops() if choice == "jiterator" else _triton_ops()
    if ops is None:
        raise ImportError(f"elementwise={choice!r}, but {choice} does not import here")
    return ops


# --------------------------------------------------------------------------- autograd Function


def _check_operands(x: torch.Tensor, W: torch.Tensor, V: torch.Tensor, U: torch.Tensor) -> None:
    shape = W.shape
    if (
        len(shape) != 2
        or V.shape != shape
        or U.shape != (shape[1], shape[0])
        or x.dim() < 1
        or x.shape[-1] != shape[0]
    ):
        raise ValueError(
            "expected x (..., hidden), W and V (hidden, intermediate), U (intermediate, hidden); "
            f"got x {tuple(x.shape)}, W {tuple(W.shape)}, V {tuple(V.shape)}, U {tuple(U.shape)}"
        )
    # dtypes are singletons, so `is` compares them; devices are compared pairwise, no set built
    device = x.device
    if not (x.dtype is W.dtype is V.dtype is U.dtype) or not (
        W.device == device and V.device == device and U.device == device
    ):
        raise ValueError(
            "x, W, V, U must share dtype and device; got "
            + ", ".join(f"{t.dtype} on {t.device}" for t in (x, W, V, U))
        )


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast off for ``device_type``: ``torch.autocast(enabled=False)`` where
    autocast is on, else a no-op (entering ``torch.autocast`` costs microseconds per call)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (e.g. meta): nothing to switch off
        enabled = False
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


def _backward(ctx, dy: torch.Tensor):
    """The gradients of :class:`MemoryOptimizedSwigluMLPFunction` (see its docstring)."""
    x, W, V, U, a, b, g = ctx.saved_tensors
    need_x, need_W, need_V, need_U = ctx.needs_input_grad[:4]
    need_gate = need_x or need_W or need_V
    recompute, ops = ctx.recompute, ctx.ops
    dx = dW = dV = dU = None

    # The engine runs backward under the autocast state of the .backward() call, not of the
    # forward, so it is checked here again.
    with _autocast_off(dy.device.type):
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]) if x is not None else None
        if recompute:
            a = torch.mm(x2, W)
            b = torch.mm(x2, V)
        if need_U and g is None and not (need_gate and ops.gate_backward_gives_g):
            # g is rebuilt on its own, used and dropped before the gate backward's outputs exist
            g = ops.gate(a, b, inplace=recompute and not need_gate)
            dU = torch.mm(g.t(), dy2)
            g = None
        if need_gate:
            dg = torch.mm(dy2, U.t())
            da, db, g_new = ops.gate_backward(
                a, b, dg, want_g=need_U and dU is None and g is None, ab_scratch=recompute
            )
            g = g if g is not None else g_new
            del dg, g_new
        del a, b  # recomputed buffers are free from here on (saved ones live with ctx)
        if need_U and dU is None:
            dU = torch.mm(g.t(), dy2)
        del g
        if need_gate:
            xt = x2.t() if need_V or need_W else None
            if need_V:
                dV = torch.mm(xt, db)
            if need_x:
                dx = torch.mm(db, V.t())
            del db
            if need_W:
                dW = torch.mm(xt, da)
            if need_x:
                dx.addmm_(da, W.t())  # dX = dA W^T + dB V^T without a separate add
            del da

    return (dx.view(ctx.x_shape) if dx is not None else None), dW, dV, dU, None, None


_backward_once_differentiable = once_differentiable(_backward)


class MemoryOptimizedSwigluMLPFunction(torch.autograd.Function):
    r"""``y = (silu(x W) * (x V)) U`` with a choice of what is kept for backward.

    **Forward.** With the leading dimensions of ``x`` flattened, :math:`X \in \mathbb{R}^{N\times H}`:

    .. math::
        A = XW,\quad B = XV,\quad S = \operatorname{silu}(A) = A\odot\sigma(A),\quad
        G = S\odot B,\quad Y = GU .

    **Backward.** Given :math:`\bar Y = \partial L/\partial Y`, the differential of a product
    :math:`Y = GU` is :math:`dY = dG\,U + G\,dU`; from
    :math:`dL = \langle \bar Y, dY\rangle = \langle \bar Y U^\top, dG\rangle
    + \langle G^\top \bar Y, dU\rangle` (Frobenius inner product):

    .. math::
        \bar U = G^\top \bar Y,\qquad \bar G = \bar Y U^\top .

    The elementwise product splits the gradient between its factors,
    :math:`\bar B = \bar G\odot S` and :math:`\bar S = \bar G\odot B`, and
    :math:`\operatorname{silu}'(a) = \sigma(a) + a\,\sigma(a)(1-\sigma(a))
    = \sigma(a)\,(1 + a\,(1-\sigma(a)))` gives

    .. math::
        \bar A = \bar G\odot B\odot \sigma(A)\odot\bigl(1 + A\odot(1-\sigma(A))\bigr).

    The two input projections give :math:`\bar W = X^\top \bar A`, :math:`\bar V = X^\top \bar B`
    and, since ``X`` feeds both, :math:`\bar X = \bar A W^\top + \bar B V^\top` (one GEMM, then a
    second one accumulating into it). A step is 9 GEMMs of :math:`2NHI` FLOPs each: 3 forward
    (A, B, Y) and 6 backward (:math:`\bar U, \bar G, \bar W, \bar V` and two for
    :math:`\bar X`). Everything else reads and writes :math:`N\times I` tensors elementwise.

    **What is kept** follows :class:`CheckpointLevel`; the backward only ever needs
    :math:`A, B` (or ``X, W, V`` to recompute them), :math:`G` (or :math:`A, B`), ``U``, and
    ``X, W, V`` for the input-side gradients. Gradients whose ``ctx.needs_input_grad`` entry is
    False are neither computed nor paid for in kept tensors. Saved tensors are never modified, so
    ``retain_graph=True`` and a second backward work; recomputed ones are overwritten in place.

    Computation happens in the inputs' common dtype with autocast disabled inside (cast inputs
    yourself). ``elementwise`` picks the backend of the elementwise part
    (:func:`elementwise_ops`). Not twice differentiable.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        W: torch.Tensor,
        V: torch.Tensor,
        U: torch.Tensor,
        checkpoint_level: int,
        elementwise: str = "auto",
    ) -> torch.Tensor:
        level = CheckpointLevel.parse(checkpoint_level)
        _check_operands(x, W, V, U)
        need_x, need_W, need_V, need_U = ctx.needs_input_grad[:4]
        need_gate = need_x or need_W or need_V  # everything upstream of G needs dG
        if level is CheckpointLevel.SAVE_ALL:
            keep_ab, keep_g = need_gate, need_U
        elif level is CheckpointLevel.RECOMPUTE_ELEMENTWISE:
            keep_ab, keep_g = need_gate or need_U, False
        else:
            keep_ab = keep_g = False
        recompute = level is CheckpointLevel.RECOMPUTE_ALL
        x2 = x.reshape(-1, x.shape[-1])
        ops = elementwise_ops(x.device, x2.shape[0] * W.shape[1], x.dtype, elementwise)

        with _autocast_off(x.device.type):
            a = torch.mm(x2, W)
            b = torch.mm(x2, V)
            # When A is not kept, G overwrites it: one (N x I) buffer less at the forward peak.
            g = ops.gate(a, b, inplace=not keep_ab)
            y = torch.mm(g, U)

        ctx.save_for_backward(
            x if (need_W or need_V or recompute) else None,
            W if (need_x or recompute) else None,
            V if (need_x or recompute) else None,
            U if need_gate else None,
            a if keep_ab else None,
            b if keep_ab else None,
            g if keep_g else None,
        )
        ctx.recompute, ctx.ops, ctx.x_shape = recompute, ops, x.shape
        return y.view(*x.shape[:-1], U.shape[1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        # With create_graph=True (grad mode on) once_differentiable makes a second
        # differentiation fail loudly; in the usual case grad mode is already off and its
        # no_grad wrapper would only cost time.
        if torch.is_grad_enabled():
            return _backward_once_differentiable(ctx, dy)
        return _backward(ctx, dy)


class MemoryOptimizedSwigluMLP(nn.Module):
    """SwiGLU MLP whose forward is :class:`MemoryOptimizedSwigluMLPFunction`.

    Parameters ``W``, ``V`` are ``(hidden, intermediate)`` and ``U`` ``(intermediate, hidden)``,
    initialised like ``nn.Linear`` (uniform in :math:`\\pm 1/\\sqrt{\\text{fan\\_in}}`).
    ``elementwise`` (one of ``ELEMENTWISE_BACKENDS``, checked here) forces the backend of the
    elementwise part; ``"auto"`` lets :func:`elementwise_ops` choose by device, size and dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        checkpoint_level: int = CheckpointLevel.SAVE_ALL,
        *,
        elementwise: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.W = nn.Parameter(torch.empty(hidden_size, intermediate_size, **kw))
        self.V = nn.Parameter(torch.empty(hidden_size, intermediate_size, **kw))
        self.U = nn.Parameter(torch.empty(intermediate_size, hidden_size, **kw))
        self.checkpoint_level = CheckpointLevel.parse(checkpoint_level)
        elementwise_ops(self.W.device, backend=elementwise)  # unknown or missing: fail here
        self.elementwise = elementwise
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in (self.W, self.V, self.U):
            bound = 1 / math.sqrt(p.shape[0])
            nn.init.uniform_(p, -bound, bound)

    @classmethod
    def from_reference(
        cls,
        ref: SwigluMLP,
        checkpoint_level: int = CheckpointLevel.SAVE_ALL,
        *,
        elementwise: str = "auto",
    ) -> MemoryOptimizedSwigluMLP:
        """A layer computing the same function as ``ref`` (weights copied, transposed)."""
        w = ref.W.weight
        out = cls(
            w.shape[1],
            w.shape[0],
            checkpoint_level,
            elementwise=elementwise,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            out.W.copy_(ref.W.weight.t())
            out.V.copy_(ref.V.weight.t())
            out.U.copy_(ref.U.weight.t())
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MemoryOptimizedSwigluMLPFunction.apply(
            x, self.W, self.V, self.U, int(self.checkpoint_level), self.elementwise
        )

    def extra_repr(self) -> str:
        return (
            f"hidden={self.W.shape[0]}, intermediate={self.W.shape[1]}, "
            f"checkpoint_level={self.checkpoint_level.name}, elementwise={self.elementwise}"
        )
