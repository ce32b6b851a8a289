"""Pipeline-parallel training of an MLP digit classifier cut into stages: the run's settings,
each rank's part (through effdl's schedules, through torch.distributed.pipelining, or the peak
memory at growing micro-batch counts) and the single-process reference.

One process per stage; the optimizer steps once per batch after all micro-batches, so the math
is that of single-process training with gradient accumulation (:func:`reference_run` with
``accumulate``). Ranks start as local processes (:func:`effdl.parallel.launch.spawn`) or under
torchrun (:func:`run_ranks`); with NCCL rank r uses GPU ``r % device_count`` (ranks may share a
GPU). Every rank returns a dict of its measurements; the peak memory is that of the rank's
process (RSS sampled on the CPU, ``max_memory_allocated`` on a GPU). Each step's record (loss,
step time of the slowest rank) is written by rank 0 as soon as every rank has measured the step
(:class:`StepLog`), so an interrupted run keeps the steps it made.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from effdl.cli import (
    UsageError,
    require_choices,
    require_fits,
    require_positive,
    require_processes,
)
from effdl.data.digits import DigitsDataError, load_digits_tensors
from effdl.parallel.classifiers import epoch_batches, equal_work_mlp, multiply_adds
from effdl.parallel.launch import round_robin_device, share_cpu, spawn
from effdl.parallel.pipeline import (
    SCHEDULES,
    PipelineStage,
    accumulated_backward,
    split_sequential,
)
from effdl.parallel.pipeline_measure import action_seconds, message_seconds, slowest_rank_steps
from effdl.profiling.timing import peak_memory, synchronize
from effdl.results import RunLog

Group = dist.ProcessGroup | None
BACKENDS = ("gloo", "nccl")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
TORCH_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class PipelineConfig:
    """One run: pipeline training (default), its single-process ``reference`` (on whole batches,
    or with ``accumulate`` over the micro-batches), or ``long``."""

    schedule: str = "1f1b"
    stages: int = 4
    virtual: int = 2  # chunks per rank of the interleaved schedule
    micro_batches: int = 8
    batch: int = 128
    steps: int = 300
    hidden: int = 256
    lr: float = 0.01
    timed_steps: int = 20  # the last steps; the earlier ones are warm-up
    reference: bool = False
    accumulate: bool = False  # the reference accumulates gradients over the micro-batches
    long: bool = False
    compare_torch: bool = False  # torch.distributed.pipelining's schedule on the same stages
    long_micro_batches: tuple[int, ...] = (10, 100, 1000)
    long_micro_batch_size: int = 4
    long_steps: int = 2
    backend: str = "gloo"
    data: Path | None = None
    dtype: str = "float32"  # float64: curves that coincide over long runs (rounding not amplified)
    seed: int = 0  # from --seed: the model's weights and the data order, the same on every rank
    threads: int = 0  # intra-op threads per CPU rank; 0: available cores // stages

    @property
    def chunks(self) -> int:
        return self.virtual if self.schedule == "interleaved" else 1

    def validate(self) -> None:
        require_choices(self, "schedule", SCHEDULES)
        require_choices(self, "backend", BACKENDS)
        require_choices(self, "dtype", DTYPES)
        require_positive(self, "micro_batches", "batch", "steps", "hidden", "virtual")
        require_positive(self, "long_micro_batches", "long_micro_batch_size", "long_steps")
        require_positive(self, "lr", minimum=0)
        require_processes(self, "threads")
        require_positive(self, "timed_steps")
        rows = max(self.batch, self.long_micro_batch_size * max(self.long_micro_batches))
        require_fits(
            "--batch --hidden --stages --long-micro-batches --long-micro-batch-size",
            rows * self.hidden + self.stages * self.hidden**2,
            "a batch's activations and the stages' weights",
        )
        if self.timed_steps >= self.steps and not (self.reference or self.long):
            raise UsageError(
                f"--timed-steps {self.timed_steps} must be below --steps {self.steps}: "
                "the first steps are warm-up, left out of the timing"
            )
        require_processes(self, "stages", minimum=2)
        if self.accumulate and not self.reference:
            raise UsageError("--accumulate applies to --reference only")
        if self.compare_torch and self.schedule not in TORCH_SCHEDULES:
            raise UsageError(
                f"--compare-torch needs --schedule in {sorted(TORCH_SCHEDULES)}, "
                f"got {self.schedule!r}"
            )
        if self.batch % self.micro_batches:
            raise UsageError(
                f"--batch {self.batch} is not a multiple of --micro-batches {self.micro_batches}"
            )
        if self.backend == "nccl" and not self.reference:
            self.check_gpu_layout(torch.cuda.device_count())
        if self.schedule == "interleaved":
            counts = [self.micro_batches] + (list(self.long_micro_batches) if self.long else [])
            if any(m % self.stages for m in counts):
                raise UsageError(
                    f"--schedule interleaved needs micro-batch counts {counts} to be multiples "
                    f"of --stages {self.stages}"
                )

    def check_gpu_layout(self, gpus: int) -> None:
        """NCCL refuses two ranks of one communicator on one GPU. Rank r runs on GPU
        ``r % gpus``: the pipeline's two-rank links then never pair ranks of one GPU, except the
        interleaved schedule's wrap-around link (last rank to rank 0) when ``stages % gpus ==
        1``; torch.distributed.pipelining talks over the whole group, so it needs a GPU per
        stage."""
        if gpus == 0:
            raise UsageError("--backend nccl needs CUDA GPUs; this machine has none (use gloo)")
        if self.compare_torch and self.stages > gpus:
            raise UsageError(
                f"--compare-torch with --backend nccl needs a GPU per stage (its schedule talks "
                f"over the whole group): {self.stages} stages, {gpus} GPUs; use --stages {gpus} "
                "or --backend gloo"
            )
        if gpus == 1 or (self.chunks > 1 and (self.stages - 1) % gpus == 0):
            raise UsageError(
                f"--backend nccl: {self.stages} stages on {gpus} GPU(s) put neighbouring stages "
                "on one GPU, which NCCL refuses; use a stage count that is not 1 more than a "
                "multiple of the GPU count, or --backend gloo"
            )


@dataclass(frozen=True)
class StepLog:
    """Where rank 0 (or the reference) writes each step's record as it is measured: ``log``,
    the record's ``variant``, and its ``config``, whose ``data`` and ``cores_per_rank`` (where
    it has that key) the ranks fill in (:meth:`completed`) once they know them."""

    log: RunLog
    variant: str
    config: dict[str, Any]

    def completed(
        self, *, source: str | None = None, cores: list[list[int]] | None = None
    ) -> StepLog:
        config = dict(self.config)
        if source is not None:
            config["data"] = source
        if cores is not None and "cores_per_rank" in config:
            config["cores_per_rank"] = cores
        return replace(self, config=config)

    def write(self, row: dict[str, Any]) -> None:
        self.log.log(self.variant, self.config, row)


def report_step(
    row: dict[str, Any],
    rank: int,
    world: int,
    control: Group,
    step_log: StepLog | None,
    loss_rank: int = 0,
) -> None:
    """Rank 0 gathers every rank's ``{"step", "loss", "step_s"}`` of one step and writes the
    step's record (rank ``loss_rank``'s loss, the slowest rank's time: ``slowest_rank_steps``);
    called by every rank after the timed region. Float64 carries each float exactly."""
    mine = torch.tensor([row["loss"], row["step_s"]], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, rows, dst=0, group=control)
    if rank == 0 and step_log is not None:
        per_rank = [
            [{"step": row["step"], "loss": r[0].item(), "step_s": r[1].item()}] for r in rows
        ]
        step_log.write(slowest_rank_steps(per_rank, loss_rank)[0])


def load_data(cfg: PipelineConfig) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Training rows (flattened, float32), labels, and the data's name: scikit-learn's digits,
    CIFAR-10 from ``--data``, or effdl.data.digits' generated stand-in (see its docs)."""
    try:
        data = load_digits_tensors(cfg.data)
    except DigitsDataError as err:
        raise UsageError(f"--data: {err}") from None
    return data.x_train.flatten(1).float(), data.y_train.long(), data.source


