"""Host cost of one elementwise launch on CUDA: aten op, Triton kernel through JITFunction, and a
torch.cuda.jiterator kernel (Triton 3.6's compiled-kernel handle wants its launcher's internal
argument list, so it is left out) (probe, H100).

Tiny tensors (4096 elements), so the GPU never bounds the loop; 20 rounds of 2000 launches each,
median microseconds per launch.
"""

import statistics as st
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
from effdl.ops import swiglu_triton as st_mod

dev = torch.device("cuda")
a = torch.randn(4096, device=dev, dtype=torch.bfloat16)
b = torch.randn_like(a)
g = torch.empty_like(a)
dg = torch.randn_like(a)
da, db = torch.empty_like(a), torch.empty_like(a)
n = a.numel()
grid = (triton.cdiv(n, st_mod.BLOCK),)
print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())

cases = {
    "aten mul": lambda: torch.mul(a, b),
    "aten silu": lambda: torch.nn.functional.silu(a),
    "triton gate (JIT run)": lambda: st_mod._gate_kernel[grid](
        a, b, g, n, BLOCK=st_mod.BLOCK, num_warps=8
    ),
    "triton gate_backward (JIT run)": lambda: st_mod._gate_backward_kernel[grid](
        a, b, dg, da, db, da, n, WANT_G=False, BLOCK=st_mod.BLOCK, num_warps=8
    ),
    "effdl gate()": lambda: st_mod.gate(a, b, inplace=False),
}
try:
    from torch.cuda.jiterator import _create_jit_fn, _create_multi_output_jit_fn

    gate_jit = _create_jit_fn(
        "template <typename T> T swiglu_gate(T a, T b) {"
        " float x = static_cast<float>(a);"
        " return static_cast<T>(x / (1.0f + ::expf(-x)) * static_cast<float>(b)); }"
    )
    bwd_jit = _create_multi_output_jit_fn(
        "template <typename T> void swiglu_gate_bwd(T a, T b, T dg, T& da, T& db) {"
        " float x = static_cast<float>(a), y = static_cast<float>(b), d = static_cast<float>(dg);"
        " float s = 1.0f / (1.0f + ::expf(-x));"
        " da = static_cast<T>(d * y * s * (1.0f + x * (1.0f - s)));"
        " db = static_cast<T>(d * x * s); }",
        num_outputs=2,
    )
    ref = torch.nn.functional.silu(a.float()) * b.float()
    print("jiterator gate max err vs fp32:", (gate_jit(a, b).float() - ref).abs().max().item())
    cases["jiterator gate"] = lambda: gate_jit(a, b)
    cases["jiterator gate_backward"] = lambda: bwd_jit(a, b, dg)
except Exception as e:
    print("jiterator unavailable:", type(e).__name__, e)

for f in cases.values():
    for _ in range(200):
        f()
torch.cuda.synchronize()
res = {k: [] for k in cases}
for _ in range(20):
    for k, f in cases.items():
        t0 = time.perf_counter()
        for _ in range(2000):
            f()
        res[k].append((time.perf_counter() - t0) / 2000 * 1e6)
    torch.cuda.synchronize()
for k, v in res.items():
    print(f"{k:34s} {st.median(v):7.2f} us/launch (min {min(v):.2f})")
