"""StaticGradScaler / DynamicGradScaler against torch.amp.GradScaler and fp32 autograd."""

import math

import pytest
import torch
from torch import nn

from effdl.amp import DynamicGradScaler, StaticGradScaler
from effdl.amp.grads import unscale_and_check_, zero_fraction

INF, NAN = float("inf"), float("nan")


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(5, 3, generator=g)), nn.Parameter(torch.randn(4, generator=g))]


def _injected_sequence(n_steps=24):
    """Per step: a multiplier for each of the two parameters; some steps overflow."""
    seq = []
    for i in range(n_steps):
        a, b = 1.0 + i / 10, -0.5
        if i in (2, 3, 11):
            a = INF
        if i in (7, 16):
            b = NAN
        if i == 17:
            a, b = -INF, NAN
        seq.append((a, b))
    return seq


def _run(scaler, params, seq, lr=0.1):
    opt = torch.optim.SGD(params, lr=lr)
    scales, skipped = [], []
    for a, b in seq:
        opt.zero_grad(set_to_none=True)
        loss = (params[0] * a).sum() + (params[1] * b).sum()
        before = [p.detach().clone() for p in params]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(x, p) for x, p in zip(before, params, strict=True)))
    return scales, skipped


@pytest.mark.parametrize(
    "kwargs",
    [
        {"init_scale": 2.0**16, "growth_interval": 3},
        {"init_scale": 8.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 2},
        {"init_scale": 1.0, "growth_interval": 1},
    ],
)
def test_dynamic_trajectory_matches_torch_gradscaler(kwargs):
    seq = _injected_sequence()
    ref_params, own_params = _params(), _params()
    ref = torch.amp.GradScaler("cpu", **kwargs)
    own = DynamicGradScaler(**kwargs)
    ref_scales, ref_skipped = _run(ref, ref_params, seq)
    own_scales, own_skipped = _run(own, own_params, seq)
    assert own_scales == ref_scales
    assert own_skipped == ref_skipped
    assert own.skipped_steps == sum(ref_skipped) == 6
    for p, q in zip(own_params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_torch_defaults():
    own, ref = DynamicGradScaler(), torch.amp.GradScaler("cpu")
    assert own.get_scale() == ref.get_scale() == 2.0**16
    assert (own.growth_factor, own.backoff_factor, own.growth_interval) == (
        ref.get_growth_factor(),
        ref.get_backoff_factor(),
        ref.get_growth_interval(),
    )


def test_unscaled_gradients_equal_fp32_gradients_with_accumulation_and_groups():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    unused = nn.Parameter(torch.ones(3))  # never gets a gradient
    xs = [torch.randn(4, 6) for _ in range(3)]
    ref = [torch.zeros_like(p) for p in model.parameters()]
    for x in xs:  # fp32 reference: accumulated plain gradients
        grads = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
        ref = [r + g for r, g in zip(ref, grads, strict=True)]
    opt = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": [*model[2].parameters(), unused]}], lr=0.0
    )
    scaler = DynamicGradScaler(init_scale=2.0**10)
    for x in xs:  # scale each micro-batch, unscale once
        scaler.scale(model(x).pow(2).mean()).backward()
    scaler.unscale_(opt)
    for p, r in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-7)
    assert unused.grad is None
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 0


