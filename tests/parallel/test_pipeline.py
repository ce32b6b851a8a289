"""Pipeline schedules and their executor against single-process training (gloo, 4 processes).

Reference: the same float64 ``nn.Sequential`` built from the same seed in every rank and trained
in one process on the whole batch; the pipeline's stages are consecutive pieces of an identical
copy. After each optimizer step every rank's parameters must equal the reference's pieces to
float64 rounding (micro-batch gradients are summed in another order). The schedules themselves
are checked without processes: action counts and order, the data dependencies (``simulate``),
the activations held in flight, and the bubble against the closed-form fraction (lock-step and
timed simulations).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from effdl.parallel import spawn
from effdl.parallel.pipeline import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    Action,
    PipelineStage,
    accumulated_backward,
    bubble_fraction,
    gpipe_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
    simulate,
    simulate_seconds,
    split_sequential,
)

F64_TOL = {"rtol": 1e-10, "atol": 1e-12}
STAGES, WIDTH, CLASSES = 4, 6, 3


# -- schedules, without processes ------------------------------------------------------------


def peak_in_flight(actions: list[Action]) -> int:
    held, peak = 0, 0
    for a in actions:
        held += 1 if a.kind == FORWARD else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize(
    "name, chunks",
    [("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)],
)
@pytest.mark.parametrize("stages, micro_batches", [(4, 4), (4, 8), (4, 12), (2, 6)])
def test_each_forward_precedes_its_backward_once(name, chunks, stages, micro_batches):
    for rank in range(stages):
        actions = SCHEDULES[name](stages, micro_batches, rank, chunks)
        expected = {(i, c) for i in range(micro_batches) for c in range(chunks)}
        forwards = [(a.micro_batch, a.chunk) for a in actions if a.kind == FORWARD]
        backwards = [(a.micro_batch, a.chunk) for a in actions if a.kind == BACKWARD]
        assert sorted(forwards) == sorted(expected) and sorted(backwards) == sorted(expected)
        position = {(a.kind, a.micro_batch, a.chunk): k for k, a in enumerate(actions)}
        assert all(position[FORWARD, i, c] < position[BACKWARD, i, c] for i, c in expected)


@pytest.mark.parametrize("stages, micro_batches", [(4, 4), (4, 8), (4, 1000), (2, 3), (5, 7)])
def test_one_f_one_b_holds_at_most_stages_activations_and_gpipe_all(stages, micro_batches):
    for rank in range(stages):
        gpipe = gpipe_schedule(stages, micro_batches, rank)
        one_f_one_b = one_f_one_b_schedule(stages, micro_batches, rank)
        assert peak_in_flight(gpipe) == micro_batches
        assert peak_in_flight(one_f_one_b) == min(stages - rank, micro_batches)


@pytest.mark.parametrize(
    "name, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)]
)
@pytest.mark.parametrize("stages, micro_batches", [(4, 4), (4, 8), (4, 16), (2, 6)])
def test_simulated_bubble_equals_the_formula(name, chunks, stages, micro_batches):
    """Unit time per chunk action: the makespan is 2 (m + (S - 1) / v) stage-steps, so the idle
    share is (S - 1) / (v m + S - 1)."""
    rounds = simulate(SCHEDULES[name], stages, micro_batches, chunks)
    busy = 2 * micro_batches * chunks
    assert 1 - busy / rounds == pytest.approx(bubble_fraction(stages, micro_batches, chunks))


@pytest.mark.parametrize(
    "name, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)]
)
@pytest.mark.parametrize("stages, micro_batches", [(4, 4), (4, 16), (2, 6)])
@pytest.mark.parametrize("forward, backward", [(1.0, 1.0), (1.0, 2.0), (0.3, 0.7)])
def test_timed_simulation_with_equal_stages_gives_the_formula(
    name, chunks, stages, micro_batches, forward, backward
):
    """Equal stage times and free messages: the idle share is the formula's, whatever the
    forward and backward times."""
    makespan = simulate_seconds(
        SCHEDULES[name], stages, micro_batches, [forward] * stages, [backward] * stages, chunks
    )
    busy = micro_batches * chunks * (forward + backward)
    assert 1 - busy / makespan == pytest.approx(bubble_fraction(stages, micro_batches, chunks))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_timed_simulation_of_unequal_stages_and_messages(name):
    """S = 2, m = 2, rank 1 twice as slow, 0.5 per message, by hand: rank 1's forwards end at
    1.5 + 2 and 3.5 + 2 (GPipe) or its first backward at 3.5 + 4 (1F1B); its last backward ends
    at 13.5 either way, and rank 0's, which waits for it, at 13.5 + 0.5 + 2 = 16."""
    assert simulate_seconds(SCHEDULES[name], 2, 2, (1, 2), (2, 4), message_s=0.5) == 16.0


