"""At the smallest bf16 configs a step is ~0.2 ms of GPU work and ~1 ms of host work: is level
0's host path slower than the reference module's on CUDA? (probe, H100)

Wall time per step of back-to-back steps (the host bounds it), reference vs level 0, 10
interleaved rounds, with the garbage collector on and off; then a cProfile of each.
"""

import cProfile
import gc
import io
import pstats
import statistics as st
import sys
import time

import torch

sys.path.insert(0, ".")
from effdl.models.swiglu import MLPStack, SwigluMLP
from effdl.ops.swiglu import MemoryOptimizedSwigluMLP

dev = torch.device("cuda")


def build(kind, h, i, n):
    torch.manual_seed(0)
    if kind == "reference":
        layers = [SwigluMLP(h, i, device=dev, dtype=torch.bfloat16) for _ in range(n)]
    else:
        layers = [
            MemoryOptimizedSwigluMLP(h, i, 0, device=dev, dtype=torch.bfloat16) for _ in range(n)
        ]
    return MLPStack(layers, residual=True)


def steps(m, x, dy, n):
    for _ in range(n):
        m.zero_grad(set_to_none=True)
        m(x).backward(dy)


def wall_per_step(m, x, dy, n=200, gc_off=False):
    if gc_off:
        gc.disable()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps(m, x, dy, n)
    torch.cuda.synchronize()
    gc.enable()
    return (time.perf_counter() - t0) / n * 1e3


for bs in (16, 32):
    x = torch.randn(bs, 128, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    models = {k: build(k, 512, 2048, 2) for k in ("reference", "level0")}
    for m in models.values():
        steps(m, x, dy, 50)
    res = {(k, g): [] for k in models for g in (False, True)}
    for _ in range(10):
        for k, m in models.items():
            for g in (False, True):
                res[k, g].append(wall_per_step(m, x, dy, gc_off=g))
    print(f"\n=== {bs}x128 h512 i2048 L2 bf16, {torch.cuda.get_device_name()}: ms per step")
    for (k, g), v in res.items():
        print(f"{k:10s} gc {'off' if g else 'on '}: median {st.median(v):.3f} min {min(v):.3f}")
    for g in (False, True):
        r = st.median(res["level0", g]) / st.median(res["reference", g])
        print(f"level0/reference (gc {'off' if g else 'on'}): {r:.3f}")
    for k, m in models.items():
        prof = cProfile.Profile()
        prof.enable()
        steps(m, x, dy, 200)
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
        print(f"--- {k} cProfile, 200 steps\n" + s.getvalue()[-2600:])
