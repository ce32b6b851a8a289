"""Host cost of one elementwise launch on CUDA: aten op, Triton kernel, jiterator kernel (probe).

A Triton kernel is launched through its JITFunction (Triton 3.6's compiled-kernel handle wants
its launcher's internal argument list, so it is left out). Tiny tensors (4096 bf16 elements), so
the GPU never bounds the loop; 20 interleaved rounds of 2000 launches each. Needs CUDA. Writes
``--out/launch_overhead.jsonl``: per launch kind, the median and minimum microseconds per launch
over the rounds, and a ``jiterator gate accuracy`` record (max error of the jiterator gate
against fp32).
"""

from __future__ import annotations

import argparse
import statistics as st
import time
from pathlib import Path

import torch
import triton

from effdl.ops import swiglu_triton as st_mod
from effdl.results import RunLog

ELEMENTS, ROUNDS, LAUNCHES, WARMUP = 4096, 20, 2000, 200

GATE_SOURCE = (
    "template <typename T> T swiglu_gate(T a, T b) {"
    " float x = static_cast<float>(a);"
    " return static_cast<T>(x / (1.0f + ::expf(-x)) * static_cast<float>(b)); }"
)
GATE_BWD_SOURCE = (
    "template <typename T> void swiglu_gate_bwd(T a, T b, T dg, T& da, T& db) {"
    " float x = static_cast<float>(a), y = static_cast<float>(b), d = static_cast<float>(dg);"
    " float s = 1.0f / (1.0f + ::expf(-x));"
    " da = static_cast<T>(d * y * s * (1.0f + x * (1.0f - s)));"
    " db = static_cast<T>(d * x * s); }"
)


def launch_cases(dev: torch.device) -> tuple[dict, float | None]:
    """Callables that each launch one kernel, and the jiterator gate's max error (or None)."""
    a = torch.randn(ELEMENTS, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    g = torch.empty_like(a)
    dg = torch.randn_like(a)
    da = torch.empty_like(a)
    db = torch.empty_like(a)
    grid = (triton.cdiv(ELEMENTS, st_mod.BLOCK),)
    cases = {
        "aten mul": lambda: torch.mul(a, b),
        "aten silu": lambda: torch.nn.functional.silu(a),
        "triton gate (JIT run)": lambda: st_mod._gate_kernel[grid](
            a, b, g, ELEMENTS, BLOCK=st_mod.BLOCK, num_warps=8
        ),
        "triton gate_backward (JIT run)": lambda: st_mod._gate_backward_kernel[grid](
            a, b, dg, da, db, da, ELEMENTS, WANT_G=False, BLOCK=st_mod.BLOCK, num_warps=8
        ),
        "effdl gate()": lambda: st_mod.gate(a, b, inplace=False),
    }
    try:
        from torch.cuda.jiterator import _create_jit_fn, _create_multi_output_jit_fn

        gate_jit = _create_jit_fn(GATE_SOURCE)
        bwd_jit = _create_multi_output_jit_fn(GATE_BWD_SOURCE, num_outputs=2)
    except Exception as e:  # jiterator needs NVRTC; the rest of the probe does not
        print("jiterator unavailable:", type(e).__name__, e)
        return cases, None
    ref = torch.nn.functional.silu(a.float()) * b.float()
    err = (gate_jit(a, b).float() - ref).abs().max().item()
    cases["jiterator gate"] = lambda: gate_jit(a, b)
    cases["jiterator gate_backward"] = lambda: bwd_jit(a, b, dg)
    return cases, err


def time_launches(cases: dict) -> dict[str, list[float]]:
    """Microseconds per launch of each case, one value per round (rounds interleave the cases)."""
    for f in cases.values():
        for _ in range(WARMUP):
            f()
    torch.cuda.synchronize()
    per_round: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(ROUNDS):
        for k, f in cases.items():
            t0 = time.perf_counter()
            for _ in range(LAUNCHES):
                f()
            per_round[k].append((time.perf_counter() - t0) / LAUNCHES * 1e6)
        torch.cuda.synchronize()
    return per_round


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/swiglu/probes"), help="log folder")
    args = p.parse_args()
    log = RunLog(args.out / "launch_overhead.jsonl", task="swiglu", create=True)
    cases, jit_err = launch_cases(torch.device("cuda"))
    config = {
        "elements": ELEMENTS,
        "dtype": "bf16",
        "rounds": ROUNDS,
        "launches_per_round": LAUNCHES,
        "triton": triton.__version__,
    }
    for name, us in time_launches(cases).items():
        log.log(name, config, {"us_per_launch_median": st.median(us), "us_per_launch_min": min(us)})
        print(f"{name:34s} {st.median(us):7.2f} us/launch (min {min(us):.2f})")
    if jit_err is not None:
        log.log(
            "jiterator gate accuracy",
            {"elements": ELEMENTS, "dtype": "bf16"},
            {"max_abs_err_vs_fp32": jit_err},
        )
        print("jiterator gate max err vs fp32:", jit_err)


if __name__ == "__main__":
    main()