def test_timed_simulation_of_gpipe_with_a_slower_last_stage():
    """GPipe, S = 2, m = 8: the slower rank 1 paces both phases, so the step lasts
    F0 + 8 F1 + 8 B1 + B0."""
    makespan = simulate_seconds(SCHEDULES["gpipe"], 2, 8, (5.0, 6.0), (17.0, 19.0))
    assert makespan == pytest.approx(5 + 8 * 6 + 8 * 19 + 17)


def test_bubble_fraction_formula():
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert bubble_fraction(4, 29) == pytest.approx(0.09375)
    assert bubble_fraction(4, 8, chunks=2) == pytest.approx(3 / 19)


def test_simulate_reports_a_deadlock():
    def backwards_first(stages, micro_batches, rank, chunks=1):
        actions = one_f_one_b_schedule(stages, micro_batches, rank)
        return actions[::-1] if rank == 1 else actions

    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(backwards_first, 4, 4)
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate_seconds(backwards_first, 4, 4, [1.0] * 4, [1.0] * 4)


def test_schedules_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="multiple of the number of stages"):
        interleaved_schedule(4, 6, 0, 2)
    with pytest.raises(ValueError, match="one chunk per rank"):
        one_f_one_b_schedule(4, 8, 0, 2)


def test_split_sequential_cuts_consecutive_pieces():
    model = nn.Sequential(*[nn.Identity() for _ in range(9)])
    pieces = split_sequential(model, 4)
    assert [len(p) for p in pieces] == [2, 2, 3, 2]
    assert [m for p in pieces for m in p] == list(model)
    with pytest.raises(ValueError, match="cannot cut 9 layers into 10"):
        split_sequential(model, 10)


# -- the executor, 4 gloo processes ----------------------------------------------------------


def single_threaded() -> None:
    """One intra-op thread in a forked rank: if this test session ran a multi-threaded torch
    kernel before the fork, the child's OpenMP pool is unusable and a parallel kernel hangs."""
    torch.set_num_threads(1)


