"""scaled_step's ``unscaled_grads`` hook sees the true gradients under every scaler, and the step
it surrounds is the one without the hook."""

import pytest
import torch

from effdl.amp.grads import total_norm
from effdl.amp.precision import PrecisionSpec, build_precision
from effdl.amp.training_step import scaled_step


def one_step(scaler: str, hook: bool):
    """(the gradients the hook saw, the weights after the step) of one SGD step of a small
    regression under ``scaler`` (fp32 forward, so every scaler's step is the plain one)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = build_precision(PrecisionSpec("none", scaler), torch.device("cpu"), static_scale=2.0**10)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    seen = []

    def forward():
        out = model(x)
        return out, torch.nn.functional.mse_loss(out, y)

    def grads():
        seen.append([p.grad.clone() for p in model.parameters()])

    scaled_step(opt, prec, forward, unscaled_grads=grads if hook else None)
    return seen, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("scaler", ["torch", "static", "dynamic", "none"])
def test_the_hook_sees_unscaled_gradients_and_leaves_the_step_alone(scaler):
    (plain,), plain_after = one_step("none", hook=True)
    (seen,), after = one_step(scaler, hook=True)
    _, after_without_hook = one_step(scaler, hook=False)
    for g, ref in zip(seen, plain, strict=True):
        torch.testing.assert_close(g, ref)
    for w, ref, free in zip(after, plain_after, after_without_hook, strict=True):
        torch.testing.assert_close(w, ref)
        assert torch.equal(w, free)


def test_total_norm_is_torchs_over_mixed_dtypes_and_inf_where_an_element_is():
    torch.manual_seed(0)
    grads = [torch.randn(7, 3), torch.randn(5, dtype=torch.float16), torch.randn(2, 2, 2) * 1e3]
    expected = torch.nn.utils.get_total_norm([g.float() for g in grads])
    torch.testing.assert_close(total_norm(grads), expected)
    grads[1][0] = float("inf")
    assert total_norm(grads).isinf()