def stage_modules(
    cfg: PipelineConfig, rank: int, features: int, device: torch.device
) -> list[nn.Sequential]:
    """This rank's pieces (the full model is built from the seed on every rank, then cut)."""
    torch.manual_seed(cfg.seed)
    pieces = cfg.stages * cfg.chunks
    model = equal_work_mlp(features, cfg.hidden, 10, pieces).to(device, DTYPES[cfg.dtype])
    cut = split_sequential(model, pieces)
    return [cut[c * cfg.stages + rank] for c in range(cfg.chunks)]


def build_stage(cfg: PipelineConfig, rank: int, features: int, device: torch.device):
    """This rank's stage and its optimizer."""
    mine = stage_modules(cfg, rank, features, device)
    stage = PipelineStage(mine if cfg.chunks > 1 else mine[0], rank, cfg.stages, device=device)
    optimizer = torch.optim.SGD([p for m in mine for p in m.parameters()], lr=cfg.lr, momentum=0.9)
    return stage, optimizer


def train_rank(
    rank: int,
    world: int,
    cfg: PipelineConfig,
    device: torch.device,
    control: Group,
    step_log: StepLog | None = None,
) -> dict:
    """Train through the pipeline; every rank returns its measurements (each has the losses),
    and rank 0 writes each step's record to ``step_log`` as it goes (:func:`report_step`)."""
    x, y, source = load_data(cfg)
    step_log = step_log.completed(source=source) if step_log is not None else None
    x, y = x.to(device, DTYPES[cfg.dtype]), y.to(device)
    stage, optimizer = build_stage(cfg, rank, x.shape[1], device)
    pair = dist.new_group([0, 1])
    shape = (cfg.batch // cfg.micro_batches, cfg.hidden)
    message_s = message_seconds(rank, pair, shape, x.dtype, device) if rank < 2 else None
    steps, busy, walls, forward, backward = [], [], [], [], []
    with peak_memory(device, cpu_rss=True) as memory:
        for step, rows in enumerate(epoch_batches(len(x), cfg.batch, cfg.steps, cfg.seed)):
            timed = step >= cfg.steps - cfg.timed_steps
            dist.barrier(group=control)
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = stage.run(
                x[rows], y[rows], cfg.micro_batches, cfg.schedule, record_timings=timed
            )
            optimizer.step()
            synchronize(device)
            steps.append({"step": step, "loss": loss.item(), "step_s": time.perf_counter() - start})
            report_step(steps[-1], rank, world, control, step_log)
            if timed:
                busy.append(stage.last_stats.busy_s)
                walls.append(stage.last_stats.wall_s)
                f, b = action_seconds(stage)
                forward.append(f)
                backward.append(b)
    return {
        "steps": steps,
        "busy_s": busy,
        "wall_s": walls,
        "forward_s": statistics.median(forward),
        "backward_s": statistics.median(backward),
        "message_s": message_s,
        "multiply_adds": sum(map(multiply_adds, stage.chunks)),
        "peak_in_flight": stage.last_stats.peak_in_flight,
        "peak_memory_bytes": memory.bytes,
        "source": source,
    }


def torch_rank(
    rank: int,
    world: int,
    cfg: PipelineConfig,
    device: torch.device,
    control: Group,
    step_log: StepLog | None = None,
) -> dict:
    """The same stages, data and optimizer through torch.distributed.pipelining (the speed
    reference; only the last rank sees the loss, the others log NaN). Peak memory is sampled
    as in :func:`train_rank`, so both runs carry the same sampling thread; step records too."""
    from torch.distributed import pipelining

    x, y, source = load_data(cfg)
    step_log = step_log.completed(source=source) if step_log is not None else None
    x, y = x.to(device, DTYPES[cfg.dtype]), y.to(device)
    (module,) = stage_modules(cfg, rank, x.shape[1], device)
    stage = pipelining.PipelineStage(module, rank, world, device)
    kind = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[cfg.schedule]
    schedule = kind(stage, cfg.micro_batches, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=0.9)
    steps = []
    with peak_memory(device, cpu_rss=True) as memory:
        for step, rows in enumerate(epoch_batches(len(x), cfg.batch, cfg.steps, cfg.seed)):
            dist.barrier(group=control)
            start = time.perf_counter()
            optimizer.zero_grad()
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(x[rows])
            elif rank == world - 1:
                schedule.step(target=y[rows], losses=losses)
            else:
                schedule.step()
            optimizer.step()
            synchronize(device)
            loss = torch.stack(losses).mean().item() if losses else float("nan")
            steps.append({"step": step, "loss": loss, "step_s": time.perf_counter() - start})
            report_step(steps[-1], rank, world, control, step_log, loss_rank=-1)
    return {"steps": steps, "peak_memory_bytes": memory.bytes, "source": source}


def long_rank(
    rank: int, world: int, cfg: PipelineConfig, device: torch.device, control: Group
) -> dict:
    """Peak memory and activations in flight at each micro-batch count (rows drawn with
    replacement, ``long_micro_batch_size`` per micro-batch)."""
    x, y, source = load_data(cfg)
    stage, optimizer = build_stage(cfg, rank, x.shape[1], device)
    gen = torch.Generator().manual_seed(cfg.seed)
    counts = []
    for m in cfg.long_micro_batches:
        rows = torch.randint(0, len(x), (m * cfg.long_micro_batch_size,), generator=gen)
        xb, yb = x[rows].to(device, DTYPES[cfg.dtype]), y[rows].to(device)
        dist.barrier(group=control)
        start = time.perf_counter()
        with peak_memory(device, cpu_rss=True) as memory:
            for _ in range(cfg.long_steps):
                optimizer.zero_grad()
                loss = stage.run(xb, yb, m, cfg.schedule)
                optimizer.step()
            synchronize(device)
        counts.append({
            "micro_batches": m,
            "start_memory_bytes": memory.start_bytes,
            "peak_memory_bytes": memory.bytes,
            "peak_in_flight": stage.last_stats.peak_in_flight,
            "step_s": (time.perf_counter() - start) / cfg.long_steps,
            "loss": loss.item(),
        })  # fmt: skip
    return {"counts": counts, "source": source}


def control_group(backend: str) -> Group:
    """The group of the barriers and of the results: a gloo group beside NCCL, which refuses
    collectives over ranks that share a GPU (the pipeline itself only talks to neighbours)."""
    return dist.new_group(backend="gloo") if backend == "nccl" else None


def rank_result(
    rank: int,
    world: int,
    cfg: PipelineConfig,
    local_rank: int,
    local_world: int,
    control: Group,
    step_log: StepLog | None = None,
) -> dict:
    """This rank's run. NCCL ranks take GPU ``local_rank % count``: round-robin, so 4 stages
    on 2 GPUs put neighbouring stages on different GPUs. CPU ranks take their share of this
    host's cores (effdl.parallel.launch.share_cpu). Rank 0 writes the step records to
    ``step_log``, their config completed with the data and every rank's cores."""
    device, cores = round_robin_device(cfg.backend, local_rank), ()
    if cfg.backend != "nccl":
        cores = share_cpu(local_rank, local_world, cfg.threads).cores
    if cfg.long:
        result = long_rank(rank, world, cfg, device, control)
    else:
        every = [None] * world if rank == 0 else None
        dist.gather_object(list(cores), every, dst=0, group=control)
        if step_log is not None:
            step_log = step_log.completed(cores=every)
        entry = torch_rank if cfg.compare_torch else train_rank
        result = entry(rank, world, cfg, device, control, step_log)
    return {**result, "cpu_cores": list(cores)}


def spawned_rank(rank: int, world: int, cfg: PipelineConfig, step_log: StepLog | None) -> dict:
    """Entry of a rank started by :func:`spawn` (rank 0 writes to ``step_log``)."""
    mine = step_log if rank == 0 else None
    return rank_result(rank, world, cfg, rank, world, control_group(cfg.backend), mine)


def run_ranks(cfg: PipelineConfig, step_log: StepLog | None = None) -> list[dict] | None:
    """Every rank's result (in the logging process), or None on a torchrun rank other than 0.
    ``step_log``: where rank 0 writes each step's record (the logging process's log)."""
    if "LOCAL_RANK" not in os.environ:
        # A torch optimizer's first construction imports the compiler stack (seconds): once
        # here, so that forked ranks inherit it.
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)
        return spawn(spawned_rank, cfg.stages, cfg, step_log, backend=cfg.backend)
    dist.init_process_group(cfg.backend)  # not init_from_env: GPUs are shared round-robin
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.stages:
        raise UsageError(f"torchrun started {world} processes for --stages {cfg.stages}")
    control = control_group(cfg.backend)
    local = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    result = rank_result(rank, world, cfg, *local, control, step_log if rank == 0 else None)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(result, gathered, dst=0, group=control)
    dist.destroy_process_group()
    return gathered


