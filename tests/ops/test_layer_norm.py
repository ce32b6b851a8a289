"""Fused LayerNorm against torch's own: F.layer_norm and nn.LayerNorm.

On the CPU: the PyTorch path (outputs, all three gradients, float64 gradcheck), the Triton
kernels under Triton's interpreter (a subprocess: TRITON_INTERPRET must be set before triton is
imported), the state_dict and the swap inside a decoder layer. On CUDA (``-m gpu``): the kernels
in fp32, bf16 and fp16 at LM-like and odd widths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from effdl.ops import layer_norm
from effdl.ops.layer_norm import (
    MAX_TRITON_WIDTH,
    FusedLayerNorm,
    InputDtypeLayerNorm,
    TritonLayerNorm,
    fused_layer_norm,
    swap_layer_norms,
    uses_triton,
)
from tests.triton_interpreter import assert_kernels_ok_in_interpreter

# Relative to the reference's largest magnitude (at least 1); the reference runs in float64.
REL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
# (x shape, normalized_shape)
SHAPES = [((6, 33), (33,)), ((2, 5, 64), (64,)), ((3, 4, 6), (4, 6)), ((1, 1), (1,))]
AFFINE = [(True, True), (True, False), (False, False)]  # (weight, bias)


def make_inputs(shape, normalized_shape, affine, dtype, device="cpu", contiguous=True, seed=0):
    """x (strided where not ``contiguous``), weight, bias (or None), dy; all requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = rand(*shape) * 3 + 1
    if not contiguous:  # the same values, every other element of a twice-as-wide tensor
        x = torch.stack([x, rand(*shape)], dim=-1)[..., 0]
    weight = rand(*normalized_shape) + 1 if affine[0] else None
    bias = rand(*normalized_shape) if affine[1] else None
    dy = rand(*shape)

    def prep(t):
        return None if t is None else t.to(device, dtype).requires_grad_(True)

    return prep(x), prep(weight), prep(bias), dy.to(device, dtype)


def outputs_and_grads(fn, x, weight, bias, dy):
    leaves = [t for t in (x, weight, bias) if t is not None]
    y = fn(x, weight, bias)
    return [y, *torch.autograd.grad(y, leaves, dy)]


def reference(normalized_shape, eps=1e-5):
    """F.layer_norm on float64 copies of the inputs."""

    def fn(x, weight, bias):
        as64 = lambda t: None if t is None else t.double()  # noqa: E731
        return F.layer_norm(as64(x), normalized_shape, as64(weight), as64(bias), eps)

    return fn


def ours(normalized_shape, eps=1e-5):
    return lambda x, w, b: fused_layer_norm(x, w, b, eps, normalized_shape)


def assert_rel_close(got, expected, dtype, what):
    scale = expected.abs().max().clamp_min(1.0)
    err = (got.double() - expected.double()).abs().max() / scale
    assert got.dtype == dtype, what
    assert err <= REL_TOL[dtype], f"{what}: relative error {err:.3g} > {REL_TOL[dtype]}"


def check_against_reference(shape, normalized_shape, affine, dtype, device, contiguous):
    x, w, b, dy = make_inputs(shape, normalized_shape, affine, dtype, device, contiguous)
    got = outputs_and_grads(ours(normalized_shape), x, w, b, dy)
    expected = outputs_and_grads(reference(normalized_shape), x, w, b, dy)
    for name, g, e in zip(["y", "dx", "dw", "db"], got, expected, strict=False):
        assert_rel_close(g, e, dtype, name)


# --------------------------------------------------------------------------- the PyTorch path


