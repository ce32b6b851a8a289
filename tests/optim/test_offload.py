"""CPUOffloadAdam/AdamW against torch.optim.Adam/AdamW on fp32 copies of a small model.

Reference: torch.optim.Adam / AdamW (default single-tensor implementation, and the fused one
for bit-exact comparisons of the fp32 masters). Tolerances are stated where they are used.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from effdl.optim import CPUOffloadAdam, CPUOffloadAdamW, offload
from effdl.optim.quantized_state import BLOCK_SIZE, quantized_nbytes

# fp32 working weights vs torch's single-tensor Adam: the fused kernel orders the same fp32
# operations differently, so parameters agree to a few ulps after several steps.
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 5)
        self.unused = nn.Linear(3, 3)  # never used in forward: gets no grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(self.emb(x))))).sum(1)


def make_groups(model: nn.Module) -> list[dict]:
    decay = [model.fc1.weight, model.fc2.weight, model.emb.weight]
    rest = [p for p in model.parameters() if all(p is not d for d in decay)]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0, "lr": 3e-3, "betas": (0.8, 0.99)},
    ]


def masters_in_model_order(opt: CPUOffloadAdam, model: nn.Module) -> list[torch.Tensor]:
    """opt.master_params() follows param_groups order; line them up with model.parameters()."""
    grouped = [p for g in opt.param_groups for p in g["params"]]
    by_id = {id(p): m for p, m in zip(grouped, opt.master_params(), strict=True)}
    return [by_id[id(p)] for p in model.parameters()]


def batches(n: int, micro: int, seed: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randint(0, 11, (4, 6), generator=g), torch.randn(4, 5, generator=g))
            for _ in range(micro)
        ]
        for _ in range(n)
    ]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean() / micro


def run_reference(model, opt_cls, data, **kw) -> torch.optim.Optimizer:
    """Train ``model`` in place with torch's optimizer; returns the optimizer."""
    opt = opt_cls(make_groups(model), lr=1e-2, **kw)
    for step in data:
        for x, y in step:
            loss_fn(model, x, y, len(step)).backward()
        opt.step()
        opt.zero_grad()
    return opt


@dataclass
class Twins:
    """Two copies of one TinyNet: ``ref`` already trained on ``data`` by torch's optimizer,
    ``ours`` untouched (for the offloaded optimizer); ``base`` is the initial model."""

    base: TinyNet
    ref: TinyNet
    ours: TinyNet
    data: list[list[tuple[torch.Tensor, torch.Tensor]]]


def twins(seed: int, n: int, micro: int, opt_cls=torch.optim.Adam, **kw) -> Twins:
    torch.manual_seed(seed)
    base = TinyNet()
    t = Twins(base, copy.deepcopy(base), copy.deepcopy(base), batches(n, micro, seed))
    run_reference(t.ref, opt_cls, t.data, **kw)
    return t


def run_offload(model, data, adamw: bool, use_backward: bool = True, **kw) -> CPUOffloadAdam:
    opt = CPUOffloadAdam(make_groups(model), lr=1e-2, adamw=adamw, **kw)
    for step in data:
        for i, (x, y) in enumerate(step):
            loss = loss_fn(model, x, y, len(step))
            if use_backward:
                opt.backward(loss, final=i == len(step) - 1)
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("adamw", [False, True])
@pytest.mark.parametrize("use_backward", [False, True])
def test_matches_torch_adam_fp32(adamw: bool, use_backward: bool) -> None:
    t = twins(seed=0, n=5, micro=3, opt_cls=torch.optim.AdamW if adamw else torch.optim.Adam)
    ref, ours = t.ref, t.ours
    opt = run_offload(
        ours, t.data, adamw, use_backward, working_dtype=torch.float32, bucket_numel=100
    )
    assert len(opt._buckets) > 2  # several buckets, so bucket boundaries are exercised
    for (name, a), b, m in zip(
        ref.named_parameters(), ours.parameters(), masters_in_model_order(opt, ours), strict=True
    ):
        torch.testing.assert_close(b, a, **FP32_TOL, msg=name)
        torch.testing.assert_close(m, a.detach(), **FP32_TOL, msg=name)
    # a parameter that never got a gradient is untouched, as in torch (no weight decay applied)
    torch.testing.assert_close(ours.unused.weight, t.base.unused.weight, rtol=0, atol=0)
    opt.close()


def test_masters_bit_exact_vs_fused_torch_adamw() -> None:
    t = twins(seed=1, n=4, micro=2, opt_cls=torch.optim.AdamW, fused=True)
    opt = run_offload(t.ours, t.data, adamw=True, working_dtype=torch.float32)
    for a, m in zip(t.ref.parameters(), masters_in_model_order(opt, t.ours), strict=True):
        assert torch.equal(m, a.detach())
    opt.close()


def test_bf16_working_weights_track_fp32_reference() -> None:
    t = twins(seed=2, n=4, micro=2)
    opt = run_offload(t.ours, t.data, adamw=False)
    for a, b, m in zip(
        t.ref.parameters(), t.ours.parameters(), masters_in_model_order(opt, t.ours), strict=True
    ):
        assert b.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(b, m.to(torch.bfloat16))  # working copy = master rounded to bf16
        # bf16 forward/backward: gradients carry ~3 significant digits; after 4 steps of lr 1e-2
        # the masters stay within a few percent of a step size of the fp32 reference.
        torch.testing.assert_close(m, a.detach(), rtol=2e-2, atol=2e-2)
    opt.close()


