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
import copy
import os
import time
from dataclasses import asdict, dataclass, replace
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
    require_positive,
    run_main,
    start_run,
)
from effdl.data.digits import DigitsData, DigitsDataError, load_digits_tensors
from effdl.parallel import (
    ColumnParallelLinear,
    ParallelLayerNorm,
    ParallelMLP,
    ParallelTransformerBlock,
    RowParallelLinear,
    accumulated_backward,
    available_cores,
    cpu_threads,
    init_from_env,
    share_cpu,
    spawn,
)
from effdl.profiling.timing import RegionTimer, TimingStats, synchronize

TASK = "parallelism"
LEVELS = ("mlp", "norm", "block")
BACKENDS = ("gloo", "nccl")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}
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
        require_positive(self, "world_size", "steps", "batch", "hidden", "d_model", "heads")
        require_positive(
            self, "sweep_world", "bench_batch", "bench_width", "bench_iters", "bench_rounds"
        )
        require_positive(self, "lr", minimum=0)
        require_positive(self, "warmup", "threads", minimum=0)
        if self.warmup >= self.steps:
            raise UsageError(f"--warmup {self.warmup} leaves no timed step of --steps {self.steps}")
        for world in (*self.world_size, *self.sweep_world):
            for name in ("hidden", "d_model", "heads"):
                if getattr(self, name) % world:
                    raise UsageError(f"--{name.replace('_', '-')} must divide by {world} ranks")
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


# ------------------------------------------------------------------------------------ models
class RowTokenClassifier(nn.Module):
    """Image rows as tokens: (N, C, H, W) -> H tokens of C*W pixels -> linear embedding plus a
    learned position embedding -> ``block`` -> LayerNorm -> mean over tokens -> class logits."""

    def __init__(self, image_shape: tuple[int, int, int], block: nn.Module, d_model: int) -> None:
        super().__init__()
        channels, height, width = image_shape
        self.embed = nn.Linear(channels * width, d_model)
        self.position = nn.Parameter(0.02 * torch.randn(height, d_model))
        self.block = block
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = images.permute(0, 2, 1, 3).flatten(2)
        return self.head(self.norm(self.block(self.embed(tokens) + self.position)).mean(1))


def reference_model(level: str, cfg: TensorParallelConfig, image_shape, seed: int) -> nn.Module:
    """The single-process model of ``level``; the same ``seed`` gives the same weights."""
    torch.manual_seed(seed)
    features = image_shape[0] * image_shape[1] * image_shape[2]
    if level == "block":
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.heads, cfg.hidden, dropout=0.0, activation=cfg.activation,
            batch_first=True, norm_first=True,
        )  # fmt: skip
        model = RowTokenClassifier(image_shape, layer, cfg.d_model)
    else:
        norm = [nn.LayerNorm(cfg.hidden)] if level == "norm" else []
        first, last = nn.Linear(features, cfg.hidden), nn.Linear(cfg.hidden, 10)
        model = nn.Sequential(nn.Flatten(), first, *norm, ACTIVATIONS[cfg.activation](), last)
    return model.to(DTYPES[cfg.dtype])


def parallelize(level: str, model: nn.Module) -> nn.Module:
    """The tensor-parallel twin of ``reference_model(level)`` over the default process group
    (this rank's shards of its weights; replicated layers are used as they are)."""
    if level == "block":
        model.block = ParallelTransformerBlock.from_encoder_layer(model.block)
        return model
    if level == "mlp":
        flatten, first, act, last = model
        return nn.Sequential(flatten, ParallelMLP.from_linears(first, act, last))
    flatten, first, norm, act, last = model
    return nn.Sequential(
        flatten,
        ColumnParallelLinear.from_linear(first, gather_output=False),
        ParallelLayerNorm.from_layer_norm(norm),
        act,
        RowParallelLinear.from_linear(last, input_is_parallel=True),
    )


# ---------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class TrainResult:
    losses: list[float]
    test_accuracy: float
    step_time: TimingStats  # seconds, the steps after warm-up


