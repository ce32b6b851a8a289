"""Pipeline parallelism on ``torch.distributed`` point-to-point messages (GPipe, Huang et al.
2019; 1F1B, Narayanan et al. 2019; interleaved 1F1B, Narayanan et al. 2021).

A model cut into consecutive pieces runs as a pipeline over the ranks of a process group: rank
``r`` of ``S`` holds one piece (or ``v`` pieces, "chunks", for the interleaved schedule: chunk
``c`` of rank ``r`` is global stage ``c * S + r``). A batch is split into ``m`` equal
micro-batches along dim 0; activations go forward and their gradients backward with
``isend``/``irecv``; the last stage computes ``loss_fn(output, target) / m`` per micro-batch, so
the gradients accumulated over all micro-batches equal those of the whole-batch mean loss.

A schedule is a function giving each rank its list of :class:`Action` (forward or backward of
one micro-batch on one chunk); :class:`PipelineStage` executes any such list. Sends never block
(``isend``; each is waited only once a later message proves it was received: an activation
when its gradient comes back, a gradient when the previous rank's next forward arrives), a
rank blocks only on the receive of an input it needs, so a schedule runs without deadlock
when every rank's list respects the data dependencies (:func:`simulate` checks that without
processes), and 1F1B's memory stays bounded by the number of stages.

On the CPU, receives are posted ahead (``irecv``): on each link, the next input the schedule
will need is posted as soon as its buffer's shape is known, so gloo receives it in its
background thread while the rank computes. On CUDA a receive is posted when its action runs: a
receive posted ahead is a kernel that spins until its message comes, and any device-wide
synchronization meanwhile (CUDA's lazy loading of a kernel used for the first time, a
``cudaFree``) waits for it, while the peer that would send it may be waiting for this rank.

Each direction of each link (activations ``r -> r+1``, gradients ``r+1 -> r``) has its own
two-rank process group: messages in one group arrive in the order they were sent, and NCCL,
which runs the operations of one communicator in order on one stream, cannot deadlock on a send
waiting behind a receive of the opposite direction.

Shapes: each run, the first activation a chunk sends is preceded by a small header (dtype and
shape), so receivers allocate their buffers without being told, and shapes may change between
runs; every micro-batch of a run has the same shape (the batch must divide evenly).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from effdl.profiling.timeline import Timeline

Group = dist.ProcessGroup | None
Schedule = Callable[[int, int, int, int], list["Action"]]

FORWARD, BACKWARD = "F", "B"
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
_MAX_DIMS = 8


@dataclass(frozen=True)
class Action:
    """Forward (``"F"``) or backward (``"B"``) of micro-batch ``micro_batch`` on chunk ``chunk``
    of this rank."""

    kind: str
    micro_batch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


def gpipe_schedule(stages: int, micro_batches: int, rank: int, chunks: int = 1) -> list[Action]:
    """All forwards (chunk by chunk), then all backwards (last chunk first): every micro-batch's
    activations are alive at once, so memory grows with ``micro_batches``."""
    forwards = [Action(FORWARD, i, c) for c in range(chunks) for i in range(micro_batches)]
    backwards = [
        Action(BACKWARD, i, c) for c in reversed(range(chunks)) for i in range(micro_batches)
    ]
    return forwards + backwards


def one_f_one_b_schedule(
    stages: int, micro_batches: int, rank: int, chunks: int = 1
) -> list[Action]:
    """1F1B: ``stages - 1 - rank`` warm-up forwards, then alternate one forward and one backward,
    then the remaining backwards. A rank holds at most ``stages - rank`` micro-batches'
    activations, whatever ``micro_batches`` is; the bubble is GPipe's."""
    if chunks != 1:
        raise ValueError(f"1F1B runs one chunk per rank, got {chunks} (use interleaved)")
    warmup = min(stages - 1 - rank, micro_batches)
    actions = [Action(FORWARD, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
    return actions + [Action(BACKWARD, i) for i in range(micro_batches - warmup, micro_batches)]


def interleaved_schedule(
    stages: int, micro_batches: int, rank: int, chunks: int = 2
) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM): each rank holds ``chunks`` pieces; forwards go through
    groups of ``stages`` micro-batches chunk by chunk, backwards likewise from the last chunk.
    The warm-up, ``2 (stages - 1 - rank) + (chunks - 1) stages`` forwards, fills the pipeline;
    the bubble shrinks by ``chunks`` at the price of ``chunks`` times more messages.
    ``micro_batches`` must be a multiple of ``stages``."""
    if micro_batches % stages:
        raise ValueError(
            f"interleaved 1F1B needs micro_batches ({micro_batches}) to be a multiple of "
            f"the number of stages ({stages})"
        )
    total = micro_batches * chunks
    group = stages * chunks

    def unit(k: int, kind: str) -> Action:
        chunk = (k // stages) % chunks
        if kind == BACKWARD:
            chunk = chunks - 1 - chunk
        return Action(kind, (k // group) * stages + k % stages, chunk)

    warmup = min(2 * (stages - 1 - rank) + (chunks - 1) * stages, total)
    actions = [unit(k, FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [unit(warmup + k, FORWARD), unit(k, BACKWARD)]
    return actions + [unit(k, BACKWARD) for k in range(total - warmup, total)]


SCHEDULES: dict[str, Schedule] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "interleaved": interleaved_schedule,
}


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share of a GPipe or 1F1B step with equal stage times, ``(S - 1) / (m + S - 1)``;
    with ``chunks`` pieces per rank (interleaved), the fill and drain take ``1 / chunks`` of the
    time: ``(S - 1) / (chunks * m + S - 1)``."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def simulate(schedule: Schedule, stages: int, micro_batches: int, chunks: int = 1) -> int:
    """Run every rank's action list against the data dependencies, in lock-step rounds of one
    time unit per action, and return the number of rounds (the makespan). A forward needs the
    previous global stage's forward of the same micro-batch; a backward needs the next stage's
    backward (and its own forward). Raises RuntimeError when no rank can proceed (deadlock)."""
    lists = [schedule(stages, micro_batches, r, chunks) for r in range(stages)]
    last = stages * chunks - 1
    done: set[tuple[str, int, int]] = set()  # (kind, micro-batch, global stage)
    position = [0] * stages
    rounds = 0
    while any(p < len(a) for p, a in zip(position, lists, strict=True)):
        ready = []
        for r, actions in enumerate(lists):
            if position[r] == len(actions):
                continue
            a = actions[position[r]]
            g = a.chunk * stages + r
            if all(n in done for n in _needs(a, g, last)):
                ready.append((r, (a.kind, a.micro_batch, g)))
        if not ready:
            stuck = {r: lists[r][position[r]] for r in range(stages) if position[r] < len(lists[r])}
            raise RuntimeError(f"schedule deadlocks; next actions by rank: {stuck}")
        for r, key in ready:
            done.add(key)
            position[r] += 1
        rounds += 1
    return rounds


def _needs(action: Action, stage: int, last: int) -> list[tuple[str, int, int]]:
    """What ``action`` on global stage ``stage`` waits for, as (kind, micro-batch, stage): a
    forward the previous stage's forward, a backward its own forward and the next stage's
    backward."""
    if action.kind == FORWARD:
        return [] if stage == 0 else [(FORWARD, action.micro_batch, stage - 1)]
    needs = [(FORWARD, action.micro_batch, stage)]
    return needs + ([] if stage == last else [(BACKWARD, action.micro_batch, stage + 1)])


def simulate_seconds(
    schedule: Schedule,
    stages: int,
    micro_batches: int,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    chunks: int = 1,
    message_s: float = 0.0,
) -> float:
    """The makespan (seconds) of one step when each forward on rank ``r`` takes
    ``forward_s[r]``, each backward ``backward_s[r]`` (per chunk), and every message between
    ranks ``message_s``; each rank runs its actions in order, as soon as their inputs are there.
    With equal times and free messages the idle share ``1 - busy / makespan`` is
    :func:`bubble_fraction`; measured stage times give the bubble to expect from their
    imbalance. Raises RuntimeError on a deadlock, like :func:`simulate`."""
    lists = [schedule(stages, micro_batches, r, chunks) for r in range(stages)]
    last = stages * chunks - 1
    end: dict[tuple[str, int, int], float] = {}
    position, free = [0] * stages, [0.0] * stages
    while any(p < len(a) for p, a in zip(position, lists, strict=True)):
        progressed = False
        for r, actions in enumerate(lists):
            while position[r] < len(actions):
                a = actions[position[r]]
                g = a.chunk * stages + r
                needs = _needs(a, g, last)
                if not all(n in end for n in needs):
                    break
                arrivals = [end[n] + (message_s if n[2] != g else 0.0) for n in needs]
                took = forward_s[r] if a.kind == FORWARD else backward_s[r]
                free[r] = end[(a.kind, a.micro_batch, g)] = max([free[r], *arrivals]) + took
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: lists[r][position[r]] for r in range(stages) if position[r] < len(lists[r])}
            raise RuntimeError(f"schedule deadlocks; next actions by rank: {stuck}")
    return max(free)


@dataclass
class ActionTiming:
    """Compute time of one action (receives excluded), seconds since the run started."""

    action: Action
    start_s: float
    end_s: float


@dataclass
class RunStats:
    """What one :meth:`PipelineStage.run` did on this rank."""

    loss: float = float("nan")
    peak_in_flight: int = 0  # most micro-batches with forward done and backward not yet
    peak_pending_sends: int = 0  # most sends posted and not yet known to be received
    wall_s: float = 0.0  # from the start of the run until every send and kernel completed
    timings: list[ActionTiming] = field(default_factory=list)

    @property
    def busy_s(self) -> float:
        """Time spent computing (needs ``record_timings``)."""
        return sum(t.end_s - t.start_s for t in self.timings)


def measured_bubble_fraction(busy_s: Sequence[float], wall_s: float) -> float:
    """Idle share of a pipeline step: ``1 - mean(busy) / wall``, from every rank's compute time
    and the step's wall time (the slowest rank's)."""
    return 1.0 - sum(busy_s) / len(busy_s) / wall_s


def accumulated_backward(
    model: nn.Module,
    batch: torch.Tensor,
    target: torch.Tensor,
    parts: int = 1,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The single-process math of :meth:`PipelineStage.run`: ``batch`` and ``target`` cut into
    ``parts`` slices along dim 0 (``torch.chunk``, as the stage cuts micro-batches), one backward
    of ``loss_fn(model(slice), target) / parts`` each, in slice order (the order in which every
    schedule runs a chunk's backwards), gradients accumulated. Slices of unequal size are
    weighted by their share of the rows instead. ``parts = 1`` is plain whole-batch training.
    Returns the float64 sum of the scaled losses (the loss the pipeline reports)."""
    loss_fn = loss_fn or nn.functional.cross_entropy
    equal = len(batch) % parts == 0
    total = torch.zeros((), dtype=torch.float64, device=batch.device)
    for xs, ys in zip(batch.chunk(parts), target.chunk(parts), strict=True):
        loss = loss_fn(model(xs), ys)
        loss = loss / parts if equal else loss * (len(ys) / len(target))
        loss.backward()
        total += loss.detach()
    return total


