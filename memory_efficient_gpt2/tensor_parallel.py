"""Tensor-parallel training of small image classifiers against single-process training.

Levels (``--level``, several at once allowed), each a single-process model and its sharded twin
built from the same seeded weights (effdl.parallel.tensor):

    mlp    Flatten -> Linear -> ReLU -> Linear          as ParallelMLP (column -> row parallel)
    norm   Flatten -> Linear -> LayerNorm -> ReLU -> Linear, the LayerNorm over sharded features
    block  image rows as tokens (8 rows of 8 pixels = 8 tokens on digits) -> a Transformer
           encoder block with its heads and MLP split across ranks -> mean-pool -> Linear

Both train on the same batches (scikit-learn's digits by default, ``--data`` CIFAR-10 batches)
with Adam; the run logs each per-step loss curve, the test accuracy, the median step time after
``--warmup`` steps, and the largest relative gap between the parallel and the reference curve.
Beside them it logs the reference trained once more with each batch's gradient accumulated over
its two halves (``<level>_reference_halves``): the same math summed in another order, so its gap
to the reference is what rounding alone does to the training, the scale to read a parallel gap on.

The MLPs use ReLU (``--activation``, the assignment's levels) or GELU. With ReLU a float32 curve
is at the mercy of single gates: a pre-activation within rounding of zero opens in one run and
stays shut in the other, Adam turns that one sample's gradient into a step of about the learning
rate on the unit's weights, and the runs part (the single-process reference against its own
halves twin too). GELU has no kink, so the gap stays at rounding size and the curves can show
the parallel math equal to the single-process one in float32 as well.

    python memory_efficient_gpt2/tensor_parallel.py --quick                        # CPU, gloo
    python memory_efficient_gpt2/tensor_parallel.py --world-size 2 4 --level mlp norm block
    python memory_efficient_gpt2/tensor_parallel.py --reference --level norm       # 1 process
    python memory_efficient_gpt2/tensor_parallel.py --sweep-world 1,2,4            # step time
    python memory_efficient_gpt2/tensor_parallel.py --compare-dtensor              # vs DTensor
    torchrun --nproc-per-node 2 memory_efficient_gpt2/tensor_parallel.py --backend nccl

Without torchrun the ranks are local processes (effdl.parallel.launch.spawn; gloo on the CPU,
or NCCL with one GPU per rank). Under torchrun every rank trains and rank 0 also trains the
reference and writes the logs. Each rank, and the reference in its own process, takes
``--threads`` intra-op threads (default: an equal share of the cores, so every world size runs
on the same CPU) and its own block of cores; the logs record the share.
"""

from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    print_table,
    require_choices,
    require_fits,
    require_positive,
    require_processes,
    run_main,
    start_run,
)
from effdl.data.digits import DigitsData, DigitsDataError, load_digits_tensors
from effdl.parallel import init_from_env, share_cpu, spawn
from effdl.parallel.classifiers import (
    ACTIVATIONS,
    LEVELS,
    TrainResult,
    level_model,
    parallelize,
    train_classifier,
)
from effdl.parallel.dtensor_comparison import time_parallel_mlps
from effdl.parallel.launch import cpu_share_record, round_robin_device

TASK = "parallelism"
BACKENDS = ("gloo", "nccl")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
LOGS = {
    "curves": "tensor_parallel_curves.jsonl",
    "step_time": "tensor_parallel_step_time.jsonl",
    "dtensor": "tensor_parallel_dtensor.jsonl",
}


