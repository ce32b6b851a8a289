"""Profile a few training iterations of the ViT pipeline (as given or fixed): torch.profiler's
op tables and trace, and effdl's layer-level Profile, on the same pipeline and schedule.

Each iteration is split into named ranges (``data_wait``: next(loader), ``to_device``,
``train_step``, ``batch_stats``) so the trace shows data loading against GPU work; during the
torch.profiler pass every module's forward is a range too (``module: <path>: <Class>``), the
reference for the layer Profile's forward times. The two passes run one after the other on
consecutive batches of one loader, with the same wait/warmup/active schedule. Written to --out:

- ``vit_profile_ops.jsonl``: one record per module range and per op (name and input shapes, the
  ``--log-ops`` with the most self time): CPU and device time, calls, memory;
- ``<pipeline>_ops.txt``: key_averages tables (by op; by op and input shape; module ranges);
- ``<pipeline>_torch_trace.json``: the Chrome trace of the active iterations (Perfetto opens it);
- ``<pipeline>_layers.txt`` and ``<pipeline>_layers_trace.json``: Profile's summary and trace.

The same log also gets, per run: ``range`` records (host time of each named range per active
iteration, and the device time of the kernels launched inside it: data loading against GPU work,
from the trace). Then the loader is stopped (its workers would compete for the host's cores) and,
on resident batches already on the device: on one of ``--compare-batch-size`` images (default:
the pipeline's batch; the fixed ViT at batch 256 is bound by the host's kernel launches, so its
per-layer GPU times mean little: a larger batch keeps the GPU busy), ``layer_compare`` records
(each module's forward: Profile's CUDA-event time per call against torch.profiler's device time
of the kernels launched inside the module's range, each kernel once, and as key_averages sums
it, which counts again the kernels whose launch stalled on a full command queue; same schedule), with ``config.comparison`` ``same_iterations`` (both profilers record
the same iterations: one execution), ``same_iterations_sampled`` (the same, with Profile hooking
one in ``--compare-sample-every`` modules per step: ``config.sample_every``) or
``separate_passes`` (torch.profiler's pass, then
Profile's), and per comparison a ``layer_agreement`` record (share of the modules over 1 ms whose
times agree within 10%, against either reference); and ``overhead`` records (step time with
Profile recording against the bare step, in pairs of consecutive steps (see
:func:`profile_overhead`), at the pipeline's batch and the comparison batch, hooking every
module, hooking modules to ``--shallow-depth``, and hooking one in every ``--sample-every``
modules per recorded step).

    python task3_vit_profiling/profile_model.py --quick --pipeline fixed            # CPU
    python task3_vit_profiling/profile_model.py --device cuda --pipeline as_given --out runs/vit/profile
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

import effdl.vit_pipeline as vp
from effdl.cli import Run, print_table, require_positive, run_main, start_run
from effdl.profiling import layer_profiler
from effdl.profiling.timing import RegionTimer
from effdl.vit_pipeline.profiling import (
    MODULE_PREFIX,
    agreement,
    event_record,
    layer_comparison,
    module_ranges,
    range_records,
    run_iterations,
)

LOG = "vit_profile_ops.jsonl"


def add_schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", type=int, default=1, help="iterations skipped by both profilers")
    p.add_argument("--warmup", type=int, default=2, help="iterations traced but discarded")
    p.add_argument("--active", type=int, default=3, help="iterations recorded")
    p.add_argument("--row-limit", type=int, default=40, help="rows per printed table")
    p.add_argument("--log-ops", type=int, default=100, help="ops (by input shape) logged")
    p.add_argument(
        "--overhead-rounds",
        type=int,
        default=3,
        help="rounds of bare/profiled step pairs of each overhead measurement, at least",
    )
    p.add_argument(
        "--overhead-seconds",
        type=float,
        default=20.0,
        help="more rounds until the variant's bare and profiled steps took this long",
    )
    p.add_argument(
        "--overhead-steps",
        type=int,
        default=10,
        help="timed pairs of steps per round (rounded up to whole rotations of a sampled profile)",
    )
    p.add_argument(
        "--compare-batch-size",
        type=int,
        default=None,
        help="images in the resident batch of the layer comparison (default: --batch-size)",
    )
    p.add_argument(
        "--shallow-depth",
        type=int,
        default=4,
        help="module depth of the shallow profile in the overhead records (4: each block's "
        "attention and feed-forward)",
    )
    p.add_argument(
        "--compare-sample-every",
        type=int,
        default=20,
        help="a third layer comparison with Profile hooking one in this many modules per step "
        "(1: none)",
    )
    p.add_argument(
        "--sample-every",
        type=int,
        nargs="+",
        default=[10, 20, 40],
        help="sampled profiles of the overhead records: each hooks every module, one in this "
        "many per step (Profile's sample_every)",
    )


def endless(loader) -> Iterator:
    """The loader's batches, pass after pass (an image that cannot be decoded: a UsageError)."""
    while True:
        yield from vp.decoded_batches(loader)