def test_state_dict_matches_torch_and_round_trips_mid_training() -> None:
    t = twins(seed=3, n=6, micro=2)
    opt = run_offload(t.ours, t.data[:3], adamw=False, working_dtype=torch.float32)
    state = opt.state_dict()
    opt.close()

    # the same layout and values as torch.optim.Adam's after the same three steps
    torch_state = run_reference(copy.deepcopy(t.base), torch.optim.Adam, t.data[:3]).state_dict()
    assert sorted(state["state"]) == sorted(torch_state["state"])  # "unused" has no state
    for idx, theirs in torch_state["state"].items():
        mine = state["state"][idx]
        assert float(mine["step"]) == float(theirs["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine[key], theirs[key], **FP32_TOL, msg=f"{idx} {key}")
    for mine, theirs in zip(state["param_groups"], torch_state["param_groups"], strict=True):
        assert mine == {k: theirs[k] for k in mine}

    # a fresh model (different weights) and optimizer continue from the saved state
    torch.manual_seed(99)
    resumed = TinyNet()
    opt2 = CPUOffloadAdam(make_groups(resumed), lr=0.5, working_dtype=torch.float32)
    opt2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == 1e-2  # hyper-parameters restored too
    for step in t.data[3:]:
        for i, (x, y) in enumerate(step):
            opt2.backward(loss_fn(resumed, x, y, len(step)), final=i == len(step) - 1)
        opt2.step()
    for (name, a), b in zip(t.ref.named_parameters(), resumed.parameters(), strict=True):
        if name.startswith("unused"):
            continue  # never stepped: no saved state, keeps the fresh model's init
        torch.testing.assert_close(b, a, **FP32_TOL, msg=name)
    opt2.close()


def test_zero_grad_discards_accumulated_gradients() -> None:
    torch.manual_seed(4)
    model = TinyNet()
    before = [p.detach().clone() for p in model.parameters()]
    opt = CPUOffloadAdam(model.parameters(), lr=1e-2, working_dtype=torch.float32)
    x, y = batches(1, 1, seed=4)[0][0]
    opt.backward(loss_fn(model, x, y, 1))
    assert all(p.grad is None for p in model.parameters())  # grads leave the params at once
    opt.zero_grad()
    opt.step()
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.state_dict()["state"] == {}  # no parameter was stepped
    opt.close()


def test_loss_scale_unscales_and_skips_on_inf() -> None:
    t = twins(seed=5, n=3, micro=2)
    ref, ours, data = t.ref, t.ours, t.data
    opt = CPUOffloadAdam(make_groups(ours), lr=1e-2, working_dtype=torch.float32)
    for step in data:
        for i, (x, y) in enumerate(step):
            opt.backward(loss_fn(ours, x, y, len(step)), final=i == len(step) - 1, scale=1024.0)
        assert opt.step() and not opt.found_inf
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a, **FP32_TOL)

    # an overflowing step is skipped entirely: weights and step counts unchanged
    snapshot = [p.detach().clone() for p in ours.parameters()]
    steps = float(opt.state_dict()["state"][0]["step"])
    x, y = data[0][0]
    (loss_fn(ours, x, y, 1) * float("inf")).backward()
    assert opt.step(scale=2.0) is False and opt.found_inf
    assert float(opt.state_dict()["state"][0]["step"]) == steps
    for a, b in zip(snapshot, ours.parameters(), strict=True):
        assert torch.equal(a, b)
    # the next finite step proceeds normally
    opt.backward(loss_fn(ours, x, y, 1), final=True, scale=4.0)
    assert opt.step() and not opt.found_inf
    opt.close()


def test_adamw_subclass_has_torch_adamw_defaults() -> None:
    torch.manual_seed(7)
    base = nn.Linear(3, 2)
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    torch_opt = torch.optim.AdamW(ref.parameters())
    opt = CPUOffloadAdamW(ours.parameters(), working_dtype=torch.float32)
    assert opt.adamw
    group = opt.param_groups[0]
    assert {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")} == {
        k: torch_opt.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")
    }
    x = torch.randn(4, 3)
    for _ in range(3):
        ref(x).square().sum().backward()
        torch_opt.step()
        torch_opt.zero_grad()
        opt.backward(ours(x).square().sum(), final=True)
        opt.step()
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a, **FP32_TOL)
    opt.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "learning rate"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": -1.0}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"grad_accumulation": "disk"}, "grad_accumulation"),
        ({"working_dtype": torch.int8}, "working_dtype"),
        ({"update_on": "gpu"}, "update_on"),
        ({"update_on": "device"}, 'needs moments="int8"'),
        ({"grad_accumulation_dtype": torch.float16}, "grad_accumulation_dtype must be"),
        (
            {"grad_accumulation": "cpu", "grad_accumulation_dtype": torch.bfloat16},
            'needs grad_accumulation="gpu"',
        ),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CPUOffloadAdam(nn.Linear(2, 2).parameters(), **kwargs)