def reference_run(
    cfg: PipelineConfig, device: torch.device, step_log: StepLog | None = None
) -> dict:
    """The same model, data order and optimizer in one process, on whole batches or, with
    ``cfg.accumulate``, accumulating the gradients of the micro-batches; each step's record is
    written to ``step_log`` as it is measured."""
    x, y, source = load_data(cfg)
    step_log = step_log.completed(source=source) if step_log is not None else None
    x, y = x.to(device, DTYPES[cfg.dtype]), y.to(device)
    torch.manual_seed(cfg.seed)
    model = equal_work_mlp(x.shape[1], cfg.hidden, 10, cfg.stages * cfg.chunks)
    model = model.to(device, DTYPES[cfg.dtype])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    steps = []
    with peak_memory(device, cpu_rss=True) as memory:
        for step, rows in enumerate(epoch_batches(len(x), cfg.batch, cfg.steps, cfg.seed)):
            start = time.perf_counter()
            optimizer.zero_grad()
            parts = cfg.micro_batches if cfg.accumulate else 1
            loss = accumulated_backward(model, x[rows], y[rows], parts).item()
            optimizer.step()
            synchronize(device)
            step_s = time.perf_counter() - start
            steps.append({"step": step, "loss": loss, "step_s": step_s})
            if step_log is not None:
                step_log.write(steps[-1])
    return {"steps": steps, "peak_memory_bytes": memory.bytes, "source": source}
