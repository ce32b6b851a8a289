"""The fused LayerNorm's C++ autograd op against the Python Function over the same kernels.

Both launch the same compiled Triton binaries, so outputs and gradients must be bitwise equal;
F.layer_norm is the reference for both in test_layer_norm.py (which goes through the C++ op
where it is built). On the CPU: the loader's switches.
"""

from __future__ import annotations

import pytest
import torch

from effdl.ops import cpp_extension, layer_norm
from effdl.ops.layer_norm import (
    MAX_TRITON_WIDTH,
    FusedLayerNormFunction,
    cpp_op,
    fused_layer_norm,
)


def test_cpp_ops_are_off_without_cuda_or_when_disabled(monkeypatch):
    monkeypatch.setattr(cpp_extension, "_loaded", {})
    monkeypatch.setenv(cpp_extension.DISABLE_ENV_VAR, "0")
    assert not cpp_extension.cpp_ops_enabled()
    assert (
        cpp_extension.load_cpp_extension("effdl_fused_layer_norm", "fused_layer_norm.cpp") is None
    )
    monkeypatch.setenv(cpp_extension.DISABLE_ENV_VAR, "1")
    assert cpp_extension.cpp_ops_enabled() == torch.cuda.is_available()


def test_cpu_inputs_never_build_the_cpp_op(monkeypatch):
    """The Python path serves CPU tensors without asking for the C++ op."""
    built = []
    monkeypatch.setattr(layer_norm, "_cpp_op", None)
    monkeypatch.setattr(layer_norm, "load_cpp_extension", lambda *a: built.append(a))
    x = torch.randn(4, 8, requires_grad=True)
    fused_layer_norm(x, None, None).sum().backward()
    assert built == [] and x.grad is not None


def both_paths(x, weight, bias, dy, normalized_shape, need=(True, True, True)):
    """Outputs and the wanted gradients from the C++ op and from the Python Function."""
    width = torch.Size(normalized_shape).numel()
    results = []
    for run in (
        lambda x, w, b: on_cpp_op(x, w, b, normalized_shape),
        lambda x, w, b: FusedLayerNormFunction.apply(x, w, b, 1e-5, True, width),
    ):
        leaves = [t.detach().requires_grad_(n) if t is not None else None
                  for t, n in zip((x, weight, bias), need, strict=True)]  # fmt: skip
        y = run(*leaves)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads = torch.autograd.grad(y, wanted, dy) if wanted else ()
        results.append([y, *grads])
    return results


def on_cpp_op(x, weight, bias, normalized_shape):
    y = cpp_op().fused_layer_norm(x, weight, bias, 1e-5, normalized_shape)
    assert y is not None, "the C++ op did not take these inputs"
    return y


def assert_bitwise_equal(got, expected):
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.shape == e.shape and g.dtype == e.dtype, i
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=f"output {i}")


CASES = [  # (x shape, normalized shape, x dtype, weight dtype or None, bias dtype or None)
    ((4096, 512), (512,), torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ((2, 300, 1000), (1000,), torch.float16, torch.float16, torch.float16),
    ((7, 1), (1,), torch.float32, torch.float32, torch.float32),  # ints equal to 1 fold away
    ((1, 64), (64,), torch.bfloat16, torch.bfloat16, None),  # one row
    ((513, 4096), (4096,), torch.float32, torch.bfloat16, torch.float32),  # mixed dtypes
    ((8, 3, 33), (3, 33), torch.bfloat16, None, None),
    ((64, 8192), (8192,), torch.bfloat16, torch.bfloat16, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "offset"])
def test_cpp_op_matches_python_function_bitwise(case, layout):
    pytest.importorskip("triton")
    assert cpp_op() is not None, "the C++ op did not build here"
    shape, normalized_shape, dtype, w_dtype, b_dtype = case
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*shape, 2, device="cuda", generator=gen).to(dtype)
    x = x[..., 0] if layout == "strided" else x[..., 0].contiguous()
    if layout == "offset":  # a row start 2 bytes off the 16-byte alignment
        flat = torch.empty(x.numel() + 1, device="cuda", dtype=dtype)
        flat[1:].copy_(x.flatten())
        x = flat[1:].view(x.shape)
    weight = None if w_dtype is None else torch.randn(normalized_shape, device="cuda").to(w_dtype)
    bias = None if b_dtype is None else torch.randn(normalized_shape, device="cuda").to(b_dtype)
    dy = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    for _ in range(2):  # a new key, then the kept plan
        got, expected = both_paths(x, weight, bias, dy, normalized_shape)
        assert_bitwise_equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("need", [(True, False, True), (False, True, False), (False, False, True)])
