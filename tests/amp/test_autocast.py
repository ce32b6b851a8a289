"""Autocast against torch.autocast: per-op output dtypes, a small model's loss and gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from effdl.amp import Autocast
from effdl.amp.autocast import _local, policy_of

# (name, op, input factory): matrix ops that both policies run in the low dtype.
MATRIX_OPS = [
    ("linear", lambda a, b, c: F.linear(a, b, c[:8])),
    ("matmul", lambda a, b, c: torch.matmul(a, b)),
    ("@", lambda a, b, c: a @ b),
    ("Tensor.mm", lambda a, b, c: a.mm(b)),
    ("bmm", lambda a, b, c: torch.bmm(a[None], b[None])),
    ("addmm", lambda a, b, c: torch.addmm(c[:8], a, b)),
    ("baddbmm", lambda a, b, c: torch.baddbmm(c[None, None, :8], a[None], b[None])),
    ("conv1d", lambda a, b, c: F.conv1d(a[None], b[:, :, None])),
    ("conv2d", lambda a, b, c: F.conv2d(a[None, None], b[None, None, :3, :3])),
    ("conv3d", lambda a, b, c: F.conv3d(a[None, None, None], b[None, None, None, :1, :3])),
    ("conv_transpose2d", lambda a, b, c: F.conv_transpose2d(a[None, None], b[None, None, :2, :2])),
    ("sdpa", lambda a, b, c: F.scaled_dot_product_attention(a[None], b[None], a[None])),
]
# fp32 ops that torch's CPU policy also runs in fp32 (losses).
LOSS_OPS = [
    ("mse_loss", lambda a, b, c: F.mse_loss(a, b)),
    ("l1_loss", lambda a, b, c: F.l1_loss(a, b)),
    ("bce_with_logits", lambda a, b, c: F.binary_cross_entropy_with_logits(a, b.sigmoid())),
    ("nll_loss", lambda a, b, c: F.nll_loss(a, torch.zeros(8, dtype=torch.long))),
    ("smooth_l1_loss", lambda a, b, c: F.smooth_l1_loss(a, b)),
    ("kl_div", lambda a, b, c: F.kl_div(a, b, reduction="batchmean")),
]
# fp32 ops where torch's CPU policy keeps bf16 but its CUDA policy (and ours) use fp32.
NORM_OPS = [
    ("layer_norm", lambda a, b, c: F.layer_norm(a, (8,), c[:8], c[8:])),
    ("group_norm", lambda a, b, c: F.group_norm(a[None], 2)),
    ("softmax", lambda a, b, c: F.softmax(a, -1)),
    ("Tensor.softmax", lambda a, b, c: a.softmax(-1)),
    ("log_softmax", lambda a, b, c: F.log_softmax(a, -1)),
    ("sum", lambda a, b, c: a.sum()),
    ("exp", lambda a, b, c: torch.exp(a)),
    ("pow", lambda a, b, c: a**2),
    ("cross_entropy", lambda a, b, c: F.cross_entropy(a, torch.zeros(8, dtype=torch.long))),
]


def _inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(*s, generator=g) for s in ((8, 8), (8, 8), (16,)))
    return [t.to(device=device, dtype=dtype) for t in (a, b, c)]


def _dtype_under(ctx, op, device, dtype=torch.float32):
    with ctx:
        return op(*_inputs(device, dtype)).dtype


@pytest.mark.parametrize(
    "name,op", MATRIX_OPS + LOSS_OPS, ids=lambda v: v if isinstance(v, str) else ""
)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_cpu_output_dtypes_match_torch_autocast(name, op, input_dtype):
    ref = _dtype_under(torch.autocast("cpu", torch.bfloat16), op, "cpu", input_dtype)
    own = _dtype_under(Autocast("cpu", torch.bfloat16), op, "cpu", input_dtype)
    assert own == ref


@pytest.mark.parametrize("name,op", NORM_OPS, ids=lambda v: v if isinstance(v, str) else "")
def test_cpu_precision_sensitive_ops_run_in_fp32(name, op):
    assert _dtype_under(Autocast("cpu", torch.bfloat16), op, "cpu", torch.bfloat16) == torch.float32


def test_batch_norm_runs_in_fp32_and_fp64_is_left_alone():
    bn = nn.BatchNorm2d(3)
    x = torch.randn(2, 3, 4, 4, dtype=torch.bfloat16)
    with Autocast("cpu"):
        assert bn(x).dtype == torch.float32
        d = torch.randn(4, 4, dtype=torch.float64)
        assert (d @ d).dtype == torch.float64
        i = torch.ones(3, dtype=torch.long)
        assert i.sum().dtype == torch.long
    assert policy_of(F.batch_norm) == "fp32" and policy_of(F.linear) == "low"
    assert policy_of(F.relu) is None


def _small_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(4, 16, 3, padding=1),
        nn.GELU(),
        nn.Flatten(),
        nn.Linear(16 * 12, 32),
        nn.LayerNorm(32),
        nn.Linear(32, 5),
    )


def _loss_and_grads(ctx, model, x, y):
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def test_small_model_loss_and_grads_match_torch_autocast_cpu_bf16():
    model = _small_model()
    torch.manual_seed(1)
    x, y = torch.randn(64, 4, 12), torch.randint(0, 5, (64,))
    ref_loss, ref_grads = _loss_and_grads(torch.autocast("cpu", torch.bfloat16), model, x, y)
    own_loss, own_grads = _loss_and_grads(Autocast("cpu", torch.bfloat16), model, x, y)
    fp32_loss, _ = _loss_and_grads(Autocast("cpu", enabled=False), model, x, y)
    assert own_loss.dtype == torch.float32
    torch.testing.assert_close(own_loss, ref_loss, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(own_loss, fp32_loss, rtol=2e-2, atol=1e-2)
    for g, r, p in zip(own_grads, ref_grads, model.parameters(), strict=True):
        assert g.dtype == p.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=5e-2, atol=5e-3)


def test_each_parameter_is_cast_once_per_region_and_cache_is_cleared():
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with Autocast("cpu"):
        a, b = lin(x), lin(x)
        cache = _local.mode.cache
        assert {id(lin.weight), id(lin.bias)} == set(cache)
        cached_weight = cache[id(lin.weight)][1]
        assert cached_weight.dtype == torch.bfloat16
        # both uses read the same low-precision copy
        assert a.grad_fn.next_functions[1][0] is b.grad_fn.next_functions[1][0]
        with torch.no_grad():
            lin(x)  # no-grad casts are not cached (they carry no graph)
        assert len(cache) == 2
    assert len(cache) == 0 and getattr(_local, "mode", None) is None
    (a.float().sum() + b.float().sum()).backward()
    torch.testing.assert_close(lin.weight.grad, 2 * x.sum(0).expand(8, 8), rtol=2e-2, atol=2e-2)


def test_nesting_and_disabled_regions():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    with Autocast("cpu"):
        assert (x @ w).dtype == torch.bfloat16
        with Autocast("cpu", enabled=False):
            assert (x @ w).dtype == torch.float32
            with Autocast("cpu"):
                assert (x @ w).dtype == torch.bfloat16
            assert (x @ w).dtype == torch.float32
        with Autocast("cuda"):  # another device type leaves CPU casting as it was
            assert (x @ w).dtype == torch.bfloat16
        assert (x @ w).dtype == torch.bfloat16
    assert (x @ w).dtype == torch.float32
    with Autocast("cpu", enabled=False):
        assert (x @ w).dtype == torch.float32


def test_decorator_and_exception_restore_state():
    @Autocast("cpu")
    def f(a):
        return a @ a

    assert f(torch.randn(3, 3)).dtype == torch.bfloat16
    with pytest.raises(KeyError), Autocast("cpu"):
        raise KeyError("boom")
    assert getattr(_local, "mode", None) is None
    assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float32


def test_outermost_region_pauses_the_garbage_collector_and_restores_it():
    import gc
    import threading

    assert gc.isenabled()
    with Autocast("cpu"):
        assert not gc.isenabled()
        with Autocast("cpu", enabled=False):
            assert not gc.isenabled()
        assert not gc.isenabled()  # only the outermost exit restores it
    assert gc.isenabled()
    with pytest.raises(KeyError), Autocast("cpu"):
        raise KeyError("boom")
    assert gc.isenabled()
    with Autocast("cpu", pause_gc=False):
        assert gc.isenabled()
    assert gc.isenabled()
    # A region on another thread keeps it paused until the last one exits.
    inside, leave = threading.Event(), threading.Event()

    def other():
        with Autocast("cpu"):
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(5)
    with Autocast("cpu"):
        pass
    assert not gc.isenabled()
    leave.set()
    t.join()
    assert gc.isenabled()
    # A collector the user switched off stays off.
    gc.disable()
    try:
        with Autocast("cpu"):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_transformer_layer_attention_runs_in_low_precision():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16)
    seen = []
    hook = layer.linear1.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    with Autocast("cpu"):
        out, _ = layer.self_attn(x, x, x, need_weights=False)
        assert out.dtype == torch.bfloat16
        y = layer(x, x)
    hook.remove()
    assert y.dtype == torch.float32  # ends in a LayerNorm
    assert seen == [(torch.float32, torch.bfloat16)]
    y.pow(2).sum().backward()
    own = [p.grad for p in layer.parameters()]
    assert all(g.dtype == torch.float32 for g in own)
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16):
        ref = layer(x, x)
    ref.float().pow(2).sum().backward()
    for g, p in zip(own, layer.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-2, atol=1e-4)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="device_type"):
        Autocast("mps")
    with pytest.raises(ValueError, match="dtype"):
        Autocast("cpu", torch.float64)


CUDA_EXTRA = [
    ("layer_norm", lambda a, b, c: F.layer_norm(a, (8,), c[:8], c[8:])),
    ("group_norm", lambda a, b, c: F.group_norm(a[None], 2)),
    ("softmax", lambda a, b, c: F.softmax(a, -1)),
    ("log_softmax", lambda a, b, c: F.log_softmax(a, -1)),
    ("sum", lambda a, b, c: a.sum()),
    ("exp", lambda a, b, c: torch.exp(a)),
    ("pow", lambda a, b, c: a**2),
    (
        "cross_entropy",
        lambda a, b, c: F.cross_entropy(a, torch.zeros(8, dtype=torch.long, device=a.device)),
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,op", MATRIX_OPS + CUDA_EXTRA, ids=lambda v: v if isinstance(v, str) else ""
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_output_dtypes_match_torch_autocast(name, op, dtype):
    for input_dtype in (torch.float32, dtype):
        ref = _dtype_under(torch.autocast("cuda", dtype), op, "cuda", input_dtype)
        own = _dtype_under(Autocast("cuda", dtype), op, "cuda", input_dtype)
        assert own == ref, (name, input_dtype)


@pytest.mark.gpu
def test_cuda_fp16_small_model_matches_torch_autocast_and_works_with_gradscaler():
    model = _small_model().cuda()
    torch.manual_seed(1)
    x, y = torch.randn(64, 4, 12, device="cuda"), torch.randint(0, 5, (64,), device="cuda")
    ref_loss, ref_grads = _loss_and_grads(torch.autocast("cuda", torch.float16), model, x, y)
    own_loss, own_grads = _loss_and_grads(Autocast("cuda", torch.float16), model, x, y)
    torch.testing.assert_close(own_loss, ref_loss, rtol=2e-3, atol=2e-3)
    for g, r in zip(own_grads, ref_grads, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=1e-2, atol=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Autocast("cuda", torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**16


def test_self_attention_keeps_one_packed_in_projection():
    """Casting query/key/value separately would break MHA's ``query is key`` check and split the
    packed in-projection into three GEMMs; the GEMM count must equal torch.autocast's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountGemms(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
                self.n += 1
            return func(*args, **(kwargs or {}))

    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 5, 32)
    counts = []
    for ctx in (torch.autocast("cpu", torch.bfloat16), Autocast("cpu", torch.bfloat16)):
        with ctx, CountGemms() as counter:
            mha(x, x, x, need_weights=False)
        counts.append(counter.n)
    assert counts == [2, 2]  # the packed q/k/v in-projection and the out-projection


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"ignore_index": 3, "reduction": "sum"},
        {"weight": True, "reduction": "none"},
        {"label_smoothing": 0.1},  # falls back to casting the input
    ],
)
@pytest.mark.parametrize("shape", [(8, 5), (4, 5, 3), (5,)])
def test_cross_entropy_on_low_precision_logits_matches_fp32_cross_entropy(kwargs, shape):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(*shape, generator=g).to(torch.bfloat16).requires_grad_()
    n_classes = shape[0] if len(shape) == 1 else shape[1]
    target_shape = () if len(shape) == 1 else (shape[0], *shape[2:])
    target = torch.randint(0, n_classes, target_shape, generator=g)
    if kwargs.get("weight"):
        kwargs = {**kwargs, "weight": torch.rand(n_classes, generator=g).to(torch.bfloat16)}
    ref_logits = logits.detach().float().requires_grad_()
    ref_kwargs = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    ref = F.cross_entropy(ref_logits, target, **ref_kwargs)
    with Autocast("cpu", torch.bfloat16):
        out = F.cross_entropy(logits, target, **kwargs)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)  # bf16 log-probabilities
    scaled = logits.detach().clone().requires_grad_()
    with Autocast("cpu", torch.bfloat16):
        big = F.cross_entropy(scaled, target, **kwargs)
    (big.sum() * 2.0**16).backward()  # a loss scale the low dtype could not hold as a gradient
    assert torch.isfinite(scaled.grad).all()
    out.sum().backward()
    ref.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, rtol=2e-2, atol=1e-2)


