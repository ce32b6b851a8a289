"""Count the GEMM kernels one training step of each SwiGLU variant launches, per layer.

Non-reentrant ``torch.utils.checkpoint`` stops re-running the forward as soon as every tensor
the backward needs exists again; for ``U(silu(W x) * V x)`` that is after ``g``, so it should
re-run 2 of the 3 forward GEMMs (11 per layer and step against the reference's 9), not 3. This
counts the GEMM kernels in a torch.profiler trace (CUDA) or, on a CPU, the matmuls that actually
execute (below autograd: the profiler's op events include the GEMM that early stop aborts after
it was dispatched, before its kernel ran).

    python3 swiglu_checkpoint/probes/gemm_kernel_count.py --device cuda --out runs/swiglu
"""

from __future__ import annotations

import re

import torch
from torch.profiler import ProfilerActivity, profile

from effdl.cli import base_parser, print_table, require_fits, require_positive, run_main, start_run
from effdl.models.swiglu import Checkpointed, MLPStack, SwigluMLP
from effdl.ops.swiglu import CheckpointLevel, MemoryOptimizedSwigluMLP
from effdl.profiling.flops import MatmulCounter

GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|sm\d+_.*_tn|ampere_|hopper_", re.IGNORECASE)
LEVELS = {"level0": 0, "level1": 1, "level2": 2}


def build(
    variant: str, layers: int, hidden: int, inter: int, device, dtype, residual: bool
) -> torch.nn.Module:
    kw = {"device": device, "dtype": dtype}
    if variant in LEVELS:
        mods = [MemoryOptimizedSwigluMLP(hidden, inter, CheckpointLevel(LEVELS[variant]), **kw)
                for _ in range(layers)]  # fmt: skip
    else:
        mods = [SwigluMLP(hidden, inter, **kw) for _ in range(layers)]
        if variant == "checkpoint":
            mods = [Checkpointed(m) for m in mods]
    return MLPStack(mods, residual=residual)


def count_gemms(model, x, dy, cuda: bool) -> tuple[int, list[str]]:
    """GEMM kernels (CUDA) or executed aten matmuls (CPU) in one forward + backward."""
    for _ in range(2):  # warm-up: GEMM heuristics, lazy init
        model(x).backward(dy)
    if not cuda:
        with MatmulCounter() as counter:
            model(x).backward(dy)
        return counter.total, sorted(f"aten::{name}" for name in counter.counts)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(x).backward(dy)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    gemms = [n for n in names if GEMM_KERNEL.search(n)]
    return len(gemms), sorted(set(gemms))


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/swiglu")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--no-residual", dest="residual", action="store_false",
                   help="bare stack x = mlp(x), as the assignment's test model")  # fmt: skip
    args = p.parse_args()
    require_positive(args, "layers")
    require_fits("--layers", args.layers * 3 * 1024 * 4096, "the layers' weights")
    run = start_run(args, task="swiglu", logs="gemm_kernel_count.jsonl")
    cuda = run.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    hidden, inter, tokens = (1024, 4096, 4096) if cuda else (64, 192, 128)
    rows = []
    for variant in ("reference", "checkpoint", "level0", "level2", "level1"):
        torch.manual_seed(args.seed)
        model = build(variant, args.layers, hidden, inter, run.device, dtype, args.residual)
        x = torch.randn(tokens, hidden, device=run.device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        n, names = count_gemms(model, x, dy, cuda)
        per_layer = n / args.layers
        config = {"layers": args.layers, "hidden": hidden, "intermediate": inter,
                  "tokens": tokens, "dtype": str(dtype), "device": str(run.device),
                  "residual": args.residual}  # fmt: skip
        run.log.log(variant, config, {"gemms_per_step": n, "gemms_per_layer": per_layer,
                                      "kernel_names": names})  # fmt: skip
        rows.append({"variant": variant, "GEMMs/layer/step": per_layer, "kernels": len(names)})
    print_table(rows, title=f"GEMMs per layer and training step on {run.where}")


if __name__ == "__main__":
    run_main(main)
