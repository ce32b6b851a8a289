"""MasterWeights against torch.optim.AdamW (and SGD) on fp32 parameters fed the same gradients;
its GPU pass against torch.optim.AdamW(fused=True) on the GPU."""

import copy

import pytest
import torch
from torch import nn

from effdl.optim.master_weights import MasterWeights


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def adamw_decay_on_matrices(params) -> torch.optim.AdamW:
    """Two groups with their own hyper-parameters, as training scripts build them."""
    params = list(params)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 3e-3},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))


def sgd_momentum(params) -> torch.optim.SGD:
    """An optimizer without the fused AdamW pass: MasterWeights runs its own step."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def micro_batches(step: int, n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(n)]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)).float() - y).pow(2).mean()


def train_side_by_side(make, steps: int, clip: float | None = None, device: str = "cpu"):
    """A model trained through MasterWeights (fp32 working weights) beside an fp32 copy trained
    by ``make``'s optimizer on the same micro-batches, both clipped to ``clip`` (the norms
    checked equal); returns (model, reference)."""
    reference = small_model().to(device)
    model = copy.deepcopy(reference)
    ref_opt = make(reference.parameters())
    holder = MasterWeights(model, make, dtype=torch.float32)
    assert len(holder.masters) == len(ref_opt.param_groups)
    for step in range(steps):
        for x, y in micro_batches(step):
            loss_of(reference, x.to(device), y.to(device)).backward()
            loss_of(model, x.to(device), y.to(device)).backward()
        assert all(p.grad is None for p in model.parameters())  # moved to the masters
        if clip is not None:
            expected = nn.utils.clip_grad_norm_(reference.parameters(), clip)
            torch.testing.assert_close(holder.clip_grad_norm_(clip), expected)
        ref_opt.step()
        ref_opt.zero_grad()
        holder.step()
        holder.zero_grad()
    return model, reference


def assert_same_parameters(model, reference, rtol=1e-6, atol=1e-7) -> None:
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=rtol, atol=atol)


@pytest.mark.parametrize("make", [adamw, adamw_decay_on_matrices, sgd_momentum])
def test_fp32_working_weights_train_exactly_like_the_optimizer(make):
    assert_same_parameters(*train_side_by_side(make, steps=4))


def test_bf16_masters_get_the_fp32_sum_of_the_bf16_gradients():
    """Brute force: the same bf16 model run bare, its micro-batch gradients summed in fp32 and
    given to AdamW on fp32 copies; the model then holds those masters rounded to bf16."""
    model = small_model()
    masters_ref = [p.detach().clone() for p in model.parameters()]
    bare = copy.deepcopy(model).to(torch.bfloat16)  # the same bf16 weights, without hooks
    holder = MasterWeights(model, adamw)
    ref_opt = adamw(masters_ref)
    for step in range(3):
        sums = [torch.zeros_like(m) for m in masters_ref]
        for x, y in micro_batches(step):
            loss_of(model, x, y).backward()
            bare.zero_grad(set_to_none=True)
            loss_of(bare, x, y).backward()
            for s, p in zip(sums, bare.parameters(), strict=True):
                s += p.grad.float()
        for m, s in zip(masters_ref, sums, strict=True):
            m.grad = s
        ref_opt.step()
        holder.step()
        holder.zero_grad()
        with torch.no_grad():
            for b, m in zip(bare.parameters(), masters_ref, strict=True):
                b.copy_(m)
    flat_ref = torch.cat([m.reshape(-1) for m in masters_ref])
    torch.testing.assert_close(holder.masters[0].detach(), flat_ref, rtol=0, atol=0)
    for p, ref in zip(model.parameters(), masters_ref, strict=True):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, ref.to(torch.bfloat16))


@pytest.mark.parametrize("make", [adamw, sgd_momentum])
def test_clipping_inside_the_step_matches_clipping_fp32_parameters(make):
    """clip_grad_norm_ returns torch's norm, and the step then applies torch's scaling (inside
    the AdamW pass; by a multiply before any other optimizer's step)."""
    assert_same_parameters(*train_side_by_side(make, steps=3, clip=0.1))


def test_refuses_low_precision_models_and_empty_ones():
    with pytest.raises(ValueError, match="build the model in float32"):
        MasterWeights(small_model().to(torch.bfloat16), adamw)
    with pytest.raises(ValueError, match="left 2 of the model's 6 trainable parameters out"):
        MasterWeights(small_model(), lambda params: adamw(params[:4]))
    frozen = small_model().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        MasterWeights(frozen, adamw)
    with pytest.raises(TypeError, match=r"model must be an nn\.Module, got str"):
        MasterWeights("abc", adamw)
    with pytest.raises(TypeError, match="make_optimizer must be callable"):
        MasterWeights(small_model(), None)


def test_close_removes_the_hooks():
    model = small_model()
    holder = MasterWeights(model, adamw, dtype=torch.float32)
    holder.close()
    x, y = micro_batches(0, 1)[0]
    loss_of(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(not m.grad.any() for m in holder.masters)


def test_a_parameter_without_gradient_gets_a_zero_one_not_the_last_steps():
    """Step 1 trains every layer; step 2 only the last one (the others' outputs detached)."""
    reference = small_model()
    model = copy.deepcopy(reference)
    ref_opt = adamw(reference.parameters())
    holder = MasterWeights(model, adamw, dtype=torch.float32)
    x, y = micro_batches(0, 1)[0]
    for net in (reference, model):
        loss_of(net, x, y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    holder.step()
    holder.zero_grad()
    for net in (reference, model):
        (net[3](net[:3](x).detach()) - y).pow(2).mean().backward()
    for p in reference.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # what MasterWeights gives it
    ref_opt.step()
    holder.step()
    assert_same_parameters(model, reference)


@pytest.mark.gpu
def test_cuda_pass_matches_torch_fused_adamw():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on a machine with a GPU: pytest -m gpu)")

    def fused(params):
        return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    model, reference = train_side_by_side(fused, steps=5, clip=0.1, device="cuda")
    assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)


def train_steps(model: nn.Module, holder: MasterWeights, steps: range) -> list[float]:
    losses = []
    for step in steps:
        for x, y in micro_batches(step):
            loss = loss_of(model, x, y)
            loss.backward()
        losses.append(loss.item())
        holder.clip_grad_norm_(1.0)
        holder.step()
        holder.zero_grad()
    return losses


@pytest.mark.parametrize("make", [adamw, sgd_momentum])
def test_a_resume_from_the_state_dict_continues_bit_exactly(make):
    """bf16 working weights: a resume that restarted the masters from them would drift."""
    model = small_model()
    holder = MasterWeights(model, make)
    whole = train_steps(model, holder, range(6))
    first = small_model()
    holder = MasterWeights(first, make)
    head = train_steps(first, holder, range(3))
    state = copy.deepcopy(holder.state_dict())
    resumed = small_model()
    holder = MasterWeights(resumed, make)
    holder.load_state_dict(state)
    assert head + train_steps(resumed, holder, range(3, 6)) == whole
    for p, q in zip(resumed.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_load_state_dict_refuses_another_optimizer_or_shape():
    state = MasterWeights(small_model(), adamw).state_dict()
    with pytest.raises(ValueError, match="state is of a AdamW optimizer, this one is a SGD"):
        MasterWeights(small_model(), sgd_momentum).load_state_dict(state)
    other = nn.Sequential(nn.Linear(8, 4))
    with pytest.raises(ValueError, match="do not match"):
        MasterWeights(other, adamw).load_state_dict(state)


def test_frozen_parameters_and_empty_groups_are_handled():
    model = small_model()
    model[0].requires_grad_(False)

    def with_an_empty_group(params):
        return torch.optim.AdamW([{"params": list(params)}, {"params": []}], lr=1e-2)

    holder = MasterWeights(model, with_an_empty_group)
    assert model[0].weight.dtype == torch.bfloat16 and not model[0].weight.requires_grad
    frozen = model[0].weight.clone()
    train_steps(model, holder, range(2))
    assert torch.equal(model[0].weight, frozen)
    assert holder.masters[1].numel() == 0
