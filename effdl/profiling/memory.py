"""GPU memory settings a capped run needs before CUDA starts."""

from __future__ import annotations

import os
import warnings

import torch

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def use_expandable_segments() -> str:
    """Have the CUDA caching allocator grow its segments in place (``expandable_segments``), so
    that memory reserved but unallocated between fixed-size segments does not count against a
    cap set with ``torch.cuda.set_per_process_memory_fraction``. Sets ``PYTORCH_CUDA_ALLOC_CONF``
    unless the user did; the allocator reads it when CUDA starts, so call this first. Returns
    the setting in force (for the run log); warns if CUDA started first, too late for it."""
    if torch.cuda.is_initialized() and ALLOC_CONF not in os.environ:
        warnings.warn(
            f"CUDA started before {ALLOC_CONF}={EXPANDABLE} could apply; set it in the "
            "environment for a capped run",
            stacklevel=2,
        )
        return ""
    return os.environ.setdefault(ALLOC_CONF, EXPANDABLE)