def test_clipping_between_unscale_and_step_sees_true_gradients():
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = StaticGradScaler(scale=1024.0)
    scaler.scale((p * torch.tensor([3.0, 4.0, 0.0])).sum()).backward()
    scaler.unscale_(opt)
    norm = nn.utils.clip_grad_norm_([p], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    scaler.step(opt)  # does not unscale a second time
    scaler.update()
    torch.testing.assert_close(p.detach(), torch.tensor([-0.6, -0.8, 0.0]))


@pytest.mark.parametrize("scaler_cls", [StaticGradScaler, DynamicGradScaler])
def test_fp16_gradients_are_unscaled_in_fp16(scaler_cls):
    p = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = scaler_cls(2.0**12)
    c = torch.tensor([1e-6, 2e-3, 0.5, 3.0], dtype=torch.float16)
    scaler.scale((p * c).sum()).backward()
    assert p.grad.dtype == torch.float16
    scaler.unscale_(opt)
    expected = ((c.float() * 2.0**12).half().float() / 2.0**12).half()
    torch.testing.assert_close(p.grad, expected, rtol=0, atol=0)
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 0


def test_mixed_fp16_fp32_gradients_detect_inf_in_either():
    grads = [torch.ones(3), torch.ones(2, dtype=torch.float16)]
    assert not unscale_and_check_(grads, 0.5).item()
    torch.testing.assert_close(grads[1], torch.full((2,), 0.5, dtype=torch.float16))
    grads[1][0] = NAN
    assert unscale_and_check_(grads, 1.0).item()
    assert unscale_and_check_([], 1.0) is None


def test_static_scaler_keeps_its_scale_and_skips_overflows():
    scaler = StaticGradScaler(scale=2.0**8)
    params = _params()
    scales, skipped = _run(scaler, params, _injected_sequence())
    assert set(scales) == {2.0**8}
    assert skipped == [i in (2, 3, 7, 11, 16, 17) for i in range(24)]  # the injected inf/NaN
    assert scaler.skipped_steps == 6


def test_hysteresis_tolerates_overflows_before_backing_off():
    scaler = DynamicGradScaler(init_scale=64.0, hysteresis=2, growth_interval=100)
    params = _params()
    scales, skipped = _run(scaler, params, [(INF, 1.0), (1.0, 1.0), (INF, 1.0), (INF, 1.0)])
    assert scales == [64.0, 64.0, 32.0, 32.0]
    assert skipped == [True, False, True, True]


def test_min_and_max_scale_clamp():
    up = DynamicGradScaler(init_scale=4.0, growth_factor=3.0, growth_interval=1, max_scale=20.0)
    scales, _ = _run(up, _params(), [(1.0, 1.0)] * 3)
    assert scales == [12.0, 20.0, 20.0]
    down = DynamicGradScaler(init_scale=4.0, min_scale=1.0)
    scales, skipped = _run(down, _params(), [(INF, 1.0)] * 4)
    assert scales == [2.0, 1.0, 1.0, 1.0] and all(skipped)


def test_state_dict_round_trip_continues_the_same_trajectory():
    seq = _injected_sequence()
    a = DynamicGradScaler(init_scale=16.0, growth_interval=3)
    _run(a, _params(), seq[:10])
    b = DynamicGradScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert _run(a, _params(), seq[10:])[0] == _run(b, _params(), seq[10:])[0]


def test_disabled_scaler_is_a_pass_through():
    scaler = DynamicGradScaler(enabled=False)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    loss = p.sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    torch.testing.assert_close(p.detach(), torch.zeros(2))


def test_scale_accepts_nested_outputs_and_promotes_fp16_loss():
    scaler = StaticGradScaler(scale=2.0**16)
    out = scaler.scale([torch.tensor(2.0, dtype=torch.float16), (torch.tensor(1.0),)])
    assert out[0].dtype == torch.float32 and out[0].item() == 2.0**17
    assert out[1][0].item() == 2.0**16
    with pytest.raises(TypeError, match="tensor or a list"):
        scaler.scale("loss")


def test_protocol_errors():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = DynamicGradScaler()
    with pytest.raises(RuntimeError, match="no inf checks"):
        scaler.update()
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="closure"):
        scaler.step(opt, closure=lambda: 0.0)
    empty = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)
    with pytest.raises(RuntimeError, match="no gradients"):
        scaler.step(empty)
    with pytest.raises(RuntimeError, match="empty"):
        DynamicGradScaler().load_state_dict({})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"init_scale": 0.0}, "init_scale must be positive and finite"),
     ({"init_scale": math.inf}, "init_scale must be positive and finite"),
     ({"growth_factor": 1.0}, "growth_factor must be > 1"),
     ({"backoff_factor": 1.5}, r"backoff_factor must be in \(0, 1\)"),
     ({"growth_interval": 0}, "growth_interval and hysteresis must be >= 1"),
     ({"hysteresis": 0}, "growth_interval and hysteresis must be >= 1"),
     ({"min_scale": 0.0}, "min_scale must be positive and finite"),
     ({"init_scale": 1.0, "min_scale": 2.0}, "min_scale <= init_scale"),
     ({"init_scale": 8.0, "max_scale": 4.0}, "min_scale <= init_scale <= max_scale")],
)  # fmt: skip
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicGradScaler(**kwargs)


def test_update_reads_flags_of_optimizers_that_were_only_unscaled():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = DynamicGradScaler(init_scale=8.0)
    scaler.scale((p * INF).sum()).backward()
    scaler.unscale_(opt)
    scaler.update()  # no step(): the flag is read here
    assert scaler.get_scale() == 4.0 and scaler.last_found_inf


