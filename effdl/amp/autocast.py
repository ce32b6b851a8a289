"""Autocast written without ``torch.autocast``: per-op precision chosen by a torch-function mode.

Inside ``with Autocast("cuda", torch.float16):`` every call to a torch function, a Tensor method
or a ``torch.nn.functional`` function passes through :class:`_CastingMode` (a
``TorchFunctionMode``) before it runs. One dict lookup sorts it into a policy:

* ``LOW``: matrix-multiply-class ops (linear, matmul/mm/bmm/addmm/baddbmm, einsum,
  convolutions, scaled-dot-product and multi-head attention): floating inputs on the region's
  device are cast to the low dtype, so they run on tensor cores and return low precision.
* ``FP32``: ops that need fp32's range or accumulation (normalizations, losses,
  exp/log/pow-like pointwise ops, norms): low-precision inputs are cast to fp32 and the result
  is fp32.
* ``FP32_OUT``: ops with a ``dtype=`` argument (softmax/log-softmax, sum/prod, cumsum/cumprod)
  get ``dtype=torch.float32`` instead: the kernel reads the low-precision input and computes
  and writes fp32, one pass over the data instead of a cast pass plus an fp32 pass (torch's
  ``fp32_set_opt_dtype`` policy). Cross-entropy on low-precision logits accumulates in fp32
  and returns an fp32 loss without first copying the logits to fp32 (see ``_cross_entropy``).
* everything else runs untouched in whatever dtype it receives.

The lists follow torch.autocast's CUDA policy, with one deliberate difference: batch norm is an
``FP32`` op here (torch leaves it in the input dtype). The same policy applies on CPU (where
torch's own CPU policy keeps layer norm and softmax in bf16).

Parameters (leaf tensors that require grad) are cast once per region: the low-precision copy is
cached, keyed on the parameter, and the cache is dropped when the outermost region exits. The
casts are ordinary differentiable ``Tensor.to`` calls, so backward returns fp32 gradients to
fp32 parameters. Casts are not cached under ``torch.no_grad()`` (such a copy carries no graph and
must not be reused by a later differentiable forward in the same region).

Python's cyclic garbage collector is paused inside the outermost region (``pause_gc=True``, the
default) and restored on exit: the casts here are Python-level calls, so every cast activation
gets a Python tensor object, and the collections those objects set off mid-forward stall the
queuing of kernels. Reference counting still frees acyclic garbage at once; cyclic garbage made
inside a long region waits until it exits.

Scope: Python functions the mode does not know (e.g. a ``torch.nn.functional`` helper not in the
tables) are opaque to it: their inner ops run in the dtypes they are given. Only out-of-place ops
are cast; RNN modules are not covered.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from effdl.gc_pause import GC_PAUSE

LOW, FP32, FP32_OUT, SPECIAL = 1, 2, 3, 4
_CASTABLE = frozenset({torch.float32, torch.float16, torch.bfloat16})

_LOW_NAMES = (
    "linear", "bilinear", "matmul", "mm", "mv", "bmm", "addmm", "addmv", "addr", "addbmm",
    "baddbmm", "chain_matmul", "multi_dot", "einsum", "prelu",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "convolution", "scaled_dot_product_attention", "multi_head_attention_forward",
    "__matmul__", "__rmatmul__",
)  # fmt: skip
_FP32_NAMES = (
    # normalizations
    "layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm", "local_response_norm",
    "normalize",
    # range-sensitive reductions without a dtype argument
    "softmin", "logsumexp", "norm", "vector_norm", "matrix_norm", "dist", "cdist", "pdist", "renorm", "cosine_similarity",
    # pointwise ops whose results leave fp16's range or lose its precision
    "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "pow", "__pow__",
    "__rpow__", "softplus", "acos", "asin", "cosh", "sinh", "tan", "erfinv",
    # losses
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "cross_entropy", "nll_loss",
    "kl_div", "l1_loss", "mse_loss", "smooth_l1_loss", "huber_loss", "poisson_nll_loss",
    "gaussian_nll_loss", "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "multilabel_soft_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss",
)  # fmt: skip
_FP32_OUT_NAMES = ("softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod")
# The public namespaces: the mode sees the function the caller called (``F.mse_loss``), not the
# internal ones it runs on (those run with the mode switched off).
_NAMESPACES = (torch, torch.Tensor, F, torch.linalg, torch.functional)


def _collect(names: Iterable[str]) -> set:
    funcs = set()
    for name in names:
        for ns in _NAMESPACES:
            f = getattr(ns, name, None)
            if callable(f):
                funcs.add(f)
    return funcs


_POLICY: dict[Any, int] = {f: FP32 for f in _collect(_FP32_NAMES)}
_POLICY.update({f: FP32_OUT for f in _collect(_FP32_OUT_NAMES)})
_POLICY.update({f: LOW for f in _collect(_LOW_NAMES)})
_LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})
_CONTAINERS = (Tensor, list, tuple)  # argument types that may hold something to cast


def _cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy`` with fp32 accumulation and an fp32 loss, without an fp32 logits copy.

    For low-precision logits with class-index targets, the log-softmax kernel reads and writes
    the (tokens x classes) log-probabilities in the input dtype and accumulates in fp32 (the
    ``<Half, float, Half>`` kernel that also appears in torch.autocast's CUDA profile); only
    the picked target log-probabilities are taken to fp32, and the loss is reduced in fp32, so
    a scaled loss's gradient (2**16 is inf in fp16) stays fp32 until it is spread over the
    tokens, with no fp32 copy of the logits written and read again. Other cases (probability
    targets, label smoothing, legacy reduction flags) run on fp32 logits.
    """
    if (
        input.dtype not in _LOW_PRECISION
        or target.is_floating_point()
        or label_smoothing != 0.0
        or size_average is not None
        or reduce is not None
    ):
        if weight is not None and weight.dtype in _LOW_PRECISION:
            weight = weight.float()
        return F.cross_entropy(input.float(), target, weight, size_average, ignore_index,
                               reduce, reduction, label_smoothing)  # fmt: skip
    class_dim = 0 if input.dim() == 1 else 1
    log_probs = F.log_softmax(input, class_dim).movedim(class_dim, -1)
    valid = target != ignore_index
    index = target.masked_fill(~valid, 0)
    picked = log_probs.gather(-1, index.unsqueeze(-1)).squeeze(-1).float()
    w = valid.float() if weight is None else weight.float()[index] * valid
    losses = -picked * w
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / w.sum()
    raise ValueError(f"{reduction} is not a valid value for reduction")


