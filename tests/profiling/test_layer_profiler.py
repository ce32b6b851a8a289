"""Profile and Schedule: the schedule against torch.profiler's, well-formed spans, recorded steps,
clean removal, the trace-event format, measured times; on a GPU, torch.profiler's kernel times
and the profiler's own overhead."""

from __future__ import annotations

import copy
import io
import itertools
import json
import statistics
import time
import warnings
import weakref
from collections import Counter

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerAction, profile, schedule

from effdl.profiling.kernel_split import launched_kernel_us
from effdl.profiling.layer_profiler import Phase, Profile, Schedule, Span
from effdl.profiling.timing import RegionTimer

TORCH_PHASE = {
    ProfilerAction.NONE: Phase.NONE,
    ProfilerAction.WARMUP: Phase.WARMUP,
    ProfilerAction.RECORD: Phase.RECORD,
    ProfilerAction.RECORD_AND_SAVE: Phase.RECORD,
}


class Block(nn.Module):
    """Attention-like siblings reading one input, then a residual feed-forward container."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.softmax = nn.Softmax(dim=-1)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.softmax(self.q(h) @ self.k(h).T) @ self.v(h)
        return x + self.ff(x)


class Net(nn.Module):
    """Nested containers, and ``shared`` called twice per forward."""

    def __init__(self, d_in: int = 12, d: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embed(x))
        return self.head(self.shared(torch.relu(self.shared(x))))


def train_steps(model: nn.Module, prof: Profile | None, steps: int, x: torch.Tensor) -> None:
    for _ in range(steps):
        model(x).square().mean().backward()
        if prof is not None:
            prof.step()


def parent_path(path: str, root: str = "model") -> str:
    return path.rsplit(".", 1)[0] if "." in path else root


def assert_nested(track: list[Span]) -> None:
    """Laminar (any two spans disjoint or one holding the other), each inside a parent's span."""
    stack: list[Span] = []
    for s in sorted(track, key=lambda s: (s.start_ns, -s.end_ns)):
        while stack and stack[-1].end_ns <= s.start_ns:
            stack.pop()
        assert not stack or s.end_ns <= stack[-1].end_ns, (stack[-1], s)
        stack.append(s)
    for s in track:
        if s.path != "model":
            parents = [p for p in track if p.path == parent_path(s.path)]
            assert any(p.start_ns <= s.start_ns and s.end_ns <= p.end_ns for p in parents), s


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(8, 12, generator=torch.Generator().manual_seed(1))


# -- Schedule --------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_schedule_matches_torch_profiler_schedule() -> None:
    for wait, warmup, active, repeat, skip_first in itertools.product(
        range(3), range(3), range(1, 4), range(3), range(3)
    ):
        ours = Schedule(wait, warmup, active, repeat, skip_first)
        ref = schedule(
            wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first
        )
        got = [ours.phase(s) for s in range(40)]
        assert got == [TORCH_PHASE[ref(s)] for s in range(40)], ours


@pytest.mark.parametrize(
    "args",
    [(-1, 1, 1, 0, 0), (0, -1, 1, 0, 0), (0, 0, 0, 0, 0), (0, 0, 1, -1, 0), (0, 0, 1, 0, -1)],
)
def test_schedule_rejects_what_torch_rejects(args: tuple[int, ...]) -> None:
    names = ("wait", "warmup", "active", "repeat", "skip_first")
    with pytest.raises(AssertionError):
        schedule(**dict(zip(names, args, strict=True)))
    with pytest.raises(ValueError, match="active >= 1"):
        Schedule(*args)


@pytest.mark.parametrize(
    "args", [(0, 0, 1.5), (0, 0, float("nan")), (0, float("inf"), 1), (True, 0, 1)]
)
def test_schedule_rejects_counts_that_are_not_whole_numbers(args: tuple) -> None:
    with pytest.raises(ValueError, match="whole numbers of steps"):
        Schedule(*args)


def test_schedule_rejects_a_negative_step() -> None:
    with pytest.raises(ValueError, match="step must be >= 0"):
        Schedule(0, 0, 1).phase(-1)