@dataclass(frozen=True)
class TensorParallelConfig:
    """One invocation: which levels, how many ranks, the training and benchmark sizes."""

    level: tuple[str, ...] = LEVELS
    world_size: tuple[int, ...] = (2,)
    backend: str = "gloo"
    reference: bool = False  # single-process training only
    sweep_world: tuple[int, ...] = ()  # step time per world size instead of curves
    compare_dtensor: bool = False  # fwd+bwd time of our MLP against DTensor's
    steps: int = 200
    batch: int = 128
    lr: float = 3e-3
    hidden: int = 256  # MLP hidden features (mlp, norm) and the block's feed-forward width
    d_model: int = 64
    heads: int = 4
    activation: str = "relu"  # of every level's MLP (ACTIVATIONS)
    warmup: int = 5  # steps (or benchmark iterations) left out of the timing
    dtype: str = "float32"
    data: Path | None = None
    bench_batch: int = 1024
    bench_width: tuple[int, ...] = (64, 512)  # MLP width -> 4 x width -> width
    bench_iters: int = 20  # iterations per timed round
    bench_rounds: int = 10  # timed rounds per model, alternating, after --warmup rounds
    threads: int = 0  # intra-op threads per rank; 0: available cores // world size

    def validate(self) -> None:
        require_choices(self, "level", LEVELS)
        require_choices(self, "backend", BACKENDS)
        require_choices(self, "dtype", DTYPES)
        require_choices(self, "activation", ACTIVATIONS)
        require_processes(self, "world_size", "sweep_world", minimum=1)
        require_positive(self, "world_size", "steps", "batch", "hidden", "d_model", "heads")
        require_positive(
            self, "sweep_world", "bench_batch", "bench_width", "bench_iters", "bench_rounds"
        )
        require_positive(self, "lr", minimum=0)
        require_positive(self, "warmup", minimum=0)
        require_processes(self, "threads")
        if self.warmup >= self.steps:
            raise UsageError(f"--warmup {self.warmup} leaves no timed step of --steps {self.steps}")
        for flag, worlds in (
            ("--world-size", self.world_size),
            ("--sweep-world", self.sweep_world),
        ):
            for world, name in itertools.product(worlds, ("hidden", "d_model", "heads")):
                if getattr(self, name) % world:
                    raise UsageError(f"{flag} {world} does not divide --{name.replace('_', '-')} "
                                     f"{getattr(self, name)}")  # fmt: skip
        numel = (self.batch + self.d_model) * self.hidden + (self.bench_batch + max(self.bench_width)) * max(self.bench_width)  # fmt: skip
        require_fits("--batch --hidden --d-model --bench-batch --bench-width", numel, "the MLP's activations and weights")  # fmt: skip
        if self.d_model % self.heads:
            raise UsageError(f"--d-model {self.d_model} must divide by --heads {self.heads}")


FULL = TensorParallelConfig()
QUICK = TensorParallelConfig(
    steps=12, batch=64, hidden=32, d_model=16, warmup=2, bench_batch=64, bench_width=(32,),
    bench_iters=2, bench_rounds=2,
)  # fmt: skip


def world_list(text: str) -> tuple[int, ...]:
    """argparse type of ``--sweep-world``: comma-separated world sizes, e.g. ``1,2,4``."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4, got {text!r}") from None


def parse_args() -> tuple[argparse.Namespace, TensorParallelConfig]:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/parallelism")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("level", nargs="+", choices=LEVELS, type=str)
    flags.add("world_size", nargs="+", type=int, help="ranks of the parallel runs")
    flags.add("backend", choices=BACKENDS)
    flags.add("reference", action="store_true", help="train single-process only")
    flags.add("sweep_world", type=world_list, help="time training steps at these world sizes")
    flags.add("compare_dtensor", action="store_true", help="time our MLP against DTensor's")
    flags.add("steps", type=int)
    flags.add("batch", type=int, help="images per step")
    flags.add("lr", type=float, help="Adam's learning rate")
    flags.add("hidden", type=int)
    flags.add("d_model", type=int)
    flags.add("heads", type=int)
    flags.add("activation", choices=sorted(ACTIVATIONS), help="of every level's MLP")
    flags.add("warmup", type=int)
    flags.add("dtype", choices=sorted(DTYPES))
    flags.add("data", type=Path, help="CIFAR-10 python batches; default: scikit-learn digits")
    flags.add("bench_batch", type=int, help="rows of the DTensor comparison's input")
    flags.add("bench_width", nargs="+", type=int)
    flags.add("bench_iters", type=int, help="iterations per timed round of the DTensor comparison")
    flags.add("bench_rounds", type=int, help="timed rounds per model of the DTensor comparison")
    flags.add("threads", type=int, help="intra-op threads per rank; 0: cores // world size")
    args = p.parse_args()
    return args, flags.resolve(args)


# ---------------------------------------------------------------------------------- training
def reference_model(
    level: str, cfg: TensorParallelConfig, image_shape: tuple[int, int, int], seed: int
) -> nn.Module:
    """The single-process model of ``level`` with this run's sizes (same seed, same weights)."""
    return level_model(
        level, image_shape, hidden=cfg.hidden, d_model=cfg.d_model, heads=cfg.heads,
        activation=cfg.activation, dtype=DTYPES[cfg.dtype], seed=seed,
    )  # fmt: skip


def train(
    model: nn.Module, data: DigitsData, cfg: TensorParallelConfig, seed: int, device, parts: int = 1
) -> TrainResult:
    """:func:`effdl.parallel.classifiers.train_classifier` with this run's settings."""
    return train_classifier(
        model, data, steps=cfg.steps, batch=cfg.batch, lr=cfg.lr, warmup=cfg.warmup,
        dtype=DTYPES[cfg.dtype], seed=seed, device=device, parts=parts,
    )  # fmt: skip


