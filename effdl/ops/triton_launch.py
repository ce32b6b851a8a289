"""Launch a Triton kernel through its compiled handle, without the JIT's per-call binding.

``kernel[grid](*args)`` binds the arguments, derives their specialization (dtypes, 16-byte
alignment of pointers, integers equal to 1 or divisible by 16), hashes it to find the compiled
kernel and only then launches it: some 80 microseconds of host time per launch on the GPU
machines' hosts, several times what a LayerNorm over a few MB runs on the GPU, and several times
what torch spends launching its own kernel. :class:`CompiledLauncher` computes a key from the same
properties of the arguments (a superset: an extra distinction only compiles one more variant)
and launches a kernel it has seen with that key through ``CompiledKernel.run``; an unseen key,
and every launch while Triton's launch hooks are set (a profiler), go through ``kernel[grid]``,
which compiles or finds the kernel as always.

Feature detection: the direct call needs a CUDA tensor and a Triton whose ``CompiledKernel.run``
takes every parameter of the signature, constexprs included (3.3 and later); elsewhere, and
under Triton's interpreter, every launch takes the JIT path.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
except ImportError:  # CPU-only installs
    triton = None

INT32 = range(-(2**31), 2**31)
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})


def _direct_launch_supported() -> bool:
    if triton is None:
        return False
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 3)


def _launch_hooks_set() -> bool:
    """Whether Triton's launch enter/exit hooks are set (a profiler such as proton): the JIT
    path calls them with its launch metadata. A hook is a function, None, or (newer Triton) a
    chain of functions, empty when none is set."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return True  # no knobs module: keep to the JIT path
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(h, "calls", h) for h in hooks)


def _arg_key(arg: object) -> object:
    """What Triton specializes a runtime argument on: a tensor's dtype and whether its data is
    16-byte aligned; an int's width and whether it is 1 or divisible by 16; a float's type."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):
        return ("bool", arg)
    if isinstance(arg, int):
        return (arg == 1, arg % 16 == 0, arg in INT32)
    return type(arg)


class CompiledLauncher:
    """``launcher(grid, *args, **constexprs)`` launches ``kernel`` on the current CUDA stream
    as ``kernel[grid](*args, **constexprs)`` would.

    ``args`` are the kernel's runtime parameters, positionally, in its signature's order;
    ``constexprs`` its constexpr parameters, the signature's last ones, by keyword in order,
    and launch options (``num_warps``); the same names each call. ``grid`` is a tuple of one to
    three ints.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, Any] = {}
        self._direct = _direct_launch_supported()

    def __call__(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        first = args[0]
        if not (self._direct and first.is_cuda) or _launch_hooks_set():
            self.kernel[grid](*args, **constexprs)
            return
        key = (*map(_arg_key, args), *constexprs.values(), first.device.index)
        compiled = self._compiled.get(key)
        if compiled is None:
            names = [k for k in constexprs if k not in LAUNCH_OPTIONS]
            if names != self.kernel.arg_names[len(args) :]:
                raise TypeError(
                    f"{self.kernel.fn.__name__}: pass the runtime parameters positionally and the "
                    f"constexprs by keyword, in the order of {self.kernel.arg_names}"
                )
            # The JIT path compiles (or finds) the kernel for these arguments and launches it.
            self._compiled[key] = self.kernel[grid](*args, **constexprs)
            return
        g = (*grid, 1, 1)
        params = [*args, *(v for k, v in constexprs.items() if k not in LAUNCH_OPTIONS)]
        compiled.run(
            g[0], g[1], g[2],
            torch._C._cuda_getCurrentRawStream(first.device.index),
            compiled.function, compiled.packed_metadata, None, None, None, *params,
        )  # fmt: skip