@pytest.mark.parametrize(("shape", "normalized_shape"), SHAPES, ids=str)
@pytest.mark.parametrize("affine", AFFINE, ids=["w_b", "w", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
def test_torch_path_matches_f_layer_norm(shape, normalized_shape, affine, dtype, contiguous):
    assert not uses_triton(torch.empty(1), 64)
    check_against_reference(shape, normalized_shape, affine, dtype, "cpu", contiguous)


@pytest.mark.parametrize("affine", AFFINE, ids=["w_b", "w", "none"])
def test_torch_path_gradcheck_float64(affine):
    x, w, b, _ = make_inputs((4, 3, 7), (3, 7), affine, torch.float64)
    inputs = tuple(t for t in (x, w, b) if t is not None)

    def fn(*args):
        it = iter(args[1:])
        weight = next(it) if affine[0] else None
        bias = next(it) if affine[1] else None
        return fused_layer_norm(args[0], weight, bias, 1e-5, (3, 7))

    assert torch.autograd.gradcheck(fn, inputs)


def test_gradients_only_for_inputs_that_need_them():
    x, w, b, dy = make_inputs((5, 8), (8,), (True, True), torch.float32)
    w.requires_grad_(False)
    fused_layer_norm(x.detach(), w, b).backward(dy)
    assert w.grad is None and b.grad is not None


def test_empty_input_gives_empty_output_and_zero_parameter_grads():
    x = torch.empty(0, 3, 8, requires_grad=True)
    ln = FusedLayerNorm(8)
    ln(x).sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(ln.weight.grad, torch.zeros(8)) and torch.equal(ln.bias.grad, torch.zeros(8))


def test_output_keeps_x_dtype_under_autocast():
    torch.manual_seed(0)
    ln = FusedLayerNorm(16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ln(x)
    assert y.dtype == torch.bfloat16
    expected = F.layer_norm(x.float(), (16,), ln.weight, ln.bias)
    torch.testing.assert_close(y.float(), expected, rtol=0, atol=2e-2)


def test_input_dtype_layer_norm_is_torchs_kernel_outside_autocast():
    torch.manual_seed(0)
    ln = InputDtypeLayerNorm(16, dtype=torch.bfloat16)
    nn.init.normal_(ln.weight)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ln(x)
    assert y.dtype == torch.bfloat16  # nn.LayerNorm gives float32 here
    assert torch.equal(y, F.layer_norm(x, (16,), ln.weight, ln.bias))


def test_shape_mismatch_is_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="does not end in"):
        fused_layer_norm(x, None, None, 1e-5, (6,))
    with pytest.raises(ValueError, match="bias of shape"):
        fused_layer_norm(x, torch.ones(8), torch.zeros(6), 1e-5, (8,))


@pytest.mark.parametrize(
    ("x", "weight", "normalized_shape", "match"),
    [
        (torch.tensor(1.0), None, None, "at least 1 dim"),
        (torch.ones(4, 8, dtype=torch.long), None, None, "floating-point"),
        (torch.randn(4, 8), torch.ones(8, dtype=torch.long), None, "weight must be floating"),
        (torch.randn(4, 8), None, (), "at least one dim"),
    ],
    ids=["scalar", "integer_x", "integer_weight", "empty_normalized_shape"],
)
def test_bad_inputs_get_one_line_errors(x, weight, normalized_shape, match):
    with pytest.raises(ValueError, match=match):
        fused_layer_norm(x, weight, None, 1e-5, normalized_shape)


def test_bias_alone_sets_the_normalized_shape():
    x, b = torch.randn(3, 2, 4), torch.randn(2, 4)
    torch.testing.assert_close(fused_layer_norm(x, None, b), F.layer_norm(x, (2, 4), None, b))


def test_strided_parameters_match_f_layer_norm():
    """Parameters whose elements are strided (every other element of a buffer; a transposed
    2-D weight) reach the kernels as contiguous copies; gradients come back in their shapes."""
    x = torch.randn(5, 3, 4, requires_grad=True)
    w = (torch.randn(4, 3) + 1).t().requires_grad_(True)  # shape (3, 4), not contiguous
    b = torch.randn(24)[::2].view(3, 4).detach().requires_grad_(True)
    dy = torch.randn(5, 3, 4)
    y = fused_layer_norm(x, w, b, 1e-5)
    got = [y, *torch.autograd.grad(y, [x, w, b], dy)]
    yr = F.layer_norm(x, (3, 4), w, b, 1e-5)
    expected = [yr, *torch.autograd.grad(yr, [x, w, b], dy)]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_double_backward_is_refused_not_dropped():
    """create_graph=True asks for a backward that is itself differentiable: refused, rather
    than its second-order terms silently missing."""
    x = torch.randn(4, 8, requires_grad=True)
    y = fused_layer_norm(x, None, None).pow(3).sum()
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(y, x, create_graph=True)


# --------------------------------------------------------------------------- the module


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"bias": False}, {"elementwise_affine": False}, {"eps": 1e-3}],
    ids=["default", "no_bias", "no_affine", "eps"],
)
def test_state_dict_round_trip_with_nn_layer_norm(kwargs):
    torch.manual_seed(0)
    ref = nn.LayerNorm((4, 6), **kwargs)
    for p in ref.parameters():
        nn.init.normal_(p)
    fused = FusedLayerNorm((4, 6), **kwargs)
    fused.load_state_dict(ref.state_dict())
    back = nn.LayerNorm((4, 6), **kwargs)
    back.load_state_dict(fused.state_dict())
    assert fused.state_dict().keys() == ref.state_dict().keys()
    for name, t in ref.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    x = torch.randn(3, 4, 6)
    torch.testing.assert_close(fused(x), ref(x))