def build_model(pieces: int) -> nn.Sequential:
    """``pieces`` Linear+Tanh blocks and a classifier, float64, the same weights on every rank."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(pieces - 1)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, CLASSES)).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two steps, of 16 and 8 rows: the activation shapes change between runs."""
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, WIDTH, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (n,), generator=gen))
        for n in (16, 8)
    ]  # fmt: skip


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def train_against_reference(
    rank: int,
    world: int,
    schedule: str,
    chunks: int,
    micro_batches: int,
    optimizer: str,
    device: str = "cpu",
    post_ahead: bool | None = None,
) -> dict:
    """Two optimizer steps through the pipeline and in one process; this rank's parameters of
    both, the losses of both, the peak activations held in flight per step, and the recorded
    action timings of the last step. On CUDA, rank ``r`` uses GPU ``r % count`` (neighbouring
    stages on different GPUs)."""
    single_threaded()
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    reference = build_model(world * chunks).to(device)
    reference_opt = make_optimizer(optimizer, reference.parameters())
    pieces = split_sequential(build_model(world * chunks).to(device), world * chunks)
    mine = [pieces[c * world + rank] for c in range(chunks)]
    stage = PipelineStage(mine if chunks > 1 else mine[0], rank, world, post_ahead=post_ahead)
    opt = make_optimizer(optimizer, [p for piece in mine for p in piece.parameters()])
    out = {"loss": [], "reference_loss": [], "peak": []}
    for x, y in batches():
        x, y = x.to(device), y.to(device)
        reference_opt.zero_grad()
        loss = nn.functional.cross_entropy(reference(x), y)
        loss.backward()
        reference_opt.step()
        opt.zero_grad()
        out["loss"].append(stage.run(x, y, micro_batches, schedule, record_timings=True).item())
        opt.step()
        out["reference_loss"].append(loss.item())
        out["peak"].append(stage.last_stats.peak_in_flight)
    stats = stage.last_stats
    out["timings"] = [(t.action, t.start_s, t.end_s) for t in stats.timings], stats.wall_s
    reference_pieces = split_sequential(reference, world * chunks)
    out["params"] = [p.detach().cpu() for piece in mine for p in piece.parameters()]
    out["reference_params"] = [
        p.detach().cpu()
        for c in range(chunks)
        for p in reference_pieces[c * world + rank].parameters()
    ]
    return out


def assert_timings_follow(timings: tuple[list, float], actions: list) -> None:
    """One compute span per action, in the schedule's order, inside the run's wall time."""
    spans, wall_s = timings
    assert [action for action, _, _ in spans] == actions
    ends = [0.0]
    for _, start, end in spans:
        assert ends[-1] <= start <= end <= wall_s
        ends.append(end)


@pytest.mark.parametrize("post_ahead", [True, False], ids=["posted-ahead", "posted-in-place"])
@pytest.mark.parametrize(
    "schedule, chunks, micro_batches, optimizer",
    [("gpipe", 1, 8, "sgd"), ("1f1b", 1, 8, "adam"), ("interleaved", 2, 8, "sgd")],
)
def test_training_steps_equal_single_process_training(
    schedule, chunks, micro_batches, optimizer, post_ahead
):
    """Receives posted ahead (the CPU's default) and posted when their action runs (CUDA's)."""
    results = spawn(
        train_against_reference, STAGES, schedule, chunks, micro_batches, optimizer, "cpu",
        post_ahead,
    )  # fmt: skip
    for rank, got in enumerate(results):
        assert len(got["params"]) == len(got["reference_params"]) == 2 * chunks
        for p, q in zip(got["params"], got["reference_params"], strict=True):
            torch.testing.assert_close(p, q, **F64_TOL, msg=f"rank {rank}")
        assert got["loss"] == pytest.approx(got["reference_loss"], rel=1e-12)
        actions = SCHEDULES[schedule](STAGES, micro_batches, rank, chunks)
        assert got["peak"] == [peak_in_flight(actions)] * 2
        assert_timings_follow(got["timings"], actions)
    peaks = [got["peak"][0] for got in results]
    if schedule == "gpipe":
        assert peaks == [micro_batches] * STAGES
    if schedule == "1f1b":
        assert peaks == [STAGES - r for r in range(STAGES)]


def pending_sends(rank: int, world: int, micro_batch_counts: list[int]) -> list[int]:
    """Most sends outstanding at once on this rank, per 1F1B run of each micro-batch count."""
    single_threaded()
    stage = PipelineStage(split_sequential(build_model(world), world)[rank], rank, world)
    peaks = []
    for m in micro_batch_counts:
        x = torch.randn(2 * m, WIDTH, dtype=torch.float64)
        stage.run(x, torch.zeros(2 * m, dtype=torch.long), m, "1f1b")
        peaks.append(stage.last_stats.peak_pending_sends)
    return peaks


