import copy

import pytest
import torch
from torch import nn

from effdl.amp import DynamicGradScaler, StaticGradScaler
from effdl.amp.precision import PrecisionSpec, build_precision, forward_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "spec,scaler_type,low_output",
    [
        (PrecisionSpec(), StaticGradScaler, False),
        (PrecisionSpec("torch", "torch"), torch.amp.GradScaler, True),
        (PrecisionSpec("torch", "static"), StaticGradScaler, True),
        (PrecisionSpec("own", "dynamic"), DynamicGradScaler, True),
    ],
)
def test_setups_build_the_named_pieces_and_train(spec, scaler_type, low_output):
    prec = build_precision(spec, CPU, torch.bfloat16, growth_interval=2)
    assert isinstance(prec.scaler, scaler_type)
    torch.manual_seed(0)
    lin = nn.Linear(4, 1)
    ref = copy.deepcopy(lin)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    for _ in range(3):
        opt.zero_grad()
        with prec.autocast():
            out = lin(x)
        assert (out.dtype == torch.bfloat16) == low_output
        prec.backward(out.float().pow(2).mean())
        prec.step(opt)
        scale, skipped = prec.scale_and_skipped()
        assert not skipped
        ref_opt.zero_grad()  # reference: the same autocast, no scaling at all
        with prec.autocast():
            ref(x).float().pow(2).mean().backward()
        ref_opt.step()
    expected = {"none": 1.0, "static": 2.0**16, "torch": 2.0**17, "dynamic": 2.0**17}[spec.scaler]
    assert scale == expected
    # Power-of-two scales are exact: scaled training takes the unscaled steps bit for bit.
    for p, q in zip(lin.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_torch_scaler_skip_is_detected_from_backoff():
    prec = build_precision(PrecisionSpec("torch", "torch"), CPU, torch.bfloat16)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    prec.backward((p * float("inf")).sum())
    prec.step(opt)
    assert prec.scale_and_skipped() == (2.0**15, True)
    torch.testing.assert_close(p.detach(), torch.ones(2), rtol=0, atol=0)  # the step was skipped


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="autocast"):
        PrecisionSpec("apex", "none")
    with pytest.raises(ValueError, match="scaler"):
        PrecisionSpec("none", "loss")


@pytest.mark.parametrize(
    "name, dtype, tf32",
    [("bf16", torch.bfloat16, False), ("fp16", torch.float16, False), ("tf32", None, True),
     ("fp32", None, False)],
)  # fmt: skip
def test_forward_precision_matches_torch_autocast_and_sets_tf32(name, dtype, tf32):
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        ctx = forward_precision(torch.device("cpu"), name)
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
        x = torch.randn(4, 4)
        with ctx():
            out = x @ x
        if dtype is None:
            assert out.dtype == torch.float32
        else:
            with torch.autocast("cpu", dtype=dtype):
                assert out.dtype == (x @ x).dtype
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_forward_precision_rejects_unknown_names():
    with pytest.raises(ValueError, match="precision must be one of"):
        forward_precision(torch.device("cpu"), "int8")