# Ops with their own mixed-precision recipe; they receive the arguments uncast.
_SPECIAL = {F.cross_entropy: _cross_entropy}
_POLICY.update({f: SPECIAL for f in _SPECIAL})


def policy_of(func: Any) -> str | None:
    """``"low"``, ``"fp32"`` or None (runs as given) for a torch function object."""
    return {LOW: "low", FP32: "fp32", FP32_OUT: "fp32", SPECIAL: "fp32", None: None}[
        _POLICY.get(func)
    ]


class _CastingMode(TorchFunctionMode):
    """The one mode installed per thread while any Autocast region is open.

    ``low`` maps a device type ("cuda", "cpu") to its low dtype, or to None inside an
    ``enabled=False`` region; nested regions save and restore entries of it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.low: dict[str, torch.dtype | None] = {}
        self.cache_enabled = True
        self.cache: dict[int, tuple[Tensor, Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Hot path: most intercepted calls (views, shapes, adds, dropout) have no policy.
        kind = _POLICY.get(func)
        if kind is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if kind == FP32_OUT:
            return self._run_fp32_out(func, args, kwargs or {})
        if kind == SPECIAL:
            x = args[0] if args else (kwargs or {}).get("input")
            if isinstance(x, Tensor) and self._low_for(x) is not None:
                func = _SPECIAL[func]
            return func(*args, **kwargs) if kwargs else func(*args)
        # One cast per distinct tensor per call: attention checks ``query is key is value`` to
        # run one packed in-projection GEMM, so casting the same tensor twice would split it in 3.
        memo: dict[int, Any] = {}
        args = [self._cast_arg(a, kind, memo) if isinstance(a, _CONTAINERS) else a for a in args]
        if kwargs:
            kwargs = {
                k: self._cast_arg(v, kind, memo) if isinstance(v, _CONTAINERS) else v
                for k, v in kwargs.items()
            }
            return func(*args, **kwargs)
        return func(*args)

    def _run_fp32_out(self, func, args, kwargs):
        """Call ``func`` with ``dtype=float32`` when its input is low precision on a cast device."""
        x = args[0] if args else kwargs.get("input")
        if (
            isinstance(x, Tensor)
            and x.dtype in _LOW_PRECISION
            and kwargs.get("dtype") is None
            and not any(isinstance(a, torch.dtype) for a in args)  # dtype given positionally
            and self._low_for(x) is not None
        ):
            kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)

    def _low_for(self, t: Tensor) -> torch.dtype | None:
        return self.low.get("cuda" if t.is_cuda else t.device.type)

    def _cast_arg(self, a: Any, kind: int, memo: dict[int, Any]) -> Any:
        if isinstance(a, Tensor):
            hit = memo.get(id(a))
            if hit is None:
                hit = memo[id(a)] = self._cast(a, kind)
            return hit
        if a and isinstance(a[0], Tensor):  # a list or tuple of tensors
            return type(a)([self._cast(t, kind) for t in a])
        return a

    def _cast(self, a: Tensor, kind: int) -> Tensor:
        if a.dtype not in _CASTABLE:  # integers, bool, fp64 stay as they are
            return a
        low = self._low_for(a)
        if low is None:
            return a
        if kind == LOW:
            return a if a.dtype is low else self._to_low(a, low)
        return a if a.dtype is torch.float32 else a.float()

    def _to_low(self, t: Tensor, low: torch.dtype) -> Tensor:
        if not (self.cache_enabled and t.is_leaf and t.requires_grad and torch.is_grad_enabled()):
            return t.to(low)
        hit = self.cache.get(id(t))
        if hit is not None and hit[0] is t and hit[1].dtype is low:
            return hit[1]
        cast = t.to(low)
        # Keep t alive with its copy, so its id cannot be reused within the region.
        self.cache[id(t)] = (t, cast)
        return cast


_local = threading.local()


class Autocast:
    """Mixed precision for a region of code, without ``torch.autocast``.

    ``Autocast(device_type, dtype=torch.float16, enabled=True, cache_enabled=True,
    pause_gc=True)``: within the region, ops on ``device_type`` tensors follow the policy in this
    module's docstring (matrix ops in ``dtype``, precision-sensitive ops in fp32). Regions nest:
    an inner region overrides the outer one for its device type until it exits
    (``enabled=False`` turns casting off). Use it for the forward pass and the loss; run
    ``backward()`` and the optimizer step outside (the parameter-cast cache assumes parameters do
    not change inside a region). ``pause_gc``: the outermost region pauses Python's cyclic
    garbage collector until it exits (see the module docstring); ``False`` leaves it alone.
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool = True,
        pause_gc: bool = True,
    ) -> None:
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
        if dtype is None:
            dtype = torch.float16 if device_type == "cuda" else torch.bfloat16
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.device_type = device_type
        self.dtype = dtype
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.pause_gc = pause_gc
        self._saved: list[tuple] = []

    def __enter__(self) -> Autocast:
        mode = getattr(_local, "mode", None)
        outermost = mode is None
        if outermost:
            mode = _local.mode = _CastingMode()
            _local.depth = 0
            _local.gc_paused = self.pause_gc
            if self.pause_gc:
                GC_PAUSE.acquire()
        self._saved.append((mode.low.get(self.device_type), mode.cache_enabled))
        mode.low[self.device_type] = self.dtype if self.enabled else None
        mode.cache_enabled = self.cache_enabled
        _local.depth += 1
        if outermost:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode = _local.mode
        previous, cache_enabled = self._saved.pop()
        mode.low[self.device_type] = previous
        mode.cache_enabled = cache_enabled
        _local.depth -= 1
        if _local.depth == 0:
            mode.cache.clear()
            _local.mode = None
            mode.__exit__(*exc)
            if _local.gc_paused:
                GC_PAUSE.release()

    def __call__(self, fn):
        """Use as a decorator: run ``fn`` inside a fresh region with these settings."""

        def wrapped(*args, **kwargs):
            with Autocast(
                self.device_type, self.dtype, self.enabled, self.cache_enabled, self.pause_gc
            ):
                return fn(*args, **kwargs)

        return wrapped
