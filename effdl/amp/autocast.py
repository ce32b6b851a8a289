"""Autocast written without ``torch.autocast``: the policy's functions are swapped for casting
wrappers while a region is open, so every other op runs at full speed.

Inside ``with Autocast("cuda", torch.float16):`` the ops of a fixed policy cast their floating
inputs on the region's device before they run:

* ``LOW``: matrix-multiply-class ops (linear, matmul/mm/bmm/addmm/baddbmm, einsum,
  convolutions, scaled-dot-product and multi-head attention): inputs go to the low dtype, so
  they run on tensor cores and return low precision.
* ``FP32``: ops that need fp32's range or accumulation (normalizations, softmax/log-softmax,
  losses, exp/log/pow-like pointwise ops, sums/products/norms): low-precision inputs go to fp32
  and the result is fp32.
* everything else runs untouched in whatever dtype it receives.

The lists follow torch.autocast's CUDA policy, with one deliberate difference: batch norm is an
``FP32`` op here (torch leaves it in the input dtype). The same policy applies on CPU (where
torch's own CPU policy keeps layer norm and softmax in bf16).

How (the "O1" design of NVIDIA apex amp): the policy names are looked up once, at import, in
``torch``, ``torch.Tensor``, ``torch.nn.functional``, ``torch._C._nn``, ``torch.linalg`` and
``torch.functional``. While at least one enabled region is open in any thread, each of those
attributes is replaced by a thin wrapper; when the last one closes (in any thread, also on an
exception), the original objects are put back: module attributes are reassigned, and
``torch.Tensor`` attributes get their own ``__dict__`` entry back or, where the method was
inherited from ``torch._C.TensorBase``, lose the shadowing entry. A region keeps its settings in
thread-local state; a wrapper reads it and, outside a region or in an ``enabled=False`` one,
calls the original at once. Unlisted ops are never touched, so they cost nothing: an earlier
version used a ``TorchFunctionMode``, which sends every torch call of the region (``.shape``
reads, views, adds, dropout...) through a Python handler; on a 4-layer decoder that made a
forward+backward 13% slower than torch.autocast on an H100, and the step was launch-bound.

Each call casts each distinct tensor once: multi-head attention checks ``query is key is value``
to run one packed in-projection GEMM, so casting the same tensor twice would split it in three.
Functions of ``torch.nn.functional`` call each other through module globals, so a listed
function reached from inside another (``multi_head_attention_forward`` -> ``linear`` ->
``scaled_dot_product_attention``; ``F.layer_norm`` -> ``torch.layer_norm``) is a wrapper too.
A wrapper runs its original with casting switched off in its thread, so such inner calls pass
straight through (one thread-local read) and never cast twice; the inner ops of a listed
function therefore run in the dtypes its wrapper chose (as with the earlier torch-function
mode; torch.autocast would, e.g., still run the attention-weights softmax of
``need_weights=True`` in fp32 on CUDA, where ours stays in the low dtype).

Parameters (leaf tensors that require grad) are cast once per region: the low-precision copy is
cached, keyed on the parameter, and the cache is dropped when the thread's outermost region
exits. The casts are ordinary differentiable ``Tensor.to`` calls, so backward returns fp32
gradients to fp32 parameters. Casts are not cached under ``torch.no_grad()`` (such a copy
carries no graph and must not be reused by a later differentiable forward in the same region).

Limits:

* Only the attributes above are swapped: code that bound a function before the region (``from
  torch.nn.functional import linear`` at import, a stored ``f = torch.matmul``) calls the
  original and is not cast. Code inside the region that stores a wrapper keeps a harmless
  pass-through after it. Only out-of-place ops are cast; RNN modules are not covered, nor
  fused inference kernels outside the lists (``nn.TransformerEncoderLayer``'s eval-mode fast
  path runs in its input dtype; ``nn.MultiheadAttention``'s, ``_native_multi_head_attention``,
  is a ``LOW`` op).
* Threads: regions are per thread (another thread outside any region runs as usual, paying
  one thread-local read per listed call while the wrappers are installed); the swap itself is
  process-wide and guarded by a lock. Autograd's backward, which runs in C++ (and on CUDA in
  its own threads), is not affected.
* Cost: the swap happens at each entry of the first enabled region and at the last exit
  (about 25 us on a CPU, plus re-warming CPython's attribute caches for tensors, since
  ``torch.Tensor`` changed); keep a region around a whole forward, not around single ops.
  A listed call inside a region pays about 1-2 us of Python for its checks.
* Not meant to be traced by ``torch.compile``/``torch.jit`` (the wrappers read Python
  thread-local state).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

LOW, FP32 = 1, 2
_FP32 = torch.float32
_CASTABLE = frozenset({_FP32, torch.float16, torch.bfloat16})

_LOW_NAMES = (
    "linear", "bilinear", "matmul", "mm", "mv", "bmm", "addmm", "addmv", "addr", "addbmm",
    "baddbmm", "chain_matmul", "multi_dot", "einsum", "prelu",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "convolution", "scaled_dot_product_attention", "multi_head_attention_forward",
    "_native_multi_head_attention", "__matmul__", "__rmatmul__",
)  # fmt: skip
_FP32_NAMES = (
    # normalizations
    "layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm", "local_response_norm",
    "normalize",
    # softmax family and range-sensitive reductions
    "softmax", "log_softmax", "softmin", "logsumexp", "sum", "prod", "cumsum", "cumprod",
    "norm", "vector_norm", "matrix_norm", "dist", "cdist", "pdist", "renorm", "cosine_similarity",
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
_NAMESPACES = (torch, torch.Tensor, F, torch._C._nn, torch.linalg, torch.functional)
_CARRIERS = (Tensor, list, tuple)  # argument types that may hold tensors to cast
_INHERITED = object()  # marks a torch.Tensor method with no entry in torch.Tensor.__dict__


class _ThreadState(threading.local):
    """This thread's regions: ``low`` maps a device type ("cuda", "cpu") to its low dtype for
    the innermost region on it, and has no entry where casting is off (so ``not low`` means
    "pass through"); ``depth`` counts open regions; ``cache`` holds parameter casts."""

    def __init__(self) -> None:
        self.low: dict[str, torch.dtype] = {}
        self.depth = 0
        self.cache_enabled = True
        self.cache: dict[int, tuple[Tensor, Tensor]] = {}


_local = _ThreadState()


def _to_low(t: Tensor, low: torch.dtype, st: _ThreadState) -> Tensor:
    if not (st.cache_enabled and t.is_leaf and t.requires_grad and torch.is_grad_enabled()):
        return t.to(low)
    hit = st.cache.get(id(t))
    if hit is not None and hit[0] is t and hit[1].dtype is low:
        return hit[1]
    cast = t.to(low)
    # Keep t alive with its copy, so its id cannot be reused within the region.
    st.cache[id(t)] = (t, cast)
    return cast


def _cast(a: Any, kind: int, st: _ThreadState, memo: dict[int, Tensor]) -> Any:
    """``a`` as ``kind`` wants it; ``memo`` maps ids of tensors cast in this call to their casts.

    Written for the common case (already in the right dtype: a few attribute reads, no
    allocation), since nested wrapped calls see inputs their caller already cast."""
    if isinstance(a, Tensor):
        dtype = a.dtype
        if dtype not in _CASTABLE:  # integers, bool, fp64 stay as they are
            return a
        low = st.low.get("cuda" if a.is_cuda else "cpu" if a.is_cpu else "")
        if low is None or dtype is (low if kind == LOW else _FP32):
            return a
        hit = memo.get(id(a))
        if hit is None:
            hit = memo[id(a)] = _to_low(a, low, st) if kind == LOW else a.float()
        return hit
    if type(a) in (list, tuple) and a and isinstance(a[0], Tensor):
        return type(a)([_cast(t, kind, st, memo) for t in a])
    return a


def _wrap(orig: Callable, kind: int) -> Callable:
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        st = _local
        if not st.low:
            return orig(*args, **kwargs)
        # Most arguments are not tensors (multi_head_attention_forward takes 25): skip the call.
        memo: dict[int, Tensor] = {}
        args = [_cast(a, kind, st, memo) if isinstance(a, _CARRIERS) else a for a in args]
        if kwargs:
            kwargs = {
                k: _cast(v, kind, st, memo) if isinstance(v, _CARRIERS) else v
                for k, v in kwargs.items()
            }
        # The original runs with casting off in this thread (a fresh dict, which a region opened
        # in there may edit): the listed ops it calls get inputs this call already cast.
        low, st.low = st.low, {}
        try:
            return orig(*args, **kwargs)
        finally:
            st.low = low

    return wrapper


def _build_patches() -> tuple[dict[Any, int], list[tuple[Any, str, Any, Callable]]]:
    """The policy of each original function and wrapper, and the swaps to make:
    (namespace, name, original attribute or ``_INHERITED``, wrapper)."""
    kinds = {name: FP32 for name in _FP32_NAMES} | {name: LOW for name in _LOW_NAMES}
    policy: dict[Any, int] = {}
    wrappers: dict[int, Callable] = {}  # one wrapper per original, so aliases stay aliases
    patches = []
    for ns in _NAMESPACES:
        for name, kind in kinds.items():
            orig = getattr(ns, name, None)
            if not callable(orig):
                continue
            wrapper = wrappers.get(id(orig))
            if wrapper is None:
                wrapper = wrappers[id(orig)] = _wrap(orig, kind)
            policy[orig] = policy[wrapper] = kind
            patches.append((ns, name, ns.__dict__.get(name, _INHERITED), wrapper))
    return policy, patches


_POLICY, _PATCHES = _build_patches()
_install_lock = threading.Lock()
_open_regions = 0  # enabled regions open in all threads; the wrappers are in place while > 0


def _acquire() -> None:
    global _open_regions
    with _install_lock:
        if _open_regions == 0:
            for ns, name, _, wrapper in _PATCHES:
                setattr(ns, name, wrapper)
        _open_regions += 1


def _release() -> None:
    global _open_regions
    with _install_lock:
        _open_regions -= 1
        if _open_regions == 0:
            for ns, name, raw, _ in _PATCHES:
                if raw is _INHERITED:
                    delattr(ns, name)
                else:
                    setattr(ns, name, raw)


def policy_of(func: Any) -> str | None:
    """``"low"``, ``"fp32"`` or None (runs as given) for a torch function object (the original
    or, inside a region, its wrapper)."""
    return {LOW: "low", FP32: "fp32", None: None}[_POLICY.get(func)]


class Autocast:
    """Mixed precision for a region of code, without ``torch.autocast``.

    ``Autocast(device_type, dtype=torch.float16, enabled=True, cache_enabled=True)``: within
    the region, ops on ``device_type`` tensors follow the policy in this module's docstring
    (matrix ops in ``dtype``, precision-sensitive ops in fp32). Regions nest: an inner region
    overrides the outer one for its device type until it exits (``enabled=False`` turns casting
    off). Regions are per thread. Use it for the forward pass and the loss; run ``backward()``
    and the optimizer step outside (the parameter-cast cache assumes parameters do not change
    inside a region).
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool = True,
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
        self._saved: list[tuple[torch.dtype | None, bool]] = []

    def __enter__(self) -> Autocast:
        st = _local
        # A disabled region only changes this thread's state: it has nothing to cast.
        if self.enabled:
            _acquire()
        self._saved.append((st.low.get(self.device_type), st.cache_enabled))
        if self.enabled:
            st.low[self.device_type] = self.dtype
        else:
            st.low.pop(self.device_type, None)
        st.cache_enabled = self.cache_enabled
        st.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        st = _local
        previous, st.cache_enabled = self._saved.pop()
        if previous is None:
            st.low.pop(self.device_type, None)
        else:
            st.low[self.device_type] = previous
        st.depth -= 1
        if st.depth == 0:
            st.cache.clear()
        if self.enabled:
            _release()

    def __call__(self, fn: Callable) -> Callable:
        """Use as a decorator: run ``fn`` inside a fresh region with these settings."""

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with Autocast(self.device_type, self.dtype, self.enabled, self.cache_enabled):
                return fn(*args, **kwargs)

        return wrapped
