"""Block-wise 8-bit quantization against brute-force nearest-code rounding, and the 8-bit Adam
step against torch's fused Adam kernel run on the same (dequantized) moments."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from effdl.optim import quantized_state as qs
from effdl.optim.quantized_state import (
    BLOCK_SIZE,
    CodeMaps,
    QuantizedAdamMoments,
    QuantizedMomentBuffers,
    dequantize,
    dynamic_code,
    quantize,
)


def heavy_tailed(n: int, seed: int, signed: bool) -> torch.Tensor:
    """Values spread over ~8 decades, as Adam's moments are (the second one squared)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
    return x if signed else x.square()


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_code_has_bitsandbytes_layout(signed: bool) -> None:
    code = dynamic_code(signed)
    assert code.shape == (256,) and code.dtype == torch.float32
    assert torch.all(code[1:] > code[:-1])  # sorted, no duplicates
    assert code[-1] == 1 and 0 in code
    positive = code[code > 0]
    # seven decades from 1e-7 up, 2**e (signed) or 2**(e+1) (unsigned) values in decade e
    for e in range(7):
        in_decade = ((positive >= 10.0 ** (e - 7)) & (positive < 10.0 ** (e - 6))).sum()
        assert in_decade == (2**e if signed else 2 ** (e + 1))
    if signed:
        torch.testing.assert_close(code[:127], -positive[:-1].flip(0), rtol=0, atol=0)
    else:
        assert code[0] == 0


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, 2047, 2048, 5000])
def test_quantize_rounds_to_the_nearest_code_per_block(signed: bool, n: int) -> None:
    x = heavy_tailed(n, seed=n, signed=signed)
    codes, absmax = quantize(x, signed=signed)
    assert codes.dtype == torch.uint8 and codes.shape == (n,)
    assert absmax.dtype == torch.float32 and absmax.shape == (math.ceil(n / BLOCK_SIZE),)

    blocks = torch.nn.functional.pad(x, (0, absmax.numel() * BLOCK_SIZE - n)).view(-1, BLOCK_SIZE)
    torch.testing.assert_close(absmax, blocks.abs().amax(1), rtol=0, atol=0)
    normalized = (blocks / absmax[:, None]).view(-1)[:n]
    distance = (normalized[:, None] - dynamic_code(signed)[None, :]).abs()
    best = distance.min(1).values
    chosen = distance.gather(1, codes.long()[:, None]).squeeze(1)
    torch.testing.assert_close(chosen, best, rtol=0, atol=1e-7)  # ties may go either way

    y = dequantize(codes, absmax, x.shape, signed=signed)
    # Error bound: half the widest gap between codes (top decade: 0.9/64 signed, 0.9/128
    # unsigned) times the block's absmax; below 1e-7 of the absmax, rounding to 0 at worst.
    per_value_absmax = absmax.repeat_interleave(BLOCK_SIZE)[:n]
    half_gap = 0.9 / (64 if signed else 128) / 2
    assert torch.all((y - x).abs() <= half_gap * per_value_absmax * (1 + 1e-4))
    small = x.abs() < 1e-7 * per_value_absmax
    assert torch.all((y - x).abs()[small] <= 1e-7 * per_value_absmax[small])


def test_zero_blocks_and_shapes_round_trip() -> None:
    x = torch.zeros(3, BLOCK_SIZE)
    x[1, 5] = -2.0  # the most negative value sets the absmax: stored as about -0.993 of it
    codes, absmax = quantize(x)
    assert absmax.tolist() == [0.0, 2.0, 0.0]
    y = dequantize(codes, absmax, x.shape)
    assert y.shape == x.shape and torch.count_nonzero(y) == 1
    torch.testing.assert_close(y[1, 5], torch.tensor(-2.0), rtol=1e-2, atol=0)
    x[1, 5] = 2.0  # a positive maximum is stored exactly
    codes, absmax = quantize(x)
    assert torch.equal(dequantize(codes, absmax, x.shape), x)


@pytest.mark.parametrize("numel", [1, 2048, 2049, 10_000])
def test_memory_is_one_byte_per_value_plus_one_absmax_per_block(numel: int) -> None:
    state = QuantizedAdamMoments.zeros(numel)
    expected = 2 * (numel + 4 * math.ceil(numel / 2048))
    assert state.nbytes == expected == 2 * qs.quantized_nbytes(numel)
    held = [state.exp_avg_codes, state.exp_avg_absmax, state.exp_avg_sq_codes]
    held.append(state.exp_avg_sq_absmax)
    assert sum(t.untyped_storage().nbytes() for t in held) == expected


def test_gpt2_xl_moment_bytes() -> None:
    """Whole-model accounting (computed): 1,557,611,200 parameters, as one flat count."""
    n = 1_557_611_200
    assert 2 * 4 * n == 12_460_889_600  # fp32 moments: 12.5 GB
    assert 2 * qs.quantized_nbytes(n) == 3_121_306_824  # int8 moments: 3.1 GB


