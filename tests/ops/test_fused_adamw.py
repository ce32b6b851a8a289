"""adamw_step_ against torch.optim.AdamW: the PyTorch path on the CPU and the Triton kernel
through Triton's interpreter."""

import pytest
import torch

from effdl.ops.fused_adamw import adamw_step_
from tests.triton_interpreter import assert_kernels_ok_in_interpreter

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def torch_adamw_steps(master, grads, scale):
    p = master.clone().requires_grad_()
    opt = torch.optim.AdamW(
        [p],
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        foreach=False,
    )
    for g in grads:
        p.grad = g * scale
        opt.step()
    return p.detach()


@pytest.mark.parametrize("scale", [None, 0.25])
def test_torch_path_equals_adamw_over_steps(scale):
    torch.manual_seed(0)
    master = torch.randn(1000)
    grads = [torch.randn(1000) for _ in range(4)]
    expected = torch_adamw_steps(master, grads, 1.0 if scale is None else scale)
    m, v = torch.zeros(1000), torch.zeros(1000)
    working = torch.empty(1000, dtype=torch.bfloat16)
    grad_scale = None if scale is None else torch.tensor(scale)
    for step, g in enumerate(grads, start=1):
        adamw_step_(master, g, m, v, working, step=step, grad_scale=grad_scale, **HYPER)
    torch.testing.assert_close(master, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(working, master.to(torch.bfloat16))


_INTERPRETED_KERNEL_CHECK = """
import torch
from effdl.ops import fused_adamw as fa
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
torch.manual_seed(0)
for n in (1, fa.BLOCK + 5):
    for scale in (None, torch.tensor([0.25])):
        master = torch.randn(n)
        grads = [torch.randn(n) for _ in range(3)]
        ref = master.clone()
        rm, rv = torch.zeros(n), torch.zeros(n)
        m, v = torch.zeros(n), torch.zeros(n)
        working = torch.empty(n, dtype=torch.bfloat16)
        ref_working = torch.empty(n, dtype=torch.bfloat16)
        for step, g in enumerate(grads, start=1):
            fa.adamw_step_(ref, g, rm, rv, ref_working, step=step, grad_scale=scale, **HYPER)
            decay = 1.0 - HYPER["lr"] * HYPER["weight_decay"]
            step_size = HYPER["lr"] / (1.0 - HYPER["beta1"] ** step)
            bc2_sqrt = (1.0 - HYPER["beta2"] ** step) ** 0.5
            fa._adamw_kernel[(fa.triton.cdiv(n, fa.BLOCK),)](
                master, g, m, v, working, scale if scale is not None else master, n,
                decay, HYPER["beta1"], HYPER["beta2"], step_size, bc2_sqrt, HYPER["eps"],
                HAS_SCALE=scale is not None, BLOCK=fa.BLOCK)
        for got, want in ((master, ref), (m, rm), (v, rv)):
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (n, scale, (got - want).abs().max())
        # the interpreter's bf16 conversion may round differently from CUDA's: within one ulp
        assert ((working.float() - master).abs() <= master.abs() * 2.0**-7).all()
print("kernels ok")
"""


def test_triton_kernel_in_interpreter_equals_the_torch_path():
    assert_kernels_ok_in_interpreter(_INTERPRETED_KERNEL_CHECK)


@pytest.mark.gpu
def test_cuda_kernel_equals_the_torch_path():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on a machine with a GPU: pytest -m gpu)")
    torch.manual_seed(0)
    n = (1 << 20) + 3
    state = [
        torch.randn(n, device="cuda"),
        torch.zeros(n, device="cuda"),
        torch.zeros(n, device="cuda"),
    ]
    ref = [t.clone() for t in state]
    working = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    ref_working = torch.empty_like(working)
    scale = torch.tensor([0.5], device="cuda")
    for step in range(1, 4):
        g = torch.randn(n, device="cuda")
        adamw_step_(state[0], g, state[1], state[2], working, step=step, grad_scale=scale, **HYPER)
        p, m, v = ref
        gs = g * scale
        p.mul_(1 - HYPER["lr"] * HYPER["weight_decay"])
        m.lerp_(gs, 1 - HYPER["beta1"])
        v.mul_(HYPER["beta2"]).addcmul_(gs, gs, value=1 - HYPER["beta2"])
        denom = (v.sqrt() / (1 - HYPER["beta2"] ** step) ** 0.5).add_(HYPER["eps"])
        p.addcdiv_(m, denom, value=-HYPER["lr"] / (1 - HYPER["beta1"] ** step))
        ref_working.copy_(p)
    for got, want in zip(state, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(working, state[0].to(torch.bfloat16))