@pytest.mark.parametrize(
    ("device", "match"),
    [
        ("meta", r"device must be the CPU or a CUDA device .*got meta"),
        ("cuda:64", r"device cuda:64: (CUDA is not available|this machine has \d+ CUDA)"),
        ("gpu", r"device: cannot parse 'gpu'"),
    ],
)
def test_a_device_the_optimizer_cannot_work_on_is_refused(device: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CPUOffloadAdam(nn.Linear(2, 2).parameters(), device=device)


def test_parameters_on_the_meta_device_are_refused_without_a_device() -> None:
    with pytest.raises(ValueError, match="device must be the CPU or a CUDA device"):
        CPUOffloadAdam(nn.Linear(2, 2, device="meta").parameters())


@pytest.mark.parametrize(
    "scale", [0.0, -1.0, float("nan"), float("inf"), torch.tensor(0.0), torch.ones(2), "x"]
)
@pytest.mark.parametrize("where", ["backward", "step"])
def test_a_loss_scale_that_is_not_finite_and_positive_is_refused(scale, where) -> None:
    lin = nn.Linear(2, 2)
    opt = CPUOffloadAdam(lin.parameters(), working_dtype=torch.float32)
    before = [p.detach().clone() for p in lin.parameters()]
    loss = lin(torch.ones(1, 2)).sum()
    with pytest.raises(ValueError, match=r"^scale must be"):
        if where == "backward":
            opt.backward(loss, final=True, scale=scale)
        else:
            opt.backward(loss)  # not final: no bucket is updated inside backward
            opt.step(scale=scale)
    assert all(torch.equal(a, b) for a, b in zip(before, lin.parameters(), strict=True))
    opt.close()


def test_bad_params_are_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        CPUOffloadAdam([])
    with pytest.raises(ValueError, match="amsgrad"):
        CPUOffloadAdam([{"params": nn.Linear(2, 2).parameters(), "amsgrad": True}])
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="more than one"):
        CPUOffloadAdam([{"params": [lin.weight]}, {"params": [lin.weight]}])


def test_load_state_dict_rejects_mismatch() -> None:
    opt = CPUOffloadAdam(nn.Linear(2, 2).parameters(), working_dtype=torch.float32)
    other = CPUOffloadAdam(nn.Linear(3, 3).parameters(), working_dtype=torch.float32)
    for o in (opt, other):
        p = o.param_groups[0]["params"]
        o.backward(sum(q.sum() for q in p), final=True)
        o.step()
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    opt.close()
    other.close()


def test_load_state_dict_refuses_another_optimizers_state() -> None:
    """Another optimizer class's state (SGD's, AdamW's into Adam and back) or no state dict at
    all: a ValueError naming what differs, before anything changes."""
    lin = nn.Linear(2, 2)
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.ones(1, 2)).sum().backward()
    sgd.step()
    adamw = torch.optim.AdamW(lin.parameters())
    adamw.step()
    opt = CPUOffloadAdam(nn.Linear(2, 2).parameters(), working_dtype=torch.float32)
    opt_w = CPUOffloadAdamW(nn.Linear(2, 2).parameters(), working_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"param_groups\[0\] lacks \['betas', 'eps'\]: not the "
                       r"state of an Adam optimizer .*into CPUOffloadAdam"):  # fmt: skip
        opt.load_state_dict(sgd.state_dict())
    with pytest.raises(ValueError, match=r"param_groups\[0\] is AdamW's .*CPUOffloadAdam is Adam"):
        opt.load_state_dict(adamw.state_dict())
    adam = torch.optim.Adam(lin.parameters())
    adam.step()
    with pytest.raises(ValueError, match=r"is Adam's \(decoupled_weight_decay=False\); "
                       r"CPUOffloadAdamW is AdamW"):  # fmt: skip
        opt_w.load_state_dict(adam.state_dict())
    opt_w.load_state_dict(adamw.state_dict())  # torch's AdamW state loads into ours
    amsgrad = torch.optim.Adam(lin.parameters(), amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="amsgrad=True: unsupported"):
        opt.load_state_dict(amsgrad)
    for bad, match in (([], "must be a dict of 'state' and 'param_groups', got list"),
                       ({"state": {}}, r"got \['state'\]")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
    opt.close()
    opt_w.close()


def test_load_state_dict_names_the_first_state_that_does_not_fit() -> None:
    """Two mismatched entries: the error names the first, in parameter order."""
    opt = _stepped_linear()
    state = opt.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(3, 2)
    state["state"][1]["master"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"^state_dict\['state'\]\[0\]\['exp_avg'\] has shape "
                       r"\(3, 2\), parameter has \(2, 3\)$"):  # fmt: skip
        opt.load_state_dict(state)
    state = opt.state_dict()
    del state["state"][1]["step"]
    with pytest.raises(ValueError, match=r"\['state'\]\[1\] lacks 'step': not an Adam state"):
        opt.load_state_dict(state)
    opt.close()


def _stepped_linear() -> CPUOffloadAdam:
    torch.manual_seed(0)
    opt = CPUOffloadAdam(nn.Linear(3, 2).parameters(), working_dtype=torch.float32)
    p = opt.param_groups[0]["params"]
    opt.backward(sum(q.square().sum() for q in p), final=True)
    opt.step()
    return opt


def _set(path: tuple, value):
    def change(state: dict) -> None:
        *head, last = path
        d = state
        for k in head:
            d = d[k]
        d[last] = value

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [(_set(("state", 0, "master"), torch.zeros(1)), r"\['state'\]\[0\]\['master'\] has shape \(1,\), parameter has \(2, 3\)"),
     (_set(("state", 0, "master"), torch.zeros(3)), r"\['master'\] has shape \(3,\)"),
     (_set(("state", 1, "exp_avg_sq"), torch.zeros(2, 3)), r"\['state'\]\[1\]\['exp_avg_sq'\] has shape \(2, 3\)"),
     (_set(("state", 0, "step"), torch.tensor(float("nan"))), r"\['step'\] must be a whole number >= 1, got nan"),
     (_set(("param_groups", 0, "lr"), float("nan")), r"param_groups\[0\]: invalid learning rate: nan"),
     (_set(("param_groups", 0, "lr"), -1.0), r"param_groups\[0\]: invalid learning rate: -1.0"),
     (_set(("param_groups", 0, "eps"), float("nan")), "invalid eps: nan"),
     (_set(("param_groups", 0, "betas"), (0.9, 1.0)), "invalid betas"),
     (_set(("param_groups", 0, "weight_decay"), -0.1), "invalid weight_decay")],
)  # fmt: skip
def test_load_state_dict_validates_before_changing_anything(change, message) -> None:
    saved = _stepped_linear()
    state = saved.state_dict()
    saved.close()
    change(state)
    opt = _stepped_linear()
    before = opt.state_dict()
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(state)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for idx, entry in before["state"].items():
        for key, t in entry.items():
            torch.testing.assert_close(after["state"][idx][key], t, rtol=0, atol=0)
    opt.close()


