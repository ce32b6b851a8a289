"""MemoryOptimizedSwigluMLPFunction against autograd on the nn.Linear reference SwigluMLP."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from effdl.models.swiglu import Checkpointed, MLPStack, SwigluMLP
from effdl.ops import swiglu
from effdl.ops.swiglu import (
    ELEMENTWISE_BACKENDS,
    TORCH_OPS,
    TRITON_MIN_ELEMENTS,
    CheckpointLevel,
    ElementwiseOps,
    MemoryOptimizedSwigluMLP,
    MemoryOptimizedSwigluMLPFunction,
    elementwise_ops,
)
from tests.triton_interpreter import assert_kernels_ok_in_interpreter

LEVELS = list(CheckpointLevel)
HIDDEN, INTER = 16, 40
# Largest error allowed, relative to the largest magnitude of the reference tensor.
REL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def apply(x, W, V, U, level):
    return MemoryOptimizedSwigluMLPFunction.apply(x, W, V, U, int(level))


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, what
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= tol * max(scale, 1e-30), f"{what}: max error {err:.3g} > {tol} * {scale:.3g}"


def make_pair(level, dtype=torch.float32, device="cpu", seed=0, elementwise="auto"):
    torch.manual_seed(seed)
    ref = SwigluMLP(HIDDEN, INTER).to(device=device, dtype=dtype)
    return ref, MemoryOptimizedSwigluMLP.from_reference(ref, level, elementwise=elementwise)


def make_x(shape, dtype, device="cpu", contiguous=True, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if contiguous:
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    else:  # same values, leading two dims stored swapped
        x = torch.randn(shape[1], shape[0], *shape[2:], generator=gen, dtype=torch.float64)
        x = x.transpose(0, 1)
    x = x.to(device=device, dtype=dtype)
    assert x.is_contiguous() == contiguous
    return x


def grads_of(module, x, dy):
    x = x.detach().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    names = ("W", "V", "U")
    if isinstance(module, SwigluMLP):
        # nn.Linear stores (out, in): transpose to the Function's (in, out) layout
        weights = [getattr(module, n).weight.grad.t() for n in names]
    else:
        weights = [getattr(module, n).grad for n in names]
    return y.detach(), dict(zip(("x", *names), [x.grad, *weights], strict=True))


def record_saved(fn):
    """Run ``fn`` with a pack hook that records every tensor autograd saves."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _out_of_place_gate(a, b, *, inplace):
    return torch.nn.functional.silu(a) * b


def _out_of_place_gate_backward(a, b, dg, *, want_g, ab_scratch):
    assert not want_g, "a backend that writes nothing in place is not asked for g"
    s = torch.sigmoid(a)
    return dg * b * s * (1 + a * (1 - s)), dg * a * s, None


# A CPU stand-in for the jiterator backend: new outputs only, g built by the caller.
OUT_OF_PLACE_OPS = ElementwiseOps(
    "jiterator", _out_of_place_gate, _out_of_place_gate_backward, gate_backward_gives_g=False
)


@pytest.fixture(params=["torch", "out_of_place"])
def backend(request, monkeypatch):
    """Runs a test on the PyTorch path and on a backend that writes nothing in place (the
    jiterator one's contract, whose backward builds g before dA, dB)."""
    if request.param == "out_of_place":
        monkeypatch.setattr(swiglu, "elementwise_ops", lambda *args, **kw: OUT_OF_PLACE_OPS)
    return request.param


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("contiguous", [True, False])
def test_gradcheck_float64(level, contiguous, backend):
    gen = torch.Generator().manual_seed(0)
    x = make_x((3, 2, 6), torch.float64, contiguous=contiguous).requires_grad_(True)
    W, V = (torch.randn(6, 10, generator=gen, dtype=torch.float64) for _ in range(2))
    U = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    for t in (W, V, U):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: apply(*a, level), (x, W, V, U))


