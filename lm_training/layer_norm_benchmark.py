"""Time LayerNorm forward+backward: torch's nn.LayerNorm, effdl's FusedLayerNorm, torch.compile's.

For every (tokens x hidden) shape and dtype, the variants are timed side by side by
:func:`effdl.profiling.harness.time_variants` (built once, warmed up, then interleaved rounds of
back-to-back steps; CUDA events around each forward and backward, and the host's own time of
each call). A step is ``y = ln(x)`` and the backward of a fixed random ``dy`` into x, the weight
and the bias. Variants:

  torch      nn.LayerNorm (aten's fused kernels)
  fused      effdl.ops.layer_norm.FusedLayerNorm (on CUDA torch's kernel in the input's dtype
             below TRITON_MIN_BYTES, the Triton kernels above; its PyTorch path elsewhere; the
             log's ``path`` says which)
  triton     the Triton kernels at every size (CUDA only by default)
  compiled   torch.compile(nn.LayerNorm) (CUDA only by default: compiling on a CPU is slow)
  host_floor a Python autograd.Function over (x, weight, bias) that launches no kernel: x back
             (a view) forward, an uninitialized dx backward (allocated, then taken as x.grad
             without a copy); what any LayerNorm written as a Python Function costs the host
             in this loop, before its first kernel (eager time only; CUDA only by default)

Bytes moved per step, the least any implementation must move: the forward reads x and writes y,
the backward reads x and dy and writes dx (5 passes over tokens x hidden at the dtype's size),
plus each row's mean and rstd (fp32, written once and read once) and the parameters (w, b read;
dw, db written). Achieved bandwidth is those bytes over the median step time, set against the
device-to-device copy bandwidth measured at the start of the same run.

Three times per variant. ``step``: eager calls, as a model runs them, on the device's clock;
for small shapes the GPU waits for the host, and this is the host's cost of the step (the loop's
own work, ``zero_grad`` and the events, included, the same for every variant). ``host``: the
host's time inside the forward call and the backward call alone (``perf_counter``), what a
variant's Python and launches cost. ``graph`` (CUDA only): the same forward+backward captured
once in a CUDA graph and replayed ``--graph-replays`` times between two events, in interleaved
rounds: the kernels' own time, what the bandwidth fraction is about.

    python3 lm_training/layer_norm_benchmark.py --quick          # CPU: the PyTorch paths, seconds
    python3 lm_training/layer_norm_benchmark.py --device cuda    # the full grid
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
from torch import nn
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
    start_run,
)
from effdl.ops.layer_norm import FusedLayerNorm, TritonLayerNorm, kernel_path, uses_triton
from effdl.profiling.flops import measure_copy_bandwidth
from effdl.profiling.harness import (
    HarnessConfig,
    Regions,
    Variant,
    capture_graph,
    graph_replay_times,
    host_timed,
    time_variants,
)
from effdl.profiling.timing import TimingStats, median_ratio_ci

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VARIANTS = ["torch", "fused", "triton", "compiled", "host_floor"]
CUDA_ONLY_DEFAULTS = {"triton", "compiled", "host_floor"}
HOST_ONLY = {"host_floor"}  # no kernels: no bandwidth, no CUDA-graph time
PASSES = 5  # x, y forward; x, dy, dx backward
MAX_REPS = 20000


@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int

    def __str__(self) -> str:  # the --shapes form
        return f"{self.tokens}x{self.hidden}"

    def bytes_moved(self, itemsize: int) -> int:
        """The least traffic of one forward+backward step (see the module docstring)."""
        rows = 2 * 4 * self.tokens  # mean and rstd: fp32, written forward, read backward
        params = 5 * itemsize * self.hidden  # w, b read; w read again; dw, db written
        return PASSES * itemsize * self.tokens * self.hidden + rows + params


GPU_GRID = [Shape(*s) for s in ((8192, 768), (16384, 1024), (32768, 2048), (4096, 4096),
                                 (65536, 1024), (4096, 512), (16384, 8192))]  # fmt: skip
QUICK_GRID = [Shape(256, 64), Shape(512, 96)]


def parse_shape(text: str) -> Shape:
    """``--shapes`` entry ``TOKENSxHIDDEN`` as a Shape."""
    try:
        tokens, hidden = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--shapes: {text!r} is not TOKENSxHIDDEN (e.g. 8192x768)") from None
    if min(tokens, hidden) <= 0:
        raise UsageError(f"--shapes: {text!r} has a non-positive entry")
    return Shape(tokens, hidden)


@dataclass(frozen=True)
class BenchmarkConfig:
    """The grid, the variants (None: all runnable on the device) and how long each is timed."""

    shapes: list[Shape] = field(default_factory=lambda: list(GPU_GRID))
    dtypes: list[str] = field(default_factory=lambda: ["bf16", "fp32"])
    variants: list[str] | None = None
    eps: float = 1e-5
    warmup: int = 3
    warmup_time: float = 0.5
    reps: int = 20
    rounds: int = 50
    min_time: float = 2.0
    copy_bytes: int = 2**30  # the copy bandwidth's size
    graph_replays: int = 50  # per timed round of the CUDA-graph time

    def validate(self) -> None:
        require_choices(self, "dtypes", DTYPES)
        if self.variants is not None:
            require_choices(self, "variants", VARIANTS)
        require_positive(self, "reps", "rounds", "graph_replays")
        require_positive(self, "warmup", "warmup_time", "min_time", minimum=0)
        if not self.eps > 0:
            raise UsageError(f"--eps must be > 0, got {self.eps!r}")

    def harness(self) -> HarnessConfig:
        return HarnessConfig(
            rounds=self.rounds,
            min_steps=self.reps,
            max_steps=MAX_REPS,
            min_time=self.min_time,
            warmup_steps=self.warmup,
            warmup_time=self.warmup_time,
        )

    def runnable_variants(self, device: torch.device) -> list[str]:
        if self.variants is not None:
            return list(self.variants)
        if device.type == "cuda":
            return list(VARIANTS)
        return [v for v in VARIANTS if v not in CUDA_ONLY_DEFAULTS]


FULL = BenchmarkConfig()
QUICK = BenchmarkConfig(
    shapes=list(QUICK_GRID), graph_replays=3, warmup=1, warmup_time=0.0, reps=3, rounds=3,
    min_time=0.0, copy_bytes=2**24,
)  # fmt: skip


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/lm_training")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("shapes", type=parse_shape, nargs="+", metavar="TxH", help="tokens x hidden")
    flags.add("dtypes", nargs="+", help=f"of {list(DTYPES)}")
    flags.add("variants", nargs="+", help=f"subset of {VARIANTS} (default: all on CUDA)")
    flags.add("eps", type=float, help="LayerNorm epsilon")
    flags.add("warmup", type=int, help="untimed steps per variant, at least")
    flags.add("warmup_time", type=float, help="seconds of untimed steps per variant, at least")
    flags.add("reps", type=int, help="timed steps per variant, at least")
    flags.add("rounds", type=int, help="variants take turns this many times per shape")
    flags.add("min_time", type=float, help="seconds of timed steps per variant")
    flags.add("graph_replays", type=int, help="CUDA-graph replays per timed round (CUDA only)")
    args = p.parse_args()
    return args, flags.resolve(args)


class _NoKernelFunction(torch.autograd.Function):
    """Takes what FusedLayerNorm's Function takes and launches nothing: ``x`` back (a view)
    forward; backward, a new uninitialized dx (which autograd takes as ``x.grad`` as it is,
    where ``dy`` itself, held by the caller, would be copied) and no parameter gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return torch.empty_like(dy), None, None


