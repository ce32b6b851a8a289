"""Why is level 0 slower than the reference module at two small configs? (probe, H100)

For each config: (1) step time as the benchmark takes it (sync before each step, events around
forward and backward), medians of many reps, variants interleaved; (2) back-to-back steps with
no sync between them (GPU-bound throughput); (3) the kernels of one step from torch.profiler:
summed kernel time per name, so a slower kernel or an extra one shows up.
"""

import statistics as st
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from effdl.models.swiglu import MLPStack, SwigluMLP
from effdl.ops.swiglu import MemoryOptimizedSwigluMLP

dev = torch.device("cuda")
CONFIGS = [((8, 512, 1024, 4096, 3), torch.bfloat16), ((16, 128, 512, 2048, 2), torch.float32)]


def build(kind, h, i, n, dtype):
    torch.manual_seed(0)
    if kind == "reference":
        layers = [SwigluMLP(h, i, device=dev, dtype=dtype) for _ in range(n)]
    else:
        layers = [MemoryOptimizedSwigluMLP(h, i, 0, device=dev, dtype=dtype) for _ in range(n)]
    return MLPStack(layers, residual=True)


def step(m, x, dy):
    m.zero_grad(set_to_none=True)
    m(x).backward(dy)


def synced(m, x, dy):
    torch.cuda.synchronize()
    e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    m.zero_grad(set_to_none=True)
    e[0].record()
    y = m(x)
    e[1].record()
    y.backward(dy)
    e[2].record()
    torch.cuda.synchronize()
    return e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2])


def back_to_back(m, x, dy, n=50):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        step(m, x, dy)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


for (bs, sl, h, i, n), dtype in CONFIGS:
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.randn(bs, sl, h, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    models = {k: build(k, h, i, n, dtype) for k in ("reference", "level0")}
    for m in models.values():
        for _ in range(5):
            step(m, x, dy)
    res = {k: {"fwd": [], "bwd": [], "b2b": []} for k in models}
    for _ in range(30):
        for k, m in models.items():
            f, b = synced(m, x, dy)
            res[k]["fwd"].append(f)
            res[k]["bwd"].append(b)
    for _ in range(5):
        for k, m in models.items():
            res[k]["b2b"].append(back_to_back(m, x, dy))
    print(f"\n=== {bs}x{sl} h{h} i{i} L{n} {dtype} on {torch.cuda.get_device_name()}")
    for k, r in res.items():
        f, b, c = (st.median(r[q]) for q in ("fwd", "bwd", "b2b"))
        print(
            f"{k:10s} synced: fwd {f:.3f} ms bwd {b:.3f} ms step {f + b:.3f} ms | "
            f"back-to-back step {c:.3f} ms"
        )
    for q in ("fwd", "bwd", "b2b"):
        ratio = st.median(res["level0"][q]) / st.median(res["reference"][q])
        print(f"level0/reference {q}: {ratio:.3f}")
    for k, m in models.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                synced(m, x, dy)
        print(f"\n--- {k}: kernels of 3 synced steps (sum over steps, us)")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=18, max_name_column_width=70
            )
        )