def stop_loader(batches: Iterator) -> None:
    """Close :func:`endless` and with it the loader's iterator, whose workers exit: they would
    go on decoding prefetched batches on the host's cores while the overhead is measured."""
    batches.close()


def torch_profile(trainer: vp.Trainer, batches: Iterator, args, out: Path, name: str):
    """The torch.profiler pass; returns the profiler (its key_averages cover the active steps)."""
    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sched = schedule(wait=args.wait, warmup=args.warmup, active=args.active, repeat=1)
    trace = out / f"{name}_torch_trace.json"
    with (
        module_ranges(trainer.model),
        profile(activities=activities, schedule=sched, record_shapes=True, profile_memory=True,
                on_trace_ready=lambda p: p.export_chrome_trace(str(trace))) as prof,
    ):  # fmt: skip
        run_iterations(trainer, batches, args.wait + args.warmup + args.active, prof.step)
    return prof


def layer_profile(
    trainer: vp.Trainer, batches: Iterator, args, out: Path, name: str
) -> layer_profiler.Profile:
    """The layer Profile pass on the same schedule; writes its trace, returns the profile."""
    sched = layer_profiler.Schedule(wait=args.wait, warmup=args.warmup, active=args.active)
    with layer_profiler.Profile(trainer.model, name=f"vit_{name}", schedule=sched) as prof:
        run_iterations(trainer, batches, args.wait + args.warmup + args.active, prof.step)
    prof.to_perfetto(str(out / f"{name}_layers_trace.json"))
    return prof


def log_and_write_tables(prof, run: Run, config: dict, args, out: Path, name: str) -> str:
    """One record per module range and per op (by input shape; the ``--log-ops`` with the most
    self time); the three tables as text. Returns the by-op table."""
    sort = "self_device_time_total" if run.device.type == "cuda" else "self_cpu_time_total"
    by_op, by_shape = prof.key_averages(), prof.key_averages(group_by_input_shape=True)
    modules = [e for e in by_op if e.key.startswith(MODULE_PREFIX)]
    ops = [e for e in by_shape if not e.key.startswith(MODULE_PREFIX)]
    ops = sorted(ops, key=lambda e: getattr(e, sort), reverse=True)[: args.log_ops]
    for kind, events in (("module", modules), ("op", ops)):
        for evt in events:
            run.log.log(name, {**config, "kind": kind}, event_record(evt))
    tables = {
        "by op": by_op.table(sort_by=sort, row_limit=args.row_limit),
        "by op and input shape": by_shape.table(sort_by=sort, row_limit=args.row_limit),
        "module forward ranges": "\n".join(
            f"{e.key:70s} calls {e.count:4d}  cpu {e.cpu_time_total / 1e3:9.3f} ms  "
            f"device {getattr(e, 'device_time_total', 0) / 1e3:9.3f} ms"
            for e in sorted(modules, key=lambda e: e.key)
        ),
    }
    text = "\n\n".join(f"== {title}\n{table}" for title, table in tables.items())
    (out / f"{name}_ops.txt").write_text(text)
    return tables["by op"]


def resident_batch(trainer: vp.Trainer, batches: Iterator, images: int):
    """``images`` training images and labels on the device, prepared as the pipeline prepares
    them, from as many loader batches as it takes (each moved on its own: device-side
    augmentation of one huge batch would need several times its memory)."""
    xs, ys, n = [], [], 0
    while n < images:
        x, y = trainer.to_device(next(batches))
        xs.append(x[: images - n])
        ys.append(y[: images - n])
        n += len(xs[-1])
    return torch.cat(xs), torch.cat(ys)


def resident_steps(trainer: vp.Trainer, x, y, n: int, step: Callable[[], None]) -> None:
    trainer.model.train()
    for _ in range(n):
        trainer.train_step(x, y)
        step()


