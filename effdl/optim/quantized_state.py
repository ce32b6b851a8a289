"""Block-wise 8-bit Adam moments, as bitsandbytes' 8-bit optimizers keep them.

A tensor is cut into blocks of :data:`BLOCK_SIZE` values; each block stores one fp32 absmax and
one uint8 code per value, the index of the nearest entry of a 256-value code map after dividing
by the absmax. Memory is ``1 + 4 / 2048`` bytes per value instead of 4.

The code map is bitsandbytes' "dynamic tree" map (:func:`dynamic_code`), not a linear one:
Adam's moments span many decades inside one block (the second moment is a squared gradient), and
a linear map would round everything below ``absmax / 255`` to zero, turning ``m / sqrt(v)`` into
``m / eps``. The dynamic map spends its codes per decade, from ``1e-7`` to ``1`` of the absmax,
with finer steps in the larger decades. The first moment uses the signed map, the second the
unsigned one (twice the resolution, since it is never negative).

Per block the absmax lets one outlier cost precision only in its own 2048 values. Rounding is
to the nearest code (no stochastic rounding). The Adam update itself runs in fp32: the moments of
a chunk of blocks are dequantized, updated with the gradient, used for the step, and
re-quantized (:meth:`QuantizedAdamMoments.step`). Every step is a vectorized torch op, so the same
code runs on the CPU or on a GPU; the code maps must then live on that device (:class:`CodeMaps`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from effdl.optim.fused_adam import fused_adam_

BLOCK_SIZE = 2048
# Blocks processed together by QuantizedAdamMoments.step: bounds its fp32 scratch to 8 MiB.
CHUNK_BLOCKS = 512


def dynamic_code(signed: bool) -> Tensor:
    """The 256 sorted fp32 values of bitsandbytes' dynamic map (``create_dynamic_map``).

    Decade ``e`` (0..6) covers ``[0.1, 1] * 10**(e - 6)`` with ``2**e`` values per sign (signed)
    or ``2**(e + 1)`` values (unsigned), at the midpoints of an even split; then 0 and 1. The
    signed map has no -1: a block's most negative value, if it sets the absmax, is stored as
    about -0.993 of it.
    """
    values = [0.0, 1.0]
    for e in range(7):
        n = 2**e if signed else 2 ** (e + 1)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (e - 6)).tolist()
        values += mids + ([-v for v in mids] if signed else [])
    code = torch.tensor(sorted(values), dtype=torch.float32)
    assert code.numel() == 256
    return code


@dataclass(frozen=True)
class CodeMaps:
    """The signed and unsigned dynamic maps, and the rounding boundaries between their codes,
    on one device. Built once per device: a lookup table on the wrong device would cost a copy
    (and a stream sync) on every call."""

    codes: dict[bool, Tensor]  # signed -> the 256 sorted code values
    boundaries: dict[bool, Tensor]  # signed -> the 255 midpoints between neighbouring codes

    @classmethod
    def on(cls, device: str | torch.device) -> CodeMaps:
        codes = {signed: dynamic_code(signed).to(device) for signed in (True, False)}
        # Nearest-code rounding is a binary search among the midpoints between neighbours.
        return cls(codes, {signed: (c[1:] + c[:-1]) / 2 for signed, c in codes.items()})


CPU_MAPS = CodeMaps.on("cpu")


def num_blocks(numel: int) -> int:
    """Blocks of :data:`BLOCK_SIZE` needed for ``numel`` values (the last one may be short)."""
    return -(-numel // BLOCK_SIZE)


def quantized_nbytes(numel: int) -> int:
    """Bytes of one quantized tensor of ``numel`` values: a code each, an fp32 absmax a block."""
    return numel + 4 * num_blocks(numel)


def quantize(x: Tensor, *, signed: bool = True, maps: CodeMaps = CPU_MAPS) -> tuple[Tensor, Tensor]:
    """Block-wise 8-bit quantization of ``x`` (any shape, floating point, flattened).

    Returns ``(codes, absmax)`` on ``x``'s device, which must be ``maps``'s: ``codes`` uint8 of
    shape ``(x.numel(),)``, ``absmax`` fp32 of shape ``(num_blocks(x.numel()),)``. With
    ``signed=False`` the input must be non-negative (negative values round to 0). An all-zero
    block has absmax 0 and dequantizes to zeros.
    """
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = F.pad(flat, (0, num_blocks(n) * BLOCK_SIZE - n)).view(-1, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normalized = blocks / scale[:, None]
    codes = torch.bucketize(normalized, maps.boundaries[signed], out_int32=True).to(torch.uint8)
    return codes.view(-1)[:n], absmax


def dequantize(
    codes: Tensor,
    absmax: Tensor,
    shape: torch.Size | tuple[int, ...],
    *,
    signed: bool = True,
    maps: CodeMaps = CPU_MAPS,
) -> Tensor:
    """The fp32 tensor of ``shape`` that ``quantize(..., signed=signed)`` encoded (on the
    device of ``codes``, ``absmax`` and ``maps``)."""
    n = codes.numel()
    values = maps.codes[signed][codes.long()]
    values = F.pad(values, (0, absmax.numel() * BLOCK_SIZE - n)).view(-1, BLOCK_SIZE)
    return (values * absmax[:, None]).view(-1)[:n].view(shape)


_MOMENT_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")


class QuantizedAdamMoments:
    """One parameter's Adam moments (``exp_avg``, ``exp_avg_sq``) in block-wise 8-bit form.

    Holds ``numel`` values per moment: uint8 codes plus an fp32 absmax per block of
    :data:`BLOCK_SIZE`, so :attr:`nbytes` is ``2 * (numel + 4 * ceil(numel / 2048))``. The four
    tensors may be views into larger buffers (:class:`QuantizedMomentBuffers`); ``maps`` must be
    on their device. :meth:`zeros` starts at zero, as torch's Adam state does.
    """

    def __init__(
        self,
        exp_avg_codes: Tensor,
        exp_avg_absmax: Tensor,
        exp_avg_sq_codes: Tensor,
        exp_avg_sq_absmax: Tensor,
        maps: CodeMaps = CPU_MAPS,
    ) -> None:
        self.numel = exp_avg_codes.numel()
        self.exp_avg_codes = exp_avg_codes
        self.exp_avg_absmax = exp_avg_absmax
        self.exp_avg_sq_codes = exp_avg_sq_codes
        self.exp_avg_sq_absmax = exp_avg_sq_absmax
        self.maps = maps

    @classmethod
    def zeros(cls, numel: int) -> QuantizedAdamMoments:
        """Zero moments of ``numel`` values in fresh CPU tensors."""
        codes, absmax = (numel,), (num_blocks(numel),)
        return cls(
            torch.zeros(codes, dtype=torch.uint8),
            torch.zeros(absmax),
            torch.zeros(codes, dtype=torch.uint8),
            torch.zeros(absmax),
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())

    def exp_avg(self) -> Tensor:
        """The first moment, dequantized (fp32, flat)."""
        return dequantize(self.exp_avg_codes, self.exp_avg_absmax, (self.numel,), maps=self.maps)

    def exp_avg_sq(self) -> Tensor:
        """The second moment, dequantized (fp32, flat)."""
        return dequantize(
            self.exp_avg_sq_codes,
            self.exp_avg_sq_absmax,
            (self.numel,),
            signed=False,
            maps=self.maps,
        )

    def set(self, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
        """Quantize fp32 moments (any shape with ``numel`` values) into this state."""
        self._store(0, exp_avg.reshape(-1), exp_avg_sq.reshape(-1))

    def zero_(self) -> None:
        """Both moments back to zero (a zero absmax dequantizes its block to zeros)."""
        self.exp_avg_absmax.zero_()
        self.exp_avg_sq_absmax.zero_()

    def state_dict(self) -> dict[str, Tensor]:
        """The codes and absmaxes themselves (a lossless copy; see :meth:`load_state_dict`)."""
        return {key: getattr(self, key) for key in _MOMENT_KEYS}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Copy codes and absmaxes saved by :meth:`state_dict` (shapes must match)."""
        for key, dst in self.state_dict().items():
            dst.copy_(state[key])

    @torch.no_grad()
    def step(
        self,
        param: Tensor,
        grad: Tensor,
        step: Tensor,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        adamw: bool,
        chunk_blocks: int | None = None,
    ) -> None:
        """One Adam (``adamw=False``) or AdamW step of ``param`` in place, updating the moments.

        ``param`` and ``grad`` are flat contiguous tensors of ``numel`` values on this state's
        device, ``param`` fp32 and ``grad`` fp32 or bf16 (read as fp32 chunk by chunk, so a
        bf16 gradient costs 4 more bytes per value of a chunk, not a full fp32 copy); ``step`` is the fp32 scalar step count there, already incremented for
        this step. Chunk by chunk of ``chunk_blocks`` blocks (default :data:`CHUNK_BLOCKS`):
        dequantize both moments, run torch's fused Adam kernel on them in fp32, re-quantize.
        Scratch is about 40 bytes per value of a chunk. Given the dequantized moments the
        parameter update is exactly torch's fused kernel on that device; the only error is the
        moments' rounding, and a first moment whose second moment rounded to 0 is dropped
        (else the step would be ``m / eps``). Chunks are independent, so the chunk size does not change results.
        """
        chunk = (chunk_blocks or CHUNK_BLOCKS) * BLOCK_SIZE
        for start in range(0, self.numel, chunk):
            end = min(start + chunk, self.numel)
            part = self._slice(start, end)
            m, v = part.exp_avg(), part.exp_avg_sq()
            # A second moment far below its block's largest (a rarely used embedding row
            # beside frequent ones) is stored as 0 while its first moment is not: its step would
            # be m / eps. Such a value takes no step from its stale first moment.
            m.masked_fill_(v == 0, 0.0)
            previous = step - 1  # the kernel counts this step itself, in a copy per chunk
            fused_adam_(
                [param[start:end]],
                [grad[start:end].float()],
                [m],
                [v],
                [previous],
                adamw=adamw,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=weight_decay,
            )
            self._store(start, m, v)

    def _slice(self, start: int, end: int) -> QuantizedAdamMoments:
        """Values ``start:end`` as a view (``start`` block-aligned)."""
        blocks = slice(start // BLOCK_SIZE, num_blocks(end))
        return QuantizedAdamMoments(
            self.exp_avg_codes[start:end],
            self.exp_avg_absmax[blocks],
            self.exp_avg_sq_codes[start:end],
            self.exp_avg_sq_absmax[blocks],
            self.maps,
        )

    def _store(self, start: int, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
        """Quantize fp32 moments for values ``start:start+len`` (``start`` block-aligned)."""
        part = self._slice(start, start + exp_avg.numel())
        codes, absmax = quantize(exp_avg, signed=True, maps=self.maps)
        part.exp_avg_codes.copy_(codes)
        part.exp_avg_absmax.copy_(absmax)
        codes, absmax = quantize(exp_avg_sq, signed=False, maps=self.maps)
        part.exp_avg_sq_codes.copy_(codes)
        part.exp_avg_sq_absmax.copy_(absmax)


class QuantizedMomentBuffers:
    """The 8-bit moments of several tensors in four flat buffers, so that all of them move
    between host and device in four copies.

    Tensor ``i`` has ``numels[i]`` values; its codes sit at ``offsets[i]`` of code buffers of
    ``total_numel`` values (the layout of the caller's other flat buffers, gaps included), its
    absmaxes in one run of ``num_blocks(numels[i])`` entries after those of tensor ``i - 1``.
    :attr:`moments` are per-tensor :class:`QuantizedAdamMoments` views, all starting at zero.
    """

    def __init__(
        self,
        numels: Sequence[int],
        offsets: Sequence[int],
        total_numel: int,
        *,
        pin_memory: bool = False,
    ) -> None:
        self.numels, self.offsets, self.total_numel = list(numels), list(offsets), total_numel
        blocks = sum(num_blocks(n) for n in self.numels)
        codes, absmax = (total_numel,), (blocks,)
        self.buffers = {
            "exp_avg_codes": torch.zeros(codes, dtype=torch.uint8, pin_memory=pin_memory),
            "exp_avg_absmax": torch.zeros(absmax, pin_memory=pin_memory),
            "exp_avg_sq_codes": torch.zeros(codes, dtype=torch.uint8, pin_memory=pin_memory),
            "exp_avg_sq_absmax": torch.zeros(absmax, pin_memory=pin_memory),
        }
        self.moments = self.moment_views(CPU_MAPS)

    @property
    def nbytes(self) -> int:
        """Bytes of the four buffers (gaps between tensors included)."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def to(self, device: torch.device, maps: CodeMaps) -> QuantizedMomentBuffers:
        """The same moments on ``device`` (``maps`` must be there), in the same layout; the
        copies are enqueued non-blocking on the current stream. On this buffers' own device,
        the result shares their memory."""
        moved = copy.copy(self)
        moved.buffers = {k: t.to(device, non_blocking=True) for k, t in self.buffers.items()}
        moved.moments = moved.moment_views(maps)
        return moved

    def copy_(self, src: QuantizedMomentBuffers) -> None:
        """Copy ``src``'s moments (same layout, any device) into these buffers, non-blocking on
        the current stream; nothing to do where they share memory."""
        for key, dst in self.buffers.items():
            if src.buffers[key].data_ptr() != dst.data_ptr():
                dst.copy_(src.buffers[key], non_blocking=True)

    def moment_views(self, maps: CodeMaps) -> list[QuantizedAdamMoments]:
        """One :class:`QuantizedAdamMoments` per tensor, views into the buffers that use
        ``maps`` (which must be on the buffers' device)."""
        b = self.buffers
        views, block = [], 0
        for n, off in zip(self.numels, self.offsets, strict=True):
            codes, blocks = slice(off, off + n), slice(block, block + num_blocks(n))
            views.append(
                QuantizedAdamMoments(
                    b["exp_avg_codes"][codes],
                    b["exp_avg_absmax"][blocks],
                    b["exp_avg_sq_codes"][codes],
                    b["exp_avg_sq_absmax"][blocks],
                    maps,
                )
            )
            block += blocks.stop - block
        return views
