"""CPU cost of the length-bucketed batch sampler: __init__ vs n (O(n)) and per batch (flat in n).

Lengths are drawn like WikiText-103 paragraph lengths (log-normal, median 75 tokens, cut to
640). For each n and k: ``__init__`` time (median of repeats), the epoch-start cost (first
batch, which restores the index pool), and the mean cost per batch and per index over up to
``--batches`` following batches.

    python task2_batching/sampler_costs.py --quick
    python task2_batching/sampler_costs.py            # n up to 1.8 M (the WikiText-103 size)
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from tqdm import tqdm

from effdl.cli import UsageError, base_parser, print_table, run_main, seed_everything
from effdl.data.samplers import UltraDuperBigBrainBatchSampler
from effdl.results import RunLog


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task2")
    p.add_argument(
        "--ns",
        type=int,
        nargs="+",
        default=None,
        help="dataset sizes; default 1e4 1e5 1e6 1.8e6 (1e3 1e4 1e5 with --quick)",
    )
    p.add_argument("--ks", type=int, nargs="+", default=[1, 5, 50, 640])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=2000, help="batches timed per (n, k)")
    p.add_argument("--repeats", type=int, default=5, help="__init__ repeats")
    return p.parse_args()


def wikitext_like_lengths(n: int, rng: np.random.Generator, max_length: int = 640) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(75.0), 0.95, n), 1, max_length).astype(np.int64)


def measure(lengths: np.ndarray, batch_size: int, k: int, batches: int, repeats: int) -> dict:
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


def main() -> None:
    args = parse_args()
    seed_everything(args.seed)
    ns = args.ns or (
        [1_000, 10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000, 1_800_000]
    )
    batches = min(args.batches, 300) if args.quick else args.batches
    repeats = 2 if args.quick else args.repeats
    if min(ns) < 1 or args.batch_size < 1 or min(args.ks) < 0:
        raise UsageError("--ns and --batch-size must be positive, --ks non-negative")
    rng = np.random.default_rng(args.seed)
    log = RunLog(args.out / "sampler_costs.jsonl", task="task2")
    rows = []
    for n in tqdm(ns, desc="n", unit="size"):
        lengths = wikitext_like_lengths(n, rng)
        for k in args.ks:
            m = measure(lengths, args.batch_size, k, batches, repeats)
            log.log(
                f"sampler_n{n}_k{k}",
                {"experiment": "sampler_costs", "n": n, "k": k, "batch_size": args.batch_size},
                m,
            )
            rows.append(
                {
                    "n": n,
                    "k": k,
                    "init_ms": m["init_s"] * 1e3,
                    "first_batch_ms": m["first_batch_s"] * 1e3,
                    "batch_us": m["batch_s_mean"] * 1e6,
                    "index_us": m["index_s_mean"] * 1e6,
                    "mean_batch_len": m["mean_batch_len"],
                }
            )
    print_table(rows, title=f"UltraDuperBigBrainBatchSampler costs on CPU (log: {log.path})")


if __name__ == "__main__":
    run_main(main)
