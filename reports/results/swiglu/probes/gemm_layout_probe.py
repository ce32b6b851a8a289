# ruff: noqa: B023  (archived probe: kept as it ran; its lambdas run inside the loop)
"""Does the weight layout (hidden x inter contiguous vs nn.Linear's inter x hidden) change GEMM time?"""

import torch

from effdl.profiling.timing import benchmark

print(torch.cuda.get_device_name())
for dtype in (torch.bfloat16, torch.float32):
    for m, k, n in [(4096, 1024, 4096), (4096, 4096, 1024), (2048, 512, 2048), (8192, 4096, 16384)]:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w_kn = torch.randn(k, n, device="cuda", dtype=dtype)  # ours: (hidden, inter)
        w_nk = w_kn.t().contiguous()  # nn.Linear weight
        a = benchmark(lambda: torch.mm(x, w_kn), warmup=10, iters=50, device="cuda").median
        b = benchmark(lambda: torch.mm(x, w_nk.t()), warmup=10, iters=50, device="cuda").median
        c = benchmark(
            lambda: torch.nn.functional.linear(x, w_nk), warmup=10, iters=50, device="cuda"
        ).median
        print(
            f"{str(dtype)[6:]:9s} {m}x{k}x{n}: mm(x, W[k,n]) {a * 1e6:8.1f} us | mm(x, W[n,k].t()) {b * 1e6:8.1f} us | linear {c * 1e6:8.1f} us | ratio {a / c:.3f}"
        )
