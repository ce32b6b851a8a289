"""Where do level 0 and the reference module spend a step at the small bf16 configs? (probe)

For each config: wall time per step of back-to-back steps (10 interleaved rounds of 100 steps)
and GPU kernel time per step (torch.profiler over 20 steps, kernels summed and grouped by name),
for the reference module, level 0 on the PyTorch path and level 0 on the Triton path. Needs
CUDA. Writes ``--out/small_config_kernels.jsonl``: per config and variant the median and minimum
wall ms per step, kernel ms per step, the GPU's busy share (kernel / wall), the wall time over the
reference's, and the eight longest kernels (microseconds per step, by name). ``--quick`` is a
short smoke run of the first config on the GPU.

    python3 swiglu_checkpoint/probes/small_config_kernel_probe.py --out runs/swiglu/probes
"""

from __future__ import annotations

import statistics as st
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from effdl.cli import ConfigFlags, base_parser, require_cuda, require_positive, run_main, start_run
from effdl.models.swiglu import MLPStack, SwigluMLP
from effdl.ops.swiglu import MemoryOptimizedSwigluMLP
from effdl.results import RunLog

# (batch_size, seq_len, hidden_dim, intermediate_size, num_layers)
CONFIGS = ((16, 128, 512, 2048, 2), (32, 128, 512, 2048, 2), (8, 512, 1024, 4096, 3))
KINDS = ("reference", "level0_torch", "level0_triton")
TOP_KERNELS = 8
DTYPE = torch.bfloat16


@dataclass
class ProbeConfig:
    """Configs and step counts; the defaults are the GPU experiment."""

    configs: list[tuple[int, ...]] = field(default_factory=lambda: list(CONFIGS))
    warmup_steps: int = 50
    rounds: int = 10  # interleaved rounds of every kind
    steps_per_round: int = 100
    profiled_steps: int = 20
    residual: bool = True  # x + mlp(x) per layer, as the benchmark's default; False: the bare stack

    def validate(self) -> None:
        require_positive(self, "rounds", "steps_per_round", "profiled_steps")
        require_positive(self, "warmup_steps", minimum=0)


FULL = ProbeConfig()
QUICK = ProbeConfig(configs=list(CONFIGS[:1]), warmup_steps=3, rounds=3, steps_per_round=5,
                    profiled_steps=2)  # fmt: skip


def build(kind: str, h: int, i: int, n: int, dev: torch.device, residual: bool) -> MLPStack:
    torch.manual_seed(0)
    if kind == "reference":
        layers = [SwigluMLP(h, i, device=dev, dtype=DTYPE) for _ in range(n)]
    else:
        backend = kind.removeprefix("level0_")
        layers = [MemoryOptimizedSwigluMLP(h, i, 0, device=dev, dtype=DTYPE, elementwise=backend)
                  for _ in range(n)]  # fmt: skip
    return MLPStack(layers, residual=residual)


def steps(kind: str, m: MLPStack, x: torch.Tensor, dy: torch.Tensor, n: int) -> None:
    for _ in range(n):
        m.zero_grad(set_to_none=True)
        x.grad = None
        m(x).backward(dy)


def kernel_us_per_step(kind: str, m: MLPStack, x: torch.Tensor, dy: torch.Tensor, n: int) -> dict:
    """Microseconds per step of each CUDA kernel (names cut to 60 characters) over ``n`` steps,
    longest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps(kind, m, x, dy, n)
        torch.cuda.synchronize()
    per_name: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name[:60]] += e.device_time / n
    return dict(sorted(per_name.items(), key=lambda kv: -kv[1]))


def measure_config(pcfg: ProbeConfig, shape: tuple[int, ...], dev: torch.device):
    """Per kind: the wall ms per step of each round (rounds interleaved, the order rotating)
    and the kernel microseconds per step by name."""
    bs, seq, h, i, n = shape
    x = torch.randn(bs, seq, h, device=dev, dtype=DTYPE, requires_grad=True)
    dy = torch.randn_like(x)
    models = {k: build(k, h, i, n, dev, pcfg.residual) for k in KINDS}
    for k, m in models.items():
        steps(k, m, x, dy, pcfg.warmup_steps)
    torch.cuda.synchronize()
    wall = defaultdict(list)
    for r in range(pcfg.rounds):
        for k in KINDS[r % 3 :] + KINDS[: r % 3]:
            t0 = time.perf_counter()
            steps(k, models[k], x, dy, pcfg.steps_per_round)
            torch.cuda.synchronize()
            wall[k].append((time.perf_counter() - t0) / pcfg.steps_per_round * 1e3)
    kernels = {k: kernel_us_per_step(k, models[k], x, dy, pcfg.profiled_steps) for k in KINDS}
    return wall, kernels


def log_config(
    log: RunLog, pcfg: ProbeConfig, shape: tuple[int, ...], wall: dict, kernels: dict
) -> list[dict]:
    """The records of one config, a kind each, from its wall ms per round and kernel us."""
    bs, seq, h, i, n = shape
    config = {
        "batch_size": bs,
        "seq_len": seq,
        "hidden_dim": h,
        "intermediate_size": i,
        "num_layers": n,
        "dtype": "bf16",
        "rounds": pcfg.rounds,
        "steps_per_round": pcfg.steps_per_round,
        "profiled_steps": pcfg.profiled_steps,
        "residual": pcfg.residual,
    }
    ref = st.median(wall["reference"])
    print(f"\n=== {bs}x{seq} h{h} i{i} L{n} bf16, {log.env['gpu']}")
    records = []
    for k in KINDS:
        gpu_ms = sum(kernels[k].values()) / 1e3
        w = st.median(wall[k])
        metrics = {
            "wall_ms_per_step_median": w,
            "wall_ms_per_step_min": min(wall[k]),
            "gpu_kernel_ms_per_step": gpu_ms,
            "gpu_busy": gpu_ms / w,
            "top_kernels_us": dict(list(kernels[k].items())[:TOP_KERNELS]),
            "wall_over_reference": w / ref,
        }
        records.append(log.log(k, config, metrics))
        print(f"{k:14s} wall/step {w:.3f} ms  GPU kernels {gpu_ms:.3f} ms  busy {gpu_ms / w:.2f}")
    return records


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/swiglu/probes")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("warmup_steps", type=int, help="untimed steps per kind and config")
    flags.add("rounds", type=int, help="interleaved timed rounds")
    flags.add("steps_per_round", type=int, help="back-to-back steps per round")
    flags.add("profiled_steps", type=int, help="steps under torch.profiler per kind")
    flags.add("residual", flag="--no-residual", action="store_false",
              help="bare stack x = mlp(x), as the assignment's test model")  # fmt: skip
    args = p.parse_args()
    pcfg = flags.resolve(args)
    require_cuda(args.device, "the small-config kernel probe")
    run = start_run(args, task="swiglu", logs="small_config_kernels.jsonl")
    for shape in pcfg.configs:
        log_config(run.log, pcfg, shape, *measure_config(pcfg, shape, run.device))


if __name__ == "__main__":
    run_main(main)