def use_cpu_share(rank: int, world: int, cfg: TensorParallelConfig) -> None:
    """Split this host's cores among its ranks (effdl.parallel.launch.share_cpu), so world sizes
    are compared on the same CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    share_cpu(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world)), cfg.threads)


def train_rank(
    rank: int, world: int, level: str, cfg: TensorParallelConfig, data: DigitsData, seed: int
) -> TrainResult:
    """One rank of a parallel run (for :func:`spawn`): the same data, seeds and batches as the
    reference, the model sharded."""
    use_cpu_share(rank, world, cfg)
    model = parallelize(level, reference_model(level, cfg, data.image_shape, seed))
    return train(model, data, cfg, seed, round_robin_device(cfg.backend, dist.get_rank()))


def train_parallel(
    level: str, world: int, cfg: TensorParallelConfig, data: DigitsData, seed: int
) -> TrainResult:
    """Rank 0's result of a parallel run: in local processes, or here under torchrun."""
    if dist.is_initialized():
        return train_rank(dist.get_rank(), world, level, cfg, data, seed)
    return spawn(train_rank, world, level, cfg, data, seed, backend=cfg.backend)[0]


def train_single(
    rank: int,
    world: int,
    level: str,
    cfg: TensorParallelConfig,
    data: DigitsData,
    seed: int,
    device: torch.device,
    parts: tuple[int, ...] = (1,),
) -> list[TrainResult]:
    """The reference: the unsharded model on the same data, seeds and batches, trained once per
    entry of ``parts`` (each batch's gradient accumulated over that many slices), from the same
    weights each time. The process-group arguments let :func:`spawn` run it (``world`` = 1; it
    communicates nothing)."""
    use_cpu_share(0, 1, cfg)
    return [
        train(reference_model(level, cfg, data.image_shape, seed), data, cfg, seed, device, n)
        for n in parts
    ]


def train_reference(
    level: str, cfg: TensorParallelConfig, data: DigitsData, seed: int, device: torch.device,
    parts: tuple[int, ...] = (1,),
) -> list[TrainResult]:  # fmt: skip
    """:func:`train_single` in a process of its own, with the CPU threads it is given there (this
    process stays single-threaded so that it can fork, see :func:`main`), unless this process
    is a torchrun rank or forks no ranks (``--reference``)."""
    if dist.is_initialized() or cfg.reference:
        return train_single(0, 1, level, cfg, data, seed, device, parts)
    return spawn(train_single, 1, level, cfg, data, seed, device, parts)[0]


def reference_device(cfg: TensorParallelConfig, run) -> torch.device:
    """Where the reference trains: ``--device`` for a reference-only run, else the kind of
    device the ranks use (the CPU with gloo, this process's GPU with NCCL)."""
    if cfg.reference:
        return run.device
    return (
        torch.device("cuda", torch.cuda.current_device())
        if cfg.backend == "nccl"
        else torch.device("cpu")
    )


def run_config(level: str, world: int, cfg: TensorParallelConfig, source: str) -> dict:
    keys = ("steps", "batch", "lr", "hidden", "d_model", "heads", "activation", "warmup", "dtype",
            "backend")  # fmt: skip
    return {
        "level": level,
        "world_size": world,
        "data": source,
        **cpu_share_record(world, cfg.threads),
        **{k: getattr(cfg, k) for k in keys},
    }


def time_mlps(rank: int, world: int, cfg: TensorParallelConfig, seed: int) -> list[dict]:
    """One rank of the DTensor comparison (for :func:`spawn`): its CPU share and device, then
    :func:`effdl.parallel.dtensor_comparison.time_parallel_mlps` (rank 0's clock is logged)."""
    use_cpu_share(rank, world, cfg)
    return time_parallel_mlps(
        round_robin_device(cfg.backend, dist.get_rank()), cfg.bench_width, batch=cfg.bench_batch,
        dtype=DTYPES[cfg.dtype], iters=cfg.bench_iters, rounds=cfg.bench_rounds,
        warmup_rounds=cfg.warmup, seed=seed,
    )  # fmt: skip


