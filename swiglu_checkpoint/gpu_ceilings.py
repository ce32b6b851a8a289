"""Measure the GPU's dense-GEMM and copy-bandwidth ceilings: yardsticks for efficiency numbers.

Dense GEMM throughput (TFLOP/s) per dtype and device-to-device copy bandwidth (GB/s) on the
device at hand. Reports divide achieved FLOP/s and bytes/s by these measured values rather than
by datasheet peaks. Also the project's example of the task-script conventions.

    python3 swiglu_checkpoint/gpu_ceilings.py --quick          # CPU smoke run
    python3 swiglu_checkpoint/gpu_ceilings.py --device cuda    # on a machine with a GPU
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    print_table,
    require_choices,
    require_fits,
    require_positive,
    run_main,
    start_run,
)
from effdl.profiling.flops import measure_copy_bandwidth, measure_matmul_tflops
from effdl.results import RunLog

DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class CeilingsConfig:
    """GEMM sizes and dtypes, the copy's size, and the timed calls per measurement."""

    sizes: list[int] = field(default_factory=lambda: [4096, 8192])
    dtypes: list[str] = field(default_factory=lambda: list(DTYPES))
    copy_gib: float = 4.0
    iters: int = 20

    def validate(self) -> None:
        require_choices(self, "dtypes", DTYPES)
        require_positive(self, "sizes", "iters")
        require_fits("--sizes", 3 * max(self.sizes) ** 2, "the product's three n x n matrices")
        if not self.copy_gib > 0:
            raise UsageError(f"--copy-gib must be > 0, got {self.copy_gib}")
        require_fits("--copy-gib", 2 * self.copy_gib * 2**30, "the copy's source and target", 1)


FULL = CeilingsConfig()
QUICK = CeilingsConfig(sizes=[256, 512], copy_gib=1 / 16, iters=3)


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/ceilings")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("sizes", type=int, nargs="+", help="GEMM sizes n (n x n x n)")
    flags.add("dtypes", nargs="+", help=f"subset of {list(DTYPES)}")
    flags.add("copy_gib", type=float, help="bytes copied for the bandwidth test (GiB)")
    flags.add("iters", type=int, help="timed calls per measurement")
    args = p.parse_args()
    return args, flags.resolve(args)


def measure_gemms(cfg: CeilingsConfig, device: torch.device, log: RunLog) -> list[dict]:
    """TFLOP/s of every dtype and size, logged; TF32 allowed only for ``tf32`` (and restored)."""
    rows = []
    work = [(d, n) for d in cfg.dtypes for n in cfg.sizes]
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, n in tqdm(work, desc="GEMM", unit="shape"):
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            tf, stats = measure_matmul_tflops(n, DTYPES[name], device, iters=cfg.iters)
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
    return rows


def measure_copy(cfg: CeilingsConfig, device: torch.device, log: RunLog) -> dict:
    """Device-to-device copy bandwidth (bytes read plus written), logged."""
    nbytes = int(cfg.copy_gib * 1024**3)
    gbs, stats = measure_copy_bandwidth(nbytes, device, iters=cfg.iters)
    log.log(
        "copy",
        {"op": "copy", "bytes": nbytes, "device": str(device)},
        {"gb_per_s": gbs, **stats.as_dict("time_s_")},
    )
    return {
        "measure": "d2d copy (r+w)",
        "size": nbytes,
        "value": gbs,
        "unit": "GB/s",
        "median_ms": stats.median * 1e3,
    }


def main() -> None:
    args, cfg = parse_args()
    run = start_run(args, task="ceilings", logs="ceilings.jsonl")
    if run.device.type == "cpu" and {"bf16", "fp16"} & set(cfg.dtypes) and not args.quick:
        print(
            "note: low-precision GEMMs on a CPU say little about a GPU; use --quick for a smoke run"
        )
    rows = [*measure_gemms(cfg, run.device, run.log), measure_copy(cfg, run.device, run.log)]
    print_table(rows, title=f"Ceilings on {run.where} (log: {run.log.path})")


if __name__ == "__main__":
    run_main(main)
