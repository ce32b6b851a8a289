"""Measure the two ceilings every efficiency number in effdl is compared against.

Dense GEMM throughput (TFLOP/s) per dtype and device-to-device copy bandwidth (GB/s) on the
device at hand. Reports divide achieved FLOP/s and bytes/s by these measured values rather than
by datasheet peaks. Also the project's example of the task-script conventions.

    python swiglu_checkpoint/gpu_ceilings.py --quick          # CPU smoke run
    python swiglu_checkpoint/gpu_ceilings.py --device cuda    # on the GPU machine
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from effdl.cli import (
    UsageError,
    base_parser,
    device_from_arg,
    print_table,
    run_main,
    seed_everything,
)
from effdl.profiling.flops import measure_copy_bandwidth, measure_matmul_tflops
from effdl.results import RunLog

DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/ceilings")
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="GEMM sizes n (n x n x n); default 4096 8192 on CUDA, 256 512 with --quick",
    )
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), help=f"subset of {list(DTYPES)}")
    p.add_argument(
        "--copy-gib",
        type=float,
        default=None,
        help="bytes copied for the bandwidth test (GiB); default 4, 0.0625 with --quick",
    )
    p.add_argument("--iters", type=int, default=20)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = device_from_arg(args.device)
    seed_everything(args.seed)
    unknown = sorted(set(args.dtypes) - set(DTYPES))
    if unknown:
        raise UsageError(f"--dtypes: unknown {unknown}; expected a subset of {list(DTYPES)}")
    if device.type == "cpu" and {"bf16", "fp16"} & set(args.dtypes) and not args.quick:
        print(
            "note: low-precision GEMMs on a CPU say little about a GPU; use --quick for a smoke run"
        )
    sizes = args.sizes or ([256, 512] if args.quick else [4096, 8192])
    copy_gib = args.copy_gib if args.copy_gib is not None else (1 / 16 if args.quick else 4.0)
    if min(sizes) <= 0 or copy_gib <= 0:
        raise UsageError("--sizes and --copy-gib must be positive")
    iters = 3 if args.quick else args.iters

    log = RunLog(args.out / "ceilings.jsonl", task="ceilings")
    rows = []
    work = [(d, n) for d in args.dtypes for n in sizes]
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, n in tqdm(work, desc="GEMM", unit="shape"):
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            tf, stats = measure_matmul_tflops(n, DTYPES[name], device, iters=iters)
            config = {"op": "matmul", "dtype": name, "n": n, "device": str(device)}
            log.log(f"matmul_{name}", config, {"tflops": tf, **stats.as_dict("time_s_")})
            rows.append(
                {
                    "measure": f"matmul {name}",
                    "size": n,
                    "value": tf,
                    "unit": "TFLOP/s",
                    "median_ms": stats.median * 1e3,
                }
            )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32

    nbytes = int(copy_gib * 1024**3)
    gbs, stats = measure_copy_bandwidth(nbytes, device, iters=iters)
    log.log(
        "copy",
        {"op": "copy", "bytes": nbytes, "device": str(device)},
        {"gb_per_s": gbs, **stats.as_dict("time_s_")},
    )
    rows.append(
        {
            "measure": "d2d copy (r+w)",
            "size": nbytes,
            "value": gbs,
            "unit": "GB/s",
            "median_ms": stats.median * 1e3,
        }
    )

    print_table(rows, title=f"Ceilings on {log.env['gpu'] or log.env['cpu']} (log: {log.path})")


if __name__ == "__main__":
    run_main(main)