# -------------------------------------------------------------------------------------- main
def main() -> None:
    args, cfg = parse_args()
    torchrun = "RANK" in os.environ and not cfg.reference
    if not (torchrun or cfg.reference):
        # Ranks are forked from here, and a child forked after this process ran OpenMP-parallel
        # kernels can hang in its first one (libgomp's thread pool does not survive fork).
        torch.set_num_threads(1)
    if torchrun:
        init_from_env(cfg.backend)
        cfg = replace(cfg, world_size=(dist.get_world_size(),))
    try:
        data = load_digits_tensors(cfg.data, seed=args.seed)
    except DigitsDataError as e:
        raise UsageError(f"--data: {e}") from None
    leader = not torchrun or dist.get_rank() == 0
    run = start_run(args, task=TASK, logs=list(LOGS.values()) if leader else [])
    if cfg.compare_dtensor:
        compare_dtensor(cfg, args.seed, run, leader)
    elif cfg.sweep_world:
        sweep_world(cfg, data, args.seed, run)
    else:
        learning_curves(cfg, data, args.seed, run, leader)
    if torchrun:
        dist.destroy_process_group()


def learning_curves(cfg, data: DigitsData, seed: int, run, leader: bool) -> None:
    """Per level the reference and its halves twin, then each parallel run, each logged as it
    finishes (by rank 0 under torchrun, where the other ranks train the parallel runs only)."""
    log, rows = run.logs[Path(LOGS["curves"]).stem] if leader else None, []
    for level in cfg.level:
        if leader:
            device, config = reference_device(cfg, run), run_config(level, 1, cfg, data.source)
            reference, halves = train_reference(level, cfg, data, seed, device, parts=(1, 2))
            log_run(log, rows, config, "reference", reference)
            log_run(log, rows, config, "reference, halves", halves, reference)
        for world in () if cfg.reference else cfg.world_size:
            result = train_parallel(level, world, cfg, data, seed)
            if leader:
                config = run_config(level, world, cfg, data.source)
                log_run(log, rows, config, f"parallel x{world}", result, reference)
    if leader:
        print_table(rows, title=f"{data.source}, {cfg.steps} steps on {run.where} ({cfg.dtype})")


def log_run(log, rows: list, config: dict, mode: str, result: TrainResult,
            reference: TrainResult | None = None) -> None:  # fmt: skip
    """Log one finished run as ``<level>_<mode>`` (``reference``, ``reference_halves`` or
    ``parallel``), with its largest relative gap to ``reference`` when given, and add its
    table row to ``rows``."""
    level = config["level"]
    metrics = result.metrics()
    row = {
        "level": level, "mode": mode, "first_loss": result.losses[0],
        "final_loss": result.losses[-1], "test_acc": result.test_accuracy,
        "step_ms": result.step_time.median * 1e3,
    }  # fmt: skip
    if reference is not None:
        gap = result.max_relative_gap(reference)
        metrics["max_rel_gap_vs_reference"] = row["max_rel_gap"] = gap
    log.log(f"{level}_{mode.split(' x')[0].replace(', ', '_')}", config, metrics)
    rows.append(row)


def sweep_world(cfg, data: DigitsData, seed: int, run) -> None:
    if dist.is_initialized():
        raise UsageError("--sweep-world starts its own processes: run it without torchrun")
    log, rows = run.logs[Path(LOGS["step_time"]).stem], []
    for level in cfg.level:
        (reference,) = train_reference(level, cfg, data, seed, reference_device(cfg, run))
        log_run(log, rows, run_config(level, 1, cfg, data.source), "reference", reference)
        for w in cfg.sweep_world:
            result = train_parallel(level, w, cfg, data, seed)
            log_run(log, rows, run_config(level, w, cfg, data.source), f"parallel x{w}", result)
    print_table(rows, title=f"step time vs world size on {run.where} ({os.cpu_count()} cores)")


def compare_dtensor(cfg, seed: int, run, leader: bool) -> None:
    log, table = run.logs[Path(LOGS["dtensor"]).stem] if leader else None, []
    for world in cfg.world_size:
        if dist.is_initialized():
            rows = time_mlps(dist.get_rank(), world, cfg, seed)
        else:
            rows = spawn(time_mlps, world, cfg, seed, backend=cfg.backend)[0]
        if not leader:
            continue
        for row in rows:  # logged as each world size is measured
            config = {"world_size": world, "batch": cfg.bench_batch, "width": row["width"],
                      "hidden": 4 * row["width"], "dtype": cfg.dtype, "backend": cfg.backend,
                      "iters": cfg.bench_iters, "warmup": cfg.warmup,
                      **cpu_share_record(world, cfg.threads)}  # fmt: skip
            metrics = {k: v for k, v in row.items() if k not in ("impl", "width")}
            log.log(f"mlp_{row['impl']}", config, metrics)
            table.append({"world": world, "width": row["width"], "impl": row["impl"],
                          "median_ms": row["fwd_bwd_ms_median"]})  # fmt: skip
    if leader:
        print_table(table, title=f"MLP forward+backward, ours vs DTensor, on {run.where}")


if __name__ == "__main__":
    run_main(main)
