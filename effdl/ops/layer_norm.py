"""Fused LayerNorm: Triton kernels for the forward and the backward, a PyTorch path.

For ``x`` viewed as ``(M, N)`` rows (``N`` = the normalized size), per row::

    mean = sum(x) / N,  rstd = 1 / sqrt(sum((x - mean)^2) / N + eps),  xhat = (x - mean) * rstd
    y = xhat * w + b

and, with ``g = dy * w`` (``dy`` where there is no weight)::

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))     (the row means over N)
    dw = sum over rows of dy * xhat,   db = sum over rows of dy

The forward saves ``x`` and the per-row ``mean`` and ``rstd``; the backward recomputes ``xhat``.
A training step moves 5 passes over ``M x N`` (forward: read x, write y; backward: read x and
dy, write dx). Every sum is fp32 and each output is rounded once, on store; dw and db are summed
from per-program fp32 partials in a fixed order (no atomics), so results do not depend on
scheduling. Inputs and outputs may be fp32, fp16 or bf16 (``x`` and ``w`` of different ones).

The kernels run inside one autograd Function, :class:`FusedLayerNormFunction`, launched as
Triton kernels are (``kernel[grid](...)``). Those launches and the Function cost the host more
than torch's own LayerNorm, so CUDA inputs smaller than :data:`TRITON_MIN_BYTES` go to torch's
kernel instead, run outside autocast so the output keeps ``x``'s dtype: below that size the
layer_norm benchmark finds torch's eager step at least as fast. The PyTorch path (same formulas,
fp32 or float64) serves CPU tensors, float64, rows wider than :data:`MAX_TRITON_WIDTH` and
machines without triton; :func:`kernel_path` is the one place that decides.

Under autocast the output keeps ``x``'s dtype (nn.LayerNorm returns float32 there): fusing is
meant to move half the bytes, and the layers that follow cast their input anyway.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path serves every input
    triton = None

TRITON_MIN_BYTES = 256 * 2**20  # smaller CUDA inputs: torch's kernel (lm_training's benchmark)
MAX_TRITON_WIDTH = 16384  # elements of one row kept in registers by one program
PROGRAMS_PER_SM = 4  # backward programs per SM: rows in flight on every SM while keeping the
# dw/db partials (programs x N) small
ROW_STAGES = 3  # rows of x and dy in flight per backward program (software pipelining)
ROW_BUFFER_BYTES = 128 * 1024  # shared memory those rows may take per program (of ~227 KiB/SM)
INTERPRETER_PROGRAMS = 4  # backward programs off CUDA (the Triton interpreter)
SUM_BLOCK_P, SUM_BLOCK_N = 128, 16  # the partial-sum kernel's tile: programs x columns
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


if triton is not None:

    @triton.jit
    def _forward_kernel(
        x_ptr, y_ptr, w_ptr, b_ptr, stats_ptr, x_stride, y_stride, m, n, eps,
        HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n + eps)
        y = xc * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(stats_ptr + row, mean)
        tl.store(stats_ptr + m + row, rstd)

    @triton.jit
    def _backward_kernel(
        x_ptr, dy_ptr, dx_ptr, w_ptr, stats_ptr, partial_ptr,
        x_stride, dy_stride, dx_stride, m, n, rows_per_program,
        HAS_W: tl.constexpr, WANT_DW: tl.constexpr, WANT_DB: tl.constexpr, BLOCK: tl.constexpr,
        ROW_STAGES: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        db = tl.zeros((BLOCK,), dtype=tl.float32)
        first = pid.to(tl.int64) * rows_per_program
        last = tl.minimum(first + rows_per_program, m)
        for row in tl.range(first, last, num_stages=ROW_STAGES):
            x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(stats_ptr + row)
            rstd = tl.load(stats_ptr + m + row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            g = dy
            if HAS_W:
                g = dy * w
            c_xhat = tl.sum(g * xhat, axis=0) / n
            c_mean = tl.sum(g, axis=0) / n
            dx = (g - c_mean - xhat * c_xhat) * rstd
            tl.store(dx_ptr + row * dx_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if WANT_DW:
                dw += dy * xhat
            if WANT_DB:
                db += dy
        # partials: (parts, programs, n), dw's part first when both are wanted
        if WANT_DW:
            tl.store(partial_ptr + pid * n + cols, dw, mask=mask)
        if WANT_DB:
            db_ptr = partial_ptr + WANT_DW * tl.num_programs(0) * n
            tl.store(db_ptr + pid * n + cols, db, mask=mask)

    @triton.jit
    def _sum_partials_kernel(
        partial_ptr, first_ptr, second_ptr, programs, n,
        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """first[cols] (part 0), second[cols] (part 1) = sum over programs of partial[part, :,
        cols], in a fixed order, rounded once to that output's dtype; one program per (column
        block, part)."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        part = tl.program_id(1)
        base = partial_ptr + part.to(tl.int64) * programs * n
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        for start in range(0, programs, BLOCK_P):
            rows = start + tl.arange(0, BLOCK_P)
            mask = (rows[:, None] < programs) & (cols[None, :] < n)
            acc += tl.load(base + rows[:, None] * n + cols[None, :], mask=mask, other=0.0)
        total = tl.sum(acc, axis=0)
        if part == 0:
            tl.store(first_ptr + cols, total.to(first_ptr.dtype.element_ty), mask=cols < n)
        else:
            tl.store(second_ptr + cols, total.to(second_ptr.dtype.element_ty), mask=cols < n)


