"""Time and memory of a SwiGLU MLP stack: reference, torch.utils.checkpoint, and each checkpoint level.

For every config (batch_size, seq_len, hidden_dim, intermediate_size, num_layers) and dtype, the
variants are timed side by side by :func:`effdl.profiling.harness.time_variants`: built once
(same seed) and kept alive, warmed up, a few synchronized steps each (forward, then backward of a
fixed random output gradient) for their own peak memory, then interleaved rounds of
back-to-back steps, with CUDA events around each forward and backward for the split. Before
anything is timed, ``--settle`` seconds of untimed reference steps run at the first config.
Medians are compared as ratios within the run, with a paired bootstrap interval for level 0 over
the reference (:func:`effdl.profiling.timing.median_ratio_ci`). Variants:

  reference     SwigluMLP (nn.Linear) under plain autograd
  checkpoint    the same module inside torch.utils.checkpoint(use_reentrant=False), per layer
  level0/1/2    MemoryOptimizedSwigluMLP at CheckpointLevel 0 (save all), 1 (recompute all),
                2 (save xW and xV, recompute the elementwise part)
  level0_torch, level0_jiterator, level0_triton
                level 0 with its elementwise backend forced (CUDA only): the paths compared at
                each size, the data behind effdl.ops.swiglu.TRITON_MIN_ELEMENTS

The stack is residual by default (x + mlp(x) per layer, keeping activations at unit scale across
random layers); --no-residual stacks the layers bare, as in the assignment's test model. Achieved
TFLOP/s is set against a square dense GEMM's rate measured in the same run (a reference, not an
upper bound: other shapes can run faster); a variant's floor is its GEMM FLOPs at that rate
plus its elementwise bytes at the measured copy bandwidth. Its GEMMs per
layer and step are counted before anything is timed (:func:`gemm_counts`) and logged with it.

    python3 swiglu_checkpoint/benchmark.py --quick --device cpu     # smoke run on a CPU
    python3 swiglu_checkpoint/benchmark.py --device cuda            # full grid
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import pandas as pd
import torch
from tqdm import tqdm

from effdl.cli import (
    ConfigFlags,
    Run,
    UsageError,
    base_parser,
    print_table,
    require_choices,
    require_positive,
    run_main,
    seed_everything,
    start_run,
)
from effdl.ops.swiglu_variants import (
    FORCED_BACKEND,
    GEMMS,
    LEVEL_VARIANTS,
    VARIANTS,
    Shape,
    build_stack,
    cost_of,
    with_costs,
)
from effdl.profiling.flops import MatmulCounter, measure_copy_bandwidth, measure_matmul_tflops
from effdl.profiling.harness import HarnessConfig, Regions, Variant, settle, time_variants
from effdl.profiling.timing import median_ratio_ci
from effdl.results import RunLog

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "level0_torch"]  # CUDA's fallback path only
MEMORY_STEPS = 3
MAX_REPS = 4000
GPU_GRID = [
    Shape(16, 128, 512, 2048, 2),
    Shape(32, 128, 512, 2048, 2),
    Shape(8, 512, 1024, 4096, 3),
    Shape(16, 512, 1024, 4096, 3),
    Shape(8, 1024, 2048, 8192, 4),
    Shape(4, 1024, 4096, 16384, 5),
    Shape(8, 1024, 4096, 16384, 5),
]
QUICK_GRID = [Shape(2, 16, 32, 96, 2), Shape(2, 32, 64, 192, 3)]
COUNT_SHAPE = Shape(2, 8, 16, 48, 2)  # the small stack whose GEMMs are counted
PRINTED = ["variant", "forward_time, s", "backward_time, s", "peak_memory, GB", "GEMMs/layer",
           "TFLOP/s", "floor/time", "elementwise"]  # fmt: skip


@dataclass(frozen=True)
class BenchmarkConfig:
    """The grid, the variants and how long each is warmed up and timed."""

    shapes: list[Shape] = field(default_factory=lambda: list(GPU_GRID))
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    warmup: int = 1
    warmup_time: float = 0.5
    reps: int = 5
    rounds: int = 100
    min_time: float = 3.0
    settle: float | str = "auto"  # auto: 20 s on CUDA, none on a CPU
    residual: bool = True
    tf32: bool = False
    gemm_n: int = 8192  # the GEMM ceiling's size
    copy_bytes: int = 2**30  # the copy bandwidth's size

    def validate(self) -> None:
        require_choices(self, "dtypes", DTYPES)
        require_choices(self, "variants", VARIANTS)
        require_positive(self, "reps", "rounds")
        require_positive(self, "warmup", "warmup_time", "min_time", minimum=0)
        if self.settle != "auto":
            require_positive(self, "settle", minimum=0)

    def harness(self) -> HarnessConfig:
        return HarnessConfig(
            rounds=self.rounds,
            min_steps=self.reps,
            max_steps=MAX_REPS,
            min_time=self.min_time,
            warmup_steps=self.warmup,
            warmup_time=self.warmup_time,
            memory_steps=MEMORY_STEPS,
        )


FULL = BenchmarkConfig()
QUICK = BenchmarkConfig(
    shapes=list(QUICK_GRID),
    warmup_time=0.0,
    reps=3,
    rounds=3,
    min_time=0.0,
    settle=0.0,
    gemm_n=256,
    copy_bytes=2**24,
)


def settle_seconds(cfg: BenchmarkConfig, device: torch.device) -> float:
    """``--settle``, with ``auto`` resolved: a CPU host needs no settling."""
    if cfg.settle == "auto":
        return 20.0 if device.type == "cuda" else 0.0
    return float(cfg.settle)


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/swiglu")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add(
        "shapes",
        flag="--configs",
        type=Shape.parse,
        nargs="+",
        metavar="B,S,H,I,L",
        help="batch,seq,hidden,intermediate,layers entries",
    )
    flags.add("dtypes", nargs="+", help=f"of {list(DTYPES)}")
    flags.add("variants", nargs="+", help=f"subset of {VARIANTS}")
    flags.add("warmup", type=int, help="untimed steps before the memory steps, at least")
    help_warmup = "seconds of untimed synchronized steps per variant, at least (kernels load)"
    flags.add("warmup_time", type=float, help=help_warmup)
    flags.add("reps", type=int, help="timed steps, at least")
    flags.add("rounds", type=int, help="turns the variants take per config, a chunk of steps each")
    flags.add("min_time", type=float, help="seconds of timed steps per variant, at least")
    help_settle = "seconds of untimed reference steps before anything is timed (auto: 20 on CUDA)"
    flags.add("settle", type=float, help=help_settle)
    flags.add("residual", flag="--no-residual", action="store_false", help="bare stack: x = mlp(x)")
    flags.add("tf32", action="store_true", help="allow TF32 for fp32 matmuls")
    args = p.parse_args()
    return args, flags.resolve(args)


def stack_variant(
    variant: str, shape: Shape, dtype: torch.dtype, device: torch.device, residual: bool, seed: int
) -> Variant:
    """``variant``'s stack, input and output gradient, seeded alike for every variant; a step is
    a forward and the backward of the fixed gradient, timed as regions ``fwd`` and ``bwd`` (their
    sum falls short of the step where the host bounds it: the host's work between steps shows on
    the GPU's clock only once the GPU has caught up). The gradients are dropped before each step
    and after the last, so an idle variant holds only its weights, x and dy."""

    def build():
        seed_everything(seed)
        model = build_stack(variant, shape, dtype, device, residual)
        gen = torch.Generator(device=device).manual_seed(seed)
        size = (shape.batch_size, shape.seq_len, shape.hidden_dim)
        x = torch.randn(size, device=device, dtype=dtype, generator=gen).requires_grad_(True)
        dy = torch.randn(size, device=device, dtype=dtype, generator=gen)

        def step(steps: int, regions: Regions | None) -> None:
            fwd = bwd = None
            if regions is not None:
                fwd, bwd = regions["fwd"], regions["bwd"]
            for _ in range(steps):
                model.zero_grad(set_to_none=True)
                x.grad = None
                if fwd is not None:
                    fwd.start()
                y = model(x)
                if fwd is not None:
                    fwd.stop()
                    bwd.start()
                y.backward(dy)
                if bwd is not None:
                    bwd.stop()
                del y
            model.zero_grad(set_to_none=True)
            x.grad = None

        return step

    return Variant(variant, build)


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``; None where either was not measured (None) or ``den`` is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def summary_row(shape: Shape, dtype_name: str, res: dict[str, dict], ceiling: float) -> dict:
    t = {v: m.get("step_s_median") for v, m in res.items()}
    mem = {v: m.get("peak_gib") for v, m in res.items()}
    level0 = res.get("level0", {})
    chunks = {v: m.get("step_s_per_chunk") for v, m in res.items()}
    lo = hi = None  # no interval without both variants' chunks
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


def measure_ceiling(
    dtype_name: str, cfg: BenchmarkConfig, device: torch.device, log: RunLog
) -> float:
    """The dense GEMM TFLOP/s of ``dtype_name`` at ``cfg.gemm_n``, logged."""
    ceiling, stats = measure_matmul_tflops(cfg.gemm_n, DTYPES[dtype_name], device)
    config = {"dtype": dtype_name, "n": cfg.gemm_n, "device": str(device), "tf32": cfg.tf32}
    log.log("matmul_ceiling", config, {"tflops": ceiling, **stats.as_dict("time_s_")})
    return ceiling


def counted_gemms(variant: str, dtype: torch.dtype, device: torch.device, residual: bool) -> float:
    """GEMMs per layer and training step that ``variant``'s stack executes: the aten matmuls of
    one step of a :data:`COUNT_SHAPE` stack built like the benchmark's, counted below autograd
    (recomputed ones included, a GEMM that checkpoint's early stop aborts before it runs not)."""
    model = build_stack(variant, COUNT_SHAPE, dtype, device, residual)
    size = (COUNT_SHAPE.batch_size, COUNT_SHAPE.seq_len, COUNT_SHAPE.hidden_dim)
    x = torch.randn(size, device=device, dtype=dtype, requires_grad=True)
    with MatmulCounter() as counter:
        model(x).backward(torch.randn_like(x))
    return counter.total / COUNT_SHAPE.num_layers


def gemm_counts(
    variants: list[str], dtype: torch.dtype, device: torch.device, residual: bool
) -> dict[str, float]:
    """:func:`counted_gemms` of each variant; a RuntimeError where one differs from ``GEMMS``,
    the table the logged FLOPs, TFLOP/s and floors are computed from."""
    counts = {v: counted_gemms(v, dtype, device, residual) for v in variants}
    wrong = {v: (n, GEMMS[v]) for v, n in counts.items() if n != GEMMS[v]}
    if wrong:
        raise RuntimeError(f"GEMMs per layer and step (counted, in GEMMS): {wrong}")
    return counts


def benchmark_shape(
    shape: Shape,
    dtype_name: str,
    variants: list[str],
    cfg: BenchmarkConfig,
    run: Run,
    quick: bool,
    ceiling: float,
    bandwidth: float,
    gemms: dict[str, float],
) -> dict[str, dict]:
    """Time every variant at ``shape`` and ``dtype_name``, log one record each; their metrics.
    ``gemms``: each variant's counted GEMMs per layer and step (:func:`gemm_counts`)."""
    device, dtype = run.device, DTYPES[dtype_name]
    stacks = [stack_variant(v, shape, dtype, device, cfg.residual, run.seed) for v in variants]
    results = time_variants(stacks, cfg.harness(), device)
    config = {
        **asdict(shape),
        "tokens": shape.tokens,
        "dtype": dtype_name,
        "residual": cfg.residual,
        "tf32": cfg.tf32,
        **cfg.harness().record(),
        "settle_s": settle_seconds(cfg, device),
        "device": str(device),
        "quick": quick,
    }
    res = {}
    for variant in variants:
        cost = cost_of(variant, shape, dtype, device, ceiling, bandwidth)
        metrics = with_costs(results[variant].metrics(), shape, cost, ceiling, bandwidth)
        res[variant] = {**metrics, "gemms_per_layer": gemms[variant]}
        run.log.log(variant, config, res[variant])
    return res


def experiment_rows(shape: Shape, dtype_name: str, res: dict[str, dict]) -> list[dict]:
    """One row per variant in the assignment's units: medians in seconds, peak memory in GB of
    1024**3 bytes (as ``torch.cuda.max_memory_allocated() / 1024**3``; None off CUDA). What a
    variant did not measure (off CUDA, after an OOM) is None."""
    return [
        {
            **asdict(shape),
            "dtype": dtype_name,
            "variant": v,
            "checkpoint_level": int(LEVEL_VARIANTS[v]) if v in LEVEL_VARIANTS else None,
            "forward_time, s": m.get("fwd_s_median"),
            "backward_time, s": m.get("bwd_s_median"),
            "step_time, s": m.get("step_s_median"),
            "peak_memory, GB": m.get("peak_gib"),
            "GEMMs/layer": m["gemms_per_layer"],
            "TFLOP/s": m.get("tflops_executed"),
            "floor, s": m.get("floor_s"),  # GEMMs at the ceiling + elementwise bytes
            "floor/time": m.get("floor_frac"),
            "elementwise": m["elementwise"] + (" OOM" if m.get("oom") else ""),
        }
        for v, m in res.items()
    ]


def runnable_variants(cfg: BenchmarkConfig, device: torch.device, given: bool) -> list[str]:
    """The variants to time on ``device``: off CUDA the forced-backend ones are left out of the
    defaults, and refused when the user named them."""
    if device.type == "cuda":
        return list(cfg.variants)
    forced = [v for v in cfg.variants if v in FORCED_BACKEND]
    if forced and given:
        raise UsageError(
            f"--variants {' '.join(forced)}: these force a CUDA backend; on the {device.type} "
            "level0 is the PyTorch path"
        )
    return [v for v in cfg.variants if v not in FORCED_BACKEND]


def run_experiments(
    cfg: BenchmarkConfig, run: Run, variants: list[str], quick: bool = False
) -> pd.DataFrame:
    """Every config of ``cfg`` at every dtype: each variant timed, one record per variant and a
    summary per config logged to ``run.log``, the tables printed; the rows of
    :func:`experiment_rows` of the whole grid, in the order run."""
    device = run.device
    bandwidth, _ = measure_copy_bandwidth(cfg.copy_bytes, device)
    run.log.log("copy_bandwidth", {"device": str(device)}, {"gb_per_s": bandwidth})
    settle_s = settle_seconds(cfg, device)
    if settle_s > 0:
        first = cfg.shapes[0]
        print(f"settling: {settle_s:.0f} s of untimed reference steps at {first.label}")
        reference = stack_variant(
            "reference", first, DTYPES[cfg.dtypes[0]], device, cfg.residual, run.seed
        )
        settle(reference, settle_s, device)

    rows, summary = [], []
    for dtype_name in cfg.dtypes:
        gemms = gemm_counts(variants, DTYPES[dtype_name], device, cfg.residual)
        ceiling = measure_ceiling(dtype_name, cfg, device, run.log)
        for shape in tqdm(cfg.shapes, desc=f"{dtype_name} configs", unit="config"):
            res = benchmark_shape(
                shape, dtype_name, variants, cfg, run, quick, ceiling, bandwidth, gemms
            )
            row = summary_row(shape, dtype_name, res, ceiling)
            run.log.log("summary", {**asdict(shape), "dtype": dtype_name}, row)
            summary.append(row)
            new_rows = experiment_rows(shape, dtype_name, res)
            rows += new_rows
            title = f"{shape.label} {dtype_name} (square-GEMM reference {ceiling:.1f} TFLOP/s)"
            print_table([{k: r[k] for k in PRINTED} for r in new_rows], title=title)

    print_table(summary, title=f"Ratios within this run (log: {run.log.path})")
    return pd.DataFrame(rows)


def main() -> None:
    args, cfg = parse_args()
    run = start_run(args, task="swiglu", logs="benchmark.jsonl")
    variants = runnable_variants(cfg, run.device, given=hasattr(args, "variants"))
    if run.device.type == "cpu" and not args.quick:
        print("note: a CPU run times the PyTorch paths only and has no memory statistics")
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    run_experiments(cfg, run, variants, args.quick)


if __name__ == "__main__":
    run_main(main)