def test_cross_entropy_with_probability_targets_runs_in_fp32():
    logits = torch.randn(4, 6).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(4, 6), -1)
    with Autocast("cpu", torch.bfloat16):
        out = F.cross_entropy(logits, probs)
    torch.testing.assert_close(out, F.cross_entropy(logits.float(), probs))


@pytest.mark.parametrize(
    "op",
    [
        lambda x: F.softmax(x, -1),
        lambda x: torch.log_softmax(x, -1),
        lambda x: x.sum(0),
        lambda x: torch.cumsum(x, 0),
        lambda x: x.prod(-1),
    ],
)
def test_dtype_argument_ops_compute_in_fp32_from_low_precision_input(op):
    x = torch.randn(6, 4).to(torch.bfloat16)
    with Autocast("cpu", torch.bfloat16):
        out = op(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, op(x.float()))


def test_explicit_dtype_argument_is_respected():
    x = torch.randn(6, 4).to(torch.bfloat16)
    with Autocast("cpu", torch.bfloat16):
        assert x.sum(dtype=torch.float64).dtype == torch.float64
        assert torch.softmax(x, -1, torch.float64).dtype == torch.float64
        assert torch.ones(3, dtype=torch.int64).sum().dtype == torch.int64


def test_cross_entropy_reads_low_precision_logits_without_an_fp32_copy(monkeypatch):
    from effdl.amp import autocast as autocast_module

    seen = []
    real = autocast_module._cross_entropy

    def spy(x, *args, **kwargs):
        seen.append(x.dtype)
        return real(x, *args, **kwargs)

    monkeypatch.setitem(autocast_module._SPECIAL, F.cross_entropy, spy)
    logits = torch.randn(4, 6).to(torch.bfloat16)
    with Autocast("cpu", torch.bfloat16):
        F.cross_entropy(logits, torch.tensor([0, 1, 2, 3]))
    F.cross_entropy(logits, torch.tensor([0, 1, 2, 3]))  # outside a region: not intercepted
    assert seen == [torch.bfloat16]


def test_scaled_fp16_cross_entropy_gradient_stays_finite():
    # 2**16, GradScaler's initial scale, overflows fp16: the loss and its gradient must stay
    # fp32 until the gradient is spread over the tokens (here 64 -> 1024 per token, finite).
    logits = torch.randn(64, 5).to(torch.float16).requires_grad_()
    target = torch.randint(0, 5, (64,))
    with Autocast("cpu", torch.float16):
        loss = F.cross_entropy(logits, target)
    (loss * 2.0**16).backward()
    assert loss.dtype == torch.float32
    assert torch.isfinite(logits.grad).all()
    ref = logits.detach().float().requires_grad_()
    F.cross_entropy(ref, target).backward()
    torch.testing.assert_close(logits.grad.float() / 2.0**16, ref.grad, rtol=1e-2, atol=1e-3)
