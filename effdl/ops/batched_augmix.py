"""AugMix for a whole uint8 batch on its device, with an independent random draw per sample.

:class:`BatchedAugMix` has torchvision.transforms.v2.AugMix's parameters and, per sample, its
semantics: Beta(alpha, alpha) weight between the original and the mix, Dirichlet(alpha) weights
over ``mixture_width`` chains, each chain ``chain_depth`` ops long (or 1..3 at random), each op
drawn uniformly from the AugMix set with a magnitude bin below ``severity`` and a random sign where
torchvision draws one; every op rounds to uint8 as torchvision's tensor kernel does, and the mix
is truncated to uint8 as torchvision's. torchvision applies one draw of ops to a whole batch;
here every sample has its own, as a DataLoader worker running AugMix per image would give.

One chain step is a fixed set of batched kernels, no loop over samples and no host sync:

* the per-channel pointwise ops (posterize, solarize, autocontrast, equalize, brightness,
  contrast) become one 256-entry lookup table per sample and channel, applied by one gather;
* color (saturation) and sharpness are computed for the whole batch with per-sample factors;
* the geometric ops (shear, translate, rotate) are one ``grid_sample`` with per-sample inverse
  affine matrices, built the way torchvision builds its grid;
* ``torch.where`` on the per-sample op index picks each sample's result.

Steps past a sample's chain depth are the identity. Outside pixels of a warp are 0
(torchvision's default ``fill=None``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms.v2 import InterpolationMode

from effdl.ops.dirichlet import sample_dirichlet

OPS = (
    "ShearX",
    "ShearY",
    "TranslateX",
    "TranslateY",
    "Rotate",
    "Posterize",
    "Solarize",
    "AutoContrast",
    "Equalize",
    "Brightness",
    "Color",
    "Contrast",
    "Sharpness",
)  # torchvision's AugMix order; the first 9 are the partial set (all_ops=False)
PARTIAL_OPS = 9
NO_OP = -1  # op index of a step past the sample's chain depth
UNSIGNED_OPS = ("Posterize", "Solarize", "AutoContrast", "Equalize")  # no random sign
MAGNITUDE_BINS = 10  # torchvision's _PARAMETER_MAX: severity picks one of the first bins
MAX_RANDOM_DEPTH = 3  # chain_depth <= 0 draws a depth in 1..3

_OP = {name: i for i, name in enumerate(OPS)}
_GEOMETRIC = tuple(_OP[n] for n in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"))
_MODES = {InterpolationMode.NEAREST: "nearest", InterpolationMode.BILINEAR: "bilinear"}


def magnitude_table(height: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``(len(OPS), MAGNITUDE_BINS)``: torchvision AugMix's magnitude of each op and bin
    for an ``height x width`` image (unsigned; posterize holds its bit count; 0 for the ops
    without a magnitude). Built by kernels on ``device``, no host-to-device copy."""
    n = MAGNITUDE_BINS

    def linspace(start: float, end: float) -> torch.Tensor:
        return torch.linspace(start, end, n, device=device)

    strength = linspace(0.0, 0.9)
    rows = {
        "ShearX": linspace(0.0, 0.3),
        "ShearY": linspace(0.0, 0.3),
        "TranslateX": linspace(0.0, width / 3.0),
        "TranslateY": linspace(0.0, height / 3.0),
        "Rotate": linspace(0.0, 30.0),
        "Posterize": (4 - (torch.arange(n, device=device) / ((n - 1) / 4))).round().float(),
        "Solarize": linspace(1.0, 0.0),
        "AutoContrast": torch.zeros(n, device=device),
        "Equalize": torch.zeros(n, device=device),
        "Brightness": strength,
        "Color": strength,
        "Contrast": strength,
        "Sharpness": strength,
    }
    return torch.stack([rows[name] for name in OPS])