# ------------------------------------------------------------------------------ int8 moments
def teacher_task() -> tuple[torch.Tensor, torch.Tensor]:
    """512 points in 64-d labelled into 10 classes by a random two-layer teacher."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    w1, w2 = torch.randn(64, 64, generator=g), torch.randn(64, 10, generator=g)
    return x, (torch.tanh(x @ w1) @ w2).argmax(1)


def student() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 10))  # fmt: skip


Update = Callable[[list[torch.Tensor]], None]  # one optimizer step from micro-batch losses


def train_curve(
    model: nn.Module, update: Update, order_seed: int, micro: int = 1, device: str = "cpu"
) -> torch.Tensor:
    """Full-data loss before each of 300 Adam steps on mini-batches of 64, each split into
    ``micro`` micro-batches whose losses (each 1/``micro`` of the mean) ``update`` gets."""
    x, y = teacher_task()
    x, y = x.to(device, next(model.parameters()).dtype), y.to(device)  # bf16 working weights
    g = torch.Generator().manual_seed(order_seed)
    losses = []
    for _ in range(300):
        with torch.no_grad():
            losses.append(nn.functional.cross_entropy(model(x).float(), y))
        i = torch.randperm(512, generator=g)[:64].to(device)
        update([nn.functional.cross_entropy(model(x[j]).float(), y[j]) / micro
                for j in i.chunk(micro)])  # fmt: skip
    return torch.stack(losses).cpu()


@functools.cache
def torch_adam_curve(order_seed: int, micro: int = 1) -> tuple[torch.Tensor, nn.Module]:
    """torch.optim.Adam's curve (cached: several tests compare against it; do not train it)."""
    model = student()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)  # the loop's one fast on CPU

    def update(losses: list[torch.Tensor]) -> None:
        opt.zero_grad()
        for loss in losses:
            loss.backward()
        opt.step()

    return train_curve(model, update, order_seed, micro), model


def offload_update(opt: CPUOffloadAdam) -> Update:
    """One step of ``opt``: each micro-batch's backward, the last one ``final``, then step."""

    def update(losses: list[torch.Tensor]) -> None:
        for k, loss in enumerate(losses):
            opt.backward(loss, final=k == len(losses) - 1)
        opt.step()

    return update


def assert_within_batch_order_noise(curve: torch.Tensor, ref: torch.Tensor, noise: torch.Tensor):
    """The yardstick of the int8 tests: ``curve``'s gap to ``ref`` is at most a quarter of the
    gap between two runs that differ only in mini-batch order (``noise`` vs ``ref``), in mean
    and in max, and both runs learned (loss down 100x)."""
    assert curve[-1] < 0.01 * curve[0] and ref[-1] < 0.01 * ref[0]
    gap, spread = (curve - ref).abs(), (noise - ref).abs()
    assert gap.mean() < 0.25 * spread.mean(), (float(gap.mean()), float(spread.mean()))
    assert gap.max() < 0.25 * spread.max(), (float(gap.max()), float(spread.max()))


@torch.no_grad()
def max_relative_distance(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p - q).norm() / p.norm()) for p, q in pairs)


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_int8_moments_track_torch_adam_within_batch_order_noise(update_on: str) -> None:
    """300 Adam steps (lr 1e-3, mini-batches of 64) of a 150k-parameter MLP. Noise is the gap
    between two torch.optim.Adam runs that differ only in mini-batch order. Bounds: the loss
    within a quarter of the noise, the parameters within 5% of torch's."""
    ref_curve, ref = torch_adam_curve(order_seed=0)
    noise_curve, reordered = torch_adam_curve(order_seed=1)
    model = student()
    opt = CPUOffloadAdam(
        model.parameters(), lr=1e-3, working_dtype=torch.float32, moments="int8",
        update_on=update_on,
    )  # fmt: skip
    curve = train_curve(model, offload_update(opt), order_seed=0)
    opt.close()
    assert_within_batch_order_noise(curve, ref_curve, noise_curve)
    assert max_relative_distance(ref, model) < 0.05 < 0.25 * max_relative_distance(ref, reordered)


