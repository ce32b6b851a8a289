"""Where do level 0 and the reference module spend a step at the small bf16 configs? (probe, H100)

For each config: GPU kernel time per step (torch.profiler, kernels summed, grouped by name) and
wall time per step of back-to-back steps (10 interleaved rounds), for the reference module,
level 0 on the PyTorch path and level 0 on the Triton path.
"""

import os
import statistics as st
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from effdl.models.swiglu import MLPStack, SwigluMLP
from effdl.ops.swiglu import ELEMENTWISE_ENV, MemoryOptimizedSwigluMLP

dev = torch.device("cuda")
dt = torch.bfloat16


def build(kind, h, i, n):
    torch.manual_seed(0)
    if kind == "reference":
        layers = [SwigluMLP(h, i, device=dev, dtype=dt) for _ in range(n)]
    else:
        layers = [MemoryOptimizedSwigluMLP(h, i, 0, device=dev, dtype=dt) for _ in range(n)]
    return MLPStack(layers, residual=True)


def steps(kind, m, x, dy, n):
    os.environ[ELEMENTWISE_ENV] = "triton" if kind == "level0_triton" else "torch"
    for _ in range(n):
        m.zero_grad(set_to_none=True)
        x.grad = None
        m(x).backward(dy)


KINDS = ("reference", "level0_torch", "level0_triton")
for bs, seq, h, i, n in ((16, 128, 512, 2048, 2), (32, 128, 512, 2048, 2), (8, 512, 1024, 4096, 3)):
    x = torch.randn(bs, seq, h, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    models = {k: build(k.split("_")[0], h, i, n) for k in KINDS}
    for k, m in models.items():
        steps(k, m, x, dy, 50)
    torch.cuda.synchronize()
    wall = defaultdict(list)
    for r in range(10):
        for k in KINDS[r % 3 :] + KINDS[: r % 3]:
            t0 = time.perf_counter()
            steps(k, models[k], x, dy, 100)
            torch.cuda.synchronize()
            wall[k].append((time.perf_counter() - t0) / 100 * 1e3)
    print(f"\n=== {bs}x{seq} h{h} i{i} L{n} bf16, {torch.cuda.get_device_name()}")
    for k in KINDS:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps(k, models[k], x, dy, 20)
            torch.cuda.synchronize()
        per_name = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per_name[e.name[:60]] += e.device_time / 20 / 1e3
        gpu = sum(per_name.values())
        w = st.median(wall[k])
        print(
            f"{k:14s} wall/step {w:.3f} ms (min {min(wall[k]):.3f})  GPU kernels {gpu:.3f} ms  busy {gpu / w:.2f}"
        )
        for name, t in sorted(per_name.items(), key=lambda kv: -kv[1])[:8]:
            print(f"      {t * 1e3:8.1f} us  {name}")
    ref = st.median(wall["reference"])
    print("wall ratios vs reference:", {k: round(st.median(wall[k]) / ref, 3) for k in KINDS})
