"""The SwiGLU MLP of LLaMA-style transformers, written plainly with ``nn.Linear``: the reference.

``SwigluMLP(x) = U(silu(W x) * V x)``, no biases. Each projection is an ``nn.Linear``, so its
``weight`` has the ``nn.Linear`` layout ``(out_features, in_features)``: ``W.weight`` and
``V.weight`` are ``(intermediate, hidden)`` and ``U.weight`` is ``(hidden, intermediate)``. The
matrices of :class:`effdl.ops.swiglu.MemoryOptimizedSwigluMLPFunction` are their transposes.

Also here: :class:`MLPStack` (a stack of such layers, optionally residual) and
:class:`Checkpointed` (``torch.utils.checkpoint`` around any layer), used by the tests and the
recomputation benchmark in ``swiglu_checkpoint/``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class SwigluMLP(nn.Module):
    """Bias-free SwiGLU MLP: ``(..., hidden) -> (..., hidden)`` through ``intermediate`` units."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.W = nn.Linear(hidden_size, intermediate_size, **kw)
        self.V = nn.Linear(hidden_size, intermediate_size, **kw)
        self.U = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.U(F.silu(self.W(x)) * self.V(x))


class MLPStack(nn.Module):
    """Applies ``layers`` in order; with ``residual`` each layer computes ``x + layer(x)``.

    The residual form keeps activations at unit scale through a deep stack of randomly
    initialised layers (without it each SwiGLU layer shrinks its input several-fold), and costs
    one (tokens x hidden) add per layer.
    """

    def __init__(self, layers: Iterable[nn.Module], residual: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x) if self.residual else layer(x)
        return x


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` (non-reentrant) around ``module``: keeps only its input and
    re-runs its forward during backward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.module, x, use_reentrant=False)