def test_swap_inside_decoder_layer_keeps_outputs_and_parameters():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    for norm in (layer.norm1, layer.norm2, layer.norm3):  # away from the 1/0 init
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
    tgt, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    expected = layer(tgt, memory)
    params = {name: p for name, p in layer.named_parameters()}

    assert swap_layer_norms(layer) == 3
    assert all(type(n) is FusedLayerNorm for n in (layer.norm1, layer.norm2, layer.norm3))
    assert {name: p for name, p in layer.named_parameters()} == params  # the same objects
    torch.testing.assert_close(layer(tgt, memory), expected)
    assert swap_layer_norms(layer) == 0
    layer = nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    assert swap_layer_norms(layer, InputDtypeLayerNorm) == 3
    assert type(layer.norm1) is InputDtypeLayerNorm
    layer = nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    assert swap_layer_norms(layer, TritonLayerNorm) == 3
    assert type(layer.norm1) is TritonLayerNorm


@pytest.mark.gpu
def test_cuda_triton_layer_norm_runs_the_kernels_at_a_small_size():
    """Below TRITON_MIN_BYTES, where FusedLayerNorm takes torch's kernel, TritonLayerNorm
    still runs the Triton kernels: same values as torch's within the kernels' tolerance."""
    torch.manual_seed(0)
    ln = TritonLayerNorm(1024, device="cuda")
    nn.init.normal_(ln.weight)
    x = torch.randn(300, 1024, device="cuda", requires_grad=True)
    assert layer_norm.kernel_path(x, 1024) == "torch" and uses_triton(x, 1024)
    y = ln(x)
    y.backward(torch.ones_like(y))
    assert y.grad_fn.name().endswith("FusedLayerNormFunctionBackward")
    ref = F.layer_norm(x.detach(), (1024,), ln.weight.detach(), ln.bias.detach())
    torch.testing.assert_close(y.detach(), ref, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- Triton interpreter

_INTERPRETED_KERNEL_CHECK = """
import torch, torch.nn.functional as F
from effdl.ops.layer_norm import FusedLayerNormFunction
torch.manual_seed(0)
# (rows, width, weight, bias): odd widths, rows not a multiple of the backward's programs
CASES = [(7, 33, True, True), (5, 64, True, False), (3, 100, False, False), (9, 1, True, True)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
for dtype, tol in TOL.items():
    for m, n, has_w, has_b in CASES:
        base = torch.randn(m, 2 * n, dtype=torch.float64) * 3 + 1
        x = base[:, :n]  # rows of stride 2n: the kernels take the row stride
        w = torch.randn(n, dtype=torch.float64) + 1 if has_w else None
        b = torch.randn(n, dtype=torch.float64) if has_b else None
        dy = torch.randn(m, n, dtype=torch.float64)
        leaves = [t for t in (x, w, b) if t is not None]
        low = [t.to(dtype).requires_grad_(True) for t in leaves]
        x_, w_, b_ = low[0], (low[1] if has_w else None), (low[-1] if has_b else None)
        y = FusedLayerNormFunction.apply(x_, w_, b_, 1e-5, True, n)
        got = [y, *torch.autograd.grad(y, low, dy.to(dtype))]
        ref = [t.detach().to(dtype).double().requires_grad_(True) for t in leaves]
        xr, wr, br = ref[0], (ref[1] if has_w else None), (ref[-1] if has_b else None)
        yr = F.layer_norm(xr, (n,), wr, br, 1e-5)
        expected = [yr, *torch.autograd.grad(yr, ref, dy.to(dtype).double())]
        for name, g, e in zip(("y", "dx", "dw", "db"), got, expected):
            assert g.dtype == dtype, (name, g.dtype)
            err = (g.double() - e).abs().max() / e.abs().max().clamp_min(1.0)
            assert err <= tol, (dtype, m, n, name, float(err))
# a weight and bias whose elements are strided (every other element of a buffer)
x = torch.randn(4, 16, requires_grad=True)
w = (torch.randn(32) + 1)[::2].detach().requires_grad_(True)
b = torch.randn(32)[::2].detach().requires_grad_(True)
dy = torch.randn(4, 16)
y = FusedLayerNormFunction.apply(x, w, b, 1e-5, True, 16)
got = [y, *torch.autograd.grad(y, [x, w, b], dy)]
yr = F.layer_norm(x, (16,), w, b, 1e-5)
expected = [yr, *torch.autograd.grad(yr, [x, w, b], dy)]
for g, e in zip(got, expected):
    assert (g - e).abs().max() <= 1e-5 * e.abs().max().clamp_min(1.0), "strided parameters"
# y.sum(0) hands the backward a dy whose rows all alias one row (row stride 0)
x = torch.randn(6, 40, requires_grad=True)
w = torch.randn(40, requires_grad=True)
v = torch.randn(40)
got = torch.autograd.grad(FusedLayerNormFunction.apply(x, w, None, 1e-5, True, 40).sum(0), [x, w], v)
expected = torch.autograd.grad(F.layer_norm(x, (40,), w, None, 1e-5).sum(0), [x, w], v)
for g, e in zip(got, expected):
    assert (g - e).abs().max() <= 1e-5 * e.abs().max(), "stride-0 dy"
print("kernels ok")
"""


def test_triton_kernels_in_interpreter_match_f_layer_norm():
    assert_kernels_ok_in_interpreter(_INTERPRETED_KERNEL_CHECK)


# --------------------------------------------------------------------------- CUDA

GPU_SHAPES = [
    ((4096, 768), (768,)),
    ((2, 1000, 1024), (1024,)),
    ((513, 4096), (4096,)),
    ((300, 1000), (1000,)),  # widths that are no power of 2
    ((77, 5120), (5120,)),
    ((8, 3, 33), (3, 33)),
    ((64, 8192), (8192,)),
]


@pytest.fixture
def triton_at_every_size(monkeypatch):
    """The Triton kernels for CUDA inputs of any size (torch's kernel serves small ones)."""
    monkeypatch.setattr(layer_norm, "TRITON_MIN_BYTES", 0)


@pytest.mark.gpu
@pytest.mark.usefixtures("triton_at_every_size")
@pytest.mark.parametrize(("shape", "normalized_shape"), GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("affine", AFFINE, ids=["w_b", "w", "none"])
def test_cuda_kernels_match_f_layer_norm(shape, normalized_shape, affine, dtype):
    pytest.importorskip("triton")
    width = torch.Size(normalized_shape).numel()
    assert uses_triton(torch.empty(1, device="cuda", dtype=dtype), width)
    for contiguous in (True, False):
        check_against_reference(shape, normalized_shape, affine, dtype, "cuda", contiguous)


@pytest.mark.gpu
def test_cuda_rows_too_wide_for_one_program_take_the_torch_path():
    width = 2 * MAX_TRITON_WIDTH
    assert not uses_triton(torch.empty(1, device="cuda"), width)
    check_against_reference((8, width), (width,), (True, True), torch.bfloat16, "cuda", True)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_cuda_module_bf16_weights_mixed_with_fp32_input(kernels, monkeypatch):
    pytest.importorskip("triton")
    if kernels == "triton":
        monkeypatch.setattr(layer_norm, "TRITON_MIN_BYTES", 0)
    torch.manual_seed(0)
    ref = nn.LayerNorm(1024, device="cuda")
    nn.init.normal_(ref.weight)
    fused = FusedLayerNorm(1024, device="cuda", dtype=torch.bfloat16)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(257, 1024, device="cuda")
    expected = F.layer_norm(x, (1024,), fused.weight.float(), fused.bias.float())
    torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_small_inputs_take_torchs_kernel_in_x_dtype_under_autocast(x_dtype):
    torch.manual_seed(0)
    ln = FusedLayerNorm(1024, device="cuda")  # fp32 parameters
    nn.init.normal_(ln.weight)
    x = torch.randn(300, 1024, device="cuda", dtype=x_dtype)
    assert x.numel() * x.element_size() < layer_norm.TRITON_MIN_BYTES
    with torch.autocast("cuda", dtype=torch.float16):
        y = ln(x)
    assert y.dtype == x_dtype
    assert torch.equal(y, F.layer_norm(x, (1024,), ln.weight.to(x_dtype), ln.bias.to(x_dtype)))


@pytest.mark.gpu
@pytest.mark.usefixtures("triton_at_every_size")
def test_cuda_repeated_calls_on_aligned_and_offset_rows():
    """A row start 2 bytes off the 16-byte alignment after aligned calls (and back) must not
    run the kernel Triton compiled for aligned rows."""
    pytest.importorskip("triton")
    m, n = 300, 1024
    buf = torch.randn(m * n + 1, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for offset in (0, 1, 0, 1, 1):
        x = buf[offset : offset + m * n].view(m, n).detach().requires_grad_(True)
        got = outputs_and_grads(ours((n,)), x, w, b, dy)
        expected = outputs_and_grads(reference((n,)), x, w, b, dy)
        for name, g, e in zip(["y", "dx", "dw", "db"], got, expected, strict=True):
            assert_rel_close(g, e, torch.bfloat16, f"{name} at offset {offset}")
