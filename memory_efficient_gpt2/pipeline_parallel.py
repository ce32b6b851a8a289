"""Pipeline-parallel training of an MLP digit classifier cut into stages (effdl.parallel.pipeline).

One process per stage; the optimizer steps once per batch after all micro-batches, so the math
is that of single-process training with gradient accumulation: ``--reference --accumulate`` (the
same model, seed, batches and micro-batches in one process, with the backwards in the schedules'
order), whose loss curve the pipeline's must coincide with. ``--reference`` alone trains on
whole batches: the same math summed in another order, so its gap to the accumulating reference
is the float32 rounding noise of this training (two equivalent single-process runs).

    python memory_efficient_gpt2/pipeline_parallel.py --quick                # CPU, 4 gloo processes
    python memory_efficient_gpt2/pipeline_parallel.py --schedule gpipe --steps 300
    python memory_efficient_gpt2/pipeline_parallel.py --reference --accumulate   # one process
    python memory_efficient_gpt2/pipeline_parallel.py --reference            # whole batches
    python memory_efficient_gpt2/pipeline_parallel.py --long                 # 10/100/1000 micro-batches
    python memory_efficient_gpt2/pipeline_parallel.py --compare-torch --schedule gpipe   # reference
    torchrun --nproc-per-node 4 memory_efficient_gpt2/pipeline_parallel.py --backend nccl

The ranks' side (settings, each rank's run, the reference) is effdl.parallel.pipeline_training;
this script parses the flags, starts the run and logs it. Without ``torchrun`` the script starts
its own ranks (effdl.parallel.launch.spawn); with
``--backend nccl`` rank r uses GPU ``r % device_count`` (ranks may share a GPU). CPU ranks get
``--threads`` intra-op threads each (default: an equal share of the cores) and their own block
of cores; a reference on the CPU takes the threads of one rank (the thread count decides how a
product's sums are split, hence how they round). Per step: loss and step time (that of the last
rank to finish), written by rank 0 as soon as the step is measured, so an interrupted run
keeps its steps. Per run, over the last ``--timed-steps`` steps (the earlier ones are warm-up):
the median step time, the bubble fraction measured (compute time per action against the step's
wall time) beside the formula, each stage's compute time per micro-batch and the time of one
activation message (so the reader sees that messages are small against compute), the
activations held in flight and the peak memory of every rank (RSS on CPU,
``max_memory_allocated`` on GPU).
``--long`` runs ``--long-micro-batches`` counts of ``--long-micro-batch-size`` rows each and
logs the peak memory at each count, which stays flat with 1F1B. ``--compare-torch`` trains the
same split model with torch.distributed.pipelining's ScheduleGPipe or Schedule1F1B instead (the
speed reference, logged as ``torch_gpipe``/``torch_1f1b``; step time and loss only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from pathlib import Path

import torch

from effdl.cli import ConfigFlags, Run, base_parser, print_table, run_main, start_run
from effdl.parallel.launch import available_cores, cpu_threads
from effdl.parallel.pipeline import SCHEDULES
from effdl.parallel.pipeline_measure import bubble_summary, slowest_rank_steps
from effdl.parallel.pipeline_training import (
    BACKENDS,
    DTYPES,
    PipelineConfig,
    StepLog,
    load_data,
    reference_run,
    run_ranks,
)

TASK = "parallelism"
LOG = "pipeline_parallel.jsonl"

FULL = PipelineConfig()
QUICK = PipelineConfig(
    steps=12, batch=64, hidden=32, timed_steps=4, long_micro_batches=(10, 100), long_steps=1
)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, PipelineConfig]:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/parallelism")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("schedule", choices=sorted(SCHEDULES))
    flags.add("stages", type=int, help="pipeline ranks (processes)")
    flags.add("virtual", type=int, help="chunks per rank of the interleaved schedule")
    flags.add("micro_batches", type=int, help="micro-batches per batch")
    flags.add("batch", type=int, help="rows per optimizer step")
    flags.add("steps", type=int, help="optimizer steps")
    flags.add("hidden", type=int, help="width of the MLP")
    flags.add("lr", type=float, help="SGD learning rate (momentum 0.9)")
    flags.add("timed_steps", type=int, help="last steps timed (step time, bubble fraction)")
    flags.add(
        "threads",
        type=int,
        help="intra-op threads per CPU rank, and of --reference on the CPU; 0: cores // stages",
    )
    flags.add("reference", action="store_true", help="the same training in one process")
    flags.add(
        "accumulate",
        action="store_true",
        help="with --reference: one backward per micro-batch, gradients accumulated (the "
        "pipeline's math); without: whole batches",
    )
    flags.add("long", action="store_true", help="peak memory against the micro-batch count")
    flags.add(
        "compare_torch",
        action="store_true",
        help="train with torch.distributed.pipelining's schedule instead (speed reference)",
    )
    flags.add("long_micro_batches", type=int, nargs="+", help="micro-batch counts of --long")
    flags.add("long_micro_batch_size", type=int, help="rows per micro-batch of --long")
    flags.add("long_steps", type=int, help="steps per micro-batch count of --long")
    flags.add(
        "backend",
        choices=BACKENDS,
        help="gloo: CPU processes; nccl: GPUs (--device applies to --reference only)",
    )
    flags.add("data", type=Path, help="CIFAR-10 python batches folder (default: digits)")
    flags.add("dtype", choices=sorted(DTYPES), help="parameters and activations")
    args = p.parse_args(argv)
    return args, flags.resolve(args)


def main(argv: list[str] | None = None) -> None:
    args, cfg = parse_args(argv)
    cfg = dataclasses.replace(cfg, seed=args.seed)
    if cfg.data is not None:
        load_data(cfg)  # refused here, in one line, rather than in every rank
    # The log is opened before any work, by the one process that writes it.
    logging = os.environ.get("RANK", "0") == "0"
    run = start_run(args, TASK, LOG) if logging else None
    if cfg.reference:
        if run.device.type == "cpu":
            # A product's sums are split among the intra-op threads, so the reference takes the
            # thread count of one rank to round as the ranks do.
            torch.set_num_threads(cpu_threads(cfg.stages, cfg.threads))
        variant = "reference_accumulated" if cfg.accumulate else "reference"
        result = reference_run(cfg, run.device, step_log(run, cfg, variant))
        log_training(run, cfg, variant, [result])
        return
    if "LOCAL_RANK" not in os.environ:
        # The ranks are forked from here, and a child forked after this process ran an
        # OpenMP-parallel kernel hangs in its first one (libgomp's pool does not survive fork).
        torch.set_num_threads(1)
    variant = f"torch_{cfg.schedule}" if cfg.compare_torch else cfg.schedule
    results = run_ranks(cfg, step_log(run, cfg, variant) if run and not cfg.long else None)
    if run is None:
        return
    if cfg.long:
        log_long(run, cfg, results)
    else:
        log_training(run, cfg, variant, results, loss_rank=-1 if cfg.compare_torch else 0)


def run_config(
    run: Run, cfg: PipelineConfig, source: str | None, cores: list[list[int]] | None
) -> dict:
    """Every flag of the run, the data (``source``), the host, and the CPU share of each rank
    (``cores``: each rank's CPU cores; of the reference on the CPU: its intra-op threads)."""
    config = {**dataclasses.asdict(cfg), "data": source, "where": run.where}
    if cfg.reference:
        if run.device.type == "cpu":
            config |= {"cores_available": available_cores(), "cpu_threads": torch.get_num_threads()}
    elif cfg.backend == "gloo":
        config |= {
            "cores_available": available_cores(),
            "threads_per_rank": cpu_threads(cfg.stages, cfg.threads),
            "cores_per_rank": cores,
        }
    return config


def results_config(run: Run, cfg: PipelineConfig, results: list[dict]) -> dict:
    """:func:`run_config` with the data and cores the ranks report."""
    cores = [r["cpu_cores"] for r in results] if "cpu_cores" in results[0] else None
    return run_config(run, cfg, results[0]["source"], cores)


def step_log(run: Run, cfg: PipelineConfig, variant: str) -> StepLog:
    """Where each step's record goes as it is measured; the ranks fill in the data and their
    cores (a run's config is the same in every record)."""
    return StepLog(run.log, variant, run_config(run, cfg, None, None))


def message_bytes(cfg: PipelineConfig) -> int:
    """Size of one activation message: a micro-batch of ``hidden``-wide rows."""
    return cfg.batch // cfg.micro_batches * cfg.hidden * DTYPES[cfg.dtype].itemsize


def log_training(
    run: Run, cfg: PipelineConfig, variant: str, results: list[dict], loss_rank: int = 0
) -> None:
    """The summary over the last ``timed_steps`` (each step's record, loss and step time, is
    written as the step is measured)."""
    config = results_config(run, cfg, results)
    steps = slowest_rank_steps([r["steps"] for r in results], loss_rank)
    timed = steps[-cfg.timed_steps :]
    summary = {
        "final_loss": steps[-1]["loss"],
        "median_step_s": statistics.median(r["step_s"] for r in timed),
        "timed_steps": len(timed),
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in results],
    }
    if variant in SCHEDULES:
        summary |= bubble_summary(cfg.schedule, cfg.micro_batches, cfg.chunks, results)
        summary |= {
            "forward_ms_per_micro_batch": [1e3 * r["forward_s"] for r in results],
            "backward_ms_per_micro_batch": [1e3 * r["backward_s"] for r in results],
            "message_ms": 1e3 * results[0]["message_s"],
            "message_bytes": message_bytes(cfg),
            "multiply_adds_per_row": [r["multiply_adds"] for r in results],
            "peak_in_flight": [r["peak_in_flight"] for r in results],
        }
    run.log.log(f"{variant}_summary", config, summary)
    lists = [name for name, value in summary.items() if isinstance(value, list)]
    per_rank = [
        {"rank": k, **{name: summary[name][k] for name in lists}} for k in range(len(results))
    ]
    print_table(per_rank, title=f"{variant}: per rank")
    shown = {k: v for k, v in summary.items() if k not in lists}
    print_table([shown], title=f"{variant}: {cfg.steps} steps on {config['data']}, {run.where}")


def log_long(run: Run, cfg: PipelineConfig, results: list[dict]) -> None:
    """One record per micro-batch count: every rank's peak memory and activations in flight."""
    config = results_config(run, cfg, results)
    rows = []
    for k, m in enumerate(cfg.long_micro_batches):
        per_rank = [r["counts"][k] for r in results]
        row = {
            "micro_batches": m,
            "peak_memory_bytes": [c["peak_memory_bytes"] for c in per_rank],
            "growth_bytes": [c["peak_memory_bytes"] - c["start_memory_bytes"] for c in per_rank],
            "peak_in_flight": [c["peak_in_flight"] for c in per_rank],
            "step_s": max(c["step_s"] for c in per_rank),
        }
        run.log.log(f"long_{cfg.schedule}", config, row)
        rows.append({
            "micro_batches": m,
            "peak_mib": max(row["peak_memory_bytes"]) / 2**20,
            "growth_mib": max(row["growth_bytes"]) / 2**20,
            "peak_in_flight": row["peak_in_flight"],
            "step_s": row["step_s"],
        })  # fmt: skip
    print_table(rows, title=f"--long {cfg.schedule}: peak memory per rank vs micro-batches")


if __name__ == "__main__":
    run_main(main)