def compare_layers(trainer: vp.Trainer, x, y, args) -> Iterator[tuple[str, list[dict]]]:
    """Each module's forward time per call from Profile and from torch.profiler (module ranges)
    on the same resident batch and schedule, yielded as each comparison is measured (so each is
    logged before the next starts), two ways: both recording the same iterations (Profile's
    stamps inside the ranges: one execution, one set of kernels), and in separate passes,
    torch.profiler's then Profile's (neither pays for the other's hooks, but clocks,
    temperature and the profiler's own start-up may differ between the passes). With
    ``--compare-sample-every n`` > 1, a third: the same iterations, ``n`` or more of them, with
    Profile hooking one n-th of the modules per step (each module's time from the steps it was
    hooked in)."""
    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)

    def torch_profiler(active: int = args.active):
        sched = schedule(wait=args.wait, warmup=args.warmup, active=active, repeat=1)
        return profile(activities=activities, schedule=sched)

    def layer_profile(active: int = args.active, sample_every: int = 1):
        sched = layer_profiler.Schedule(wait=args.wait, warmup=args.warmup, active=active)
        return layer_profiler.Profile(trainer.model, schedule=sched, sample_every=sample_every)

    n = args.wait + args.warmup + args.active

    # The ranges' hooks are registered first: Profile's stamps run inside each range.
    with module_ranges(trainer.model), torch_profiler() as ref, layer_profile() as prof:
        resident_steps(trainer, x, y, n, lambda: (ref.step(), prof.step()))
    yield "same_iterations", layer_comparison(ref, prof.records())
    with module_ranges(trainer.model), torch_profiler() as ref:
        resident_steps(trainer, x, y, n, ref.step)
    with layer_profile() as prof:
        resident_steps(trainer, x, y, n, prof.step)
    yield "separate_passes", layer_comparison(ref, prof.records())
    every = args.compare_sample_every
    if every > 1:
        active = max(args.active, every)
        steps = args.wait + args.warmup + active
        with (
            module_ranges(trainer.model),
            torch_profiler(active) as ref,
            layer_profile(active, every) as prof,
        ):
            resident_steps(trainer, x, y, steps, lambda: (ref.step(), prof.step()))
        yield "same_iterations_sampled", layer_comparison(ref, prof.records())


def profile_overhead(
    trainer: vp.Trainer, x, y, args, depth: int | None, sample_every: int = 1
) -> dict:
    """Training-step time on one batch already on the device, bare and with Profile (hooking
    modules to ``depth``, None: all; one in ``sample_every`` of them per recorded step), in
    pairs of consecutive steps: one Profile per round with ``Schedule(wait=1, warmup=0,
    active=1)``, so each recorded step follows a bare one and a drift of the host's speed
    cancels pair by pair. A round is ``--overhead-steps`` pairs (rounded up to whole rotations
    of the sampled modules) after one untimed pair; rounds go on until there are at least
    ``--overhead-rounds`` and the steps took ``--overhead-seconds`` (device time: CUDA events;
    host clock on the CPU).

    Each step is timed with the ``Profile.step()`` that ends it. The bare step's call hooks the
    next step's modules (host time ``register``, measured around the call); recording every
    step would pay that in the recorded step, so a pair's overhead is
    ``(recorded + register) / (bare - register) - 1``. ``overhead`` is the median over all
    pairs, ``round_overheads`` the median of each round's, ``overhead_of_medians`` from the
    pooled medians."""
    trainer.model.train()
    pairs = math.ceil(args.overhead_steps / sample_every) * sample_every
    alternate = layer_profiler.Schedule(wait=1, warmup=0, active=1)

    def timed_round() -> tuple[list[float], list[float], list[float], int]:
        timer = RegionTimer(trainer.device)
        register = []
        with layer_profiler.Profile(
            trainer.model, name="overhead", schedule=alternate, max_depth=depth,
            sample_every=sample_every,
        ) as prof:  # fmt: skip
            for _ in range(2 * (pairs + 1)):
                with timer.region():
                    trainer.train_step(x, y)
                    start = time.perf_counter()
                    prof.step()  # after a bare step: hooks the next step's modules
                    register.append(time.perf_counter() - start)
        times = timer.times()[2:]  # less the untimed pair
        return times[0::2], times[1::2], register[2::2], len(prof.records())

    trainer.train_step(x, y)  # warm-up: lazy initialisation, cuDNN/cuBLAS choices
    bare, recorded, registers, ratios, rounds = [], [], [], [], []
    while len(rounds) < args.overhead_rounds or sum(bare) + sum(recorded) < args.overhead_seconds:
        b, r, reg, modules = timed_round()
        pair_ratios = [(ri + gi) / (bi - gi) for bi, ri, gi in zip(b, r, reg, strict=True)]
        rounds.append(statistics.median(pair_ratios) - 1)
        ratios += pair_ratios
        bare += b
        recorded += r
        registers += reg
    b, h = statistics.median(bare), statistics.median(recorded)
    return {"bare_step_ms_median": b * 1e3, "profiled_step_ms_median": h * 1e3,
            "overhead": statistics.median(ratios) - 1, "overhead_of_medians": h / b - 1,
            "register_ms_median": statistics.median(registers) * 1e3,
            "round_overheads": rounds, "pairs": len(bare), "rounds": len(rounds),
            "modules_hooked": modules, "modules_per_step": math.ceil(modules / sample_every)}  # fmt: skip