def batch_indices(n_train: int, cfg: TensorParallelConfig, seed: int) -> list[torch.Tensor]:
    """The rows of every step: seeded epoch permutations, so every rank and the reference see
    the same batches in the same order."""
    g = torch.Generator().manual_seed(seed)
    epochs = -(-cfg.steps * cfg.batch // n_train)
    order = torch.cat([torch.randperm(n_train, generator=g) for _ in range(epochs)])
    return list(order[: cfg.steps * cfg.batch].view(cfg.steps, cfg.batch))


def train(
    model: nn.Module,
    data: DigitsData,
    cfg: TensorParallelConfig,
    seed: int,
    device,
    parts: int = 1,
) -> TrainResult:
    """``cfg.steps`` Adam steps of cross-entropy on the seeded batches, each batch's gradient
    accumulated over ``parts`` slices (:func:`effdl.parallel.accumulated_backward`); the loss of
    each step (before its update), the test accuracy after the last, and the step times."""
    dtype = DTYPES[cfg.dtype]
    model.to(device)
    x_train, y_train = data.x_train.to(device, dtype), data.y_train.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    timer, losses = RegionTimer(device), []
    for step, rows in enumerate(batch_indices(len(y_train), cfg, seed)):
        rows = rows.to(device)
        if step >= cfg.warmup:
            timer.start()
        optimizer.zero_grad(set_to_none=True)
        loss = accumulated_backward(model, x_train[rows], y_train[rows], parts)
        optimizer.step()
        if step >= cfg.warmup:
            timer.stop()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(data.x_test.to(device, dtype))
    accuracy = (logits.argmax(-1).cpu() == data.y_test).float().mean().item()
    return TrainResult(losses, accuracy, timer.stats())


def rank_device(backend: str) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


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
    return train(model, data, cfg, seed, rank_device(cfg.backend))


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
    level: str,
    cfg: TensorParallelConfig,
    data: DigitsData,
    seed: int,
    device,
    parts: tuple[int, ...] = (1,),
) -> list[TrainResult]:
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


def max_relative_gap(curve: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))


def cpu_config(world: int, cfg: TensorParallelConfig) -> dict:
    """The CPU share of each rank of ``world`` (see :func:`use_cpu_share`)."""
    return {
        "cpu_cores": os.cpu_count(),
        "cores_available": available_cores(),
        "threads_per_rank": cpu_threads(world, cfg.threads),
        "load_avg_1min": os.getloadavg()[0],  # other work on the host skews the CPU timings
    }


def run_config(level: str, world: int, cfg: TensorParallelConfig, source: str) -> dict:
    keys = ("steps", "batch", "lr", "hidden", "d_model", "heads", "activation", "warmup", "dtype",
            "backend")  # fmt: skip
    return {
        "level": level,
        "world_size": world,
        "data": source,
        **cpu_config(world, cfg),
        **{k: getattr(cfg, k) for k in keys},
    }


def result_metrics(result: TrainResult) -> dict:
    return {
        "losses": result.losses,
        "final_loss": result.losses[-1],
        "test_accuracy": result.test_accuracy,
        **{f"step_ms_{k}": v * 1e3 for k, v in asdict(result.step_time).items() if k != "n"},
        "timed_steps": result.step_time.n,
    }


