"""Pipeline-parallel training of an MLP digit classifier cut into stages (effdl.parallel.pipeline).

One process per stage; the optimizer steps once per batch after all micro-batches, so the math
is that of single-process training with gradient accumulation: ``--reference --accumulate`` (the
same model, seed, batches and micro-batches in one process, with the backwards in the schedules'
order), whose loss curve the pipeline's must coincide with. ``--reference`` alone trains on
whole batches: the same math summed in another order, so its gap to the accumulating reference
is the float32 rounding noise of this training (two equivalent single-process runs).

    python memory_efficient_gpt2/pipeline_parallel.py --quick                # CPU, 4 gloo processes
    python memory_efficient_gpt2/pipeline_parallel.py --schedule gpipe --steps 300
    python memory_efficient_gpt2/pipeline_parallel.py --reference --accumulate   # one process
    python memory_efficient_gpt2/pipeline_parallel.py --reference            # whole batches
    python memory_efficient_gpt2/pipeline_parallel.py --long                 # 10/100/1000 micro-batches
    python memory_efficient_gpt2/pipeline_parallel.py --compare-torch --schedule gpipe   # reference
    torchrun --nproc-per-node 4 memory_efficient_gpt2/pipeline_parallel.py --backend nccl

Without ``torchrun`` the script starts its own ranks (effdl.parallel.launch.spawn); with
``--backend nccl`` rank r uses GPU ``r % device_count`` (ranks may share a GPU). CPU ranks get
``--threads`` intra-op threads each (default: an equal share of the cores) and their own block
of cores; a reference on the CPU takes the threads of one rank (the thread count decides how a
product's sums are split, hence how they round). Per step: loss and step time (that of the last
rank to finish). Per run, over the last ``--timed-steps`` steps (the earlier ones are warm-up):
the median step time, the bubble fraction measured (compute time per action against the step's
wall time) beside the formula, each stage's compute time per micro-batch and the time of one
activation message (so the reader sees that messages are small against compute), the
activations held in flight and the peak memory of every rank (RSS on CPU,
``max_memory_allocated`` on GPU).
``--long`` runs ``--long-micro-batches`` counts of ``--long-micro-batch-size`` rows each and
logs the peak memory at each count, which stays flat with 1F1B. ``--compare-torch`` trains the
same split model with torch.distributed.pipelining's ScheduleGPipe or Schedule1F1B instead (the
speed reference, logged as ``torch_gpipe``/``torch_1f1b``; step time and loss only).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import torch._dynamo  # (optimizers import it, seconds: once here, not in every fork)
import torch.distributed as dist
from torch import nn

from effdl.cli import (
    ConfigFlags,
    Run,
    UsageError,
    base_parser,
    print_table,
    require_choices,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.digits import DigitsDataError, load_digits_tensors
from effdl.parallel.launch import available_cores, cpu_threads, share_cpu, spawn
from effdl.parallel.pipeline import (
    FORWARD,
    SCHEDULES,
    PipelineStage,
    accumulated_backward,
    bubble_fraction,
    measured_bubble_fraction,
    simulate_seconds,
    split_sequential,
)
from effdl.profiling.timing import synchronize

Group = dist.ProcessGroup | None
TASK = "parallelism"
LOG = "pipeline_parallel.jsonl"
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
        require_positive(self, "lr", "threads", minimum=0)
        require_positive(self, "timed_steps")
        if self.timed_steps >= self.steps and not (self.reference or self.long):
            raise UsageError(
                f"--timed-steps {self.timed_steps} must be below --steps {self.steps}: "
                "the first steps are warm-up, left out of the timing"
            )
        require_positive(self, "stages", minimum=2)
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


FULL = PipelineConfig()
QUICK = PipelineConfig(
    steps=12, batch=64, hidden=32, timed_steps=4, long_micro_batches=(10, 100), long_steps=1
)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, PipelineConfig]:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/parallelism")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("schedule", choices=sorted(SCHEDULES))
    flags.add("stages", type=int, help="pipeline ranks (processes)")
    flags.add("virtual", type=int, help="chunks per rank of the interleaved schedule")
    flags.add("micro_batches", type=int, help="micro-batches per batch")
    flags.add("batch", type=int, help="rows per optimizer step")
    flags.add("steps", type=int, help="optimizer steps")
    flags.add("hidden", type=int, help="width of the MLP")
    flags.add("lr", type=float, help="SGD learning rate (momentum 0.9)")
    flags.add("timed_steps", type=int, help="last steps timed (step time, bubble fraction)")
    flags.add(
        "threads",
        type=int,
        help="intra-op threads per CPU rank, and of --reference on the CPU; 0: cores // stages",
    )
    flags.add("reference", action="store_true", help="the same training in one process")
    flags.add(
        "accumulate",
        action="store_true",
        help="with --reference: one backward per micro-batch, gradients accumulated (the "
        "pipeline's math); without: whole batches",
    )
    flags.add("long", action="store_true", help="peak memory against the micro-batch count")
    flags.add(
        "compare_torch",
        action="store_true",
        help="train with torch.distributed.pipelining's schedule instead (speed reference)",
    )
    flags.add("long_micro_batches", type=int, nargs="+", help="micro-batch counts of --long")
    flags.add("long_micro_batch_size", type=int, help="rows per micro-batch of --long")
    flags.add("long_steps", type=int, help="steps per micro-batch count of --long")
    flags.add(
        "backend",
        choices=BACKENDS,
        help="gloo: CPU processes; nccl: GPUs (--device applies to --reference only)",
    )
    flags.add("data", type=Path, help="CIFAR-10 python batches folder (default: digits)")
    flags.add("dtype", choices=sorted(DTYPES), help="parameters and activations")
    args = p.parse_args(argv)
    return args, flags.resolve(args)


# -- data and model ------------------------------------------------------------------------


def load_data(cfg: PipelineConfig) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Training rows (flattened, float32), labels, and the data's name: scikit-learn's digits,
    CIFAR-10 from ``--data``, or effdl.data.digits' generated stand-in (see its docs)."""
    try:
        data = load_digits_tensors(cfg.data)
    except DigitsDataError as err:
        raise UsageError(f"--data: {err}") from None
    return data.x_train.flatten(1).float(), data.y_train.long(), data.source