def uses_triton(x: torch.Tensor, width: int) -> bool:
    """Whether :func:`fused_layer_norm` runs the Triton kernels for ``x`` with rows of ``width``:
    triton imports, ``x`` is a non-empty CUDA tensor of fp32, fp16 or bf16, and a row fits one
    program."""
    return (
        triton is not None
        and x.is_cuda
        and x.numel() > 0
        and x.dtype in TRITON_DTYPES
        and 0 < width <= MAX_TRITON_WIDTH
    )


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


@functools.cache
def _sm_count(device_index: int) -> int:
    """The GPU's SM count (asking the driver costs microseconds of host time per backward)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _backward_programs(rows: int, device: torch.device) -> int:
    """Programs of the backward: :data:`PROGRAMS_PER_SM` on every SM, never more than the
    rows."""
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        return max(1, min(rows, PROGRAMS_PER_SM * sms))
    return max(1, min(rows, INTERPRETER_PROGRAMS))


def _row_stages(block: int, x: torch.Tensor, dy: torch.Tensor) -> int:
    """Rows the backward loop keeps in flight: :data:`ROW_STAGES` where their x and dy fit
    :data:`ROW_BUFFER_BYTES` of shared memory, else 1 (no pipelining)."""
    row_bytes = block * (x.element_size() + dy.element_size())
    return ROW_STAGES if ROW_STAGES * row_bytes <= ROW_BUFFER_BYTES else 1


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``(M, width)`` rows with unit column stride (a copy only where needed; ``t``
    itself where it already is: each view costs host time in eager steps)."""
    if t.dim() == 2 and t.shape[1] == width and t.stride(1) == 1:
        return t
    rows = t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _shaped(t: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """``t`` viewed as ``shape``, or ``t`` itself where it has it already (or is None)."""
    return t if t is None or t.shape == shape else t.view(shape)


def _flat(p: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """A parameter as ``width`` contiguous elements, the layout the kernels index (``p`` itself
    where it already is; a copy where its elements are strided)."""
    if p is None or (p.dim() == 1 and p.stride(0) == 1):
        return p
    return p.reshape(width).contiguous()


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The CUDA device guard work on ``t`` needs: none off CUDA or where its device is the
    current one (Triton launches go to the current device and stream)."""
    if not t.is_cuda or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _forward_launch(x, y, weight, bias, stats, eps):
    """The forward kernel's grid, runtime arguments and compile options for these tensors (a
    missing weight or bias is passed as ``x``, never read)."""
    m, n = x.shape
    block = triton.next_power_of_2(n)
    args = (
        x, y, weight if weight is not None else x, bias if bias is not None else x, stats,
        x.stride(0), y.stride(0), m, n, eps,
    )  # fmt: skip
    options = dict(
        HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=block, num_warps=_num_warps(block)
    )
    return (m,), args, options


def _backward_layout(x, want_dw: bool, want_db: bool):
    """``(programs, rows per program, parts)`` of the backward: ``parts`` partial sums (dw's,
    db's) per program."""
    m = x.shape[0]
    programs = _backward_programs(m, x.device)
    return programs, math.ceil(m / programs), int(want_dw) + int(want_db)


def _backward_launch(x, dy, dx, weight, stats, partial, rows_per_program, want_dw, want_db):
    """The backward kernel's grid, runtime arguments and compile options."""
    m, n = x.shape
    block = triton.next_power_of_2(n)
    args = (
        x, dy, dx, weight if weight is not None else x, stats, partial,
        x.stride(0), dy.stride(0), dx.stride(0), m, n, rows_per_program,
    )  # fmt: skip
    options = dict(
        HAS_W=weight is not None, WANT_DW=want_dw, WANT_DB=want_db, BLOCK=block,
        ROW_STAGES=_row_stages(block, x, dy), num_warps=_num_warps(block),
    )  # fmt: skip
    return (partial.shape[1],), args, options


def _sum_launch(partial, dw, db):
    """The partial-sum kernel's grid, runtime arguments and compile options: it writes dw (if
    given) from the first part and db (if given) from the next."""
    parts, programs, n = partial.shape
    first = dw if dw is not None else db
    second = db if db is not None else first
    grid = (triton.cdiv(n, SUM_BLOCK_N), parts)
    args = (partial, first, second, programs, n)
    return grid, args, dict(BLOCK_P=SUM_BLOCK_P, BLOCK_N=SUM_BLOCK_N, num_warps=4)


def _triton_forward(x, weight, bias, eps):
    y = torch.empty_like(x)
    stats = torch.empty((2, x.shape[0]), device=x.device, dtype=torch.float32)  # mean, rstd
    grid, args, options = _forward_launch(x, y, weight, bias, stats, eps)
    _forward_kernel[grid](*args, **options)
    return y, stats


def _triton_backward(dy, x, weight, stats, dw_dtype, db_dtype):
    n = x.shape[1]
    want_dw, want_db = dw_dtype is not None, db_dtype is not None
    programs, rows_per_program, parts = _backward_layout(x, want_dw, want_db)
    dx = torch.empty_like(x)
    partial = torch.empty((max(parts, 1), programs, n), device=x.device, dtype=torch.float32)
    grid, args, options = _backward_launch(
        x, dy, dx, weight, stats, partial, rows_per_program, want_dw, want_db
    )
    _backward_kernel[grid](*args, **options)
    dw = torch.empty(n, device=x.device, dtype=dw_dtype) if want_dw else None
    db = torch.empty(n, device=x.device, dtype=db_dtype) if want_db else None
    if parts:
        grid, args, options = _sum_launch(partial, dw, db)
        _sum_partials_kernel[grid](*args, **options)
    return dx, dw, db


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _torch_forward(x, weight, bias, eps):
    """``y`` and the ``(2, M)`` stats (mean, rstd) in the compute dtype."""
    xf = x.to(_compute_dtype(x))
    mean = xf.mean(-1)
    xc = xf - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(-1) + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(x.dtype), torch.stack((mean, rstd))


def _torch_backward(dy, x, weight, stats, dw_dtype, db_dtype):
    cdt = _compute_dtype(x)
    mean, rstd = stats
    dyf = dy.to(cdt)
    xhat = (x.to(cdt) - mean[:, None]) * rstd[:, None]
    g = dyf * weight.to(cdt) if weight is not None else dyf
    dx = (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[:, None]
    dw = (dyf * xhat).sum(0).to(dw_dtype) if dw_dtype is not None else None
    db = dyf.sum(0).to(db_dtype) if db_dtype is not None else None
    return dx.to(x.dtype), dw, db


class FusedLayerNormFunction(torch.autograd.Function):
    """Autograd Function: ``apply(x, weight, bias, eps, use_triton, width)``.

    ``x``'s trailing elements form rows of ``width`` (viewed as ``(M, width)`` with unit column
    stride, copied only where that view does not exist); ``weight``, ``bias`` hold ``width``
    elements each, or are None. The views are taken inside the Function, so autograd records
    one node per call and no view nodes around it (each costs host time in eager backward).
    Saves ``x``, ``weight`` and the fp32 (float64 for float64 input) per-row ``mean`` and
    ``rstd`` as one ``(2, M)`` tensor; ``use_triton`` picks the kernels or the PyTorch path for
    both passes. Gradients come back in their inputs' shapes and dtypes.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, use_triton, width):
        rows = _rows(x, width)
        w, b = _flat(weight, width), _flat(bias, width)
        forward = _triton_forward if use_triton else _torch_forward
        with _on_device(rows):
            y, stats = forward(rows, w, b, eps)
        ctx.save_for_backward(rows, w, stats)
        ctx.use_triton = use_triton
        ctx.shapes = (x.shape, weight.shape if weight is not None else None)
        ctx.bias_dtype, ctx.bias_shape = (
            (bias.dtype, bias.shape) if bias is not None else (None,) * 2
        )
        return _shaped(y, x.shape)

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph=True: the backward's own graph is not built
            raise RuntimeError(
                "fused_layer_norm has no second derivative (double backward); use "
                "torch.nn.functional.layer_norm where higher-order gradients are needed"
            )
        x, weight, stats = ctx.saved_tensors
        _, want_dw, want_db, _, _, _ = ctx.needs_input_grad
        x_shape, w_shape = ctx.shapes
        backward = _triton_backward if ctx.use_triton else _torch_backward
        dy = _rows(dy, x.shape[1])
        dw_dtype = weight.dtype if want_dw else None
        with _on_device(x):
            dx, dw, db = backward(
                dy, x, weight, stats, dw_dtype, ctx.bias_dtype if want_db else None
            )
        return _shaped(dx, x_shape), _shaped(dw, w_shape), _shaped(db, ctx.bias_shape), *(None,) * 3


def fused_layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    normalized_shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)`` with fused kernels on CUDA.

    ``normalized_shape`` defaults to ``weight``'s shape, else ``bias``'s, else ``x``'s last dim;
    ``weight`` and ``bias`` (either may be None) have that shape. ``x`` (floating point, at least
    one dim) and the parameters may be non-contiguous (copied once where the kernels' layout
    cannot be viewed). Returns a new tensor of ``x``'s shape and dtype, under autocast too; see
    :func:`kernel_path` for which path runs. Differentiable once (no double backward).
    """
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"x must be a floating-point tensor of at least 1 dim, got {x.dtype} "
                         f"of shape {tuple(x.shape)}")  # fmt: skip
    if normalized_shape is None:
        given = weight if weight is not None else bias
        normalized_shape = tuple(given.shape) if given is not None else (x.shape[-1],)
    normalized_shape = tuple(normalized_shape)
    if not normalized_shape:
        raise ValueError("normalized_shape must name at least one dim, got ()")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and not p.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {p.dtype}")
        if p is not None and tuple(p.shape) != normalized_shape:
            raise ValueError(f"{name} of shape {tuple(p.shape)}; expected {normalized_shape}")
    return _apply(x, weight, bias, eps, normalized_shape)


def _apply(x, weight, bias, eps: float, normalized_shape: tuple[int, ...]) -> torch.Tensor:
    """The op on ``x`` after checking its trailing shape (the parameters' are trusted)."""
    if x.shape[x.dim() - len(normalized_shape) :] != normalized_shape:
        raise ValueError(f"x of shape {tuple(x.shape)} does not end in {normalized_shape}")
    width = math.prod(normalized_shape)
    path = kernel_path(x, width)
    if path == "torch":
        return _torch_kernel(x, weight, bias, eps, normalized_shape)
    return FusedLayerNormFunction.apply(x, weight, bias, eps, path == "triton", width)


def kernel_path(x: torch.Tensor, width: int) -> str:
    """What :func:`fused_layer_norm` runs for ``x`` with rows of ``width``: ``"torch"`` (torch's
    kernel, CUDA inputs under :data:`TRITON_MIN_BYTES`), ``"triton"`` (see :func:`uses_triton`)
    or ``"pytorch"`` (the formulas in torch ops)."""
    if x.is_cuda and x.numel() * x.element_size() < TRITON_MIN_BYTES:
        return "torch"
    return "triton" if uses_triton(x, width) else "pytorch"


def _torch_kernel(x, weight, bias, eps: float, normalized_shape: tuple[int, ...]) -> torch.Tensor:
    """torch's LayerNorm outside autocast: the output in ``x``'s dtype. Parameters of another
    dtype are cast to ``x``'s (torch's CUDA kernel takes one dtype for all three)."""

    def cast(p: torch.Tensor | None) -> torch.Tensor | None:
        return p if p is None or p.dtype == x.dtype else p.to(x.dtype)

    with torch.autocast(x.device.type, enabled=False):
        return nn.functional.layer_norm(x, normalized_shape, cast(weight), cast(bias), eps)


class FusedLayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same constructor, parameters and state_dict) computed by
    :func:`fused_layer_norm`: on CUDA the fused Triton kernels for large inputs and torch's kernel
    for small ones (see :func:`kernel_path`), the PyTorch path elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the parameters' shapes were fixed at construction: only x is checked per call
        return _apply(x, self.weight, self.bias, self.eps, self.normalized_shape)


class InputDtypeLayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose output keeps ``x``'s dtype under autocast too: torch's own kernel run
    outside autocast (fp32 statistics inside it). The reference FusedLayerNorm is measured
    against, since both move half-precision bytes where nn.LayerNorm writes fp32 under autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _torch_kernel(x, self.weight, self.bias, self.eps, self.normalized_shape)


class TritonLayerNorm(FusedLayerNorm):
    """FusedLayerNorm with its Triton kernels at every input size (its PyTorch path where
    :func:`uses_triton` says no): what the size threshold chooses against."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.weight.numel()
        return FusedLayerNormFunction.apply(
            x, self.weight, self.bias, self.eps, uses_triton(x, width), width
        )


def swap_layer_norms(module: nn.Module, kind: type[nn.LayerNorm] = FusedLayerNorm) -> int:
    """Replace every nn.LayerNorm inside ``module`` (not ``module`` itself) by a ``kind``
    (FusedLayerNorm, TritonLayerNorm or InputDtypeLayerNorm) holding the same Parameter
    objects, so optimizers and tied weights keep working. Mutates ``module``; returns how many were replaced. Subclasses of
    nn.LayerNorm (FusedLayerNorm among them) are left as they are: their forward may differ."""
    swaps = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is nn.LayerNorm
    ]
    for parent, name, old in swaps:
        new = kind(
            old.normalized_shape,
            old.eps,
            old.elementwise_affine,
            bias=old.bias is not None,
            device="meta",
        )
        new.weight, new.bias = old.weight, old.bias
        new.train(old.training)
        setattr(parent, name, new)
    return len(swaps)