SHAPES = [  # (shape of x, contiguous?): strided inputs have their leading two dims swapped
    ((7, HIDDEN), True),
    ((1, HIDDEN), True),
    ((3, 5, HIDDEN), True),
    ((3, 5, HIDDEN), False),
    ((2, 3, 4, HIDDEN), True),
    ((2, 3, 4, HIDDEN), False),
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("shape", "contiguous"), SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference_module(level, shape, contiguous, dtype):
    ref, opt = make_pair(level, dtype)
    x = make_x(shape, dtype, contiguous=contiguous)
    dy = make_x(shape, dtype, seed=2)
    y_ref, g_ref = grads_of(ref, x, dy)
    y_opt, g_opt = grads_of(opt, x, dy)
    tol = REL_TOL[dtype]
    assert y_opt.dtype == dtype and y_opt.shape == x.shape
    assert_rel_close(y_opt, y_ref, tol, "output")
    for name in g_ref:
        assert g_opt[name].dtype == dtype
        assert_rel_close(g_opt[name], g_ref[name], tol, f"grad {name}")


@pytest.mark.parametrize("level", LEVELS)
def test_float16_matches_reference(level):
    ref, opt = make_pair(level, torch.float16)
    x, dy = make_x((4, 3, HIDDEN), torch.float16), make_x((4, 3, HIDDEN), torch.float16, seed=2)
    y_ref, g_ref = grads_of(ref, x, dy)
    y_opt, g_opt = grads_of(opt, x, dy)
    assert_rel_close(y_opt, y_ref, REL_TOL[torch.float16], "output")
    for name in g_ref:
        assert_rel_close(g_opt[name], g_ref[name], REL_TOL[torch.float16], f"grad {name}")


@pytest.mark.parametrize("level", LEVELS)
def test_weights_as_transposed_views_of_reference(level):
    """Strided weights (the reference's own storage, transposed) work and route grads back."""
    ref, _ = make_pair(level)
    x = make_x((2, 5, HIDDEN), torch.float32)
    dy = make_x((2, 5, HIDDEN), torch.float32, seed=2)
    y_ref = ref(x)
    y_ref.backward(dy)
    expected = [ref.W.weight.grad.clone(), ref.V.weight.grad.clone(), ref.U.weight.grad.clone()]
    ref.zero_grad(set_to_none=True)
    y = apply(x, ref.W.weight.t(), ref.V.weight.t(), ref.U.weight.t(), level)
    y.backward(dy)
    assert_rel_close(y.detach(), y_ref.detach(), REL_TOL[torch.float32], "output")
    for lin, exp in zip((ref.W, ref.V, ref.U), expected, strict=True):
        assert_rel_close(lin.weight.grad, exp, REL_TOL[torch.float32], "weight grad")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("trainable", ["weights_only", "x_only", "U_only", "W_and_x"])
def test_needs_input_grad(level, trainable, backend):
    ref, opt = make_pair(level)
    want = {
        "weights_only": {"W", "V", "U"},
        "x_only": {"x"},
        "U_only": {"U"},
        "W_and_x": {"W", "x"},
    }[trainable]
    x = make_x((3, 4, HIDDEN), torch.float32).requires_grad_("x" in want)
    dy = make_x((3, 4, HIDDEN), torch.float32, seed=2)
    for name in ("W", "V", "U"):
        getattr(opt, name).requires_grad_(name in want)
    _, g_ref = grads_of(ref, x, dy)
    opt(x).backward(dy)
    got = {"x": x.grad, "W": opt.W.grad, "V": opt.V.grad, "U": opt.U.grad}
    for name, grad in got.items():
        if name in want:
            assert_rel_close(grad, g_ref[name], REL_TOL[torch.float32], f"grad {name}")
        else:
            assert grad is None, f"{name} got a gradient nobody asked for"


def test_retain_graph_second_backward_gives_same_grads(backend):
    """Saved tensors are not overwritten by backward, so a retained graph can be reused."""
    for level in LEVELS:
        _, opt = make_pair(level)
        x = make_x((3, 4, HIDDEN), torch.float32).requires_grad_(True)
        y = opt(x)
        dy = torch.randn_like(y)
        first = torch.autograd.grad(y, [x, opt.W, opt.V, opt.U], dy, retain_graph=True)
        second = torch.autograd.grad(y, [x, opt.W, opt.V, opt.U], dy)
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b), level