def build_model(features: int, hidden: int, classes: int, pieces: int) -> nn.Sequential:
    """``pieces`` blocks of equal work, two ``hidden x hidden`` layers each (the bubble formula
    assumes equal stage times): the input projection rides in front of the first block and the
    classifier behind the last, both small beside a block when ``features`` and ``classes`` are
    small beside ``hidden``. He initialization keeps the signal's scale through the deep ReLU
    stack (torch's default shrinks it layer by layer, and the loss then stalls for many steps)."""
    widths = [features] + [hidden] * (2 * pieces + 1) + [classes]
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(itertools.pairwise(widths)):
        linear = nn.Linear(a, b)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if k < len(widths) - 2:
            layers.append(nn.ReLU())
    # Block k: the layers (and ReLUs) of linears 2k + 1 and 2k + 2; linear 0 joins block 0,
    # the classifier the last block.
    bounds = [0] + [4 * k + 2 for k in range(1, pieces)] + [len(layers)]
    return nn.Sequential(*(nn.Sequential(*layers[a:b]) for a, b in itertools.pairwise(bounds)))


def multiply_adds(module: nn.Module) -> int:
    """Multiply-adds per row of ``module``'s Linear layers (the work of a stage)."""
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def batch_indices(n: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Rows of each step: seeded shuffles, epoch after epoch (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(n, generator=gen) for _ in range(steps * batch // n + 1)])
    return list(order[: steps * batch].view(steps, batch))


# -- measuring -----------------------------------------------------------------------------


class PeakMemory:
    """Memory at the start of a region (``start``) and its peak over it (``peak``):
    ``max_memory_allocated`` on CUDA, else this process's RSS sampled every 10 ms by a thread
    (RSS has no resettable peak)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.start, self.peak = device, 0, 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            self._process = psutil.Process()
            self.start = self.peak = self._process.memory_info().rss
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._process.memory_info().rss)


def message_seconds(
    rank: int, pair: Group, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> float:
    """One-way time of one message of ``shape`` (an activation) between ranks 0 and 1, the
    only callers: half the median round trip of 20 ping-pongs over ``pair`` (their two-rank
    group), after 3 untimed."""
    buf = torch.zeros(shape, dtype=dtype, device=device)
    times = []
    for _ in range(23):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1, group=pair)
            dist.recv(buf, 1, group=pair)
        else:
            dist.recv(buf, 0, group=pair)
            dist.send(buf, 0, group=pair)
        synchronize(device)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[3:])


def action_seconds(stage: PipelineStage) -> tuple[float, float]:
    """Mean compute time of a forward and of a backward in the last run (record_timings)."""
    forward = [t.end_s - t.start_s for t in stage.last_stats.timings if t.action.kind == FORWARD]
    backward = [t.end_s - t.start_s for t in stage.last_stats.timings if t.action.kind != FORWARD]
    return statistics.fmean(forward), statistics.fmean(backward)


# -- the ranks -----------------------------------------------------------------------------


def stage_modules(
    cfg: PipelineConfig, rank: int, features: int, device: torch.device
) -> list[nn.Sequential]:
    """This rank's pieces (the full model is built from the seed on every rank, then cut)."""
    torch.manual_seed(cfg.seed)
    pieces = cfg.stages * cfg.chunks
    model = build_model(features, cfg.hidden, 10, pieces).to(device, DTYPES[cfg.dtype])
    cut = split_sequential(model, pieces)
    return [cut[c * cfg.stages + rank] for c in range(cfg.chunks)]


def build_stage(cfg: PipelineConfig, rank: int, features: int, device: torch.device):
    """This rank's stage and its optimizer."""
    mine = stage_modules(cfg, rank, features, device)
    stage = PipelineStage(mine if cfg.chunks > 1 else mine[0], rank, cfg.stages, device=device)
    optimizer = torch.optim.SGD([p for m in mine for p in m.parameters()], lr=cfg.lr, momentum=0.9)
    return stage, optimizer


def train_rank(
    rank: int, world: int, cfg: PipelineConfig, device: torch.device, control: Group
) -> dict:
    """Train through the pipeline; every rank returns its measurements (each has the losses)."""
    x, y, source = load_data(cfg)
    x, y = x.to(device, DTYPES[cfg.dtype]), y.to(device)
    stage, optimizer = build_stage(cfg, rank, x.shape[1], device)
    pair = dist.new_group([0, 1])
    shape = (cfg.batch // cfg.micro_batches, cfg.hidden)
    message_s = message_seconds(rank, pair, shape, x.dtype, device) if rank < 2 else None
    steps, busy, walls, forward, backward = [], [], [], [], []
    with PeakMemory(device) as memory:
        for step, rows in enumerate(batch_indices(len(x), cfg.batch, cfg.steps, cfg.seed)):
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
        "peak_memory_bytes": memory.peak,
        "source": source,
    }


def torch_rank(
    rank: int, world: int, cfg: PipelineConfig, device: torch.device, control: Group
) -> dict:
    """The same stages, data and optimizer through torch.distributed.pipelining (the speed
    reference; only the last rank sees the loss, the others log NaN). Peak memory is sampled
    as in :func:`train_rank`, so both runs carry the same sampling thread."""
    from torch.distributed import pipelining

    x, y, source = load_data(cfg)
    x, y = x.to(device, DTYPES[cfg.dtype]), y.to(device)
    (module,) = stage_modules(cfg, rank, x.shape[1], device)
    stage = pipelining.PipelineStage(module, rank, world, device)
    kind = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[cfg.schedule]
    schedule = kind(stage, cfg.micro_batches, loss_fn=nn.functional.cross_entropy)
    optimizer = torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=0.9)
    steps = []
    with PeakMemory(device) as memory:
        for step, rows in enumerate(batch_indices(len(x), cfg.batch, cfg.steps, cfg.seed)):
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
    return {"steps": steps, "peak_memory_bytes": memory.peak, "source": source}


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
        with PeakMemory(device) as memory:
            for _ in range(cfg.long_steps):
                optimizer.zero_grad()
                loss = stage.run(xb, yb, m, cfg.schedule)
                optimizer.step()
            synchronize(device)
        counts.append({
            "micro_batches": m,
            "start_memory_bytes": memory.start,
            "peak_memory_bytes": memory.peak,
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
    rank: int, world: int, cfg: PipelineConfig, local_rank: int, local_world: int, control: Group
) -> dict:
    """This rank's run. NCCL ranks take GPU ``local_rank % count``: round-robin, so 4 stages
    on 2 GPUs put neighbouring stages on different GPUs. CPU ranks take their share of this
    host's cores (effdl.parallel.launch.share_cpu)."""
    device, cores = torch.device("cpu"), ()
    if cfg.backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        cores = share_cpu(local_rank, local_world, cfg.threads).cores
    entry = long_rank if cfg.long else torch_rank if cfg.compare_torch else train_rank
    return {**entry(rank, world, cfg, device, control), "cpu_cores": list(cores)}


def spawned_rank(rank: int, world: int, cfg: PipelineConfig) -> dict:
    """Entry of a rank started by :func:`spawn`."""
    return rank_result(rank, world, cfg, rank, world, control_group(cfg.backend))


def run_ranks(cfg: PipelineConfig) -> list[dict] | None:
    """Every rank's result (in the logging process), or None on a torchrun rank other than 0."""
    if "LOCAL_RANK" not in os.environ:
        return spawn(spawned_rank, cfg.stages, cfg, backend=cfg.backend)
    dist.init_process_group(cfg.backend)  # not init_from_env: GPUs are shared round-robin
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != cfg.stages:
        raise UsageError(f"torchrun started {world} processes for --stages {cfg.stages}")
    control = control_group(cfg.backend)
    local = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    result = rank_result(rank, world, cfg, *local, control)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(result, gathered, dst=0, group=control)
    dist.destroy_process_group()
    return gathered


def reference_run(cfg: PipelineConfig, device: torch.device) -> dict:
    """The same model, data order and optimizer in one process, on whole batches or, with
    ``cfg.accumulate``, accumulating the gradients of the micro-batches."""
    x, y, source = load_data(cfg)
    x, y = x.to(device, DTYPES[cfg.dtype]), y.to(device)
    torch.manual_seed(cfg.seed)
    model = build_model(x.shape[1], cfg.hidden, 10, cfg.stages * cfg.chunks)
    model = model.to(device, DTYPES[cfg.dtype])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    steps = []
    with PeakMemory(device) as memory:
        for step, rows in enumerate(batch_indices(len(x), cfg.batch, cfg.steps, cfg.seed)):
            start = time.perf_counter()
            optimizer.zero_grad()
            parts = cfg.micro_batches if cfg.accumulate else 1
            loss = accumulated_backward(model, x[rows], y[rows], parts).item()
            optimizer.step()
            synchronize(device)
            step_s = time.perf_counter() - start
            steps.append({"step": step, "loss": loss, "step_s": step_s})
    return {"steps": steps, "peak_memory_bytes": memory.peak, "source": source}


# -- the run log ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args, cfg = parse_args(argv)
    cfg = dataclasses.replace(cfg, seed=args.seed)
    # The log is opened before any work, by the one process that writes it.
    logging = os.environ.get("RANK", "0") == "0"
    run = start_run(args, TASK, LOG) if logging else None
    if cfg.reference:
        if run.device.type == "cpu":
            # A product's sums are split among the intra-op threads, so the reference takes the
            # thread count of one rank to round as the ranks do.
            torch.set_num_threads(cpu_threads(cfg.stages, cfg.threads))
        variant = "reference_accumulated" if cfg.accumulate else "reference"
        log_training(run, cfg, variant, [reference_run(cfg, run.device)])
        return
    if "LOCAL_RANK" not in os.environ:
        # The ranks are forked from here, and a child forked after this process ran an
        # OpenMP-parallel kernel hangs in its first one (libgomp's pool does not survive fork).
        torch.set_num_threads(1)
    results = run_ranks(cfg)
    if run is None:
        return
    if cfg.long:
        log_long(run, cfg, results)
    elif cfg.compare_torch:
        log_training(run, cfg, f"torch_{cfg.schedule}", results, loss_rank=-1)
    else:
        log_training(run, cfg, cfg.schedule, results)


def run_config(run: Run, cfg: PipelineConfig, results: list[dict]) -> dict:
    """Every flag of the run, the data, the host, and the CPU share of each rank (of the
    reference on the CPU: its intra-op threads)."""
    config = {**dataclasses.asdict(cfg), "data": results[0]["source"], "where": run.where}
    if cfg.reference:
        if run.device.type == "cpu":
            config |= {"cores_available": available_cores(), "cpu_threads": torch.get_num_threads()}
    elif cfg.backend == "gloo":
        config |= {
            "cores_available": available_cores(),
            "threads_per_rank": cpu_threads(cfg.stages, cfg.threads),
            "cores_per_rank": [r["cpu_cores"] for r in results],
        }
    return config


def message_bytes(cfg: PipelineConfig) -> int:
    """Size of one activation message: a micro-batch of ``hidden``-wide rows."""
    return cfg.batch // cfg.micro_batches * cfg.hidden * DTYPES[cfg.dtype].itemsize


def step_records(results: list[dict], loss_rank: int) -> list[dict]:
    """Per step: the loss seen by ``loss_rank`` and the step time of the last rank to finish
    (every rank starts a step at the same barrier, and the step is over when all are done)."""
    return [
        {**per_rank[loss_rank], "step_s": max(r["step_s"] for r in per_rank)}
        for per_rank in zip(*(r["steps"] for r in results), strict=True)
    ]


def predicted_bubble(cfg: PipelineConfig, results: list[dict], messages: bool) -> float:
    """The bubble the schedule leaves with the measured per-rank forward and backward times
    (their imbalance, which the formula leaves out) and, if ``messages``, the measured time of
    one message on every hop between ranks."""
    forward = [r["forward_s"] for r in results]
    backward = [r["backward_s"] for r in results]
    makespan = simulate_seconds(
        SCHEDULES[cfg.schedule],
        cfg.stages,
        cfg.micro_batches,
        forward,
        backward,
        cfg.chunks,
        results[0]["message_s"] if messages else 0.0,
    )
    per_action = statistics.fmean(f + b for f, b in zip(forward, backward, strict=True))
    busy = cfg.micro_batches * cfg.chunks * per_action
    return 1 - busy / makespan


def log_training(
    run: Run, cfg: PipelineConfig, variant: str, results: list[dict], loss_rank: int = 0
) -> None:
    """One record per step (loss, step time) and a summary over the last ``timed_steps``."""
    config = run_config(run, cfg, results)
    steps = step_records(results, loss_rank)
    for row in steps:
        run.log.log(variant, config, row)
    timed = steps[-cfg.timed_steps :]
    summary = {
        "final_loss": steps[-1]["loss"],
        "median_step_s": statistics.median(r["step_s"] for r in timed),
        "timed_steps": len(timed),
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in results],
    }
    if variant in SCHEDULES:
        busy = list(zip(*(r["busy_s"] for r in results), strict=True))
        walls = [max(w) for w in zip(*(r["wall_s"] for r in results), strict=True)]
        measured = [measured_bubble_fraction(b, w) for b, w in zip(busy, walls, strict=True)]
        summary |= {
            "bubble_measured": statistics.median(measured),
            "bubble_formula": bubble_fraction(cfg.stages, cfg.micro_batches, cfg.chunks),
            "bubble_predicted": predicted_bubble(cfg, results, messages=False),
            "bubble_predicted_with_messages": predicted_bubble(cfg, results, messages=True),
            "bubble_measured_per_rank": [
                statistics.median(1 - b / w for b, w in zip(r["busy_s"], walls, strict=True))
                for r in results
            ],
            "forward_ms_per_micro_batch": [1e3 * r["forward_s"] for r in results],
            "backward_ms_per_micro_batch": [1e3 * r["backward_s"] for r in results],
            "message_ms": 1e3 * results[0]["message_s"],
            "message_bytes": message_bytes(cfg),
            "multiply_adds_per_row": [r["multiply_adds"] for r in results],
            "peak_in_flight": [r["peak_in_flight"] for r in results],
        }
    run.log.log(f"{variant}_summary", config, summary)
    lists = [name for name, value in summary.items() if isinstance(value, list)]
    per_rank = [
        {"rank": k, **{name: summary[name][k] for name in lists}} for k in range(len(results))
    ]
    print_table(per_rank, title=f"{variant}: per rank")
    shown = {k: v for k, v in summary.items() if k not in lists}
    print_table([shown], title=f"{variant}: {cfg.steps} steps on {config['data']}, {run.where}")


def log_long(run: Run, cfg: PipelineConfig, results: list[dict]) -> None:
    """One record per micro-batch count: every rank's peak memory and activations in flight."""
    config = run_config(run, cfg, results)
    rows = []
    for k, m in enumerate(cfg.long_micro_batches):
        per_rank = [r["counts"][k] for r in results]
        row = {
            "micro_batches": m,
            "peak_memory_bytes": [c["peak_memory_bytes"] for c in per_rank],
            "growth_bytes": [c["peak_memory_bytes"] - c["start_memory_bytes"] for c in per_rank],
            "peak_in_flight": [c["peak_in_flight"] for c in per_rank],
            "step_s": max(c["step_s"] for c in per_rank),
        }
        run.log.log(f"long_{cfg.schedule}", config, row)
        rows.append({
            "micro_batches": m,
            "peak_mib": max(row["peak_memory_bytes"]) / 2**20,
            "growth_mib": max(row["growth_bytes"]) / 2**20,
            "peak_in_flight": row["peak_in_flight"],
            "step_s": row["step_s"],
        })  # fmt: skip
    print_table(rows, title=f"--long {cfg.schedule}: peak memory per rank vs micro-batches")


if __name__ == "__main__":
    run_main(main)
