"""Building and loading effdl's C++ ops (``effdl/ops/csrc``) on the machine that runs them.

A C++ op is built the first time it is asked for, by ``torch.utils.cpp_extension.load``: a C++
compiler, ninja and the CUDA toolkit's headers are needed, and the build (about a minute) is
cached per machine under torch's extensions folder. Where it cannot be built, or
``EFFDL_CPP_OPS=0`` is set, :func:`load_cpp_extension` returns None and the caller keeps its
Python path, after one warning naming the reason.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
DISABLE_ENV_VAR = "EFFDL_CPP_OPS"  # "0": never build, use the Python paths

_loaded: dict[str, ModuleType | None] = {}


def cpp_ops_enabled() -> bool:
    """Whether C++ ops may be built here: ``$EFFDL_CPP_OPS`` is not ``0`` and torch has CUDA."""
    return os.environ.get(DISABLE_ENV_VAR, "1") != "0" and torch.cuda.is_available()


def load_cpp_extension(name: str, source: str) -> ModuleType | None:
    """The extension built from ``csrc/<source>`` (compiled on first use, then cached), or None
    where C++ ops are disabled or the build fails (warning once with the reason)."""
    if name in _loaded:
        return _loaded[name]
    module = None
    if cpp_ops_enabled():
        from torch.utils import cpp_extension

        print(f"effdl: loading the C++ op {name} (built once per machine)", file=sys.stderr)
        try:
            module = cpp_extension.load(
                name=name, sources=[str(CSRC / source)], extra_cflags=["-O2"], with_cuda=True
            )
        except Exception as error:  # no compiler, no CUDA headers, a failed build
            reason = str(error).strip().splitlines()
            warnings.warn(
                f"effdl: could not build the C++ op {name} ({reason[-1] if reason else error!r});"
                f" using its Python path (set {DISABLE_ENV_VAR}=0 to skip the build)",
                RuntimeWarning,
                stacklevel=2,
            )
    _loaded[name] = module
    return module
