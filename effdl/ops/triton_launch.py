"""Launching a Triton kernel for less host time than ``kernel[grid](...)`` costs.

``JITFunction.run`` binds the arguments, works out their specialization and hashes a cache key on
every call: Python work per launch that can exceed a small kernel's GPU time, so an eager step
of a few small kernels waits on the host.
:class:`KernelLauncher` keeps each compiled kernel under a key built from the properties Triton
specializes on (pointer dtypes and 16-byte alignment; integers' width, being 1, divisibility by
16; the constexpr values; the launch options), a key at least as fine as Triton's own, and on a
hit calls the compiled binary directly, with Triton's launch hooks (a profiler's) as Triton
would. A key seen for the first time, Triton's interpreter, Triton releases without
``triton.knobs`` and torch.compile's tracing take the ordinary ``kernel[grid](...)`` path.

:meth:`KernelLauncher.binary` describes a compiled kernel for a launcher written in C++
(``effdl/ops/csrc``), which then calls it with ``cuLaunchKernel`` and no Python at all.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # CPU-only installs never launch kernels
    triton = None
try:
    from triton import knobs as _knobs
except ImportError:  # older Triton: launch hooks live elsewhere, every launch goes through it
    _knobs = None

_I32 = range(-(2**31), 2**31)
_PARAM_KINDS = {"i32": "i", "i64": "l", "fp32": "f"}  # scalar types a C launcher passes
SCRATCH_PARAMS = 2  # null pointers appended to a kernel's parameters (Triton's global and
# profile scratch; a kernel that declares fewer ignores the rest)


def _specialization(arg: Any) -> tuple:
    """What Triton may specialize a runtime argument on (a superset is safe: only finer keys)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):
        return (bool, arg)
    if isinstance(arg, int):
        return (arg in _I32, arg == 1, arg % 16 == 0)
    return (type(arg),)


class KernelLauncher:
    """``launcher(grid, *args, num_warps=..., **constexprs)`` runs ``kernel`` as
    ``kernel[grid](*args, num_warps=..., **constexprs)`` would, for less host time.

    ``args`` are the kernel's runtime arguments in signature order; the constexprs are keyword
    arguments, follow them in the signature and are all given (defaults are not filled in).
    ``grid`` has one to three entries. Compiled kernels are kept per key until :meth:`clear`.
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, Any] = {}
        # under TRITON_INTERPRET=1, triton.jit gives an interpreted function: nothing compiles
        self._compiles = _knobs is not None and isinstance(kernel, JITFunction)

    def clear(self) -> None:
        """Forget the compiled kernels (Triton keeps its own cache)."""
        self._compiled.clear()

    def binary(
        self, grid: tuple[int, ...], *args: Any, num_warps: int, **constexprs: Any
    ) -> tuple[int, tuple[int, int, int], int, int, str, int]:
        """Compile ``kernel`` for these arguments (launching nothing) and describe the binary for
        a C launcher: ``(function handle, grid (3 entries), threads per block, shared memory
        bytes, parameter kinds, trailing null pointers)``. The kinds have one letter per
        runtime argument: ``p`` pointer, ``i`` int32, ``l`` int64, ``f`` float32, ``-`` folded
        into the binary by Triton's specialization (an integer equal to 1, say). Raises
        RuntimeError for what such a launcher cannot do: cluster launches, programmatic
        dependent launch, scratch memory, argument types other than those."""
        kernel = self.kernel.warmup(*args, grid=grid, num_warps=num_warps, **constexprs)
        meta = kernel.metadata
        unsupported = [
            name
            for name, value in (
                ("num_ctas", getattr(meta, "num_ctas", 1) != 1),
                ("launch_pdl", getattr(meta, "launch_pdl", False)),
                ("launch_cooperative_grid", getattr(meta, "launch_cooperative_grid", False)),
                ("global_scratch_size", getattr(meta, "global_scratch_size", 0)),
                ("profile_scratch_size", getattr(meta, "profile_scratch_size", 0)),
            )
            if value
        ]
        signature, constants = kernel.src.signature, getattr(kernel.src, "constants", {})
        kinds = ""
        for index, name in enumerate(self.kernel.arg_names[: len(args)]):
            kind = signature.get(name, signature.get(index, "constexpr"))
            if kind == "constexpr" or name in constants or (index,) in constants:
                kinds += "-"
            elif kind.startswith("*"):
                kinds += "p"
            elif kind in _PARAM_KINDS:
                kinds += _PARAM_KINDS[kind]
            else:
                unsupported.append(f"{name}: {kind}")
        if unsupported:
            raise RuntimeError(f"{self.kernel.fn.__name__}: a C launcher cannot pass {unsupported}")
        kernel._init_handles()  # loads the binary on the current device
        return (
            kernel.function, (*grid, 1, 1)[:3], 32 * meta.num_warps, meta.shared, kinds,
            SCRATCH_PARAMS,
        )  # fmt: skip

    def __call__(
        self, grid: tuple[int, ...], *args: Any, num_warps: int, **constexprs: Any
    ) -> None:
        if not self._compiles or torch.compiler.is_compiling():
            # torch.compile traces a plain launch of a @triton.jit kernel into its graph
            self.kernel[grid](*args, num_warps=num_warps, **constexprs)
            return
        device = torch.cuda.current_device()
        key = (device, num_warps, tuple(constexprs.items()), *map(_specialization, args))
        compiled = self._compiled.get(key)
        if compiled is None:
            kernel = self.kernel[grid](*args, num_warps=num_warps, **constexprs)
            if isinstance(kernel, CompiledKernel):
                # the binary takes every argument in signature order, constexprs included
                names = self.kernel.arg_names[len(args) :]
                self._compiled[key] = (kernel, names)
            return
        kernel, names = compiled
        grid = (*grid, 1, 1)[:3]
        stream = driver.active.get_current_stream(device)
        args = (*args, *(constexprs[name] for name in names))
        # the same launch as JITFunction.run's, hooks (a profiler's) included
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        metadata = kernel.launch_metadata(grid, stream, *args) if enter is not None else None
        kernel.run(
            *grid, stream, kernel.function, kernel.packed_metadata, metadata, enter, leave, *args
        )