@pytest.mark.parametrize("adamw", [False, True])
def test_step_is_fused_adam_on_the_dequantized_moments(
    adamw: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(qs, "CHUNK_BLOCKS", 2)  # several chunks, the last one short
    n = 5 * BLOCK_SIZE + 77
    g = torch.Generator().manual_seed(0)
    state = QuantizedAdamMoments.zeros(n)
    state.set(torch.randn(n, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-4)
    param, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    step = torch.tensor(3.0)
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}

    ref_param, m, v = nn.Parameter(param.clone()), state.exp_avg(), state.exp_avg_sq()
    m.masked_fill_(v == 0, 0.0)  # a second moment stored as 0 drops its first moment
    ref_param.grad = grad
    torch_adam = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = torch_adam([ref_param], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                     eps=hyper["eps"], weight_decay=hyper["weight_decay"], fused=True)  # fmt: skip
    ref.state[ref_param] = {"step": step - 1, "exp_avg": m, "exp_avg_sq": v}
    ref.step()
    state.step(param, grad, step, adamw=adamw, **hyper)

    assert torch.equal(param, ref_param)
    assert step.item() == 3.0  # the caller's count, already this step's, is left as it is
    for key, ref in (("exp_avg", quantize(m)), ("exp_avg_sq", quantize(v, signed=False))):
        assert torch.equal(getattr(state, f"{key}_codes"), ref[0])
        assert torch.equal(getattr(state, f"{key}_absmax"), ref[1])


def test_a_second_moment_stored_as_zero_takes_no_step_from_its_first_moment() -> None:
    """A rarely seen embedding row beside a frequent one in one block: its second moment is far
    below the block's largest and is stored as 0, its first moment is not; with no gradient
    this step it must not move (Adam's step there would be m / eps)."""
    n = BLOCK_SIZE
    m, v = torch.full((n,), 1e-4), torch.full((n,), 1e-16)  # rare values: tiny second moment
    m[0], v[0] = 1e-2, 1.0  # one frequent value sets the block's scale
    state = QuantizedAdamMoments.zeros(n)
    state.set(m, v)
    assert state.exp_avg()[1] != 0 and state.exp_avg_sq()[1] == 0
    param, grad = torch.zeros(n), torch.zeros(n)
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    state.step(param, grad, torch.tensor(10.0), adamw=False, **hyper)
    assert param[1:].abs().max() == 0
    assert param[0] != 0  # the value with a stored second moment still steps
    assert param.abs().max() <= 10 * hyper["lr"]


def test_state_dict_round_trip_is_lossless() -> None:
    n = 3000
    a = QuantizedAdamMoments.zeros(n)
    a.set(heavy_tailed(n, 1, signed=True), heavy_tailed(n, 2, signed=False))
    b = QuantizedAdamMoments.zeros(n)
    b.load_state_dict({k: t.clone() for k, t in a.state_dict().items()})
    assert torch.equal(b.exp_avg(), a.exp_avg()) and torch.equal(b.exp_avg_sq(), a.exp_avg_sq())
    b.zero_()
    assert not b.exp_avg().any() and not b.exp_avg_sq().any()


def test_moment_buffers_hold_per_tensor_moments_in_four_flat_buffers() -> None:
    """Tensors of 3000, 10 and 2048 values at offsets 0, 3008, 3072 of 5120-value buffers:
    codes at those offsets, absmaxes in runs of 2, 1 and 1 blocks. ``to`` the buffers' own
    device shares their memory; ``copy_`` into fresh buffers of that layout reproduces every
    moment exactly."""
    numels, offsets = [3000, 10, 2048], [0, 3008, 3072]
    buffers = QuantizedMomentBuffers(numels, offsets, 5120)
    assert buffers.nbytes == 2 * (5120 + 4 * 4)
    for k, (state, n) in enumerate(zip(buffers.moments, numels, strict=True)):
        state.set(heavy_tailed(n, 10 + k, signed=True), heavy_tailed(n, 20 + k, signed=False))
    flat = buffers.buffers["exp_avg_codes"]
    assert torch.equal(flat[3008:3018], buffers.moments[1].exp_avg_codes)
    assert buffers.buffers["exp_avg_absmax"][3] == buffers.moments[2].exp_avg_absmax[0]
    saved = [(s.exp_avg(), s.exp_avg_sq()) for s in buffers.moments]

    same = buffers.to(torch.device("cpu"), CodeMaps.on("cpu"))
    assert same.buffers["exp_avg_codes"].data_ptr() == flat.data_ptr()  # no copy on its device
    copied = QuantizedMomentBuffers(numels, offsets, 5120)
    copied.copy_(buffers)
    for state, (m, v) in zip(copied.moments, saved, strict=True):
        assert torch.equal(state.exp_avg(), m) and torch.equal(state.exp_avg_sq(), v)