def test_cpp_op_computes_only_the_wanted_gradients(need):
    pytest.importorskip("triton")
    x = torch.randn(300, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    got, expected = both_paths(x, w, b, dy, (768,), need)
    assert_bitwise_equal(got, expected)


@pytest.mark.gpu
def test_cpp_op_keeps_one_plan_per_key():
    pytest.importorskip("triton")
    op = cpp_op()
    op.clear_plans()
    x = torch.randn(256, 1024, device="cuda", requires_grad=True)
    w = torch.randn(1024, device="cuda", requires_grad=True)
    for _ in range(3):
        on_cpp_op(x, w, None, (1024,)).sum().backward()
    assert op.plan_count() == 2  # one forward, one backward
    on_cpp_op(x[:128], w, None, (1024,)).sum().backward()
    assert op.plan_count() == 4


@pytest.mark.gpu
def test_cpp_op_refuses_double_backward():
    pytest.importorskip("triton")
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    y = on_cpp_op(x, None, None, (64,)).pow(3).sum()
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(y, x, create_graph=True)


@pytest.mark.gpu
def test_cpp_op_replays_in_a_cuda_graph():
    """Launches go to the current stream: captured, then replayed on new inputs."""
    pytest.importorskip("triton")
    x = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        x.grad = w.grad = None
        on_cpp_op(x, w, None, (768,)).backward(dy)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # plans made outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    x.grad = w.grad = None  # the captured backward allocates them (no accumulation)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = on_cpp_op(x, w, None, (768,))
        y.backward(dy)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    got = [y.clone(), x.grad.clone(), w.grad.clone()]
    expected = both_paths(x, w, None, dy, (768,), (True, True, False))[1]
    assert_bitwise_equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("x", "normalized_shape"),
    [
        (torch.randn(4, 8, dtype=torch.float64), (8,)),  # a dtype the kernels do not take
        (torch.randn(2, 2 * MAX_TRITON_WIDTH), (2 * MAX_TRITON_WIDTH,)),  # rows too wide
        (torch.randn(0, 8), (8,)),  # empty
        (torch.randn(4, 8), (4, 8)),  # 2-D normalized shape over a 2-D x: one row of 32
    ],
    ids=["float64", "too_wide", "empty", "whole_tensor"],
)
def test_inputs_the_kernels_do_not_take_go_to_the_python_path(x, normalized_shape):
    """None from the C++ op where the kernels do not take x; fused_layer_norm still answers."""
    pytest.importorskip("triton")
    x = x.cuda()
    op = cpp_op()
    width = torch.Size(normalized_shape).numel()
    taken = x.dtype != torch.float64 and x.numel() > 0 and width <= MAX_TRITON_WIDTH
    assert (op.fused_layer_norm(x, None, None, 1e-5, normalized_shape) is not None) == taken
    expected = torch.nn.functional.layer_norm(x.double(), normalized_shape).to(x.dtype)
    torch.testing.assert_close(fused_layer_norm(x, None, None, 1e-5, normalized_shape), expected)


@pytest.mark.gpu
def test_a_shape_mismatch_on_cuda_is_still_refused():
    pytest.importorskip("triton")
    assert (
        cpp_op().fused_layer_norm(torch.randn(4, 8, device="cuda"), None, None, 1e-5, (6,)) is None
    )
    with pytest.raises(ValueError, match="does not end in"):
        fused_layer_norm(torch.randn(4, 8, device="cuda"), None, None, 1e-5, (6,))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "autocast"])
def test_cpp_op_under_no_grad_inference_mode_and_autocast(mode):
    """Evaluation loops and mixed precision call the op too: the C++ op's output equals the
    Python Function's, keeps x's dtype, and records no graph where grad mode is off."""
    pytest.importorskip("triton")
    x = torch.randn(2, 64, 768, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    context = {
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "autocast": lambda: torch.autocast("cuda", dtype=torch.float16),
    }[mode]
    with context():
        got = on_cpp_op(x, w, b, (768,))
        expected = FusedLayerNormFunction.apply(x, w, b, 1e-5, True, 768)
    assert got.dtype == torch.bfloat16
    assert got.requires_grad == (mode == "autocast")
    assert_bitwise_equal([got.detach()], [expected.detach()])
