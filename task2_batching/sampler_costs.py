"""CPU cost of the length-bucketed batch sampler: __init__ vs n (O(n)) and per batch (flat in n).

Lengths are drawn like WikiText-103 paragraph lengths (log-normal, median 75 tokens, cut to
640). For each n and k: ``__init__`` time (median of repeats), the epoch-start cost (first
batch, which restores the index pool), and the mean cost per batch and per index over up to
``--batches`` following batches.

    python task2_batching/sampler_costs.py --quick
    python task2_batching/sampler_costs.py            # n up to 1.8 M (the WikiText-103 size)
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field, replace

import numpy as np
from tqdm import tqdm

from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    print_table,
    require_fits,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.samplers import UltraDuperBigBrainBatchSampler


@dataclass
class SamplerCostsConfig:
    ns: list[int] = field(default_factory=lambda: [10_000, 100_000, 1_000_000, 1_800_000])
    ks: list[int] = field(default_factory=lambda: [1, 5, 50, 640])
    batch_size: int = 64
    batches: int = 2000
    repeats: int = 5

    def validate(self) -> None:
        require_positive(self, "ns", "batch_size", "batches", "repeats")
        require_positive(self, "ks", minimum=0)
        require_fits("--ns", max(self.ns), "the documents' lengths (int64)", 8)
        if self.batch_size > min(self.ns):
            raise UsageError(
                f"--batch-size {self.batch_size} exceeds the smallest data set of --ns "
                f"({min(self.ns)} documents)"
            )


FULL = SamplerCostsConfig()
QUICK = replace(FULL, ns=[1_000, 10_000, 100_000], batches=300, repeats=2)


def parse_args() -> tuple[argparse.Namespace, SamplerCostsConfig]:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task2")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("ns", type=int, nargs="+", help="dataset sizes")
    flags.add("ks", type=int, nargs="+", help="length spans")
    flags.add("batch_size", type=int, help="rows per batch")
    flags.add("batches", type=int, help="batches timed per (n, k)")
    flags.add("repeats", type=int, help="__init__ repeats")
    args = p.parse_args()
    return args, flags.resolve(args)


def wikitext_like_lengths(n: int, rng: np.random.Generator, max_length: int = 640) -> np.ndarray:
    """``n`` lengths like WikiText-103's paragraphs (see the module doc)."""
    return np.clip(rng.lognormal(np.log(75.0), 0.95, n), 1, max_length).astype(np.int64)


def measure(lengths: np.ndarray, batch_size: int, k: int, batches: int, repeats: int) -> dict:
    """The sampler's ``__init__`` (median of ``repeats``), first-batch and per-batch costs."""
    inits = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler = UltraDuperBigBrainBatchSampler(lengths, batch_size, k)
        inits.append(time.perf_counter() - start)
    it = iter(sampler)
    start = time.perf_counter()
    next(it)
    first_s = time.perf_counter() - start
    taken = timed = 0
    start = time.perf_counter()
    for batch in it:
        taken += len(batch)
        timed += 1
        if timed == batches:
            break
    elapsed = time.perf_counter() - start
    return {
        "init_s": statistics.median(inits),
        "first_batch_s": first_s,
        "batch_s_mean": elapsed / max(timed, 1),
        "index_s_mean": elapsed / max(taken, 1),
        "batches_timed": timed,
        "mean_batch_len": taken / max(timed, 1),
    }


def measure_row(n: int, k: int, m: dict) -> dict:
    return {
        "n": n,
        "k": k,
        "init_ms": m["init_s"] * 1e3,
        "first_batch_ms": m["first_batch_s"] * 1e3,
        "batch_us": m["batch_s_mean"] * 1e6,
        "index_us": m["index_s_mean"] * 1e6,
        "mean_batch_len": m["mean_batch_len"],
    }


def main() -> None:
    args, cfg = parse_args()
    run = start_run(args, task="task2", logs="sampler_costs.jsonl")
    rng = np.random.default_rng(run.seed)
    rows = []
    for n in tqdm(cfg.ns, desc="n", unit="size"):
        lengths = wikitext_like_lengths(n, rng)
        for k in cfg.ks:
            m = measure(lengths, cfg.batch_size, k, cfg.batches, cfg.repeats)
            config = {"experiment": "sampler_costs", "n": n, "k": k, "batch_size": cfg.batch_size}
            run.log.log(f"sampler_n{n}_k{k}", config, m)
            rows.append(measure_row(n, k, m))
    print_table(rows, title=f"UltraDuperBigBrainBatchSampler costs on CPU (log: {run.log.path})")


if __name__ == "__main__":
    run_main(main)