@dataclass(frozen=True)
class AugMixParams:
    """One batch's AugMix draw, tensors on one device.

    ``original_weight`` float32 ``(B,)``: the Beta weight of the original image;
    ``chain_weights`` float32 ``(B, W)``: Dirichlet weights times ``1 - original_weight``;
    ``ops`` int64 ``(B, W, D)``: index into :data:`OPS`, :data:`NO_OP` past the chain's depth;
    ``magnitudes`` float32 ``(B, W, D)``: signed magnitude of each op.
    """

    original_weight: torch.Tensor
    chain_weights: torch.Tensor
    ops: torch.Tensor
    magnitudes: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AugMixParams:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            original_weight=move(self.original_weight),
            chain_weights=move(self.chain_weights),
            ops=move(self.ops),
            magnitudes=move(self.magnitudes),
        )


class BatchedAugMix(nn.Module):
    """torchvision's AugMix on a uint8 ``(B, 3, H, W)`` batch, one random draw per sample.

    Parameters and defaults as ``torchvision.transforms.v2.AugMix`` (no ``fill``: outside pixels
    are 0). Draws come from ``generator`` (its device does the sampling) or, without one, from
    the global RNG of the batch's device. Keep both on the batch's device in a training loop: a
    CPU draw for a CUDA batch costs a blocking host-to-device copy.
    """

    def __init__(
        self,
        severity: int = 3,
        mixture_width: int = 3,
        chain_depth: int = -1,
        alpha: float = 1.0,
        all_ops: bool = True,
        interpolation: InterpolationMode | str = InterpolationMode.BILINEAR,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= severity <= MAGNITUDE_BINS:
            raise ValueError(f"severity must be in [1, {MAGNITUDE_BINS}], got {severity}")
        if mixture_width < 1:
            raise ValueError(f"mixture_width must be >= 1, got {mixture_width}")
        if alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        mode = InterpolationMode(interpolation)
        if mode not in _MODES:
            raise ValueError(
                f"interpolation {mode.value!r} is not supported on tensors: "
                f"choose one of {[m.value for m in _MODES]}"
            )
        self.severity = severity
        self.mixture_width = mixture_width
        self.chain_depth = chain_depth
        self.alpha = alpha
        self.all_ops = all_ops
        self.interpolation = mode
        self.generator = generator

    def sample_params(
        self, batch: int, height: int, width: int, device: torch.device | str
    ) -> AugMixParams:
        """Draw one batch's parameters (on the generator's device) and return them on ``device``."""
        gen = self.generator
        draw_on = gen.device if gen is not None else torch.device(device)
        depth = self.chain_depth if self.chain_depth > 0 else MAX_RANDOM_DEPTH
        shape = (batch, self.mixture_width, depth)
        n_ops = len(OPS) if self.all_ops else PARTIAL_OPS

        def concentration(k: int) -> torch.Tensor:
            return torch.full((batch, k), self.alpha, dtype=torch.float32, device=draw_on)

        beta = sample_dirichlet(concentration(2), generator=gen)
        mixing = sample_dirichlet(concentration(self.mixture_width), generator=gen)
        ops = torch.randint(n_ops, shape, generator=gen, device=draw_on)
        bins = torch.randint(self.severity, shape, generator=gen, device=draw_on)
        negative = torch.rand(shape, generator=gen, device=draw_on) <= 0.5
        if self.chain_depth <= 0:
            depths = torch.randint(
                1, MAX_RANDOM_DEPTH + 1, shape[:2], generator=gen, device=draw_on
            )
            past_depth = torch.arange(depth, device=draw_on) >= depths.unsqueeze(-1)
            ops = ops.masked_fill(past_depth, NO_OP)

        table = magnitude_table(height, width, draw_on)
        # built by comparisons, not item assignment (a CUDA setitem from a Python value syncs)
        signed = torch.ones(len(OPS), dtype=torch.bool, device=draw_on)
        op_index = torch.arange(len(OPS), device=draw_on)
        for name in UNSIGNED_OPS:
            signed &= op_index != _OP[name]
        op = ops.clamp(min=0)
        magnitudes = table[op, bins]
        magnitudes = torch.where(negative & signed[op], -magnitudes, magnitudes)
        params = AugMixParams(
            original_weight=beta[:, 0],
            chain_weights=mixing * beta[:, 1:],
            ops=ops,
            magnitudes=magnitudes,
        )
        return params.to(device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``(B, 3, H, W)`` -> uint8 ``(B, 3, H, W)``, each sample augmented independently."""
        check_images(images)
        batch, _, height, width = images.shape
        params = self.sample_params(batch, height, width, images.device)
        return augmix(images, params, self.interpolation)


def check_images(images: torch.Tensor) -> None:
    """Raise unless ``images`` is a uint8 ``(B, 3, H, W)`` batch."""
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(
            f"BatchedAugMix needs a uint8 (B, 3, H, W) batch, got {images.dtype} of shape "
            f"{tuple(images.shape)}"
        )


def augmix(
    images: torch.Tensor,
    params: AugMixParams,
    interpolation: InterpolationMode | str = InterpolationMode.BILINEAR,
) -> torch.Tensor:
    """Mix of ``images`` (uint8 ``(B, 3, H, W)``) and its augmentation chains as ``params`` say;
    float32 accumulation truncated to uint8, as torchvision's AugMix."""
    per_sample = (-1, 1, 1, 1)
    mix = params.original_weight.view(per_sample) * images
    for chain in range(params.ops.shape[1]):
        aug = images
        for step in range(params.ops.shape[2]):
            aug = apply_op(
                aug, params.ops[:, chain, step], params.magnitudes[:, chain, step], interpolation
            )
        mix.add_(params.chain_weights[:, chain].view(per_sample) * aug)
    return mix.to(images.dtype)


def apply_op(
    images: torch.Tensor,
    ops: torch.Tensor,
    magnitudes: torch.Tensor,
    interpolation: InterpolationMode | str = InterpolationMode.BILINEAR,
) -> torch.Tensor:
    """Sample i of uint8 ``images`` ``(B, 3, H, W)`` through op ``OPS[ops[i]]`` (identity for
    :data:`NO_OP`) with signed magnitude ``magnitudes[i]``; uint8 out, rounded as torchvision's
    tensor kernel of that op rounds."""
    per_sample = ops.view(-1, 1, 1, 1)
    factor = _Factor(magnitudes)
    gray = _grayscale(images)
    index = images.flatten(start_dim=-2).long()  # (B, 3, H * W) table index of every pixel
    tables = _lookup_tables(images, index, gray, ops, magnitudes, factor)
    out = tables.squeeze(-2).gather(-1, index).view_as(images)
    out = torch.where(per_sample == _OP["Color"], _saturate(images, gray, factor), out)
    out = torch.where(per_sample == _OP["Sharpness"], _sharpen(images, factor), out)
    geometric = torch.zeros_like(per_sample, dtype=torch.bool)
    for op in _GEOMETRIC:
        geometric |= per_sample == op
    matrices = _inverse_affine(ops, magnitudes, images.shape[-2], images.shape[-1])
    return torch.where(
        geometric, _warp(images, matrices, _MODES[InterpolationMode(interpolation)]), out
    )


# ---- pointwise ops ---------------------------------------------------------------------------


class _Factor:
    """Per-sample blend factor ``1 + magnitude`` and ``1 - factor``, each computed in float64 and
    rounded once to float32, as torchvision's Python floats are when they meet a float32 image."""

    def __init__(self, magnitudes: torch.Tensor) -> None:
        ratio = 1.0 + magnitudes.double()
        self.ratio = ratio.float().view(-1, 1, 1, 1)
        self.complement = (1.0 - ratio).float().view(-1, 1, 1, 1)


def _grayscale(images: torch.Tensor) -> torch.Tensor:
    """float32 ``(B, 1, H, W)``: torchvision's floored ITU-R 601 luma of a uint8 image."""
    r, g, b = images.unbind(dim=-3)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).floor_().unsqueeze(-3)


def _blend(image: torch.Tensor, other: torch.Tensor, factor: _Factor) -> torch.Tensor:
    """torchvision's ``_blend`` before its cast: ``image * r + other * (1 - r)`` clamped (the
    second product fused into the add, as ``add_(other, alpha=1 - r)`` does)."""
    return image.mul(factor.ratio).addcmul_(other, factor.complement).clamp_(0, 255)


def _saturate(images: torch.Tensor, gray: torch.Tensor, factor: _Factor) -> torch.Tensor:
    """``adjust_saturation`` with a per-sample factor."""
    return _blend(images, gray, factor).to(torch.uint8)


def _sharpen(images: torch.Tensor, factor: _Factor) -> torch.Tensor:
    """``adjust_sharpness`` with a per-sample factor: the interior blends towards the rounded
    3x3 smoothing (1s around, 5 in the middle, over 13); the border row and column stay."""
    taps = torch.arange(3, device=images.device)
    centre = (taps.view(3, 1) == 1) & (taps == 1)
    kernel = torch.where(centre, 5.0 / 13.0, 1.0 / 13.0).expand(3, 1, 3, 3)
    out = images.float()
    blurred = F.conv2d(out, kernel, groups=3).round_()
    interior = out[..., 1:-1, 1:-1]
    interior.addcmul_(blurred.sub_(interior), factor.complement)
    return out.clamp_(0, 255).to(torch.uint8)


def _lookup_tables(
    images: torch.Tensor,
    index: torch.Tensor,
    gray: torch.Tensor,
    ops: torch.Tensor,
    magnitudes: torch.Tensor,
    factor: _Factor,
) -> torch.Tensor:
    """uint8 ``(B, 3, 1, 256)``: each sample's per-channel table for its op (posterize, solarize,
    autocontrast, equalize, brightness, contrast; identity for the others), computed in float32
    with torchvision's arithmetic on the 256 possible values (laid out as a 1 x 256 image, so
    per-sample ``(B, 1, 1, 1)`` factors broadcast as they do over the images)."""
    batch = images.shape[0]
    values = torch.arange(256, dtype=torch.float32, device=images.device).expand(batch, 3, 1, 256)
    magnitude = magnitudes.double().view(-1, 1, 1, 1)

    drop = torch.exp2(8 - magnitude.trunc()).float()  # posterize keeps trunc(magnitude) bits
    threshold = (255.0 * magnitude).float()
    mean = gray.mean(dim=(-3, -2, -1), keepdim=True)
    tables = {
        "Posterize": values.div(drop).floor_().mul_(drop),
        "Solarize": torch.where(values >= threshold, 255.0 - values, values),
        "AutoContrast": _autocontrast_table(images, values),
        "Equalize": _equalize_table(index, values),
        "Brightness": values.mul(factor.ratio).clamp_(0, 255),
        "Contrast": _blend(values, mean, factor),
    }
    # Candidate 0 is NO_OP's identity, candidate k + 1 is OPS[k]'s table (identity if none).
    candidates = torch.stack([values] + [tables.get(name, values) for name in OPS])
    slot = (ops + 1).view(1, -1, 1, 1, 1).expand(1, *values.shape)
    return candidates.gather(0, slot).squeeze(0).to(torch.uint8)


def _autocontrast_table(images: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``autocontrast``: each channel's [min, max] stretched to [0, 255] (constant: unchanged)."""
    low = images.amin(dim=(-2, -1), keepdim=True).float()
    high = images.amax(dim=(-2, -1), keepdim=True).float()
    flat = high == low
    scale = (high - low).mul_(1.0 / 255)
    low = low.masked_fill(flat, 0.0)
    scale = scale.masked_fill(flat, 1.0)
    return (values - low).div_(scale).clamp_(0, 255)


def _equalize_table(flat: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``equalize`` of the pixels ``flat`` ``(B, 3, H * W)``: PIL's histogram-equalisation table
    per channel, from one batched histogram; unchanged where fewer than 255 pixels differ from
    the channel's top value."""
    hist = torch.zeros(*flat.shape[:-1], 256, dtype=torch.int32, device=flat.device)
    hist.scatter_add_(-1, flat, hist.new_ones(1).expand_as(flat))
    cum_hist = hist.cumsum(dim=-1)
    top = cum_hist.argmax(dim=-1, keepdim=True)  # last non-empty bin
    step = (flat.shape[-1] - hist.gather(-1, top)).div_(255, rounding_mode="floor")
    table = (cum_hist[..., :-1] + step // 2).div_(step.clamp(min=1), rounding_mode="floor")
    table = F.pad(table.clamp_(0, 255), (1, 0))  # value 0 maps to 0
    equalized = torch.where(step != 0, table, values.view_as(table).long())
    return equalized.float().view_as(values)


# ---- geometric ops ---------------------------------------------------------------------------


def _inverse_affine(
    ops: torch.Tensor, magnitudes: torch.Tensor, height: int, width: int
) -> torch.Tensor:
    """float32 ``(B, 2, 3)``: torchvision's inverse affine matrix (output pixel -> input pixel,
    origin at the image centre) of each sample's geometric op; identity for the other ops.

    As torchvision: shears about the top-left corner with angle ``degrees(atan(magnitude))``,
    translations by ``int(magnitude)`` pixels, rotation by ``-(magnitude mod 360)`` degrees about
    the centre; computed in float64, then rounded to float32."""
    m = magnitudes.double()
    zero = torch.zeros_like(m)

    def where_op(name: str, value: torch.Tensor) -> torch.Tensor:
        return torch.where(ops == _OP[name], value, zero)

    shear_x = where_op("ShearX", torch.deg2rad(torch.rad2deg(torch.atan(m))))
    shear_y = where_op("ShearY", torch.deg2rad(torch.rad2deg(torch.atan(m))))
    tx = where_op("TranslateX", m.trunc())
    ty = where_op("TranslateY", m.trunc())
    rot = where_op("Rotate", torch.deg2rad(-torch.remainder(m, 360.0)))
    sheared = (ops == _OP["ShearX"]) | (ops == _OP["ShearY"])
    cx = torch.where(sheared, -0.5 * width, zero)
    cy = torch.where(sheared, -0.5 * height, zero)

    cos_sy, tan_sx = torch.cos(shear_y), torch.tan(shear_x)
    a = torch.cos(rot - shear_y) / cos_sy
    b = -(a * tan_sx + torch.sin(rot))
    c = torch.sin(rot - shear_y) / cos_sy
    d = torch.cos(rot) - c * tan_sx
    m0, m1, m3, m4 = d, -b, -c, a
    m2 = cx - m0 * (cx + tx) - m1 * (cy + ty)
    m5 = cy - m3 * (cx + tx) - m4 * (cy + ty)
    return torch.stack([m0, m1, m2, m3, m4, m5], dim=-1).view(-1, 2, 3).float()


def _warp(images: torch.Tensor, matrices: torch.Tensor, mode: str) -> torch.Tensor:
    """``grid_sample`` of uint8 ``images`` through per-sample inverse affine ``matrices``, the
    grid built as torchvision's ``_affine_grid`` builds it; zeros outside, rounded to uint8."""
    batch, _, h, w = images.shape
    device = images.device
    base = torch.empty(1, h, w, 3, device=device)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=device))
    base[..., 1].copy_(
        torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=device).unsqueeze_(-1)
    )
    base[..., 2].fill_(1)
    theta = matrices.transpose(1, 2).contiguous()  # (B, 3, 2), as torchvision's rescaled theta
    theta[..., 0] /= 0.5 * w
    theta[..., 1] /= 0.5 * h
    grid = base.view(1, h * w, 3).expand(batch, -1, -1).bmm(theta).view(batch, h, w, 2)
    warped = F.grid_sample(
        images.float(), grid, mode=mode, padding_mode="zeros", align_corners=False
    )
    return warped.round_().to(torch.uint8)