def main() -> None:
    args, cfg = vp.parse_config(
        __doc__.splitlines()[0], default_out="runs/vit/profile", extra=add_schedule_args
    )
    require_positive(args, "active", "log_ops", "overhead_rounds", "overhead_steps", "sample_every")
    require_positive(args, "overhead_seconds", minimum=0)
    require_positive(args, "compare_sample_every")
    require_positive(args, "shallow_depth", minimum=0)
    if args.compare_batch_size is not None:
        require_positive(args, "compare_batch_size")
    require_positive(args, "wait", "warmup", minimum=0)
    run = start_run(args, task="task3_vit", logs=LOG)
    cfg = vp.for_device(cfg, run.device)
    data = vp.prepare_data(cfg)
    train_loader, _ = vp.make_loaders(cfg, data)
    trainer = vp.build_trainer(cfg, run.device, len(data.classes))
    batches = endless(train_loader)
    out, name = Path(args.out), cfg.pipeline
    config = {**cfg.recorded(), "source": data.source, "device": str(run.device),
              "wait": args.wait, "warmup": args.warmup, "active": args.active,
              "run_id": run.run_id}  # fmt: skip
    prof = torch_profile(trainer, batches, args, out, name)
    print(log_and_write_tables(prof, run, config, args, out, name))
    for row in range_records(prof, args.active):
        run.log.log(name, {**config, "kind": "range"}, row)
    layers = layer_profile(trainer, batches, args, out, name)
    summary = str(layers.summary())
    (out / f"{name}_layers.txt").write_text(summary)
    print(f"\nLayer profile ({name}, {args.active} active iterations on {run.where}):\n{summary}")
    compare_batch = args.compare_batch_size or cfg.batch_size
    measured_agreement: list[dict] = []
    sizes = sorted({cfg.batch_size, compare_batch})
    resident = {size: resident_batch(trainer, batches, size) for size in sizes}
    stop_loader(batches)
    measured = []
    for batch_size, (x, y) in resident.items():
        at = {**config, "resident_batch": batch_size}
        if batch_size == compare_batch:
            for comparison, rows in compare_layers(trainer, x, y, args):  # logged as measured
                every = args.compare_sample_every if comparison.endswith("_sampled") else 1
                cmp = {"comparison": comparison, "sample_every": every}
                for row in rows:
                    run.log.log(name, {**at, "kind": "layer_compare", **cmp}, row)
                agreed = agreement(rows)
                run.log.log(name, {**at, "kind": "layer_agreement", **cmp}, agreed)
                print_table(
                    sorted(rows, key=lambda r: -r["torch_fwd_ms"])[:15],
                    title=f"Forward per call at batch {compare_batch}, {comparison}: "
                    "Profile vs torch.profiler (ms), slowest 15",
                )
                measured_agreement.append({"comparison": comparison, **agreed})
        hookings = [(None, 1), (args.shallow_depth, 1), *((None, n) for n in args.sample_every)]
        for depth, every in hookings:
            overhead = profile_overhead(trainer, x, y, args, depth, every)
            hooks = {"max_depth": depth, "sample_every": every,
                     "overhead_seconds": args.overhead_seconds}  # fmt: skip
            run.log.log(name, {**at, "kind": "overhead", **hooks}, overhead)
            spread = overhead["round_overheads"]  # the table gives their range
            row = {k: v for k, v in overhead.items() if k != "round_overheads"}
            measured.append({"batch": batch_size, **hooks, **row, "round_min": min(spread),
                             "round_max": max(spread)})  # fmt: skip
    print_table(measured_agreement, title="Modules over 1 ms within 10% of torch.profiler's time")
    print_table(measured, title="Profile overhead on a resident batch")
    print(f"\nwritten to {out}: {LOG}, {name}_ops.txt, {name}_torch_trace.json, "
          f"{name}_layers.txt, {name}_layers_trace.json")  # fmt: skip


if __name__ == "__main__":
    run_main(main)
