"""Time and memory of a SwiGLU MLP stack: reference, torch.utils.checkpoint, and each checkpoint level.

For every config (batch_size, seq_len, hidden_dim, intermediate_size, num_layers) and dtype, all
variants are built once (same seed) and kept alive. After ``--settle`` seconds of untimed
reference steps at the first config, each variant is warmed up (``--warmup`` steps and
``--warmup-time`` seconds at least), then runs a few synchronized steps (forward, then backward
of a fixed random output gradient) with the peak-memory counter reset before each: its own peak
is the counter less what the other, idle variants hold (their times are logged as
``step_synced_s_*``; they also charge each step the host's latency to its first kernel). Then
the variants take turns in ``--rounds`` rounds of short chunks of back-to-back steps, as a
training loop runs them, with no synchronize in between: at least ``--reps`` steps and
``--min-time`` seconds per variant. A step's time is its chunk's time over its steps, with
CUDA events around each forward and backward for the split (``time_config`` says why). Medians
are logged and compared as ratios within this run, with a bootstrap interval for level 0 over the
reference (``effdl.profiling.timing.median_ratio_ci`` over the chunks, paired by round). Variants:

  reference     SwigluMLP (nn.Linear) under plain autograd
  checkpoint    the same module inside torch.utils.checkpoint(use_reentrant=False), per layer
  level0/1/2    MemoryOptimizedSwigluMLP at CheckpointLevel 0 (save all), 1 (recompute all),
                2 (save xW and xV, recompute the elementwise part)
  level0_torch  level 0 forced onto the PyTorch elementwise path (CUDA only: what one kernel
                per elementwise step buys over aten's chain)
  level0_jiterator, level0_triton
                level 0 forced onto the jiterator / Triton kernels (CUDA only: the two fused
                paths compared at each size, the data behind
                effdl.ops.swiglu.TRITON_MIN_ELEMENTS)

The stack is residual by default (x + mlp(x) per layer, keeping activations at unit scale across
random layers); --no-residual stacks the layers bare, as in the assignment's test model.
Achieved TFLOP/s is set against a dense GEMM ceiling measured in this same run
(effdl.profiling.flops.measure_matmul_tflops, n=8192); the floor of each variant is its GEMM
FLOPs at that ceiling plus its elementwise bytes at the measured copy bandwidth.

    python swiglu_checkpoint/benchmark.py --quick --device cpu     # smoke run, < 1 min on a CPU
    python swiglu_checkpoint/benchmark.py --device cuda            # full grid, ~7 min on an H100
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from effdl.cli import (
    UsageError,
    base_parser,
    device_from_arg,
    print_table,
    run_main,
    seed_everything,
)
from effdl.gc_pause import gc_paused
from effdl.models.swiglu import Checkpointed, MLPStack, SwigluMLP
from effdl.ops.swiglu import (
    CheckpointLevel,
    MemoryOptimizedSwigluMLP,
    elementwise_ops,
)
from effdl.profiling.flops import measure_copy_bandwidth, measure_matmul_tflops
from effdl.profiling.timing import (
    GIB,
    RegionTimer,
    TimingStats,
    median_ratio_ci,
    peak_memory,
)
from effdl.results import RunLog

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LEVEL_VARIANTS = {
    "level0": CheckpointLevel.SAVE_ALL,
    "level1": CheckpointLevel.RECOMPUTE_ALL,
    "level2": CheckpointLevel.RECOMPUTE_ELEMENTWISE,
    "level0_torch": CheckpointLevel.SAVE_ALL,
    "level0_jiterator": CheckpointLevel.SAVE_ALL,
    "level0_triton": CheckpointLevel.SAVE_ALL,
}
FORCED_BACKEND = {
    "level0_torch": "torch",
    "level0_jiterator": "jiterator",
    "level0_triton": "triton",
}
VARIANTS = [
    "reference",
    "checkpoint",
    "level0",
    "level2",
    "level1",
    "level0_torch",
    "level0_jiterator",
    "level0_triton",
]
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "level0_torch"]  # CUDA's fallback path only
MEMORY_STEPS = 3
MAX_REPS = 4000

# GEMMs of 2*N*H*I FLOPs per layer and step: 3 forward + 6 backward, plus the recomputed ones.
GEMMS = {
    "reference": 9,
    "checkpoint": 12,
    "level0": 9,
    "level2": 9,
    "level1": 11,
    "level0_torch": 9,
    "level0_jiterator": 9,
    "level0_triton": 9,
}
# Elementwise traffic per layer and step, in passes over an (N x I) tensor (one read or write).
# aten (reference): silu 2 + mul 3 forward, mul-backward 6 + silu-backward 3; checkpoint re-runs
# the forward pair. Fused Triton: gate 3; backward 5, or 6 when it also rebuilds g for dU.
# jiterator: gate 3; backward 5, after a separate gate (3) where g is rebuilt for dU.
# PyTorch path: gate = silu 2 + mul_ 3; backward = silu 2 + silu_backward 3 + 2 muls 6 (+3 for g).
PASSES = {
    "aten": {"reference": 14, "checkpoint": 19},
    "triton": {"level0": 8, "level2": 9, "level1": 9},
    "jiterator": {"level0": 8, "level2": 11, "level1": 11},
    "torch": {"level0": 16, "level2": 19, "level1": 19},
}


@dataclass(frozen=True)
class Shape:
    batch_size: int
    seq_len: int
    hidden_dim: int
    intermediate_size: int
    num_layers: int

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def label(self) -> str:
        return (
            f"{self.batch_size}x{self.seq_len} h{self.hidden_dim} "
            f"i{self.intermediate_size} L{self.num_layers}"
        )

    def gemm_flops(self, variant: str) -> int:
        """GEMM FLOPs of one training step of the whole stack."""
        n, h, i = self.tokens, self.hidden_dim, self.intermediate_size
        return GEMMS[variant] * 2 * n * h * i * self.num_layers

    def elementwise_bytes(self, variant: str, backend: str, itemsize: int) -> int:
        passes = PASSES[backend][variant.split("_")[0]]
        return passes * self.tokens * self.intermediate_size * itemsize * self.num_layers


LARGE = Shape(4, 1024, 4096, 16384, 5)
GPU_GRID = [
    Shape(16, 128, 512, 2048, 2),
    Shape(32, 128, 512, 2048, 2),
    Shape(8, 512, 1024, 4096, 3),
    Shape(16, 512, 1024, 4096, 3),
    Shape(8, 1024, 2048, 8192, 4),
    LARGE,
    Shape(8, 1024, 4096, 16384, 5),
]
QUICK_GRID = [Shape(2, 16, 32, 96, 2), Shape(2, 32, 64, 192, 3)]


def parse_shape(text: str) -> Shape:
    try:
        values = [int(v) for v in text.split(",")]
        shape = Shape(*values)
    except (TypeError, ValueError):
        raise UsageError(
            f"--configs: {text!r} is not batch,seq,hidden,intermediate,layers (5 integers)"
        ) from None
    if min(values) <= 0:
        raise UsageError(f"--configs: {text!r} has a non-positive entry")
    return shape


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/swiglu")
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="batch,seq,hidden,intermediate,layers entries; default: the built-in grid",
    )
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], help=f"of {list(DTYPES)}")
    p.add_argument(
        "--variants",
        nargs="+",
        default=DEFAULT_VARIANTS,
        help=f"subset of {VARIANTS} (default: all but level0_torch)",
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed steps before the memory steps, at least"
    )
    p.add_argument(
        "--warmup-time",
        type=float,
        default=None,
        help="seconds of untimed, synchronized steps per variant before its memory steps, at "
        "least: first calls load kernels, pick GEMM algorithms and compile (default 0.5; 0 "
        "with --quick)",
    )
    p.add_argument("--reps", type=int, default=5, help="timed steps, at least")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="variants take turns this many times per config, each round a chunk of its "
        "timed steps (default 100; 3 with --quick)",
    )
    p.add_argument(
        "--min-time",
        type=float,
        default=None,
        help="seconds of timed steps per variant, at its synchronized step time "
        "(default 3; 0 with --quick)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=None,
        help="seconds of untimed reference steps at the first config before anything is timed "
        "(default 20 on CUDA, 0 with --quick or on a CPU)",
    )
    p.add_argument("--no-residual", action="store_true", help="bare stack: x = mlp(x)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 matmuls")
    return p.parse_args()


def build(variant: str, shape: Shape, dtype: torch.dtype, device, residual: bool) -> nn.Module:
    kw = {"device": device, "dtype": dtype}
    h, i = shape.hidden_dim, shape.intermediate_size
    if variant in LEVEL_VARIANTS:
        layers = [
            MemoryOptimizedSwigluMLP(
                h, i, LEVEL_VARIANTS[variant], elementwise=FORCED_BACKEND.get(variant, "auto"), **kw
            )
            for _ in range(shape.num_layers)
        ]
    else:
        layers = [SwigluMLP(h, i, **kw) for _ in range(shape.num_layers)]
        if variant == "checkpoint":
            layers = [Checkpointed(layer) for layer in layers]
    return MLPStack(layers, residual=residual)


def fresh_state(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class Contender:
    """One variant, alive for the whole config: its stack, input and output gradient, and the
    bytes it holds between steps (weights, x, dy)."""

    model: nn.Module
    x: torch.Tensor
    dy: torch.Tensor
    base: int


@dataclass
class Samples:
    """Raw measurements of one variant at one config."""

    fwd: list[float] = field(default_factory=list)  # per step, events around the forward
    bwd: list[float] = field(default_factory=list)  # per step, events around the backward
    step: list[float] = field(default_factory=list)  # per chunk: its time / its steps
    synced: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    base: int = 0
    chunks: int = 0
    chunk_steps: int = 0
    oom: bool = False

    def metrics(self, cuda: bool) -> dict:
        """Medians and spreads of the times, the peak memory; ``{"oom": True}`` after an OOM."""
        if self.oom:
            return {"oom": True}
        metrics = {
            **TimingStats.from_times(self.fwd).as_dict("fwd_s_"),
            **TimingStats.from_times(self.bwd).as_dict("bwd_s_"),
            **TimingStats.from_times(self.step).as_dict("step_s_"),
            **TimingStats.from_times(self.synced).as_dict("step_synced_s_"),
            "chunks": self.chunks,
            "chunk_steps": self.chunk_steps,
            "step_s_per_chunk": self.step,  # in round order, for paired comparisons
        }
        if cuda:
            metrics["peak_gib"] = max(self.peaks) / GIB
            metrics["base_gib"] = self.base / GIB  # weights, x, dy: held before the step
            metrics["activation_peak_gib"] = (max(self.peaks) - self.base) / GIB
        else:  # PyTorch keeps no allocator statistics on the CPU
            nan = float("nan")
            metrics.update(peak_gib=nan, base_gib=nan, activation_peak_gib=nan)
        return metrics


def build_contender(variant: str, shape: Shape, dtype: torch.dtype, device, args) -> Contender:
    """``variant``'s stack and data, seeded alike for every variant."""
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    seed_everything(args.seed)
    model = build(variant, shape, dtype, device, residual=not args.no_residual)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    size = (shape.batch_size, shape.seq_len, shape.hidden_dim)
    x = torch.randn(size, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    dy = torch.randn(size, device=device, dtype=dtype, generator=gen)
    base = torch.cuda.memory_allocated(device) - before if cuda else 0
    return Contender(model, x, dy, base)


def run_steps(
    variant: str,
    c: Contender,
    steps: int,
    fwd: RegionTimer | None = None,
    bwd: RegionTimer | None = None,
) -> None:
    """``steps`` training steps of ``c`` back to back (timed when given timers); the gradients
    are dropped before each step and after the last, so an idle variant holds only its base."""
    for _ in range(steps):
        c.model.zero_grad(set_to_none=True)
        c.x.grad = None
        if fwd is not None:
            fwd.start()
        y = c.model(c.x)
        if fwd is not None:
            fwd.stop()
            bwd.start()
        y.backward(c.dy)
        if bwd is not None:
            bwd.stop()
        del y
    c.model.zero_grad(set_to_none=True)
    c.x.grad = None


def warm_up(
    variant: str, c: Contender, steps: int, seconds: float, max_steps: int | None = MAX_REPS
) -> None:
    """At least ``steps`` synchronized steps and ``seconds`` of them (at most ``max_steps``): the
    first steps of a variant, of a shape, of a process pay one-off costs (kernel loading, GEMM
    heuristics, Triton and NVRTC compilation) that would otherwise inflate its synchronized
    steps, from which the number of timed steps is set."""
    device = c.x.device
    start, done = time.perf_counter(), 0
    while done < max(steps, 1) or (
        time.perf_counter() - start < seconds and (max_steps is None or done < max_steps)
    ):
        run_steps(variant, c, 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        done += 1


def settle(shape: Shape, dtype: torch.dtype, device, args) -> None:
    """Run the reference at ``shape`` untimed for ``args.settle`` seconds. On a freshly started
    GPU host the first half minute of a run was disturbed in three of four runs: at the first
    config (fp32 16x128, GPU-bound) chunk times of every variant scattered (the reference's
    slowest chunk 1.5-6.7x its fastest), while the configs after it repeated to 0.1%
    (reports/results/swiglu/runs_session12/)."""
    if args.settle <= 0:
        return
    print(f"settling: {args.settle:.0f} s of untimed reference steps at {shape.label}")
    c = build_contender("reference", shape, dtype, device, args)
    warm_up("reference", c, 1, args.settle, max_steps=None)
    del c
    fresh_state(device)


def measure_memory(variant: str, c: Contender, samples: Samples, args) -> None:
    """Warm ``c`` up, then run MEMORY_STEPS synchronized steps, each with the peak counter reset:
    their peaks less what the other (idle) variants hold are ``c``'s own, their times the
    ``step_synced_s_*`` entries."""
    device = c.x.device
    cuda = device.type == "cuda"
    warm_up(variant, c, args.warmup, args.warmup_time)
    synced = RegionTimer(device)
    samples.base = c.base
    for _ in range(MEMORY_STEPS):
        others = torch.cuda.memory_allocated(device) - c.base if cuda else 0
        with peak_memory(device) as mem, synced.region():
            run_steps(variant, c, 1)
        samples.peaks.append(mem.bytes - others)
    samples.synced += synced.times()


def time_config(
    shape: Shape, dtype: torch.dtype, variants: list[str], device, args
) -> dict[str, Samples]:
    """Time every variant at one config, all kept alive and taking turns in short chunks.

    Small configs take ~1 ms a step and are bound by the host's Python, whose speed drifts over
    seconds (other processes, CPU clocks); so does a GPU's clock under load. Each variant's
    ``n`` timed steps (at least ``--reps``, and ``--min-time`` seconds at its synchronized step
    time, at most MAX_REPS) are split into ``--rounds`` chunks, and every round runs one chunk of
    each variant, starting one variant later each round, after an untimed warm-up round: any
    drift is shared out over all variants instead of landing on one.

    Steps run back to back, as a training loop runs them: the host queues one step while the
    GPU runs the last. A step's time is its chunk's time (CUDA events around the chunk, no
    synchronize) over its steps, i.e. throughput. Events around each forward and backward give
    the split between them; their sum is not the step time where the host bounds the step: the
    host's work between two steps (dropping the gradients) shows on the GPU's clock only when
    the GPU has caught up by then, which differs from variant to variant.

    A variant that runs out of memory, to build or to run, is marked OOM and dropped.
    """
    samples = {v: Samples() for v in variants}
    alive: dict[str, Contender] = {}
    fresh_state(device)
    for variant in variants:
        try:
            alive[variant] = build_contender(variant, shape, dtype, device, args)
        except torch.cuda.OutOfMemoryError:
            samples[variant].oom = True

    def drop(variant: str) -> None:
        samples[variant].oom = True
        del alive[variant]
        fresh_state(device)

    for variant, c in list(alive.items()):
        try:
            measure_memory(variant, c, samples[variant], args)
        except torch.cuda.OutOfMemoryError:
            drop(variant)
            continue
        per_step = statistics.median(samples[variant].synced)
        n = max(args.reps, min(MAX_REPS, math.ceil(args.min_time / per_step)))
        samples[variant].chunks = min(args.rounds, n)
        samples[variant].chunk_steps = math.ceil(n / samples[variant].chunks)

    timers = {v: (RegionTimer(device), RegionTimer(device), RegionTimer(device)) for v in alive}
    gc.collect()
    # As timeit does: a cyclic collection would land on whichever variant runs then.
    with gc_paused():
        for rnd in range(-1, args.rounds):  # round -1 warms up
            shift = max(rnd, 0) % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                if variant not in alive or rnd >= samples[variant].chunks:
                    continue
                chunk, fwd, bwd = timers[variant]
                steps = samples[variant].chunk_steps
                try:
                    if rnd < 0:
                        run_steps(variant, alive[variant], steps)
                        continue
                    chunk.start()
                    run_steps(variant, alive[variant], steps, fwd, bwd)
                    chunk.stop()
                except torch.cuda.OutOfMemoryError:
                    drop(variant)
    for variant in alive:
        chunk, fwd, bwd = timers[variant]
        s = samples[variant]
        s.step += [t / s.chunk_steps for t in chunk.times()]
        s.fwd += fwd.times()
        s.bwd += bwd.times()
    alive.clear()
    fresh_state(device)
    return samples


def backend_of(variant: str, shape, dtype: torch.dtype, device: torch.device) -> str:
    """Which elementwise code a variant runs: aten (autograd's own kernels), or the name of its
    effdl backend (torch, jiterator, triton)."""
    if variant not in LEVEL_VARIANTS:
        return "aten"
    numel = shape.tokens * shape.intermediate_size
    return elementwise_ops(device, numel, dtype, FORCED_BACKEND.get(variant, "auto")).name


def ratio(num: float | None, den: float | None) -> float:
    if num is None or den is None or den != den or num != num or den == 0:
        return float("nan")
    return num / den


def summary_row(shape: Shape, dtype_name: str, res: dict[str, dict], ceiling: float) -> dict:
    t = {v: m.get("step_s_median") for v, m in res.items()}
    mem = {v: m.get("peak_gib") for v, m in res.items()}
    level0 = res.get("level0", {})
    chunks = {v: m.get("step_s_per_chunk") for v, m in res.items()}
    lo = hi = float("nan")
    if chunks.get("level0") and chunks.get("reference"):
        # chunk i of each ran in round i: paired where both ran the same rounds
        paired = len(chunks["level0"]) == len(chunks["reference"])
        lo, hi = median_ratio_ci(chunks["level0"], chunks["reference"], paired=paired)
    return {
        "config": shape.label,
        "dtype": dtype_name,
        "l0/ref time": ratio(t.get("level0"), t.get("reference")),
        "l0/ref 90% CI lo": lo,  # bootstrap over the chunks: the run's own noise
        "l0/ref 90% CI hi": hi,
        "l0/ref mem": ratio(mem.get("level0"), mem.get("reference")),
        "l1/ckpt mem": ratio(mem.get("level1"), mem.get("checkpoint")),
        "l1/l0 time": ratio(t.get("level1"), t.get("level0")),
        "l2/l0 time": ratio(t.get("level2"), t.get("level0")),
        "l0 frac ceiling": ratio(level0.get("tflops_model"), ceiling),
    }


def main() -> None:
    args = parse_args()
    device = device_from_arg(args.device)
    unknown = sorted(set(args.dtypes) - set(DTYPES)) + sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        raise UsageError(
            f"--dtypes/--variants: unknown {unknown}; dtypes {list(DTYPES)}, variants {VARIANTS}"
        )
    if (
        args.warmup < 0
        or (args.warmup_time or 0) < 0
        or (args.settle or 0) < 0
        or args.reps < 1
        or (args.min_time or 0) < 0
        or (args.rounds or 1) < 1
    ):
        raise UsageError(
            "--warmup, --warmup-time, --settle and --min-time must be >= 0, "
            "--reps and --rounds >= 1"
        )
    variants = [v for v in args.variants if device.type == "cuda" or v not in FORCED_BACKEND]
    if args.configs:
        grid = [parse_shape(c) for c in args.configs]
    else:
        grid = QUICK_GRID if args.quick else GPU_GRID
    if args.quick:
        args.warmup, args.reps = min(args.warmup, 1), min(args.reps, 3)
    if args.min_time is None:
        args.min_time = 0.0 if args.quick else 3.0
    if args.warmup_time is None:
        args.warmup_time = 0.0 if args.quick else 0.5
    if args.settle is None:
        args.settle = 0.0 if args.quick or device.type != "cuda" else 20.0
    if args.rounds is None:
        args.rounds = 3 if args.quick else 100
    if device.type == "cpu" and not args.quick:
        print("note: a CPU run times the PyTorch paths only and has no memory statistics")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32

    log = RunLog(args.out / "benchmark.jsonl", task="swiglu")
    gemm_n = 256 if args.quick else 8192
    bandwidth, _ = measure_copy_bandwidth((1 if args.quick else 64) * 2**20 * 16, device)
    log.log("copy_bandwidth", {"device": str(device)}, {"gb_per_s": bandwidth})

    summary, cost_rows = [], []
    settle(grid[0], DTYPES[args.dtypes[0]], device, args)
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        ceiling, stats = measure_matmul_tflops(gemm_n, dtype, device)
        log.log(
            "matmul_ceiling",
            {"dtype": dtype_name, "n": gemm_n, "device": str(device), "tf32": args.tf32},
            {"tflops": ceiling, **stats.as_dict("time_s_")},
        )
        itemsize = torch.empty((), dtype=dtype).element_size()
        for shape in tqdm(grid, desc=f"{dtype_name} configs", unit="config"):
            samples = time_config(shape, dtype, variants, device, args)
            res = {}
            for variant in variants:
                flops_exec = shape.gemm_flops(variant)
                flops_model = shape.gemm_flops("reference")
                backend = backend_of(variant, shape, dtype, device)
                ew_bytes = shape.elementwise_bytes(variant, backend, itemsize)
                floor_s = flops_exec / (ceiling * 1e12) + ew_bytes / (bandwidth * 1e9)
                metrics = samples[variant].metrics(device.type == "cuda")
                if "step_s_median" in metrics:
                    step = metrics["step_s_median"]
                    metrics.update(
                        tflops_model=flops_model / step / 1e12,  # useful FLOPs (9 GEMMs)
                        tflops_executed=flops_exec / step / 1e12,  # incl. recomputed GEMMs
                        frac_ceiling=flops_exec / step / 1e12 / ceiling,
                        floor_s=floor_s,
                        floor_frac=floor_s / step,
                    )
                metrics.update(
                    elementwise=backend,
                    gemm_flops=flops_exec,
                    elementwise_bytes=ew_bytes,
                    ceiling_tflops=ceiling,
                    copy_gb_per_s=bandwidth,
                )
                config = {
                    **asdict(shape),
                    "tokens": shape.tokens,
                    "dtype": dtype_name,
                    "residual": not args.no_residual,
                    "tf32": args.tf32,
                    "warmup": args.warmup,
                    "warmup_time_s": args.warmup_time,
                    "settle_s": args.settle,
                    "reps": args.reps,
                    "min_time_s": args.min_time,
                    "rounds": args.rounds,
                    "device": str(device),
                    "quick": args.quick,
                }
                log.log(variant, config, metrics)
                res[variant] = metrics
                if dtype_name == args.dtypes[0] and shape == grid[-1]:
                    cost_rows.append(
                        {
                            "variant": variant,
                            "GEMMs/layer": GEMMS[variant],
                            "GEMM TFLOP": flops_exec / 1e12,
                            "elementwise GB": ew_bytes / 1e9,
                            "floor ms": floor_s * 1e3,
                            "floor / level0 floor": None,
                        }
                    )
            row = summary_row(shape, dtype_name, res, ceiling)
            log.log("summary", {**asdict(shape), "dtype": dtype_name}, row)
            summary.append(row)
            print_table(
                [
                    {
                        "variant": v,
                        "fwd ms": m.get("fwd_s_median", float("nan")) * 1e3,
                        "bwd ms": m.get("bwd_s_median", float("nan")) * 1e3,
                        "peak GiB": m.get("peak_gib", float("nan")),
                        "TFLOP/s": m.get("tflops_executed", float("nan")),
                        "floor/time": m.get("floor_frac", float("nan")),
                        "elementwise": m["elementwise"] + (" OOM" if m.get("oom") else ""),
                    }
                    for v, m in res.items()
                ],
                title=f"{shape.label} {dtype_name} (ceiling {ceiling:.1f} TFLOP/s)",
            )

    floors = {r["variant"]: r["floor ms"] for r in cost_rows}
    for r in cost_rows:
        r["floor / level0 floor"] = ratio(r["floor ms"], floors.get("level0"))
    print_table(
        cost_rows,
        title=(
            f"Cost model, {grid[-1].label} {args.dtypes[0]}: GEMM FLOPs at the measured ceiling "
            f"+ elementwise bytes at {bandwidth:.0f} GB/s"
        ),
    )
    print_table(summary, title=f"Ratios within this run (log: {log.path})")


if __name__ == "__main__":
    run_main(main)