def test_int8_moments_take_about_a_quarter_of_the_host_bytes() -> None:
    model = student()
    fp32 = CPUOffloadAdam(model.parameters(), working_dtype=torch.float32)
    int8 = CPUOffloadAdam(student().parameters(), working_dtype=torch.float32, moments="int8")
    blocks = sum(-(-p.numel() // 2048) for p in model.parameters())
    # codes sit at the parameters' offsets in the flat buckets, 64-value aligned like the masters
    aligned = sum(-(-p.numel() // 64) * 64 for p in model.parameters())
    assert int8.moment_nbytes() == 2 * (aligned + 4 * blocks)
    assert fp32.moment_nbytes() == 8 * aligned
    assert int8.moment_nbytes() < 0.26 * fp32.moment_nbytes()
    fp32.close()
    int8.close()


def test_int8_state_dict_round_trips_and_converts() -> None:
    t = twins(seed=8, n=6, micro=2)
    opt = CPUOffloadAdam(make_groups(t.ours), lr=1e-2, working_dtype=torch.float32, moments="int8")
    for step in t.data[:3]:
        for i, (x, y) in enumerate(step):
            opt.backward(loss_fn(t.ours, x, y, len(step)), final=i == len(step) - 1)
        opt.step()
    state = opt.state_dict()
    assert set(state["state"][0]) == {
        "step", "master", "exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes",
        "exp_avg_sq_absmax",
    }  # fmt: skip

    def continue_from(saved: dict, moments: str) -> list[torch.Tensor]:
        torch.manual_seed(99)
        model = TinyNet()
        resumed = CPUOffloadAdam(make_groups(model), working_dtype=torch.float32, moments=moments)
        resumed.load_state_dict(saved)
        for step in t.data[3:]:
            for i, (x, y) in enumerate(step):
                resumed.backward(loss_fn(model, x, y, len(step)), final=i == len(step) - 1)
            resumed.step()
        resumed.close()
        return [p.detach() for name, p in model.named_parameters() if "unused" not in name]

    expected = continue_from(state, "int8")
    opt_params = continue_from(opt.state_dict(), "int8")  # saving twice changes nothing
    for a, b in zip(expected, opt_params, strict=True):
        assert torch.equal(a, b)
    # the same run without the optimizer in between: the saved state is the whole state
    for step in t.data[3:]:
        for i, (x, y) in enumerate(step):
            opt.backward(loss_fn(t.ours, x, y, len(step)), final=i == len(step) - 1)
        opt.step()
    ours = [p.detach() for name, p in t.ours.named_parameters() if "unused" not in name]
    for a, b in zip(expected, ours, strict=True):
        assert torch.equal(a, b)
    opt.close()
    # fp32 <-> int8: the moments are dequantized / quantized, the masters carried over exactly
    fp32 = continue_from(state, "fp32")
    for a, b in zip(expected, fp32, strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=2e-3)


@pytest.mark.parametrize("accumulator", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adamw", [False, True])
def test_int8_device_update_on_cpu_equals_the_host_update_bit_for_bit(
    adamw: bool, accumulator: torch.dtype
) -> None:
    """update_on="device" with device="cpu" takes the device path (per-bucket moments, chunks
    of the device size, copy-back into the working weights) with the CPU's fused kernels: every
    master, moment code, absmax and step count equals the host path's. Several buckets, two
    param groups, micro-batches, and a parameter without gradients."""
    t = twins(seed=3, n=4, micro=2)
    kw = {"working_dtype": torch.float32, "moments": "int8", "bucket_numel": 100,
          "grad_accumulation_dtype": accumulator}  # fmt: skip
    host = run_offload(t.ours, t.data, adamw, **kw)
    device_model = copy.deepcopy(t.base)
    device = run_offload(device_model, t.data, adamw, update_on="device", **kw)
    host_state, device_state = host.state_dict()["state"], device.state_dict()["state"]
    assert host_state.keys() == device_state.keys() and len(host_state) == 7  # "unused": none
    for idx, entry in host_state.items():
        for key, value in entry.items():
            assert torch.equal(device_state[idx][key], value), (idx, key)
    for a, b in zip(t.ours.parameters(), device_model.parameters(), strict=True):
        assert torch.equal(a, b)
    host.close()
    device.close()


def test_int8_state_with_wrong_codes_is_rejected() -> None:
    opt = CPUOffloadAdam(nn.Linear(3, 2).parameters(), working_dtype=torch.float32, moments="int8")
    p = opt.param_groups[0]["params"]
    opt.backward(sum(q.square().sum() for q in p), final=True)
    opt.step()
    state = opt.state_dict()
    state["state"][0]["exp_avg_codes"] = state["state"][0]["exp_avg_codes"].float()
    with pytest.raises(ValueError, match=r"\['exp_avg_codes'\] has dtype torch.float32"):
        opt.load_state_dict(state)
    state["state"][0]["exp_avg_codes"] = state["state"][0]["exp_avg_codes"].byte()
    state["state"][0]["exp_avg_absmax"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"\['exp_avg_absmax'\] has shape \(2,\), expected \(1,\)"):
        opt.load_state_dict(state)
    with pytest.raises(ValueError, match="moments"):
        CPUOffloadAdam(nn.Linear(2, 2).parameters(), moments="int4")
    opt.close()


# ------------------------------------------------------------------------- bf16 accumulator
def test_bf16_accumulator_rounds_once_per_micro_batch_then_steps_in_fp32() -> None:
    """The reference: each micro-batch's fp32 gradient added into a bf16 sum (the first one
    rounded on its copy), that sum read as fp32 by torch.optim.Adam(fused=True). The masters
    must equal it bit for bit (three micro-batches, two param groups, several buckets)."""
    t = twins(seed=9, n=3, micro=3, opt_cls=torch.optim.Adam, fused=True)
    opt = run_offload(t.ours, t.data, adamw=False, working_dtype=torch.float32,
                      grad_accumulation_dtype=torch.bfloat16, bucket_numel=100)  # fmt: skip
    assert {b.grad.dtype for b in opt._buckets} == {torch.bfloat16}  # 2 B per parameter
    reference = copy.deepcopy(t.base)
    ref_opt = torch.optim.Adam(make_groups(reference), lr=1e-2, fused=True)
    for step in t.data:
        sums: dict[nn.Parameter, torch.Tensor] = {}
        for x, y in step:
            reference.zero_grad()
            loss_fn(reference, x, y, len(step)).backward()
            for p in reference.parameters():
                if p.grad is not None:
                    g = p.grad.to(torch.bfloat16)
                    sums[p] = sums[p].add_(p.grad) if p in sums else g
        for p in reference.parameters():
            p.grad = sums[p].float() if p in sums else None
        ref_opt.step()
    assert not torch.equal(reference.fc1.weight, t.ref.fc1.weight)  # the rounding shows
    for a, m in zip(reference.parameters(), masters_in_model_order(opt, t.ours), strict=True):
        assert torch.equal(m, a.detach())
    opt.close()


@pytest.mark.parametrize(("moments", "update_on"), [("fp32", "host"), ("int8", "device")])
def test_bf16_accumulation_tracks_torch_adam_within_batch_order_noise(
    moments: str, update_on: str
) -> None:
    """300 steps, 4 micro-batches of 16 each, fp32 working weights so that the accumulator and
    the moments are the only differences from torch.optim.Adam. Noise: two torch runs differing
    only in mini-batch order. With fp32 moments, fp32 accumulation equals torch's fused Adam
    exactly; bf16 accumulation (and int8 moments on the device path, whose fp32-accumulation run
    the int8 tests cover) stays within a quarter of the noise and 5% of torch's parameters."""
    ref_curve, ref = torch_adam_curve(order_seed=0, micro=4)
    noise_curve, reordered = torch_adam_curve(order_seed=1, micro=4)
    accumulators = (torch.float32, torch.bfloat16) if moments == "fp32" else (torch.bfloat16,)
    curves, models = {}, {}
    for accumulator in accumulators:
        models[accumulator] = student()
        opt = CPUOffloadAdam(
            models[accumulator].parameters(), lr=1e-3, working_dtype=torch.float32,
            moments=moments, update_on=update_on, grad_accumulation_dtype=accumulator,
        )  # fmt: skip
        curves[accumulator] = train_curve(models[accumulator], offload_update(opt), 0, micro=4)
        opt.close()
    if moments == "fp32":
        assert torch.equal(curves[torch.float32], ref_curve)
    assert_within_batch_order_noise(curves[torch.bfloat16], ref_curve, noise_curve)
    distance = max_relative_distance(ref, models[torch.bfloat16])
    assert distance < 0.05 < 0.25 * max_relative_distance(ref, reordered)


# ----------------------------------------------------------------------------------- GPU path
@pytest.mark.gpu
@pytest.mark.parametrize("grad_accumulation", ["cpu", "gpu"])
@pytest.mark.parametrize("adamw", [False, True])
def test_gpu_path_matches_cpu_torch_adam(grad_accumulation: str, adamw: bool) -> None:
    """bf16 working weights on the GPU; the fp32 masters must equal, bit for bit, a CPU
    torch.optim.Adam(W)(fused=True) fed the same fp32-accumulated gradients of an identical
    bf16 GPU model, and stay close (bf16 tolerance) to a pure fp32 reference."""
    opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    t = twins(seed=6, n=4, micro=3, opt_cls=opt_cls)
    fp32_ref, ours, data = t.ref, t.ours, t.data
    masters = copy.deepcopy(t.base)  # fp32 on CPU: the reference masters
    twin = copy.deepcopy(t.base).cuda().to(torch.bfloat16)  # computes the reference gradients
    ref_opt = opt_cls(make_groups(masters), lr=1e-2, fused=True)

    opt = CPUOffloadAdam(
        make_groups(ours), lr=1e-2, adamw=adamw, device="cuda",
        grad_accumulation=grad_accumulation, bucket_numel=100,
    )  # fmt: skip
    for step in data:
        acc = [None] * len(list(twin.parameters()))
        for i, (x, y) in enumerate(step):
            x, y = x.cuda(), y.cuda()
            opt.backward(loss_fn(ours, x, y, len(step)), final=i == len(step) - 1)
            twin.zero_grad(set_to_none=True)
            loss_fn(twin, x, y, len(step)).backward()
            for k, p in enumerate(twin.parameters()):
                if p.grad is not None:
                    g = p.grad.float().cpu()
                    acc[k] = g if acc[k] is None else acc[k] + g
        opt.step()
        for p, g in zip(masters.parameters(), acc, strict=True):
            p.grad = g
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for t, m in zip(twin.parameters(), masters.parameters(), strict=True):
                t.copy_(m)
    torch.cuda.synchronize()
    for m_ours, m_ref, w, f in zip(
        masters_in_model_order(opt, ours),
        masters.parameters(),
        ours.parameters(),
        fp32_ref.parameters(),
        strict=True,
    ):
        assert torch.equal(m_ours, m_ref.detach())
        assert w.device.type == "cuda" and w.dtype == torch.bfloat16
        assert torch.equal(w.cpu(), m_ours.to(torch.bfloat16))
        torch.testing.assert_close(m_ours, f.detach(), rtol=2e-2, atol=2e-2)
    opt.close()


def _int8_twins_on_gpu(grad_accumulation: str, scale: float | None, steps: int = 4) -> tuple:
    """TinyNet trained on the GPU (bf16 working weights) by int8 CPUOffloadAdam with the update
    on the host and on the device; returns both optimizers, both models and the fp32 reference."""
    t = twins(seed=6, n=steps, micro=3)
    models, opts = [t.ours, copy.deepcopy(t.base)], []
    for model, update_on in zip(models, ("host", "device"), strict=True):
        opt = CPUOffloadAdam(
            make_groups(model), lr=1e-2, device="cuda", moments="int8", update_on=update_on,
            grad_accumulation=grad_accumulation, bucket_numel=100,
        )  # fmt: skip
        for step in t.data:
            for i, (x, y) in enumerate(step):
                loss = loss_fn(model, x.cuda(), y.cuda(), len(step))
                opt.backward(loss, final=i == len(step) - 1, scale=scale)
            opt.step()
        opts.append(opt)
    torch.cuda.synchronize()
    return opts, models, t.ref


@pytest.mark.gpu
@pytest.mark.parametrize("grad_accumulation", ["cpu", "gpu"])
@pytest.mark.parametrize("scale", [None, 1024.0])
def test_int8_device_update_on_gpu_matches_the_host_update(
    grad_accumulation: str, scale: float | None
) -> None:
    """The CUDA path of update_on="device" against the host path: the kernels differ only in
    the fused Adam's rounding (CUDA vs CPU), so masters agree to float tolerance (a moment code
    flipped at a rounding boundary moves an update by ~1% of lr = 1e-4), the working weights are
    exactly the masters cast to bf16, and both stay near the fp32 torch.optim.Adam run."""
    (host, device), (host_model, device_model), fp32_ref = _int8_twins_on_gpu(
        grad_accumulation, scale
    )
    pairs = zip(
        masters_in_model_order(host, host_model),
        masters_in_model_order(device, device_model),
        device_model.parameters(),
        fp32_ref.parameters(),
        strict=True,
    )
    for m_host, m_device, w, f in pairs:
        torch.testing.assert_close(m_device, m_host, rtol=1e-3, atol=1e-3)
        assert w.device.type == "cuda" and w.dtype == torch.bfloat16
        assert torch.equal(w.cpu(), m_device.to(torch.bfloat16))
        torch.testing.assert_close(m_device, f.detach(), rtol=2e-2, atol=2e-2)
    host_state, device_state = host.state_dict()["state"], device.state_dict()["state"]
    for idx, entry in host_state.items():
        assert torch.equal(device_state[idx]["step"], entry["step"])
        same = device_state[idx]["exp_avg_sq_codes"] == entry["exp_avg_sq_codes"]
        assert same.float().mean() > 0.95
    host.close()
    device.close()


@pytest.mark.gpu
def test_int8_device_update_scratch_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak device memory of step() over what was allocated before it: at most
    DEVICE_BUCKETS_IN_FLIGHT buckets of scratch (fp32 masters + two code buffers + absmaxes +
    steps) plus one chunk's temporaries (~40 B per value), for 8 buckets of 2**20 values; all
    eight buckets at once would need about three times the bound."""
    monkeypatch.setattr(offload, "DEVICE_CHUNK_BLOCKS", 64)  # temporaries: 64 * 2048 values
    bucket = 2**20
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)])
    opt = CPUOffloadAdam(
        model.parameters(), device="cuda", moments="int8", update_on="device",
        bucket_numel=bucket,
    )  # fmt: skip
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # the second step runs with a warm allocator
        opt.backward(model(x).float().square().mean())  # final=False: every update in step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
    per_bucket = bucket * (4 + 2) + 2 * 4 * bucket // 2048
    bound = offload.DEVICE_BUCKETS_IN_FLIGHT * per_bucket + 40 * 64 * 2048 + 2**20
    assert extra <= bound, (extra, bound)
    assert 8 * per_bucket > 2.5 * bound
    opt.close()


@pytest.mark.gpu
def test_bf16_accumulator_on_gpu_tracks_the_fp32_one_within_batch_order_noise() -> None:
    """The level-3 configuration on the GPU (bf16 working weights, int8 moments updated on the
    device, gradients accumulated on the device): 300 steps of 4 micro-batches with a bf16
    accumulator against an fp32 one; noise: the fp32 one with another mini-batch order. The
    accumulator takes half the device bytes."""
    curves, accumulators = {}, {}
    for accumulator, order_seed in ((torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 1)):
        model = student()
        opt = CPUOffloadAdam(
            model.parameters(), lr=1e-3, device="cuda", moments="int8", update_on="device",
            grad_accumulation_dtype=accumulator,
        )  # fmt: skip
        curves[accumulator, order_seed] = train_curve(
            model, offload_update(opt), order_seed, micro=4, device="cuda"
        )
        accumulators[accumulator] = sum(b.gpu_acc.nbytes for b in opt._buckets)
        assert {b.gpu_acc.dtype for b in opt._buckets} == {accumulator}
        assert all(b.grad.numel() == 0 for b in opt._buckets)  # no host gradient buffer
        opt.close()
    assert accumulators[torch.bfloat16] * 2 == accumulators[torch.float32]
    assert_within_batch_order_noise(
        curves[torch.bfloat16, 0], curves[torch.float32, 0], curves[torch.float32, 1]
    )


# --------------------------------------------------------------------------- plan_offload
XL_PARAMS = 1_557_611_200  # GPT-2-XL, tied LM head counted once
XL_WTE = 50257 * 1600


def xl_numels() -> list[int]:
    """GPT-2-XL's parameter sizes in model order: embeddings, 48 blocks, final LayerNorm."""
    d = 1600
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [XL_WTE, 1024 * d, *block * 48, d, d]


def test_largest_buckets_give_big_tensors_their_own():
    assert offload.largest_buckets([XL_WTE, 1024 * 1600, 1600 * 6400, 3]) == [
        XL_WTE,
        offload.DEFAULT_BUCKET_NUMEL,
    ]
    assert offload.largest_buckets([5, 7], bucket_numel=6) == [7, 6]


def test_plan_of_int8_moments_updated_on_device_with_bf16_accumulator():
    """GPT-2-XL's level-3 state: fp32 masters and 8-bit moments on the host, nothing else there;
    the bf16 accumulator and the update's scratch on the GPU."""
    numels = xl_numels()
    assert sum(numels) == XL_PARAMS
    plan = offload.plan_offload(
        numels, grad_accumulation_dtype=torch.bfloat16, moments="int8", update_on="device"
    )
    rows = {b.state: b for b in plan.buffers}
    assert set(rows) == {"working_weights", "master_weights", "exp_avg", "exp_avg_sq",
                         "grad_accumulation", "device_update_scratch"}  # fmt: skip
    assert rows["exp_avg"].bytes == rows["exp_avg_sq"].bytes == quantized_nbytes(XL_PARAMS)
    assert (rows["grad_accumulation"].where, rows["grad_accumulation"].dtype) == ("gpu", "bf16")
    assert rows["grad_accumulation"].bytes == 2 * XL_PARAMS
    assert plan.bytes_on("host") == 4 * XL_PARAMS + 2 * quantized_nbytes(XL_PARAMS)
    scratch = offload.device_update_scratch_bytes(
        [XL_WTE, offload.DEFAULT_BUCKET_NUMEL], "gpu", torch.bfloat16
    )
    assert plan.optimizer_gpu_bytes() == {
        "grad_accumulation": 2 * XL_PARAMS,
        "device_update_scratch": scratch,
    }
    chunk = offload.DEVICE_CHUNK_BLOCKS * BLOCK_SIZE
    fp32_acc = offload.device_update_scratch_bytes([XL_WTE, offload.DEFAULT_BUCKET_NUMEL])
    assert scratch - fp32_acc == 4 * chunk  # the bf16 chunk read as fp32
    assert plan.records()[0] == {
        "state": "working_weights", "where": "gpu", "dtype": "bf16", "bytes": 2 * XL_PARAMS
    }  # fmt: skip


@pytest.mark.parametrize(
    ("options", "host_bytes_per_param", "gpu_rows"),
    [
        ({}, 4 + 4 + 4 + 4 + 2, {"grad_accumulation"}),  # masters, moments, grad, weight stage
        ({"grad_accumulation": "cpu"}, 4 + 4 + 4 + 4 + 2 + 2, set()),  # + grad stage
        ({"grad_accumulation_dtype": torch.bfloat16}, 4 + 4 + 4 + 2 + 2, {"grad_accumulation"}),
    ],
)
def test_plan_of_fp32_moments_on_the_host(options, host_bytes_per_param, gpu_rows):
    plan = offload.plan_offload(xl_numels(), **options)
    assert plan.bytes_on("host") == host_bytes_per_param * XL_PARAMS
    assert set(plan.optimizer_gpu_bytes()) == gpu_rows
    assert plan.bytes_on("gpu") == 2 * XL_PARAMS + sum(plan.optimizer_gpu_bytes().values())


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_plan_counts_the_host_buffers_the_optimizer_allocates(moments):
    """Parameters of whole quantization blocks, so alignment adds nothing: the planned masters
    and moments are the optimizer's own bytes."""
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False))
    numels = [p.numel() for p in model.parameters()]
    opt = CPUOffloadAdam(model.parameters(), device="cpu", moments=moments, bucket_numel=4096)
    rows = {b.state: b.bytes for b in offload.plan_offload(numels, moments=moments).buffers}
    assert rows["exp_avg"] + rows["exp_avg_sq"] == opt.moment_nbytes()
    assert rows["master_weights"] == sum(m.nbytes for m in opt.master_params())
    opt.close()
