"""How noisy is a host-bound config chunk to chunk, and does pinning the process change it? (probe)

Runs swiglu_checkpoint/benchmark.py at bf16 16x128 h512 i2048 L2 (reference and level 0, 20
rounds) four times: unpinned, on cores 0-3 (``taskset``), unpinned again, on cores 4-7. Needs
CUDA and ``taskset``. Writes one record per run to ``--out/host_noise.jsonl``: each variant's
median step time over its chunks, the chunks' coefficient of variation, and level 0 / reference.
"""

from __future__ import annotations

import argparse
import statistics as st
import subprocess
import sys
import tempfile
from pathlib import Path

from effdl.results import RunLog, read_records

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmark.py"
CONFIG = {
    "batch_size": 16,
    "seq_len": 128,
    "hidden_dim": 512,
    "intermediate_size": 2048,
    "num_layers": 2,
    "dtype": "bf16",
    "rounds": 20,
    "min_time_s": 3.0,
}
RUNS = {"plain": None, "pin0-3": "0-3", "plain2": None, "pin4-7": "4-7"}  # name: cores


def benchmark_run(cores: str | None, out: Path) -> list[dict]:
    """The benchmark's records of one run at CONFIG, pinned to ``cores`` if given."""
    c = CONFIG
    cmd = [sys.executable, str(BENCHMARK), "--device", "cuda", "--dtypes", c["dtype"]]
    cmd += [
        "--configs",
        f"{c['batch_size']},{c['seq_len']},{c['hidden_dim']},"
        f"{c['intermediate_size']},{c['num_layers']}",
    ]
    cmd += ["--variants", "reference", "level0", "--rounds", str(c["rounds"])]
    cmd += ["--min-time", str(c["min_time_s"]), "--out", str(out)]
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return read_records(out / "benchmark.jsonl")


def chunk_metrics(records: list[dict]) -> dict[str, float]:
    chunks = {
        r["variant"]: r["metrics"]["step_s_per_chunk"]
        for r in records
        if "step_s_per_chunk" in r["metrics"]
    }
    metrics = {}
    for v in ("reference", "level0"):
        c = chunks[v]
        metrics[f"{v}_ms_median"] = st.median(c) * 1e3
        metrics[f"{v}_chunk_cv"] = st.stdev(c) / st.mean(c)
    metrics["l0_over_ref"] = st.median(chunks["level0"]) / st.median(chunks["reference"])
    return metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/swiglu/probes"), help="log folder")
    args = p.parse_args()
    log = RunLog(args.out / "host_noise.jsonl", task="swiglu", create=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, cores in RUNS.items():
            metrics = chunk_metrics(benchmark_run(cores, Path(tmp) / name))
            log.log(name, {**CONFIG, "cpu_affinity": cores}, metrics)
            print(name.ljust(7), " | ".join(f"{k} {v:.3f}" for k, v in metrics.items()))


if __name__ == "__main__":
    main()