def test_zero_fraction_counts_exact_zeros():
    grads = [torch.tensor([0.0, 1.0, 0.0, -0.0]), torch.tensor([[2.0, 0.0]], dtype=torch.float16)]
    assert zero_fraction(grads).item() == pytest.approx(4 / 6)
    assert math.isnan(zero_fraction([]).item())


def _cuda_step(scaler, model, opt, x):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.gpu
def test_cuda_fp16_trajectory_matches_torch_and_one_sync_per_step():
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    own_model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    own_model.load_state_dict(ref_model.state_dict())
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-3)
    own_opt = torch.optim.Adam(own_model.parameters(), lr=1e-3)
    ref = torch.amp.GradScaler("cuda", init_scale=2.0**20, growth_interval=5)
    own = DynamicGradScaler(init_scale=2.0**20, growth_interval=5)
    for i in range(30):
        x = torch.randn(32, 64, device="cuda") * (1e4 if i % 7 == 3 else 1.0)
        _cuda_step(ref, ref_model, ref_opt, x)
        _cuda_step(own, own_model, own_opt, x)
        assert own.get_scale() == ref.get_scale()
    for p, q in zip(own_model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    # Everything except step() must run without a host sync; step() syncs exactly once.
    x = torch.randn(32, 64, device="cuda")
    own_opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", torch.float16):
            loss = own_model(x).float().pow(2).mean()
        own.scale(loss).backward()
        own.unscale_(own_opt)
        torch.cuda.set_sync_debug_mode("warn")
        with pytest.warns(UserWarning, match="synchroniz") as rec:
            own.step(own_opt)
        assert len([w for w in rec if "synchroniz" in str(w.message)]) == 1
        torch.cuda.set_sync_debug_mode("error")
        own.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_cuda_nan_and_inf_detected_in_large_fp16_and_fp32_grads():
    for dtype in (torch.float16, torch.float32):
        grads = [torch.ones(1 << 20, device="cuda", dtype=dtype) for _ in range(3)]
        assert not unscale_and_check_(grads, 1.0).item()
        for bad in (INF, -INF, NAN):
            grads[1][123457] = bad
            assert unscale_and_check_(grads, 1.0).item()
            grads[1][123457] = 1.0


def test_long_overflow_run_stops_at_min_scale_and_the_next_nan_is_still_caught():
    """torch's scaler reaches 0 after ~166 overflows; then 0 * inf NaN grads pass unnoticed."""
    scaler = DynamicGradScaler()
    assert scaler.min_scale > 0
    params = _params()
    scales, skipped = _run(scaler, params, [(INF, 1.0)] * 200)
    assert all(skipped) and scales[-1] == scaler.min_scale > 0
    before = [p.detach().clone() for p in params]
    _, skipped = _run(scaler, params, [(NAN, 1.0)])
    assert skipped == [True]
    assert all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"scale": NAN}, "scale must be positive and finite, got nan"),
     ({"scale": -1.0}, "scale must be positive and finite, got -1.0"),
     ({"scale": 0.0}, "scale must be positive and finite"),
     ({"scale": INF}, "scale must be positive and finite"),
     ({"growth_interval": 0}, "growth_interval and hysteresis must be >= 1"),
     ({"hysteresis": 0}, "growth_interval and hysteresis must be >= 1"),
     ({"growth_factor": 0.5}, "growth_factor must be > 1"),
     ({"backoff_factor": NAN}, r"backoff_factor must be in \(0, 1\)"),
     ({"min_scale": 0.0}, "min_scale must be positive"),
     ({"max_scale": 2.0}, "min_scale <= scale <= max_scale"),
     ({"growth_tracker": -1}, "growth_tracker"),
     ({"skipped_steps": 6}, "skipped_steps <= steps"),
     ({"growth_factor": "x"}, "could not convert")],
)  # fmt: skip
def test_load_state_dict_validates_as_the_constructor_does(change, message):
    saved = DynamicGradScaler(init_scale=16.0, growth_interval=3)
    _run(saved, _params(), _injected_sequence()[:5])
    state = {**saved.state_dict(), **change}
    target = DynamicGradScaler(init_scale=4.0)
    untouched = target.state_dict()
    with pytest.raises(ValueError, match=f"invalid scaler state_dict: .*{message}"):
        target.load_state_dict(state)
    assert target.state_dict() == untouched


def test_static_scaler_load_state_dict_refuses_a_nan_scale():
    scaler = StaticGradScaler(scale=8.0)
    with pytest.raises(ValueError, match="scale must be positive and finite, got nan"):
        scaler.load_state_dict({"scale": NAN, "steps": 0, "skipped_steps": 0})
    assert scaler.get_scale() == 8.0