# -- spans -----------------------------------------------------------------------------------


def test_labels_leaves_by_class_others_by_path_and_class(net: Net, x: torch.Tensor) -> None:
    with Profile(net) as prof:
        train_steps(net, prof, 1, x)
    labels = {r["path"]: r["module"] for r in prof.records()}
    assert labels["model"] == "model: Net"
    assert labels["blocks"] == "blocks: Sequential"
    assert labels["blocks.0.ff"] == "blocks.0.ff: Sequential"
    assert labels["blocks.0.ff.1"] == "GELU"
    assert labels["blocks.1.q"] == "Linear"
    assert len(labels) == len(list(net.modules()))


def test_spans_nest_inside_their_parent_modules_spans(net: Net, x: torch.Tensor) -> None:
    with Profile(net) as prof:
        train_steps(net, prof, 2, x)
    spans = [s for s in prof.spans() if s.kind != "step"]
    by_track: dict[tuple[str, int], list[Span]] = {}
    for s in spans:
        by_track.setdefault((s.kind, s.step), []).append(s)
    for (kind, _), track in by_track.items():
        assert {s.path for s in track} == {r["path"] for r in prof.records()}, kind
        assert_nested(track)


def test_a_module_called_twice_gets_a_span_per_call(net: Net, x: torch.Tensor) -> None:
    with Profile(net) as prof:
        train_steps(net, prof, 3, x)
    rows = {r["path"]: r for r in prof.records()}
    assert (rows["shared"]["calls"], rows["shared"]["bwd_calls"]) == (6, 6)
    assert (rows["head"]["calls"], rows["head"]["bwd_calls"]) == (3, 3)


@pytest.mark.parametrize(
    "sched", [Schedule(wait=1, warmup=1, active=2, repeat=2, skip_first=1), Schedule(0, 0, 1), None]
)
def test_only_record_steps_are_kept(net: Net, x: torch.Tensor, sched: Schedule | None) -> None:
    n = 13
    with Profile(net, schedule=sched) as prof:
        train_steps(net, prof, n, x)
    recorded = [k for k in range(n) if sched is None or sched.phase(k) is Phase.RECORD]
    spans = prof.spans()
    assert [s.step for s in spans if s.kind == "step"] == recorded
    assert {s.step for s in spans} == set(recorded)
    rows = {r["path"]: r for r in prof.records()}
    assert rows["head"]["calls"] == rows["head"]["bwd_calls"] == len(recorded)
    assert len(prof.step_times_ms()) == len(recorded)


def test_a_block_without_step_calls_is_one_step(net: Net, x: torch.Tensor) -> None:
    with Profile(net) as prof:
        net(x).sum().backward()
    rows = {r["path"]: r for r in prof.records()}
    assert len(prof.step_times_ms()) == 1 and rows["model"]["calls"] == 1
    assert 0 < rows["model"]["step_pct"] <= 100


def test_no_grad_forward_has_no_backward_spans(net: Net, x: torch.Tensor) -> None:
    with Profile(net) as prof, torch.no_grad():
        net(x)
        prof.step()
    rows = prof.records()
    assert all(r["bwd_calls"] == 0 and r["bwd_mean_ms"] is None for r in rows)
    assert {r["path"]: r["calls"] for r in rows}["shared"] == 2


def test_hooks_are_removed_and_results_unchanged(net: Net, x: torch.Tensor) -> None:
    ref = copy.deepcopy(net)
    user_hook = net.head.register_forward_hook(lambda *_: None)
    with Profile(net) as prof:
        out = net(x)
        out.square().mean().backward()
        prof.step()
    ref_out = ref(x)
    ref_out.square().mean().backward()
    assert torch.equal(out, ref_out)
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert list(net.head._forward_hooks) == [user_hook.id]  # the user's hook stays
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.save warns of a tensor hook left on a parameter
        torch.save(list(net.parameters()), io.BytesIO())
    user_hook.remove()
    for m in net.modules():
        hooks = (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks)
        assert all(len(h) == 0 for h in hooks) and m._is_full_backward_hook is None