class HostFloor(nn.LayerNorm):
    """The host floor of a LayerNorm written as a Python autograd.Function (not a LayerNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NoKernelFunction.apply(x, self.weight, self.bias)


def build_layer_norm(variant: str, hidden: int, eps: float, dtype, device) -> nn.Module:
    """``variant``'s LayerNorm with random affine parameters (same seed for every variant)."""
    cls = {"fused": FusedLayerNorm, "triton": TritonLayerNorm, "host_floor": HostFloor}
    cls = cls.get(variant, nn.LayerNorm)
    ln = cls(hidden, eps=eps, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype, generator=gen))
        ln.bias.copy_(0.1 * torch.randn(hidden, device=device, dtype=dtype, generator=gen))
    return torch.compile(ln) if variant == "compiled" else ln


def step_inputs(shape: Shape, dtype: torch.dtype, device: torch.device):
    """The input (requiring grad) and the output gradient of every variant's step."""
    gen = torch.Generator(device=device).manual_seed(1)
    size = (shape.tokens, shape.hidden)
    x = torch.randn(size, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    dy = torch.randn(size, device=device, dtype=dtype, generator=gen)
    return x, dy


def layer_norm_variant(
    variant: str,
    shape: Shape,
    dtype: torch.dtype,
    cfg: BenchmarkConfig,
    device: torch.device,
    host: dict[str, list[float]],
) -> Variant:
    """A step: forward, then backward of a fixed dy; timed as regions ``fwd`` and ``bwd``, the
    host's time of each call appended to ``host["fwd"]`` and ``host["bwd"]``."""

    def build():
        ln = build_layer_norm(variant, shape.hidden, cfg.eps, dtype, device)
        x, dy = step_inputs(shape, dtype, device)

        def step(steps: int, regions: Regions | None) -> None:
            for _ in range(steps):
                ln.zero_grad(set_to_none=True)
                x.grad = None
                with host_timed(regions, "fwd", host):
                    y = ln(x)
                with host_timed(regions, "bwd", host):
                    y.backward(dy)
                del y
            ln.zero_grad(set_to_none=True)
            x.grad = None

        return step

    return Variant(variant, build)


def captured_step(variant: str, shape: Shape, dtype: torch.dtype, cfg: BenchmarkConfig,
                  device: torch.device) -> torch.cuda.CUDAGraph:  # fmt: skip
    """``variant``'s forward+backward captured in a CUDA graph (the gradients are allocated by
    the capture and rewritten by every replay)."""
    ln = build_layer_norm(variant, shape.hidden, cfg.eps, dtype, device)
    x, dy = step_inputs(shape, dtype, device)

    def drop_grads() -> None:
        ln.zero_grad(set_to_none=True)
        x.grad = None

    graph = capture_graph(lambda: ln(x).backward(dy), device, before_capture=drop_grads)
    graph.keep = (ln, x, dy)  # the graph reads and writes their memory
    return graph


def with_bandwidth(metrics: dict, shape: Shape, itemsize: int, copy_gb_per_s: float) -> dict:
    """``metrics`` with the bytes moved, the achieved GB/s and its fraction of the copy's."""
    nbytes = shape.bytes_moved(itemsize)
    metrics.update(bytes_moved=nbytes, copy_gb_per_s=copy_gb_per_s)
    for time_key, prefix in (("step_s_median", ""), ("graph_step_s_median", "graph_")):
        if time_key in metrics:
            gb_per_s = nbytes / metrics[time_key] / 1e9
            metrics.update({f"{prefix}gb_per_s": gb_per_s,
                            f"{prefix}frac_copy": gb_per_s / copy_gb_per_s})  # fmt: skip
    return metrics


def benchmark_shape(
    shape: Shape,
    dtype_name: str,
    variants: list[str],
    cfg: BenchmarkConfig,
    run: Run,
    quick: bool,
    copy_gb_per_s: float,
) -> dict[str, dict]:
    """Time every variant at ``shape``, log one record each; their metrics by variant."""
    device, dtype = run.device, DTYPES[dtype_name]
    host = {v: {"fwd": [], "bwd": []} for v in variants}
    built = [layer_norm_variant(v, shape, dtype, cfg, device, host[v]) for v in variants]
    results = time_variants(built, cfg.harness(), device)
    kernels = [v for v in variants if v not in HOST_ONLY]
    graph = {}
    if device.type == "cuda":
        captured = {v: captured_step(v, shape, dtype, cfg, device) for v in kernels}
        graph = graph_replay_times(captured, cfg.rounds, cfg.graph_replays)
    itemsize = torch.empty((), dtype=dtype).element_size()
    x = torch.empty(shape.tokens, shape.hidden, device=device, dtype=dtype)
    fused_path = kernel_path(x, shape.hidden)
    triton_path = "triton" if uses_triton(x, shape.hidden) else "pytorch"
    del x
    config = {"tokens": shape.tokens, "hidden": shape.hidden, "dtype": dtype_name, "eps": cfg.eps,
              **cfg.harness().record(), "device": str(device), "quick": quick}  # fmt: skip
    res = {}
    for variant in variants:
        metrics = results[variant].metrics()
        for call, times in host[variant].items():
            if times:
                metrics.update(TimingStats.from_times(times).as_dict(f"{call}_host_s_"))
        if "fwd_host_s_median" in metrics:
            metrics["host_s_median"] = metrics["fwd_host_s_median"] + metrics["bwd_host_s_median"]
        if variant in graph:
            metrics.update(graph_step_s=graph[variant],
                           graph_step_s_median=statistics.median(graph[variant]),
                           graph_replays=cfg.graph_replays)  # fmt: skip
        if variant not in HOST_ONLY:
            metrics = with_bandwidth(metrics, shape, itemsize, copy_gb_per_s)
        metrics["path"] = {"fused": fused_path, "triton": triton_path}.get(variant, variant)
        res[variant] = metrics
        run.log.log(variant, config, metrics)
    return res


def summary_row(shape: Shape, dtype_name: str, res: dict[str, dict]) -> dict:
    """The shape's times and ratios by variant; None where a variant measured none (an OOM)."""
    t = {v: m.get("step_s_median") for v, m in res.items()}
    row = {"shape": str(shape), "dtype": dtype_name}
    row.update({f"{v} ms": None if s is None else s * 1e3 for v, s in t.items()})
    row.update({f"{v} host ms": m["host_s_median"] * 1e3 for v, m in res.items()
                if "host_s_median" in m})  # fmt: skip
    kernels = {v: m for v, m in res.items() if v not in HOST_ONLY}
    row.update({f"{v} frac copy": m.get("frac_copy") for v, m in kernels.items()})
    if all("graph_step_s_median" in m for m in kernels.values()):
        row.update({f"{v} graph ms": m["graph_step_s_median"] * 1e3 for v, m in kernels.items()})
        row.update({f"{v} graph frac copy": m["graph_frac_copy"] for v, m in kernels.items()})
        if "torch" in res and "fused" in res:
            row["graph torch/fused"] = (
                res["torch"]["graph_step_s_median"] / res["fused"]["graph_step_s_median"]
            )
    if "torch" in res and "fused" in res:
        torch_chunks = res["torch"].get("step_s_per_chunk")
        fused_chunks = res["fused"].get("step_s_per_chunk")
        both = t["torch"] is not None and t["fused"] is not None
        row["torch/fused"] = t["torch"] / t["fused"] if both else None
        if torch_chunks and fused_chunks:
            lo, hi = median_ratio_ci(
                torch_chunks, fused_chunks, paired=len(torch_chunks) == len(fused_chunks)
            )
            row.update({"torch/fused 90% lo": lo, "torch/fused 90% hi": hi})
    return row


def main() -> None:
    args, cfg = parse_args()
    run = start_run(args, task="lm_training", logs="layer_norm_benchmark.jsonl")
    device = run.device
    variants = cfg.runnable_variants(device)
    if device.type != "cuda":
        print("note: off CUDA, fused is the PyTorch path; there are no memory statistics")

    copy_gb_per_s, _ = measure_copy_bandwidth(cfg.copy_bytes, device)
    copy_config = {"device": str(device), "bytes": cfg.copy_bytes}
    run.log.log("copy_bandwidth", copy_config, {"gb_per_s": copy_gb_per_s})
    summary = []
    for dtype_name in cfg.dtypes:
        for shape in tqdm(cfg.shapes, desc=f"{dtype_name} shapes", unit="shape"):
            res = benchmark_shape(shape, dtype_name, variants, cfg, run, args.quick, copy_gb_per_s)
            row = summary_row(shape, dtype_name, res)
            shape_config = {"tokens": shape.tokens, "hidden": shape.hidden, "dtype": dtype_name}
            run.log.log("summary", shape_config, row)
            summary.append(row)
    print_table(
        summary,
        title=f"LayerNorm fwd+bwd on {run.where}, copy {copy_gb_per_s:.0f} GB/s "
        f"(log: {run.log.path})",
    )


if __name__ == "__main__":
    run_main(main)