def test_one_f_one_b_outstanding_sends_do_not_grow_with_micro_batches():
    """Each send is waited once a later message proves it arrived (gloo reports a send complete
    only when waited), so buffers held for sends stay bounded, as the activations do."""
    for rank, (few, many) in enumerate(spawn(pending_sends, STAGES, [8, 64])):
        assert 0 < few == many <= 2 * STAGES, f"rank {rank}"


def refusals(rank: int, world: int) -> list[str]:
    """The error messages of misuse, in the order of ``test_misuse_is_refused_in_words``."""
    single_threaded()
    messages = []
    with pytest.raises(ValueError) as e:
        PipelineStage(nn.Linear(2, 2), (rank + 1) % world, world)
    messages.append(str(e.value))
    stage = PipelineStage(nn.Linear(2, 2), rank, world, loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError) as e:
        stage.run(torch.zeros(6, 2), torch.zeros(6, 2), 4)
    messages.append(str(e.value))
    for schedule, micro_batches in (("1F1B", 2), ("1f1b", 0)):
        with pytest.raises(ValueError) as e:
            stage.run(torch.zeros(6, 2), torch.zeros(6, 2), micro_batches, schedule)
        messages.append(str(e.value))
    with pytest.raises(ValueError) as e:
        PipelineStage(nn.ReLU(), rank, world)
    messages.append(str(e.value))
    dist.barrier()
    return messages


def test_misuse_is_refused_in_words():
    messages = spawn(refusals, 2)
    assert messages[0][0] == "stage 1 of 2 does not match the group: rank 0 of 2"
    assert messages[0][1] == "batch of 6 rows does not split into 4 equal parts"
    assert messages[1][1] == "target of 6 rows does not split into 4 equal parts"
    assert messages[0][2] == "schedule '1F1B' is not one of ['gpipe', '1f1b', 'interleaved']"
    assert messages[0][3] == "micro_batches must be >= 1, got 0"
    assert messages[0][4] == "stage 0 has no parameters to take its device from: pass device="


class Transposed(nn.Module):
    """A linear layer whose output is a transposed (non-contiguous) view."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).t().contiguous().t()


def frozen_and_strided_stages(rank: int, world: int) -> dict:
    """A 2-stage pipeline whose first stage is frozen and hands on a non-contiguous output:
    loss and the last stage's gradient beside the same model in one process."""
    single_threaded()
    torch.manual_seed(0)
    pieces = [Transposed(3, 4).requires_grad_(False).double(), nn.Linear(4, 2).double()]
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    stage = PipelineStage(pieces[rank], rank, world)
    loss = stage.run(x, y, 3, "1f1b").item()
    grad = pieces[1].weight.grad.clone() if rank == 1 else torch.zeros(())
    reference = nn.Sequential(*pieces)
    reference.zero_grad()
    ref_loss = accumulated_backward(reference, x, y, 3).item()
    ref_grad = pieces[1].weight.grad if rank == 1 else torch.zeros(())
    return {"loss": loss, "reference_loss": ref_loss, "grad": grad, "reference_grad": ref_grad}


def test_frozen_first_stage_and_non_contiguous_activations():
    for got in spawn(frozen_and_strided_stages, 2):
        assert got["loss"] == pytest.approx(got["reference_loss"], rel=1e-12)
        torch.testing.assert_close(got["grad"], got["reference_grad"])


@pytest.mark.parametrize(("rows", "parts"), [(12, 1), (12, 4), (10, 4)], ids=str)
def test_accumulated_backward_equals_whole_batch_gradients(rows, parts):
    # 10 rows in 4 parts: torch.chunk gives slices of 3, 3, 3 and 1, weighted by their rows
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = torch.randn(rows, 5, dtype=torch.float64), torch.randint(0, 3, (rows,))
    whole = nn.functional.cross_entropy(model(x), y)
    expected = torch.autograd.grad(whole, list(model.parameters()))
    loss = accumulated_backward(model, x, y, parts)
    torch.testing.assert_close(loss, whole.detach(), **F64_TOL)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, **F64_TOL)