def test_a_profile_records_one_block(net: Net) -> None:
    prof = Profile(net)
    with pytest.raises(RuntimeError, match="outside"):
        prof.step()
    with prof:
        pass
    with pytest.raises(RuntimeError, match="one `with` block"), prof:
        pass


class ResidualBlock(nn.Module):
    """torchvision's BasicBlock pattern: in-place ReLUs and an in-place residual add on the
    output of a child, which full backward hooks refuse."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.fc1(x))
        out = self.fc2(out)
        out += x
        return self.relu(out)


class TwoHeads(nn.Module):
    """A module with a tuple output and an identity child returning its input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b, self.same = nn.Linear(d, d), nn.Linear(d, d), nn.Identity()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(self.same(x))


class InPlaceNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.Sequential(ResidualBlock(d), ResidualBlock(d))
        self.heads = TwoHeads(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.heads(self.blocks(self.embed(x)))
        return a * b


def test_in_place_residuals_and_tuple_outputs_nest_and_keep_results() -> None:
    torch.manual_seed(0)
    model, x = InPlaceNet(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    with Profile(model) as prof:
        out = model(x)
        out.square().mean().backward()
        prof.step()
    ref_out = ref(x)
    ref_out.square().mean().backward()
    assert torch.equal(out, ref_out)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    rows = {r["path"]: r for r in prof.records()}
    assert (rows["blocks.0.relu"]["calls"], rows["blocks.0.relu"]["bwd_calls"]) == (2, 2)
    assert all(r["bwd_calls"] == r["calls"] for r in rows.values()), rows
    for kind in ("forward", "backward"):
        assert_nested([s for s in prof.spans() if s.kind == kind])
    # A residual block's backward holds both of its Linears' backwards.
    bwd = {s.path: s for s in prof.spans() if s.kind == "backward" and "relu" not in s.path}
    for child in ("blocks.0.fc1", "blocks.0.fc2"):
        assert bwd["blocks.0"].start_ns <= bwd[child].start_ns <= bwd[child].end_ns
        assert bwd[child].end_ns <= bwd["blocks.0"].end_ns


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_max_depth_hooks_only_modules_that_deep(net: Net, x: torch.Tensor, depth: int) -> None:
    """The same spans as a full profile's for the modules kept, and none for deeper ones."""
    expected = {
        p or "model" for p, _ in net.named_modules() if (p.count(".") + 1 if p else 0) <= depth
    }
    with Profile(net, max_depth=depth) as prof:
        train_steps(net, prof, 2, x)
    rows = {r["path"]: r for r in prof.records()}
    assert set(rows) == expected
    with Profile(net) as full:
        train_steps(net, full, 2, x)
    full_rows = {r["path"]: r for r in full.records()}
    for path, row in rows.items():
        assert (row["calls"], row["bwd_calls"]) == (
            full_rows[path]["calls"],
            full_rows[path]["bwd_calls"],
        )


def test_max_depth_must_not_be_negative(net: Net) -> None:
    with pytest.raises(ValueError, match="max_depth"):
        Profile(net, max_depth=-1)


def test_sample_every_hooks_each_module_in_its_share_of_steps(net: Net, x: torch.Tensor) -> None:
    """Module k (model order) is hooked in the steps numbered k modulo n, with the spans a full
    profile gives it there, and no others."""
    n, steps = 3, 6
    with Profile(net, sample_every=n) as prof:
        train_steps(net, prof, steps, x)
    with Profile(net) as full:
        train_steps(net, full, steps, x)
    paths = [p or "model" for p, _ in net.named_modules()]
    expected = {(p, s.step, s.kind) for s in full.spans() if s.kind != "step"
                for k, p in enumerate(paths) if p == s.path and s.step % n == k % n}  # fmt: skip
    assert {(s.path, s.step, s.kind) for s in prof.spans() if s.kind != "step"} == expected
    rows, full_rows = ({r["path"]: r for r in p.records()} for p in (prof, full))
    for path in paths:
        assert rows[path]["calls"] * n == full_rows[path]["calls"], path
        assert rows[path]["bwd_calls"] * n == full_rows[path]["bwd_calls"], path
    assert len(prof.step_times_ms()) == steps


def test_sample_every_with_a_schedule_rotates_over_recorded_steps(
    net: Net, x: torch.Tensor
) -> None:
    """Recorded steps alternate with idle and warm-up ones; every share of the modules is
    still recorded, in turn, and a warm-up step hooks the share recorded after it."""
    n = 2
    sched = Schedule(wait=1, warmup=1, active=1)
    with Profile(net, schedule=sched, sample_every=n) as prof:
        train_steps(net, prof, 3 * 2 * n, x)  # 2n cycles: each share recorded twice
    paths = [p or "model" for p, _ in net.named_modules()]
    recorded = sorted({s.step for s in prof.spans() if s.kind == "step"})
    assert recorded == [2, 5, 8, 11]
    for turn, step in enumerate(recorded):
        hooked = {s.path for s in prof.spans() if s.step == step and s.kind == "forward"}
        assert hooked == {p for k, p in enumerate(paths) if k % n == turn % n}, step


def test_sample_every_must_be_positive(net: Net) -> None:
    with pytest.raises(ValueError, match="sample_every"):
        Profile(net, sample_every=0)


def test_hooks_are_on_only_in_warmup_and_record_steps(net: Net, x: torch.Tensor) -> None:
    sched = Schedule(wait=1, warmup=1, active=1, repeat=1)
    with Profile(net, schedule=sched) as prof:
        hooked, losses = [], []
        for _ in range(4):
            hooked.append(len(net.head._forward_hooks) > 0)
            losses.append(net(x).square().mean())
            losses[-1].backward(retain_graph=True)
            prof.step()
    assert hooked == [False, True, True, False]
    assert [s.step for s in prof.spans() if s.kind == "step"] == [2]
    losses[2].backward()  # the recorded graph's hooks outlive the block, and do nothing
    assert {s.step for s in prof.spans()} == {2}


def test_a_parent_returning_its_childs_output_shares_its_start_and_holds_no_graph() -> None:
    """The model's backward starts with the stamp of its last layer (whose output it returns),
    and once the forward has returned the profile holds none of the graph: a forward whose
    output is dropped frees its activations."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(2, 4)
    hidden: list[weakref.ref] = []
    model[0].register_forward_hook(lambda _m, _a, out: hidden.append(weakref.ref(out)))
    with Profile(model) as prof:
        model(x).sum().backward()
        prof.step()
        out = model(x)
        assert hidden[-1]() is not None  # saved for the second layer's backward
        del out
        assert hidden[-1]() is None
    bwd = {s.path: s for s in prof.spans() if s.kind == "backward"}
    assert bwd["model"].start_ns == bwd["1"].start_ns
    assert bwd["model"].end_ns >= bwd["0"].end_ns >= bwd["1"].end_ns


def test_a_second_backward_through_the_graph_gets_its_own_spans(net: Net, x: torch.Tensor) -> None:
    with Profile(net) as prof:
        loss = net(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        prof.step()
    rows = {r["path"]: r for r in prof.records()}
    assert (rows["head"]["calls"], rows["head"]["bwd_calls"]) == (1, 2)
    assert (rows["shared"]["calls"], rows["shared"]["bwd_calls"]) == (2, 4)
    # The model and its first layer get no input gradient: each pass still closes their spans.
    assert (rows["model"]["calls"], rows["model"]["bwd_calls"]) == (1, 2)
    assert (rows["embed"]["calls"], rows["embed"]["bwd_calls"]) == (1, 2)
    bwd = sorted((s for s in prof.spans() if s.path == "model" and s.kind == "backward"),
                 key=lambda s: s.start_ns)  # fmt: skip
    assert bwd[0].end_ns <= bwd[1].start_ns


def backward_spans(prof: Profile, path: str) -> list[Span]:
    return sorted(
        (s for s in prof.spans() if s.path == path and s.kind == "backward"),
        key=lambda s: s.start_ns,
    )


def forward_spans(prof: Profile, path: str) -> list[Span]:
    return sorted(
        (s for s in prof.spans() if s.path == path and s.kind == "forward"),
        key=lambda s: s.start_ns,
    )


def test_each_accumulated_micro_batch_closes_its_spans_before_the_next_forward(
    net: Net, x: torch.Tensor
) -> None:
    """Spans of calls whose inputs get no gradient (the model, its first layer) end with their
    own backward pass: before the next micro-batch's forward, nested as usual."""
    with Profile(net) as prof:
        for _ in range(2):
            for _ in range(3):
                net(x).square().mean().backward()
            prof.step()
    rows = {r["path"]: r for r in prof.records()}
    assert all(r["calls"] == r["bwd_calls"] for r in rows.values()), rows
    fwd, bwd = forward_spans(prof, "model"), backward_spans(prof, "model")
    assert len(fwd) == len(bwd) == 6
    for k in range(5):
        assert fwd[k].end_ns <= bwd[k].start_ns <= bwd[k].end_ns <= fwd[k + 1].start_ns, k
    embed = backward_spans(prof, "embed")
    assert all(
        b.start_ns <= e.start_ns <= e.end_ns <= b.end_ns for b, e in zip(bwd, embed, strict=True)
    )
    for step in (0, 1):
        assert_nested([s for s in prof.spans() if s.kind == "backward" and s.step == step])


def test_backward_passes_of_two_forwards_close_their_own_spans(net: Net, x: torch.Tensor) -> None:
    """Two forwards, then the two backwards: the first pass's spans end before the second's
    begin."""
    with Profile(net) as prof:
        first, second = net(x).square().mean(), net(2 * x).square().mean()
        first.backward()
        second.backward()
        prof.step()
    bwd = backward_spans(prof, "model")
    assert len(bwd) == 2 and bwd[0].end_ns <= bwd[1].start_ns
    heads = backward_spans(prof, "head")
    assert bwd[0].start_ns <= heads[0].start_ns and heads[1].end_ns <= bwd[1].end_ns


class IgnoresInputGradient(nn.Module):
    """Uses its input (which requires grad) only without grad: no gradient reaches it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.detach())


def test_a_call_whose_input_gets_no_gradient_holds_its_weight_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), IgnoresInputGradient(4), nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    with Profile(model) as prof:
        train_steps(model, prof, 2, x)
        model(x).sum().backward()
    rows = {r["path"]: r for r in prof.records()}
    assert rows.pop("0")["bwd_calls"] == 0  # its output gets no gradient either
    assert all(r["calls"] == r["bwd_calls"] == 3 for r in rows.values()), rows
    for step in range(3):
        spans = [s for s in prof.spans() if s.kind == "backward" and s.step == step]
        assert_nested(spans)
        bwd = {s.path: s for s in spans}
        assert bwd["1"].start_ns <= bwd["1.linear"].start_ns <= bwd["1.linear"].end_ns
        assert bwd["1.linear"].end_ns <= bwd["1"].end_ns <= bwd["model"].end_ns


class Checkpointed(nn.Module):
    def __init__(self, module: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.module, self.reentrant = module, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.module, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_blocks_keep_every_span_nested(reentrant: bool) -> None:
    """Recomputed forwards (and the reentrant variant's nested backward passes) inside the
    backward end no span early."""
    torch.manual_seed(0)

    def block() -> nn.Module:
        return Checkpointed(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)), reentrant)

    model = nn.Sequential(nn.Linear(4, 4), block(), block(), nn.Linear(4, 4))
    with Profile(model) as prof:
        train_steps(model, prof, 2, torch.randn(2, 4))
    rows = {r["path"]: r for r in prof.records()}
    assert (rows["model"]["calls"], rows["model"]["bwd_calls"]) == (2, 2)
    assert (rows["1.module"]["calls"], rows["1.module"]["bwd_calls"]) == (4, 2)
    for step in (0, 1):
        spans = [s for s in prof.spans() if s.kind == "backward" and s.step == step]
        assert_nested(spans)
        bwd = {s.path: s for s in spans}
        assert max(s.end_ns for s in spans) == bwd["model"].end_ns == bwd["0"].end_ns


class InPlaceOnAView(nn.Module):
    """An in-place child called on a slice of a tensor: the child's input is a view."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.relu = nn.Linear(d, 2 * d), nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        d = x.shape[1]
        return self.relu(h[:, :d]) + h[:, d:]


def test_an_in_place_module_on_a_view_ends_after_its_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), InPlaceOnAView(4), nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4, requires_grad=True)
    with Profile(model) as prof:
        model(x).sum().backward()
        prof.step()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    rows = {r["path"]: r for r in prof.records()}
    assert all(r["calls"] == r["bwd_calls"] == 1 for r in rows.values()), rows
    spans = [s for s in prof.spans() if s.kind == "backward"]
    assert_nested(spans)
    bwd = {s.path: s for s in spans}
    assert bwd["1.relu"].end_ns <= bwd["1.fc"].start_ns  # the ReLU's backward comes first


class HooksItsOutput(nn.Module):
    """Doubles its input and hooks the result, as user code may."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        out.register_hook(lambda _grad: self.seen.append("own"))
        return out


def test_outputs_take_user_hooks_and_save_without_hook_warnings(tmp_path) -> None:
    """The profile's hooks sit in the tensors' hook dicts: hooks a user registers on a module's
    output, before or after them, run (and are removed), and ``torch.save`` of an output
    raises no warning about them."""
    torch.manual_seed(0)
    seen: list[str] = []
    model = nn.Sequential(nn.Linear(4, 4), HooksItsOutput(seen), nn.Linear(4, 4))
    with Profile(model) as prof, warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(torch.randn(2, 4))
        torch.save(out, tmp_path / "out.pt")
        out.register_hook(lambda _grad: seen.append("user"))
        out.register_hook(lambda _grad: seen.append("removed")).remove()
        out.sum().backward()
        prof.step()
    assert seen == ["user", "own"]
    rows = prof.records()
    assert all(r["calls"] == r["bwd_calls"] == 1 for r in rows), rows


# -- measured times --------------------------------------------------------------------------


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class Sleepy(nn.Module):
    """A Linear whose forward sleeps ``fwd_s`` and whose backward sleeps ``bwd_s``."""

    def __init__(self, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.fwd_s)
        return SleepInBackward.apply(self.linear(x), self.bwd_s)


MARGIN_MS = 100  # sleeps overshoot on a loaded machine; the lower bound is exact


@pytest.mark.parametrize("first", [True, False], ids=["no-grad-input", "grad-input"])
def test_sleeps_are_measured(first: bool) -> None:
    """A sleep in forward and one in backward land in that module's spans and its parents'.
    As the first layer its input needs no grad: torch fires its backward hook early, and the
    span must still hold the backward sleep."""
    fwd_ms, bwd_ms = 20, 40
    layers = [Sleepy(fwd_ms / 1e3, bwd_ms / 1e3), nn.Linear(4, 4)]
    model = nn.Sequential(*(layers if first else layers[::-1]))
    sleepy = "0" if first else "1"
    with Profile(model) as prof:
        train_steps(model, prof, 2, torch.randn(2, 4))
    rows = {r["path"]: r for r in prof.records()}
    for path in (sleepy, "model"):
        assert fwd_ms <= rows[path]["fwd_mean_ms"] < fwd_ms + MARGIN_MS, path
        assert bwd_ms <= rows[path]["bwd_mean_ms"] < bwd_ms + MARGIN_MS, path
    assert all(fwd_ms + bwd_ms <= t < fwd_ms + bwd_ms + MARGIN_MS for t in prof.step_times_ms())
    assert prof.records()[0]["path"] == "model"  # slowest first
    assert 95 < rows["model"]["step_pct"] <= 100


def test_sample_every_step_share_counts_the_steps_a_module_was_hooked_in() -> None:
    """A module hooked in every other step, sleeping through most of each step, takes most of
    the steps it was timed in (not half of all steps)."""
    model = nn.Sequential(Sleepy(0.02, 0.0), nn.Linear(4, 4))  # model, 0, 0.linear, 1
    with Profile(model, sample_every=2) as prof:
        train_steps(model, prof, 4, torch.randn(2, 4))
    rows = {r["path"]: r for r in prof.records()}
    assert (rows["model"]["calls"], rows["0"]["calls"]) == (2, 2)
    assert rows["model"]["step_pct"] > 90
    assert rows["0"]["step_pct"] > 90


def test_summary_table_lists_the_slowest_modules(net: Net, x: torch.Tensor) -> None:
    with Profile(net, name="net") as prof:
        train_steps(net, prof, 2, x)
    lines = prof.summary(top=3).splitlines()
    assert lines[0].startswith("net: 2 recorded steps") and "host clock" in lines[0]
    assert len(lines) == 1 + 2 + 3  # heading, column names and rule, 3 rows
    assert "net: Net" in lines[3]
    totals = [r["fwd_total_ms"] + r["bwd_total_ms"] for r in prof.records()]
    assert totals == sorted(totals, reverse=True)


class FakeCuda:
    """Stand-ins for CUDA events on the host clock that count synchronizes and catch an event
    read before one."""

    def __init__(self) -> None:
        self.syncs = 0
        self.records = 0

    def event(self, device: torch.device, enable_timing: bool) -> object:
        cuda = self
        assert device.type == "cuda" and enable_timing

        class Event:
            def record(self, stream: object = None) -> None:
                assert stream in (None, "current stream")  # None: the current stream
                cuda.records += 1
                self.ns = time.perf_counter_ns()

            def elapsed_time(self, end: Event) -> float:
                assert cuda.syncs > 0, "an event read before a synchronize"
                return (end.ns - self.ns) / 1e6

        return Event()

    def synchronize(self, device: torch.device) -> None:
        self.syncs += 1


def test_cuda_events_of_warmup_steps_are_reused_once_each(
    net: Net, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stamps shared by several spans go back to the pool once: an event handed out twice
    would time two moments with one (the first overwritten, spans of negative length)."""
    fake = FakeCuda()
    monkeypatch.setattr(torch, "Event", fake.event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: "current stream")
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    with Profile(net, device="cuda", schedule=Schedule(wait=0, warmup=2, active=2)) as prof:
        train_steps(net, prof, 4, x)
        pool = prof._clock._free
        assert len({id(e) for e in pool}) == len(pool)
    reference = Profile(net)
    with reference:
        train_steps(net, reference, 2, x)
    spans = prof.spans()
    assert all(s.dur_ns >= 0 for s in spans)
    assert Counter((s.path, s.kind) for s in spans) == Counter(
        (s.path, s.kind) for s in reference.spans()
    )


def test_cuda_stamps_sync_once_when_read_never_in_hooks(
    net: Net, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeCuda()
    monkeypatch.setattr(torch, "Event", fake.event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: "current stream")
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    with Profile(net, device="cuda") as prof:
        train_steps(net, prof, 2, x)
    assert fake.syncs == 0 and fake.records > 4 * len(list(net.modules()))
    spans = prof.spans()
    assert fake.syncs == 1
    assert all(s.dur_ns >= 0 for s in spans) and len(prof.step_times_ms()) == 2
    assert "CUDA events" in prof.summary().splitlines()[0]


# -- Perfetto --------------------------------------------------------------------------------

X_KEYS = {"name": str, "cat": str, "ph": str, "ts": float, "dur": float, "pid": int, "tid": int}


def test_trace_is_valid_trace_event_json(net: Net, x: torch.Tensor, tmp_path) -> None:
    with Profile(net, schedule=Schedule(wait=0, warmup=1, active=2)) as prof:
        train_steps(net, prof, 3, x)
    path = prof.to_perfetto(tmp_path / "vit" / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["ph"] for e in events} == {"X", "M"}
    complete = [e for e in events if e["ph"] == "X"]
    for e in complete:
        assert all(isinstance(e[k], t) for k, t in X_KEYS.items()), e
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["cat"] in ("step", "forward", "backward")
    names = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name" and isinstance(e["args"]["name"], str)
    }
    assert {e["tid"] for e in complete} <= set(names)
    assert {names[e["tid"]] for e in complete} == {"step", "forward", "backward"}
    assert all(names[e["tid"]] == e["cat"] for e in complete)  # one track per direction
    rows = {r["path"]: r for r in prof.records()}
    for kind, key in (("forward", "calls"), ("backward", "bwd_calls")):
        counts: dict[str, int] = {}
        for e in complete:
            if e["cat"] == kind:
                counts[e["args"]["path"]] = counts.get(e["args"]["path"], 0) + 1
        assert counts == {p: r[key] for p, r in rows.items()}, kind
    assert sum(e["cat"] == "step" for e in complete) == 2


# -- GPU -------------------------------------------------------------------------------------


def cuda_train_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.gpu
def test_layer_times_match_torch_profiler_kernel_times() -> None:
    """Forward span of each large Linear vs the device time of its ``aten::linear``'s kernels,
    each counted once (the GPU-bound loop stalls on a full launch queue)."""
    torch.manual_seed(0)
    # Distinct weight shapes name the layers in torch.profiler's events; the first three are
    # large enough, even with TF32, that their kernels dwarf the hooks' host time.
    shapes = [(4096, 8192), (8192, 8192), (8192, 4096), (4096, 1024)]
    model = nn.Sequential(*(nn.Linear(i, o) for i, o in shapes)).cuda()
    x = torch.randn(8192, 4096, device="cuda")
    sched = dict(wait=1, warmup=1, active=4)

    with Profile(model, schedule=Schedule(**sched)) as prof:
        for _ in range(6):
            cuda_train_step(model, x)
            prof.step()
    ours = {s["path"]: s["fwd_mean_ms"] for s in prof.records()}

    with profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        schedule=schedule(**sched),
        record_shapes=True,
    ) as ref:
        for _ in range(6):
            cuda_train_step(model, x)
            ref.step()
    kernel_ms: dict[tuple[int, ...], list[float]] = {}
    for e in ref.events():
        if e.name == "aten::linear":
            kernel_ms.setdefault(tuple(e.input_shapes[1]), []).append(launched_kernel_us(e) / 1e3)

    compared = 0
    for index, (d_in, d_out) in enumerate(shapes):
        theirs = statistics.median(kernel_ms[(d_out, d_in)])
        if theirs > 1.0:
            compared += 1
            assert ours[str(index)] == pytest.approx(theirs, rel=0.10), (index, theirs)
    assert compared >= 3


@pytest.mark.gpu
def test_overhead_while_recording_is_within_5_percent() -> None:
    """Median step time with every module hooked and recorded vs the bare model, interleaved."""
    torch.manual_seed(0)
    d = 1024
    model = nn.Sequential(
        *(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            for _ in range(12)
        )
    ).cuda()
    x = torch.randn(4096, d, device="cuda")

    def timed_steps(prof: Profile | None, n: int = 5) -> list[float]:
        def step() -> None:
            cuda_train_step(model, x)
            if prof is not None:
                prof.step()

        step()  # warm-up, untimed
        timer = RegionTimer("cuda")
        for _ in range(n):
            with timer.region():
                step()
        return timer.times()

    bare: list[float] = []
    hooked: list[float] = []
    for _ in range(5):
        bare += timed_steps(None)
        with Profile(model) as prof:
            hooked += timed_steps(prof)
        assert len(prof.step_times_ms()) == 6
    overhead = statistics.median(hooked) / statistics.median(bare) - 1
    assert overhead <= 0.05, f"overhead {overhead:.1%}"