# ------------------------------------------------------------------------------ DTensor bench
def time_mlps(rank: int, world: int, cfg: TensorParallelConfig, seed: int) -> list[dict]:
    """Forward+backward of ``width -> 4 width -> width`` MLPs (ReLU): ours (ParallelMLP) and
    torch's ColwiseParallel/RowwiseParallel from the same weights. Each round starts all ranks
    together (synchronize, barrier) and times ``bench_iters`` iterations of one model by the
    wall clock until its GPU work is done, so the time holds both ranks' host work and the
    waits in the collectives (GPU events on one rank would book the other rank's lateness to
    whichever model's collective absorbs it). Rounds alternate the models. One row per width
    (milliseconds per iteration, rank 0's clock)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    use_cpu_share(rank, world, cfg)
    device = rank_device(cfg.backend)
    mesh = init_device_mesh(device.type, (world,))
    rows = []
    for width in cfg.bench_width:
        torch.manual_seed(seed)
        full = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
        full = full.to(device, DTYPES[cfg.dtype])
        ours = ParallelMLP.from_linears(full[0], full[1], full[2])
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        theirs = parallelize_module(copy.deepcopy(full), mesh, plan)
        x = torch.randn(cfg.bench_batch, width, device=device, dtype=DTYPES[cfg.dtype])
        models = {"ours": ours, "dtensor": theirs}
        times: dict[str, list[float]] = {name: [] for name in models}
        for rnd in range(cfg.warmup + cfg.bench_rounds):
            for name, model in models.items():
                synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(cfg.bench_iters):
                    model.zero_grad(set_to_none=True)
                    model(x).sum().backward()
                synchronize(device)
                if rnd >= cfg.warmup:
                    times[name].append((time.perf_counter() - start) / cfg.bench_iters)
        gap = (ours(x) - theirs(x)).abs().max().item()
        for name, seconds in times.items():
            stats = TimingStats.from_times(seconds).as_dict()
            ms = {f"fwd_bwd_ms_{k}": v * 1e3 for k, v in stats.items() if k != "n"}
            rows.append({"impl": name, "width": width, **ms, "max_abs_output_diff": gap})
    return rows


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
    source = data.source
    rows = []
    for level in cfg.level:
        parallel = {} if cfg.reference else {
            w: train_parallel(level, w, cfg, data, seed) for w in cfg.world_size
        }  # fmt: skip
        if not leader:
            continue
        device = reference_device(cfg, run)
        reference, halves = train_reference(level, cfg, data, seed, device, parts=(1, 2))
        log = run.logs[Path(LOGS["curves"]).stem]
        log.log(f"{level}_reference", run_config(level, 1, cfg, source), result_metrics(reference))
        rows.append(summary_row(level, "reference", reference))
        gap = max_relative_gap(halves.losses, reference.losses)
        metrics = {**result_metrics(halves), "max_rel_gap_vs_reference": gap}
        log.log(f"{level}_reference_halves", run_config(level, 1, cfg, source), metrics)
        rows.append({**summary_row(level, "reference, halves", halves), "max_rel_gap": gap})
        for world, result in parallel.items():
            gap = max_relative_gap(result.losses, reference.losses)
            metrics = {**result_metrics(result), "max_rel_gap_vs_reference": gap}
            log.log(f"{level}_parallel", run_config(level, world, cfg, source), metrics)
            rows.append({**summary_row(level, f"parallel x{world}", result), "max_rel_gap": gap})
    if leader:
        print_table(rows, title=f"{source}, {cfg.steps} steps on {run.where} ({cfg.dtype})")


def summary_row(level: str, mode: str, result: TrainResult) -> dict:
    return {
        "level": level,
        "mode": mode,
        "first_loss": result.losses[0],
        "final_loss": result.losses[-1],
        "test_acc": result.test_accuracy,
        "step_ms": result.step_time.median * 1e3,
    }


def sweep_world(cfg, data: DigitsData, seed: int, run) -> None:
    source = data.source
    if dist.is_initialized():
        raise UsageError("--sweep-world starts its own processes: run it without torchrun")
    log, rows = run.logs[Path(LOGS["step_time"]).stem], []
    for level in cfg.level:
        (reference,) = train_reference(level, cfg, data, seed, reference_device(cfg, run))
        results = {"reference": (1, reference)}
        results |= {
            f"parallel x{w}": (w, train_parallel(level, w, cfg, data, seed))
            for w in cfg.sweep_world
        }
        for mode, (world, result) in results.items():
            variant = f"{level}_{mode.split()[0]}"
            log.log(variant, run_config(level, world, cfg, source), result_metrics(result))
            rows.append(summary_row(level, mode, result))
    print_table(rows, title=f"step time vs world size on {run.where} ({os.cpu_count()} cores)")


def compare_dtensor(cfg, seed: int, run, leader: bool) -> None:
    rows_per_world = {}
    for world in cfg.world_size:
        if dist.is_initialized():
            rows_per_world[world] = time_mlps(dist.get_rank(), world, cfg, seed)
        else:
            rows_per_world[world] = spawn(time_mlps, world, cfg, seed, backend=cfg.backend)[0]
    if not leader:
        return
    log, table = run.logs[Path(LOGS["dtensor"]).stem], []
    for world, rows in rows_per_world.items():
        for row in rows:
            config = {"world_size": world, "batch": cfg.bench_batch, "width": row["width"],
                      "hidden": 4 * row["width"], "dtype": cfg.dtype, "backend": cfg.backend,
                      "iters": cfg.bench_iters, "warmup": cfg.warmup,
                      **cpu_config(world, cfg)}  # fmt: skip
            metrics = {k: v for k, v in row.items() if k not in ("impl", "width")}
            log.log(f"mlp_{row['impl']}", config, metrics)
            table.append({"world": world, "width": row["width"], "impl": row["impl"],
                          "median_ms": row["fwd_bwd_ms_median"]})  # fmt: skip
    print_table(table, title=f"MLP forward+backward, ours vs DTensor, on {run.where}")


if __name__ == "__main__":
    run_main(main)