def split_sequential(model: nn.Sequential, parts: int) -> list[nn.Sequential]:
    """``model``'s layers cut into ``parts`` consecutive pieces of near-equal layer counts (the
    pieces share the layers, not copies)."""
    if not 1 <= parts <= len(model):
        raise ValueError(f"cannot cut {len(model)} layers into {parts} pieces")
    bounds = [round(k * len(model) / parts) for k in range(parts + 1)]
    return [model[a:b] for a, b in itertools.pairwise(bounds)]


class PipelineStage:
    """This rank's part of a pipeline: ``module`` (one piece) or a list of pieces (chunks of the
    interleaved schedule) on stage ``rank`` of ``world``, the rank and size of ``group`` (default
    group if None). Every rank must construct its stage, in the same order relative to other
    group creations, with the same number of chunks: construction creates the link groups.
    ``group`` may be a subgroup, but the link groups come from ``dist.new_group``, which every
    rank of the default group must call: two pipelines on disjoint subgroups, each built by its
    own ranks only, do not work.

    ``loss_fn(output, target)`` (default cross-entropy) is applied on the last global stage.
    Single-tensor activations only; integer inputs are fine on the first stage (no gradient
    flows into them). A chunk must not change its input in place (``ReLU(inplace=True)`` as its
    first layer): on every stage but the first, the input is a leaf whose gradient is sent back.
    ``module`` may be a list or ``nn.ModuleList`` of chunks. All traffic is between neighbouring
    stages, in two-rank groups: under NCCL several ranks may share a GPU provided neighbours
    (``r``, ``r + 1``) do not, since NCCL refuses two ranks of one communicator on the same
    device. ``post_ahead``: post receives ahead (None: on the CPU only, see the module
    docstring).
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        rank: int,
        world: int,
        group: Group = None,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        device: torch.device | str | None = None,
        post_ahead: bool | None = None,
    ) -> None:
        if (rank, world) != (dist.get_rank(group), dist.get_world_size(group)):
            raise ValueError(
                f"stage {rank} of {world} does not match the group: rank "
                f"{dist.get_rank(group)} of {dist.get_world_size(group)}"
            )
        if world < 2:
            raise ValueError(f"a pipeline needs at least 2 stages, got {world}")
        chunked = isinstance(module, Sequence | nn.ModuleList)
        self.chunks = list(module) if chunked else [module]
        self.rank, self.world, self.group = rank, world, group
        self.loss_fn = loss_fn or nn.functional.cross_entropy
        if device is None:
            first = next(self.chunks[0].parameters(), None)
            if first is None:
                raise ValueError(
                    f"stage {rank} has no parameters to take its device from: pass device="
                )
            device = first.device
        self.device = torch.device(device)
        self.post_ahead = self.device.type == "cpu" if post_ahead is None else post_ahead
        self.last_stats = RunStats()
        ranks = dist.get_process_group_ranks(group) if group is not None else range(world)
        self._global = list(ranks)
        # One group per direction of each link, created by every rank in the same order; the
        # wrap-around link (last rank -> rank 0) exists only for chunked (interleaved) stages.
        links = range(world) if len(self.chunks) > 1 else range(world - 1)
        # Keys: the sending rank (activations go to rank + 1, gradients to rank - 1).
        self._act_groups = {s: self._pair(s, (s + 1) % world) for s in links}
        self._grad_groups = {(s + 1) % world: self._pair(s, (s + 1) % world) for s in links}
        self._connect(links)

    def _connect(self, links: range) -> None:
        """One message over every link, all ranks taking the links in the same order. NCCL
        sets a group's communicator up at its first message, blocking both ranks until both
        arrive; in a common order no two ranks wait for each other across links, whereas the
        schedule's own first messages come in a different order on each rank."""
        self._unconfirmed, self._stats = {}, RunStats()
        token = torch.zeros(1, device=self.device)
        for groups, step in ((self._act_groups, 1), (self._grad_groups, -1)):
            for s in links:
                src, dst = (s, (s + 1) % self.world) if step == 1 else ((s + 1) % self.world, s)
                if self.rank == src:
                    self._send(token, dst, groups[src], ("connect", step, s))
                elif self.rank == dst:
                    self._recv(torch.empty_like(token), src, groups[src])
        self._wait_all_sends()

    def _pair(self, a: int, b: int) -> dist.ProcessGroup:
        return dist.new_group([self._global[a], self._global[b]])

    @property
    def num_stages(self) -> int:
        return self.world * len(self.chunks)

    def _stage(self, chunk: int) -> int:
        return chunk * self.world + self.rank

    # -- messages ---------------------------------------------------------------------------

    def _send(self, x: torch.Tensor, dst: int, group: dist.ProcessGroup, key: tuple) -> None:
        """Post ``x`` to ``dst``; the send stays unconfirmed under ``key`` until waited."""
        work = dist.isend(x.contiguous(), self._global[dst], group=group)
        self._unconfirmed.setdefault(key, []).append(work)
        pending = sum(map(len, self._unconfirmed.values()))
        self._stats.peak_pending_sends = max(self._stats.peak_pending_sends, pending)

    def _confirm(self, key: tuple) -> None:
        """Wait on the sends under ``key``, known to be received (so the wait returns at once)
        and release their buffers. Needed because a gloo send reports completion only when
        waited: unwaited sends would pile up, and memory grow with the micro-batch count."""
        for work in self._unconfirmed.pop(key, []):
            work.wait()

    def _wait_all_sends(self) -> None:
        for key in list(self._unconfirmed):
            self._confirm(key)

    def _recv(self, buf: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
        dist.recv(buf, self._global[src], group=group)
        return buf

    def _send_activation(self, x: torch.Tensor, chunk: int, key: tuple) -> None:
        nxt = (self.rank + 1) % self.world
        group = self._act_groups[self.rank]
        if chunk not in self._headers_sent:
            header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
            header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
            header[2 : 2 + x.dim()] = torch.tensor(x.shape)
            self._send(header, nxt, group, key)
            self._headers_sent.add(chunk)
        self._send(x, nxt, group, key)

    def _recv_header(self, chunk: int) -> None:
        """The dtype and shape of ``chunk``'s activations, sent before its first one."""
        prev = (self.rank - 1) % self.world
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        values = self._recv(header, prev, self._act_groups[prev]).tolist()
        self._recv_shapes[chunk] = (_DTYPES[values[0]], values[2 : 2 + values[1]])

    # -- receives posted ahead ----------------------------------------------------------------

    def _plan_receives(self, actions: list[Action], last: int) -> None:
        """Per link, the indices of the actions that receive on it, in order: activations from
        the previous rank (forwards of every stage but 0), gradients from the next (backwards
        of every stage but the last). Each link's messages arrive in this order."""
        self._receivers = {
            link: [
                k for k, a in enumerate(actions) if a.kind == kind and self._stage(a.chunk) != end
            ]
            for link, kind, end in (("act", FORWARD, 0), ("grad", BACKWARD, last))
        }
        self._next_receiver = {"act": 0, "grad": 0}  # position of the next one not yet posted
        self._posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}

    def _post_receives(
        self, actions: list[Action], saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """On each link with nothing posted, post the receive of the next action that needs
        one, if its buffer can be made: an activation once its chunk's header has come (the
        header itself is received in order, when the action runs), a gradient once the
        forward whose output it belongs to has run. Only where :attr:`post_ahead` is set."""
        if not self.post_ahead:
            return
        prev, nxt = (self.rank - 1) % self.world, (self.rank + 1) % self.world
        for link, receivers in self._receivers.items():
            position = self._next_receiver[link]
            if position == len(receivers) or (position and receivers[position - 1] in self._posted):
                continue  # all posted, or one still waiting to be taken
            index = receivers[position]
            action = actions[index]
            if link == "act":
                if action.chunk not in self._recv_shapes:
                    continue
                dtype, shape = self._recv_shapes[action.chunk]
                buf, peer = torch.empty(shape, dtype=dtype, device=self.device), prev
                group = self._act_groups[prev]
            else:
                if (action.chunk, action.micro_batch) not in saved:
                    continue
                out = saved[action.chunk, action.micro_batch][1]
                buf, peer = torch.empty_like(out, memory_format=torch.contiguous_format), nxt
                group = self._grad_groups[nxt]
            work = dist.irecv(buf, self._global[peer], group=group)
            self._posted[index] = (work, buf)
            self._next_receiver[link] = position + 1

    def _take(self, link: str, index: int, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The input of action ``index``: its posted receive, waited on, or (not posted yet)
        received now into ``make()``."""
        if index in self._posted:
            work, buf = self._posted.pop(index)
            work.wait()
            return buf
        position = self._next_receiver[link]
        assert self._receivers[link][position] == index, "receives taken out of order"
        self._next_receiver[link] = position + 1
        return make()

    def _take_activation(self, index: int, chunk: int) -> torch.Tensor:
        prev = (self.rank - 1) % self.world

        def receive_now() -> torch.Tensor:
            if chunk not in self._recv_shapes:
                self._recv_header(chunk)
            dtype, shape = self._recv_shapes[chunk]
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            return self._recv(buf, prev, self._act_groups[prev])

        return self._take("act", index, receive_now)

    def _take_gradient(self, index: int, out: torch.Tensor) -> torch.Tensor:
        nxt = (self.rank + 1) % self.world
        return self._take(
            "grad",
            index,
            lambda: self._recv(
                torch.empty_like(out, memory_format=torch.contiguous_format),
                nxt,
                self._grad_groups[nxt],
            ),
        )

    def _relay_loss(self, loss: torch.Tensor) -> None:
        """The last rank's loss handed down the gradient links to rank 0, so every rank returns
        it. Point-to-point, not a broadcast: the run needs no collective over the whole group,
        so under NCCL ranks may share a GPU as long as neighbouring stages do not."""
        if self.rank < self.world - 1:
            nxt = self.rank + 1
            self._recv(loss, nxt, self._grad_groups[nxt])
        if self.rank > 0:
            self._send(loss, self.rank - 1, self._grad_groups[self.rank], ("loss",))

    def _confirm_gradients(self, action: Action, prev_position: dict[Action, int]) -> None:
        """The activation of ``action`` has arrived from the previous rank, sent by its forward
        at ``prev_position``: every gradient that rank consumed (in a backward) before that
        forward has been received, so those sends are confirmed."""
        wrap = 1 if self.rank == 0 else 0  # rank 0's chunk c follows the last rank's c - 1
        sent_at = prev_position[Action(FORWARD, action.micro_batch, action.chunk - wrap)]
        for key in [k for k in self._unconfirmed if k[0] == BACKWARD]:
            _, chunk, micro_batch = key
            if prev_position[Action(BACKWARD, micro_batch, chunk - wrap)] < sent_at:
                self._confirm(key)

    # -- execution --------------------------------------------------------------------------

    def run(
        self,
        batch: torch.Tensor | None,
        target: torch.Tensor | None,
        micro_batches: int,
        schedule: str | Schedule = "1f1b",
        *,
        record_timings: bool = False,
    ) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline, by ``schedule``.

        ``batch`` is needed on rank 0 (ignored elsewhere), ``target`` on the rank of the last
        stage; both are split into ``micro_batches`` equal parts along dim 0. Gradients are
        *added* to the parameters' ``.grad`` (zero them before, step the optimizer after, as
        with ``loss.backward()``). Returns the batch's mean loss (float64 scalar) on every rank.
        ``record_timings`` times each action's compute for :attr:`last_stats` (CUDA timing
        events on the current stream, so the GPU is not synchronized and the step keeps its
        speed; ``perf_counter`` on the CPU).
        """
        if isinstance(schedule, str):
            if schedule not in SCHEDULES:
                raise ValueError(f"schedule {schedule!r} is not one of {list(SCHEDULES)}")
            schedule = SCHEDULES[schedule]
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        actions = schedule(self.world, micro_batches, self.rank, len(self.chunks))
        prev_actions = schedule(
            self.world, micro_batches, (self.rank - 1) % self.world, len(self.chunks)
        )
        prev_position = {a: k for k, a in enumerate(prev_actions)}
        last = self.num_stages - 1
        inputs = self._split(batch, micro_batches, "batch") if self.rank == 0 else None
        targets = (
            self._split(target, micro_batches, "target") if self.rank == last % self.world else None
        )
        self._stats = stats = RunStats()
        self._unconfirmed: dict[tuple, list[dist.Work]] = {}
        self._headers_sent: set[int] = set()
        self._recv_shapes: dict[int, tuple[torch.dtype, list[int]]] = {}
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._plan_receives(actions, last)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        start = time.perf_counter()
        timeline = Timeline(self.device.type == "cuda", enabled=record_timings)
        for index, action in enumerate(actions):
            key, stage = (action.chunk, action.micro_batch), self._stage(action.chunk)
            if action.kind == FORWARD:
                if stage == 0:
                    x = inputs[action.micro_batch]
                else:
                    x = self._take_activation(index, action.chunk)
                    x.requires_grad_(x.is_floating_point())
                    self._confirm_gradients(action, prev_position)
                self._post_receives(actions, saved)
                t0 = timeline.mark()
                out = self.chunks[action.chunk](x)
                if stage == last:
                    out = self.loss_fn(out, targets[action.micro_batch]) / micro_batches
                    loss_sum += out.detach()
                timeline.add(FORWARD, index, t0, timeline.mark())
                if stage != last:
                    self._send_activation(out.detach(), action.chunk, (FORWARD, *key))
                saved[key] = (x, out)
                stats.peak_in_flight = max(stats.peak_in_flight, len(saved))
                self._post_receives(actions, saved)
            else:
                x, out = saved.pop(key)
                grad = None
                if stage != last:
                    grad = self._take_gradient(index, out)
                    self._confirm((FORWARD, *key))  # the next stage used the activation
                self._post_receives(actions, saved)
                t0 = timeline.mark()
                if out.requires_grad:  # a first stage with no trainable parameters has nothing
                    torch.autograd.backward(out, grad)
                timeline.add(BACKWARD, index, t0, timeline.mark())
                if stage != 0:
                    prev = (self.rank - 1) % self.world
                    self._send(x.grad, prev, self._grad_groups[self.rank], (BACKWARD, *key))
        self._relay_loss(loss_sum)
        self._wait_all_sends()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.wall_s = time.perf_counter() - start
        stats.timings = [
            ActionTiming(actions[span["index"]], span["start_s"], span["end_s"])
            for span in timeline.spans()
        ]
        stats.loss = loss_sum.item()
        self.last_stats = stats
        return loss_sum

    def _split(self, x: torch.Tensor | None, parts: int, name: str) -> list[torch.Tensor]:
        if x is None:
            raise ValueError(f"rank {self.rank} needs the {name}")
        if x.shape[0] % parts:
            raise ValueError(f"{name} of {x.shape[0]} rows does not split into {parts} equal parts")
        return list(x.to(self.device).chunk(parts))