def test_autocast_region_computes_in_input_dtype():
    _, opt = make_pair(CheckpointLevel.SAVE_ALL)
    x = make_x((2, 3, HIDDEN), torch.float32).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = opt(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.float32 and opt.W.grad.dtype == torch.float32


@pytest.mark.parametrize("level", LEVELS)
def test_backward_inside_autocast_matches_float32_reference(level):
    """Backward runs under the autocast state of the .backward() call; it must still compute in
    fp32 (a bf16 GEMM would miss the fp32 tolerance by orders of magnitude)."""
    ref, opt = make_pair(level)
    x = make_x((3, 4, HIDDEN), torch.float32)
    dy = make_x((3, 4, HIDDEN), torch.float32, seed=2)
    y_ref, g_ref = grads_of(ref, x, dy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_opt, g_opt = grads_of(opt, x, dy)
    assert_rel_close(y_opt, y_ref, REL_TOL[torch.float32], "output")
    for name in g_ref:
        assert_rel_close(g_opt[name], g_ref[name], REL_TOL[torch.float32], f"grad {name}")


def test_autocast_context_entered_only_when_autocast_is_on(monkeypatch):
    """Entering torch.autocast costs microseconds per call, so it is skipped when it is off."""
    real_autocast, entered = torch.autocast, []

    def counting_autocast(*args, **kwargs):
        entered.append(kwargs.get("enabled"))
        return real_autocast(*args, **kwargs)

    monkeypatch.setattr(torch, "autocast", counting_autocast)
    _, opt = make_pair(CheckpointLevel.SAVE_ALL)
    x = make_x((2, 3, HIDDEN), torch.float32).requires_grad_(True)
    opt(x).sum().backward()
    assert entered == []
    with real_autocast("cpu", dtype=torch.bfloat16):
        opt(x).sum().backward()
    assert entered == [False, False]  # switched off once in forward, once in backward


@pytest.mark.parametrize("level", LEVELS)
def test_meta_tensors_give_shapes(level):
    """Autocast knows no meta device; the layer still runs there (shapes, no data)."""
    opt = MemoryOptimizedSwigluMLP(HIDDEN, INTER, level, device="meta")
    x = torch.empty(3, 5, HIDDEN, device="meta", requires_grad=True)
    y = opt(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape and opt.U.grad.shape == opt.U.shape


def test_zero_tokens():
    _, opt = make_pair(CheckpointLevel.RECOMPUTE_ALL)
    x = torch.zeros(0, 3, HIDDEN, requires_grad=True)
    opt(x).sum().backward()
    assert x.grad.shape == x.shape and torch.equal(opt.W.grad, torch.zeros_like(opt.W))


# --------------------------------------------------------------------------- what is saved


def _expected_intermediates(x, W, V):
    with torch.no_grad():
        x2 = x.reshape(-1, x.shape[-1])
        a, b = x2 @ W, x2 @ V
        return {"a": a, "b": b, "g": torch.nn.functional.silu(a) * b}


@pytest.mark.parametrize(
    ("level", "kept"),
    [
        (CheckpointLevel.SAVE_ALL, ["x", "W", "V", "U", "a", "b", "g"]),
        (CheckpointLevel.RECOMPUTE_ELEMENTWISE, ["x", "W", "V", "U", "a", "b"]),
        (CheckpointLevel.RECOMPUTE_ALL, ["x", "W", "V", "U"]),
    ],
)
@pytest.mark.parametrize("contiguous", [True, False])
def test_saved_tensors_per_level(level, kept, contiguous):
    ref, opt = make_pair(level)
    x = make_x((3, 4, HIDDEN), torch.float32, contiguous=contiguous).requires_grad_(True)
    y, saved = record_saved(lambda: opt(x))
    named = {"x": x, "W": opt.W, "V": opt.V, "U": opt.U}
    inter = _expected_intermediates(x, opt.W, opt.V)
    found = []
    for t in saved:
        match = [n for n, ref in named.items() if same_tensor(t, ref)]
        match += [n for n, ref in inter.items() if t.shape == ref.shape and torch.allclose(t, ref)]
        assert len(match) == 1, f"saved tensor of shape {tuple(t.shape)} is none of {kept}"
        found += match
    assert sorted(found) == sorted(kept)
    y.sum().backward()  # and backward still works with exactly these
    x_ref = x.detach().requires_grad_(True)
    ref(x_ref).sum().backward()
    assert_rel_close(x.grad, x_ref.grad, REL_TOL[torch.float32], "grad x")


@pytest.mark.parametrize("level", LEVELS)
def test_frozen_weights_keep_no_input_and_no_weight_copies(level):
    """Only dx is wanted: levels 0/2 need W, V, U and the activations, not x; level 1 needs x."""
    _, opt = make_pair(level)
    opt.requires_grad_(False)
    x = make_x((3, 4, HIDDEN), torch.float32).requires_grad_(True)
    _, saved = record_saved(lambda: opt(x))
    saves_x = any(same_tensor(t, x) for t in saved)
    assert saves_x == (level is CheckpointLevel.RECOMPUTE_ALL)
    big = [t for t in saved if t.shape == (12, INTER)]
    assert len(big) == {0: 2, 1: 0, 2: 2}[int(level)]  # a, b; g only feeds dU


@pytest.mark.parametrize("level", LEVELS)
def test_nothing_saved_without_grad(level):
    _, opt = make_pair(level)
    opt.requires_grad_(False)
    _, saved = record_saved(lambda: opt(make_x((3, HIDDEN), torch.float32)))
    assert saved == []


# --------------------------------------------------------------------------- training


def _train(stack: torch.nn.Module, steps: int = 4) -> list[float]:
    opt = torch.optim.Adam(stack.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, HIDDEN, generator=gen)
    target = torch.randn(4, 6, HIDDEN, generator=gen)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(stack(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("residual", [False, True])
def test_stack_trains_identically_at_every_level(residual):
    torch.manual_seed(0)
    refs = [SwigluMLP(HIDDEN, INTER) for _ in range(3)]
    expected = _train(MLPStack(refs, residual))
    torch.manual_seed(
        0
    )  # the same initial weights again, for the copies and the checkpointed stack
    refs = [SwigluMLP(HIDDEN, INTER) for _ in range(3)]
    copies = {
        level: MLPStack([MemoryOptimizedSwigluMLP.from_reference(r, level) for r in refs], residual)
        for level in LEVELS
    }
    ckpt = MLPStack([Checkpointed(r) for r in refs], residual)
    runs = {int(level): _train(stack) for level, stack in copies.items()}
    runs["checkpoint"] = _train(ckpt)
    assert expected[-1] < expected[0]  # it does train
    for name, losses in runs.items():
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0, msg=f"{name}")


# --------------------------------------------------------------------------- failure paths


def test_bad_level_is_rejected():
    _, opt = make_pair(0)
    with pytest.raises(ValueError, match="checkpoint_level must be one of"):
        apply(torch.randn(2, HIDDEN), opt.W, opt.V, opt.U, 3)
    with pytest.raises(ValueError, match="checkpoint_level"):
        MemoryOptimizedSwigluMLP(HIDDEN, INTER, checkpoint_level=-1)


def test_bad_shapes_and_dtypes_are_rejected():
    _, opt = make_pair(0)
    with pytest.raises(ValueError, match=r"x \(\.\.\., hidden\)"):
        apply(torch.randn(2, HIDDEN + 1), opt.W, opt.V, opt.U, 0)
    with pytest.raises(ValueError, match="U"):
        apply(torch.randn(2, HIDDEN), opt.W, opt.V, opt.W, 0)
    with pytest.raises(ValueError, match="share dtype"):
        apply(torch.randn(2, HIDDEN, dtype=torch.float64), opt.W, opt.V, opt.U, 0)


def test_double_backward_is_refused():
    _, opt = make_pair(0)
    x = torch.randn(2, HIDDEN, requires_grad=True)
    (gx_plain,) = torch.autograd.grad(opt(x).sum(), x)
    (gx,) = torch.autograd.grad(opt(x).sum(), x, create_graph=True)
    assert torch.equal(gx.detach(), gx_plain)  # the first derivative is the same either way
    with pytest.raises(RuntimeError):
        gx.sum().backward()
    # with an output gradient that itself requires grad (a Hessian-vector product), the
    # refusal names the reason
    y = opt(x)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y).requires_grad_(True), create_graph=True)
    assert torch.equal(gx.detach(), gx_plain)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


@pytest.mark.parametrize("bad", [3, -1, "0", None, [0], 0.5])
def test_parse_rejects_what_is_not_a_level(bad):
    with pytest.raises(ValueError, match="checkpoint_level must be one of 0 \\(SAVE_ALL\\)"):
        CheckpointLevel.parse(bad)


def test_parse_accepts_ints_and_members():
    for level in LEVELS:
        assert CheckpointLevel.parse(int(level)) is level
        assert CheckpointLevel.parse(level) is level


def test_operands_on_different_devices_are_rejected():
    _, opt = make_pair(0)
    with pytest.raises(ValueError, match="share dtype and device"):
        apply(torch.randn(2, HIDDEN, device="meta"), opt.W, opt.V, opt.U, 0)


# --------------------------------------------------------------------------- backend choice

CUDA = torch.device("cuda")  # a device object only: the chooser reads its type, needs no GPU
FAKE_TRITON = ElementwiseOps("triton", TORCH_OPS.gate, TORCH_OPS.gate_backward)


@pytest.fixture
def triton_present(monkeypatch):
    """``auto`` as on a CUDA machine where Triton and jiterator import (stand-ins, so nothing is
    imported or compiled here)."""
    monkeypatch.setattr(swiglu, "_triton_ops", lambda: FAKE_TRITON)
    monkeypatch.setattr(swiglu, "_jiterator_ops", lambda: OUT_OF_PLACE_OPS)


def test_backend_choice():
    assert elementwise_ops(torch.device("cpu")) is TORCH_OPS
    assert elementwise_ops(torch.device("cpu"), 1 << 30, torch.bfloat16) is TORCH_OPS
    assert elementwise_ops(CUDA, backend="torch") is TORCH_OPS
    choices = str(ELEMENTWISE_BACKENDS).replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=f"one of {choices}; got 'fast'"):
        elementwise_ops(torch.device("cpu"), backend="fast")


def test_module_checks_its_backend_when_built(monkeypatch):
    with pytest.raises(ValueError, match="elementwise must be one of"):
        MemoryOptimizedSwigluMLP(HIDDEN, INTER, elementwise="fast")
    monkeypatch.setattr(swiglu, "_triton_ops", lambda: None)
    with pytest.raises(ImportError, match="triton does not import"):
        MemoryOptimizedSwigluMLP(HIDDEN, INTER, elementwise="triton")
    assert "elementwise=torch" in repr(MemoryOptimizedSwigluMLP(HIDDEN, INTER, elementwise="torch"))


@pytest.mark.parametrize("dtype", list(TRITON_MIN_ELEMENTS), ids=str)
def test_auto_takes_triton_from_the_threshold_up(triton_present, dtype):
    threshold = TRITON_MIN_ELEMENTS[dtype]
    assert elementwise_ops(CUDA, threshold - 1, dtype) is OUT_OF_PLACE_OPS
    assert elementwise_ops(CUDA, 1, dtype) is OUT_OF_PLACE_OPS
    assert elementwise_ops(CUDA, threshold, dtype) is FAKE_TRITON
    assert elementwise_ops(CUDA, 64 * threshold, dtype) is FAKE_TRITON
    assert elementwise_ops(CUDA, None, dtype) is FAKE_TRITON  # size unknown: the large answer
    assert elementwise_ops(torch.device("cpu"), threshold, dtype) is TORCH_OPS


# (tokens, intermediate, dtype, level-0 path auto must pick): benchmark shapes small enough that
# jiterator's cheaper launch wins; TRITON_MIN_ELEMENTS must keep them there.
H100_FASTER = [
    (16 * 128, 2048, torch.bfloat16, "jiterator"),
    (32 * 128, 2048, torch.bfloat16, "jiterator"),
    (8 * 512, 4096, torch.bfloat16, "jiterator"),
]


@pytest.mark.parametrize(("tokens", "inter", "dtype", "faster"), H100_FASTER, ids=str)
def test_auto_picks_the_path_measured_faster(triton_present, tokens, inter, dtype, faster):
    assert elementwise_ops(CUDA, tokens * inter, dtype).name == faster


def test_auto_keeps_float64_off_triton_and_jiterator(triton_present):
    """Both fused backends compute in fp32: float64 would silently lose precision there."""
    assert elementwise_ops(CUDA, 1 << 30, torch.float64) is TORCH_OPS


def test_forced_backend_ignores_size_and_dtype(triton_present):
    assert elementwise_ops(CUDA, 1, torch.bfloat16, "triton") is FAKE_TRITON
    assert elementwise_ops(CUDA, 1, torch.float64, "triton") is FAKE_TRITON
    assert elementwise_ops(CUDA, 1 << 30, torch.bfloat16, "jiterator") is OUT_OF_PLACE_OPS
    assert elementwise_ops(CUDA, 1 << 30, torch.bfloat16, "torch") is TORCH_OPS


def test_missing_triton_and_jiterator(monkeypatch):
    monkeypatch.setattr(swiglu, "_triton_ops", lambda: None)
    monkeypatch.setattr(swiglu, "_jiterator_ops", lambda: OUT_OF_PLACE_OPS)
    assert elementwise_ops(CUDA, 1 << 30, torch.bfloat16) is OUT_OF_PLACE_OPS
    monkeypatch.setattr(swiglu, "_jiterator_ops", lambda: None)
    assert elementwise_ops(CUDA, 1 << 30, torch.bfloat16) is TORCH_OPS
    with pytest.raises(ImportError, match="elementwise='triton', but triton does not import"):
        elementwise_ops(CUDA, 1 << 30, torch.bfloat16, "triton")


def test_backend_chosen_once_per_forward_with_the_element_count(monkeypatch):
    """The forward passes N x I, the dtype and the module's backend; the backward reuses the
    forward's choice."""
    calls = []

    def recording(device, numel=None, dtype=None, backend="auto"):
        calls.append((device.type, numel, dtype, backend))
        return TORCH_OPS

    for level in LEVELS:
        for backend in ("auto", "torch"):
            _, opt = make_pair(level, elementwise=backend)
            x = make_x((3, 4, HIDDEN), torch.float32).requires_grad_(True)
            with monkeypatch.context() as m:
                m.setattr(swiglu, "elementwise_ops", recording)
                calls.clear()
                opt(x).sum().backward()
            assert calls == [("cpu", 3 * 4 * INTER, torch.float32, backend)], (level, backend)


# --------------------------------------------------------------------------- Triton kernels

_INTERPRETED_KERNEL_CHECK = """
import torch
from effdl.ops import swiglu_triton as T
from effdl.ops.swiglu import TORCH_OPS
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
    a, b, dg = (torch.randn(3, 2500, dtype=dtype) * 3 for _ in range(3))
    for inplace in (True, False):
        got = T.gate(a.clone(), b, inplace=inplace)
        exp = TORCH_OPS.gate(a.double(), b.double(), inplace=False)
        assert (got.double() - exp).abs().max() <= tol * exp.abs().max(), "gate"
    exp = TORCH_OPS.gate_backward(a.double(), b.double(), dg.double(), want_g=True, ab_scratch=False)
    for scratch in (True, False):
        got = T.gate_backward(a.clone(), b.clone(), dg.clone(), want_g=True, ab_scratch=scratch)
        for g, e in zip(got, exp):
            assert (g.double() - e).abs().max() <= tol * e.abs().max(), ("bwd", scratch)
    da, db, g = T.gate_backward(a.clone(), b.clone(), dg.clone(), want_g=False, ab_scratch=True)
    assert g is None
print("kernels ok")
"""


def test_triton_kernels_in_interpreter_match_float64_math():
    """The Triton kernels' arithmetic and in-place aliasing, run by Triton's CPU interpreter."""
    assert_kernels_ok_in_interpreter(_INTERPRETED_KERNEL_CHECK)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_backend", ["triton", "jiterator", "torch"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_cuda_matches_reference(cuda_backend, level, dtype):
    if cuda_backend == "triton":
        pytest.importorskip("triton")
    ref, opt = make_pair(level, dtype, device="cuda", elementwise=cuda_backend)
    assert elementwise_ops(opt.W.device, backend=opt.elementwise).name == cuda_backend
    for contiguous in (True, False):
        x = make_x((4, 33, HIDDEN), dtype, device="cuda", contiguous=contiguous)
        dy = make_x((4, 33, HIDDEN), dtype, device="cuda", seed=2)
        y_ref, g_ref = grads_of(ref, x, dy)
        y_opt, g_opt = grads_of(opt, x, dy)
        ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        assert_rel_close(y_opt, y_ref, REL_TOL[dtype], "output")
        for name in g_ref:
            assert_rel_close(g_opt[name], g_ref[name], REL_TOL[dtype], f"grad {name}")


@pytest.mark.gpu
def test_cuda_triton_kernels_match_torch_path():
    pytest.importorskip("triton")
    from effdl.ops import swiglu_triton as T

    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        a, b, dg = (
            torch.randn(1000, 3001, device="cuda", dtype=dtype, generator=gen) for _ in "abc"
        )
        exp = TORCH_OPS.gate_backward(
            a.double(), b.double(), dg.double(), want_g=True, ab_scratch=False
        )
        for scratch in (True, False):
            got = T.gate_backward(a.clone(), b.clone(), dg.clone(), want_g=True, ab_scratch=scratch)
            for g, e in zip(got, exp, strict=True):
                assert_rel_close(g, e, tol, f"backward {dtype} scratch={scratch}")
        assert_rel_close(T.gate(a.clone(), b, inplace=True), exp[2], tol, f"gate {dtype}")


@pytest.mark.gpu
def test_cuda_jiterator_kernels_match_torch_path():
    from effdl.ops import swiglu_jiterator as J

    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        a, b, dg = (
            torch.randn(1000, 3001, device="cuda", dtype=dtype, generator=gen) * 4 for _ in "abc"
        )
        exp = TORCH_OPS.gate_backward(
            a.double(), b.double(), dg.double(), want_g=True, ab_scratch=False
        )
        inputs = [t.clone() for t in (a, b, dg)]
        got = J.gate_backward(a, b, dg, want_g=True, ab_scratch=True)
        for g, e in zip(got, exp, strict=True):
            assert g.dtype == dtype
            assert_rel_close(g, e, tol, f"backward {dtype}")
        assert all(torch.equal(t, u) for t, u in zip(inputs, (a, b, dg), strict=True))
        assert J.gate_backward(a, b, dg, want_g=False, ab_scratch=False)[2] is None
        assert_rel_close(J.gate(a, b, inplace=True), exp[2], tol, f"gate {dtype}")
        assert J.gate(a[:0], b[:0], inplace=False).shape == (0, 3001)


@pytest.mark.gpu
def test_cuda_auto_backend_by_size():
    """The real chooser on CUDA (Triton imported): jiterator below the threshold, Triton from it."""
    pytest.importorskip("triton")
    for dtype, threshold in TRITON_MIN_ELEMENTS.items():
        assert elementwise_ops(CUDA, threshold - 1, dtype).name == "jiterator", dtype
        assert elementwise_ops(CUDA, threshold, dtype).name == "triton", dtype
    assert elementwise_ops(CUDA, 1, torch.float64).name == "torch"


def _cuda_step_peak(stack: torch.nn.Module, x: torch.Tensor) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    stack(x).backward(torch.ones_like(x))
    torch.cuda.synchronize()
    stack.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_backend", ["auto", "triton", "jiterator", "torch"])
def test_cuda_peak_memory_order(cuda_backend):
    """Level 0 peaks no higher than the reference, level 1 no higher than torch.utils.checkpoint."""
    if cuda_backend == "triton":
        pytest.importorskip("triton")
    hidden, inter, layers = 256, 1024, 4
    torch.manual_seed(0)
    refs = [SwigluMLP(hidden, inter, device="cuda") for _ in range(layers)]
    x = torch.randn(8, 512, hidden, device="cuda", requires_grad=True)
    stacks = {
        "reference": MLPStack(refs, residual=True),
        "checkpoint": MLPStack([Checkpointed(r) for r in refs], residual=True),
        **{
            int(lvl): MLPStack(
                [
                    MemoryOptimizedSwigluMLP.from_reference(r, lvl, elementwise=cuda_backend)
                    for r in refs
                ],
                True,
            )
            for lvl in LEVELS
        },
    }
    peak = {name: _cuda_step_peak(s, x) for name, s in stacks.items()}
    assert peak[0] <= peak["reference"], peak
    assert peak[2] < peak[0], peak
    assert peak[1] <= peak["checkpoint"], peak
