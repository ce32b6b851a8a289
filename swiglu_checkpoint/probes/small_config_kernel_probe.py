"""Where do level 0 and the reference module spend a step at the small bf16 configs? (probe)

For each config: wall time per step of back-to-back steps (10 interleaved rounds of 100 steps)
and GPU kernel time per step (torch.profiler over 20 steps, kernels summed and grouped by name),
for the reference module, level 0 on the PyTorch path and level 0 on the Triton path. Needs
CUDA. Writes ``--out/small_config_kernels.jsonl``: per config and variant the median and minimum
wall ms per step, kernel ms per step, the GPU's busy share (kernel / wall), the wall time over the
reference's, and the eight longest kernels (microseconds per step, by name).
"""

from __future__ import annotations

import argparse
import statistics as st
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from effdl.models.swiglu import MLPStack, SwigluMLP
from effdl.ops.swiglu import MemoryOptimizedSwigluMLP
from effdl.results import RunLog

CONFIGS = ((16, 128, 512, 2048, 2), (32, 128, 512, 2048, 2), (8, 512, 1024, 4096, 3))
KINDS = ("reference", "level0_torch", "level0_triton")
WARMUP_STEPS, ROUNDS, STEPS_PER_ROUND, PROFILED_STEPS, TOP_KERNELS = 50, 10, 100, 20, 8
DTYPE = torch.bfloat16


def build(kind: str, h: int, i: int, n: int, dev: torch.device) -> MLPStack:
    torch.manual_seed(0)
    if kind == "reference":
        layers = [SwigluMLP(h, i, device=dev, dtype=DTYPE) for _ in range(n)]
    else:
        backend = kind.removeprefix("level0_")
        layers = [MemoryOptimizedSwigluMLP(h, i, 0, device=dev, dtype=DTYPE, elementwise=backend)
                  for _ in range(n)]  # fmt: skip
    return MLPStack(layers, residual=True)


def steps(kind: str, m: MLPStack, x: torch.Tensor, dy: torch.Tensor, n: int) -> None:
    for _ in range(n):
        m.zero_grad(set_to_none=True)
        x.grad = None
        m(x).backward(dy)


def kernel_us_per_step(kind: str, m: MLPStack, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """Microseconds per step of each CUDA kernel (names cut to 60 characters), longest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps(kind, m, x, dy, PROFILED_STEPS)
        torch.cuda.synchronize()
    per_name: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name[:60]] += e.device_time / PROFILED_STEPS
    return dict(sorted(per_name.items(), key=lambda kv: -kv[1]))


def probe_config(log: RunLog, cfg: tuple[int, ...], dev: torch.device) -> None:
    bs, seq, h, i, n = cfg
    x = torch.randn(bs, seq, h, device=dev, dtype=DTYPE, requires_grad=True)
    dy = torch.randn_like(x)
    models = {k: build(k, h, i, n, dev) for k in KINDS}
    for k, m in models.items():
        steps(k, m, x, dy, WARMUP_STEPS)
    torch.cuda.synchronize()
    wall = defaultdict(list)
    for r in range(ROUNDS):
        for k in KINDS[r % 3 :] + KINDS[: r % 3]:
            t0 = time.perf_counter()
            steps(k, models[k], x, dy, STEPS_PER_ROUND)
            torch.cuda.synchronize()
            wall[k].append((time.perf_counter() - t0) / STEPS_PER_ROUND * 1e3)
    config = {
        "batch_size": bs,
        "seq_len": seq,
        "hidden_dim": h,
        "intermediate_size": i,
        "num_layers": n,
        "dtype": "bf16",
        "rounds": ROUNDS,
        "steps_per_round": STEPS_PER_ROUND,
        "profiled_steps": PROFILED_STEPS,
    }
    ref = st.median(wall["reference"])
    print(f"\n=== {bs}x{seq} h{h} i{i} L{n} bf16, {log.env['gpu']}")
    for k in KINDS:
        kernels = kernel_us_per_step(k, models[k], x, dy)
        gpu_ms = sum(kernels.values()) / 1e3
        w = st.median(wall[k])
        metrics = {
            "wall_ms_per_step_median": w,
            "wall_ms_per_step_min": min(wall[k]),
            "gpu_kernel_ms_per_step": gpu_ms,
            "gpu_busy": gpu_ms / w,
            "top_kernels_us": dict(list(kernels.items())[:TOP_KERNELS]),
            "wall_over_reference": w / ref,
        }
        log.log(k, config, metrics)
        print(f"{k:14s} wall/step {w:.3f} ms  GPU kernels {gpu_ms:.3f} ms  busy {gpu_ms / w:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/swiglu/probes"), help="log folder")
    args = p.parse_args()
    log = RunLog(args.out / "small_config_kernels.jsonl", task="swiglu", create=True)
    for cfg in CONFIGS:
        probe_config(log, cfg, torch.device("cuda"))


if __name__ == "__main__":
    main()
