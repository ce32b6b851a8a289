"""Loads the pipeline- and tensor-parallel logs (results/parallelism/) for parallelism.ipynb.

Builds what the report's sections read: the pipeline loss curves and their gaps to the two
single-process references, the activations in flight, the ``--long`` memory runs, the bubble
runs with their stage times, our step time against torch.distributed.pipelining, the
tensor-parallel curves, step times and the DTensor comparison; every target's verdict run by run
(``box``), the rows of the answers table (``answers``) and the provenance of every log
(``provenance``, ``SHARED_HOSTS_NOTE``). Also the gap-plot helper the curve
sections share. It displays nothing: the notebook runs it with ``%run -i`` and shows the tables.
"""

import re
from collections import defaultdict
from typing import NamedTuple

import numpy as np
import pandas as pd
from loaders.replicates import log_provenance  # reports/loaders/ (cwd: reports/)
from matplotlib.ticker import NullLocator

from effdl.answers import Answer
from effdl.results import read_records, results_dir

PAR = results_dir("results") / "parallelism"
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")
NOT_MEASURED = "not measured"
GAP_TARGET = (
    1e-3  # largest absolute gap |loss_a - loss_b| of a loss curve to single-process training
)
MEMORY_TARGET = 0.10  # 1F1B memory: largest over smallest, minus one
BUBBLE_TARGET = 0.20  # |measured / formula - 1|
SPEED_TARGET = 1.10  # our time over the torch reference's


def records(*patterns: str) -> list[dict]:
    # The committed logs first, then the script's default log (a `make demo` run); every record
    # keeps the name of its file.
    for pattern in patterns:
        # (a committed log over 64 KB is gzip-compressed: <name>.jsonl.gz)
        files = sorted({*PAR.glob(pattern), *PAR.glob(pattern + ".gz")}) if PAR.is_dir() else []
        if files:
            return [{**r, "file": f.name} for f in files for r in read_records(f)]
    return []


def gpu_count(file: str) -> int | None:
    # Committed GPU logs are named after their host: "..._h200x2.jsonl" ran on 2 GPUs of one host.
    found = re.search(r"x(\d+)\.jsonl(\.gz)?$", file)
    return int(found[1]) if found else None


def host(r: dict) -> str:
    """Where a run was made, from its record: under gloo the cores the run could use (a run pinned
    to a block of a larger host records the block's size, ``cores_available``); under NCCL the
    GPUs and, for a pipeline, how its stages sit on them (rank r on GPU r % count). The GPU tags
    that tell hosts apart are in the provenance appendix, not in these labels."""
    c, env = r["config"], r["env"]
    if c.get("backend", "gloo") != "nccl":
        return f"{c.get('cores_available') or env['cpu_count']}-core CPU (gloo)"
    gpus = gpu_count(r["file"])
    name = env["gpu"].removeprefix("NVIDIA ")
    where = f"{gpus}x {name}" if gpus else name
    if "stages" not in c:
        return f"{where} (NCCL)"
    if gpus and c["stages"] > gpus:
        return f"{where}, {c['stages']} stages on {gpus} GPUs (NCCL)"
    return f"{where}, {c['stages']} stages (NCCL)"


def STEP(v: object) -> str:
    return "-" if v is None or pd.isna(v) else str(int(v))


def sci(value: float) -> str:
    return "-" if pd.isna(value) else f"{value:.1e}"


def verdict(ok: bool | None) -> str:
    return {True: "met", False: "not met", None: NOT_MEASURED}[ok]


def passed(ok: pd.Series) -> np.ndarray:
    return np.where(ok, "pass", "fail")


pipe_curves = records("pipeline_curves*.jsonl", "pipeline_parallel.jsonl")
pipe_memory = records("pipeline_memory*.jsonl", "pipeline_parallel.jsonl")
pipe_bubble = records("pipeline_bubble*.jsonl", "pipeline_parallel.jsonl")
pipe_torch = records("pipeline_vs_torch*.jsonl", "pipeline_parallel.jsonl")
tp_curves = records("tensor_parallel_curves*.jsonl")
tp_step = records("tensor_parallel_step_time*.jsonl")
tp_dtensor = records("tensor_parallel_dtensor*.jsonl")
DATA = next(
    (r["config"]["data"] for r in pipe_curves + tp_curves if "data" in r["config"]), "no data"
)

# GPU tags of one 4-GPU H200 host whose runs went four at a time, one process per GPU, each pinned
# to 16 of the host's 64 cores (env.cpu_count reads 64); and of a second such host.
SHARED_HOSTS = (
    {"0bd5e7f1", "dc51dc67", "a24f1084", "24c7bc89"},
    {"fc56db01", "d09b150d", "c8a2426a"},
)


def by_file(rs: list[dict]) -> dict[str, list[dict]]:
    """The records grouped by the log they were read from."""
    files: dict[str, list[dict]] = defaultdict(list)
    for r in rs:
        files[r["file"]].append(r)
    return files


def provenance_table() -> pd.DataFrame:
    """One row per committed log: its git sha, GPU, GPU tag (env.gpu_id), where it ran (the
    report's host label) and its number of runs (distinct env.run_id)."""
    files = by_file(records("*.jsonl"))
    ran_on = {
        f: {"ran on": "; ".join(dict.fromkeys(host(r) for r in rs))} for f, rs in files.items()
    }
    return log_provenance({f: [r["env"] for r in rs] for f, rs in files.items()}, extra=ran_on)


provenance = provenance_table()
shared_tags = sorted(
    tag
    for tags in provenance.get("GPU tag(s)", [])
    for tag in tags.split(", ")
    if any(tag in hosts for hosts in SHARED_HOSTS)
)
SHARED_HOSTS_NOTE = (
    f"GPU tags {', '.join(sorted(SHARED_HOSTS[0]))} are GPUs of one 4-GPU H200 host, and "
    f"{', '.join(sorted(SHARED_HOSTS[1]))} of a second one; there the runs went four at a time, "
    "one process per GPU, each pinned to 16 of the host's 64 cores (env.cpu_count reads 64). "
    f"This report's logs from those hosts: GPU tag {', '.join(shared_tags)}."
    if shared_tags
    else ""
)
LOSS_LABEL = "training loss (cross-entropy, nats)"
GAP_LABEL = "|loss gap| (nats)"


def plot_gaps(ax, lines, target):
    """Absolute loss gaps on a log axis, where exact zeros read as zero.

    lines: (gap array, matplotlib format, plot kwargs). A log axis has no 0: exact zeros go on a
    floor line a decade under the smallest nonzero gap (and the target), labelled "0" on the axis
    and "0 (identical losses)" in the legend.
    """
    positive = [g[g > 0].min() for g, _, _ in lines if (g > 0).any()]
    floor = 10.0 ** (np.floor(np.log10(min([*positive, target]))) - 1)
    for g, fmt, kw in lines:
        ax.semilogy(np.where(g == 0, floor, g), fmt, **kw)
    ax.axhline(floor, color="0.5", lw=2, alpha=0.4, label="0 (identical losses)")
    ax.axhline(target, color="r", ls=":", label=f"{target:.0e} target")
    top = ax.get_ylim()[1]
    ax.set_ylim(floor / 4, top)
    ticks = [t for t in ax.get_yticks() if floor * 300 <= t <= top]  # clear of the 0
    ax.set_yticks([floor, *ticks], ["0", *(f"$10^{{{round(np.log10(t))}}}$" for t in ticks)])
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylabel(GAP_LABEL)


# Pipeline loss curves: one run per (variant, start time); the latest run per model and dtype.
# Two single-process references: gradients accumulated over the pipeline's micro-batches (its
# math, the one a pipeline curve is judged against) and whole batches (the same gradient summed
# in another order: the accumulating reference's gap to it is the noise floor of the training).
ACCUMULATED, WHOLE = "reference_accumulated", "reference"
GAP, GAP_WHOLE, FLOOR = (
    "max gap to accumulating reference", "max gap to whole-batch reference",
    "noise floor: whole-batch vs accumulating reference",
)  # fmt: skip


class CurveKey(NamedTuple):
    """Runs that train the same model on the same batches (a pipeline or its reference)."""

    host: str
    blocks: int  # the interleaved schedule cuts the model into stages x virtual pieces
    dtype: str
    steps: int
    batch: int
    hidden: int
    lr: float
    seed: int
    data: str


def curve_key(r: dict) -> CurveKey:
    c = r["config"]
    blocks = c["stages"] * (c["virtual"] if c["schedule"] == "interleaved" else 1)
    keys = ("dtype", "steps", "batch", "hidden", "lr", "seed", "data")
    return CurveKey(host(r), blocks, *(c[k] for k in keys))


curves: dict[CurveKey, dict[str, np.ndarray]] = defaultdict(dict)
runs: dict[tuple, list[dict]] = defaultdict(list)
for r in pipe_curves:
    if r["variant"] in (ACCUMULATED, WHOLE, *SCHEDULE_NAMES):
        runs[(r["variant"], r["env"]["time"], curve_key(r))].append(r)
for (variant, _, key), rows in sorted(runs.items(), key=lambda kv: kv[0][1]):
    curves[key][variant] = np.array([row["metrics"]["loss"] for row in rows])


def absolute_gap(curve: np.ndarray | None, ref: np.ndarray | None) -> np.ndarray | None:
    """|curve - ref| step by step; None unless both curves are there, equally long.

    Absolute, not relative: a relative gap divides by a loss that training drives towards zero.
    """
    if curve is None or ref is None or len(curve) != len(ref):
        return None
    return np.abs(curve - ref)


TOL = "rounding tolerance eps x steps x max|loss|"


def rounding_tolerance(dtype: str, ref: np.ndarray | None) -> float:
    """The gap rounding alone may leave after len(ref) steps: the dtype's machine epsilon times
    the number of steps times the largest reference loss."""
    if ref is None:
        return float("nan")
    return float(np.finfo(dtype).eps * len(ref) * np.abs(ref).max())


def largest(gap: np.ndarray | None) -> float:
    return float("nan") if gap is None else gap.max()


gap_rows = []
for key, by_variant in curves.items():
    accumulated, whole = by_variant.get(ACCUMULATED), by_variant.get(WHOLE)
    floor = absolute_gap(accumulated, whole)
    for variant in SCHEDULE_NAMES:
        loss = by_variant.get(variant)
        gap, gap_whole = absolute_gap(loss, accumulated), absolute_gap(loss, whole)
        if gap is None and gap_whole is None:
            continue
        over = np.flatnonzero(gap > GAP_TARGET) if gap is not None else []
        gap_rows.append({
            "host": key.host,
            "data": key.data,
            "schedule": variant,
            "blocks": key.blocks,
            "dtype": key.dtype,
            "steps": key.steps,
            GAP: largest(gap),
            "first step with gap > 1e-3": int(over[0]) if len(over) else None,
            GAP_WHOLE: largest(gap_whole),
            FLOOR: largest(floor),
            TOL: rounding_tolerance(key.dtype, accumulated if accumulated is not None else whole),
            "first loss (pipeline)": loss[0],
            "final loss (pipeline)": loss[-1],
            "final loss (accumulating reference)": (
                float("nan") if accumulated is None else accumulated[-1]
            ),
        })  # fmt: skip
pipe_gaps = pd.DataFrame(gap_rows)

# Activations in flight per rank: the summaries of the curve runs and of the bubble runs.
in_flight = pd.DataFrame(
    [
        {
            "host": host(r),
            "schedule": r["variant"].removesuffix("_summary"),
            "stages S": r["config"]["stages"],
            "micro-batches m": r["config"]["micro_batches"],
            "dtype": r["config"]["dtype"],
            "activations in flight per rank": r["metrics"]["peak_in_flight"],
            "most in flight": max(r["metrics"]["peak_in_flight"]),
        }
        for r in pipe_curves + pipe_bubble
        if r["variant"].endswith("_summary") and "peak_in_flight" in r["metrics"]
    ]
)
if len(in_flight):
    in_flight = in_flight.drop_duplicates(
        subset=["host", "schedule", "stages S", "micro-batches m", "dtype"], keep="last"
    )

# --long: peak memory against the micro-batch count.
memory = pd.DataFrame(
    [
        {
            "host": host(r),
            "schedule": r["variant"].removeprefix("long_"),
            "stages S": r["config"]["stages"],
            "micro-batches m": r["metrics"]["micro_batches"],
            "rows per micro-batch": r["config"]["long_micro_batch_size"],
            "hidden": r["config"]["hidden"],
            "memory counted": "max_memory_allocated"
            if r["config"]["backend"] == "nccl"
            else "process RSS",
            "peak, max over ranks (MiB)": max(r["metrics"]["peak_memory_bytes"]) / 2**20,
            "growth over the region, max over ranks (MiB)": max(r["metrics"]["growth_bytes"])
            / 2**20,
            "activations in flight per rank": r["metrics"]["peak_in_flight"],
            "step time (s)": r["metrics"]["step_s"],
        }
        for r in pipe_memory
        if r["variant"].startswith("long_")
    ]
)
if len(memory):
    memory = memory.drop_duplicates(
        subset=["host", "schedule", "micro-batches m"], keep="last"
    ).sort_values(["host", "schedule", "micro-batches m"])


def balance(values: list[float]) -> float:
    """Mean over max: the share of the slowest stage's time the average stage is busy (1 when
    every stage does the same)."""
    return float(np.mean(values) / np.max(values))


# Bubble: summaries of GPipe and 1F1B runs; stage work (multiply-adds) and stage times (measured).
bubble_rows = []
for r in pipe_bubble:
    c, m = r["config"], r["metrics"]
    if r["variant"] not in ("gpipe_summary", "1f1b_summary") or m.get("bubble_measured") is None:
        continue
    action_ms = np.add(m["forward_ms_per_micro_batch"], m["backward_ms_per_micro_batch"])
    bubble_rows.append({
        "host": host(r),
        "schedule": r["variant"].removesuffix("_summary"),
        "stages S": c["stages"],
        "micro-batches m": c["micro_batches"],
        "hidden": c["hidden"],
        "batch": c["batch"],
        "timed steps": m["timed_steps"],
        "measured": m["bubble_measured"],
        "formula (S-1)/(m+S-1)": m["bubble_formula"],
        "predicted from stage times": m["bubble_predicted"],
        "predicted, with messages": m["bubble_predicted_with_messages"],
        "median step (ms)": 1e3 * m["median_step_s"],
        "fwd+bwd per micro-batch, mean over ranks (ms)": action_ms.mean(),
        "one message (ms)": m["message_ms"],
        "multiply-adds per row, per stage": m["multiply_adds_per_row"],
        "work balance (mean/max)": balance(m["multiply_adds_per_row"]),
        "fwd+bwd per micro-batch, per rank (ms)": [round(float(t), 2) for t in action_ms],
        "forward per rank (ms)": [round(float(t), 2) for t in m["forward_ms_per_micro_batch"]],
        "backward per rank (ms)": [round(float(t), 2) for t in m["backward_ms_per_micro_batch"]],
        "time balance (mean/max)": balance(action_ms),
        "slowest rank": int(np.argmax(action_ms)),
    })  # fmt: skip
bubble = pd.DataFrame(bubble_rows)
if len(bubble):
    bubble = bubble.drop_duplicates(
        subset=["host", "schedule", "stages S", "micro-batches m", "hidden", "batch"], keep="last"
    ).sort_values(["host", "stages S", "schedule", "micro-batches m"])
    bubble["measured / formula"] = bubble["measured"] / bubble["formula (S-1)/(m+S-1)"]
    bubble["within 20%"] = passed(abs(bubble["measured / formula"] - 1) <= BUBBLE_TARGET)
    shared = bubble["host"].str.contains("stages on")  # two stages per GPU: no formula to meet
    bubble.loc[shared, "within 20%"] = bubble.loc[shared, "within 20%"] + " (GPU shared)"


# Ours against torch.distributed.pipelining: median step time of runs of the same config.
timing: dict[tuple, dict[str, float]] = defaultdict(dict)
for r in pipe_torch:
    name = r["variant"].removesuffix("_summary")
    if r["variant"].endswith("_summary") and name.removeprefix("torch_") in ("gpipe", "1f1b"):
        c = r["config"]
        key = (host(r), name.removeprefix("torch_"), c["stages"], c["micro_batches"], c["batch"],
               c["hidden"], c["steps"])  # fmt: skip
        impl = "torch" if name.startswith("torch_") else "ours"
        timing[key][impl] = r["metrics"]["median_step_s"]
        timing[key][f"{impl} loss"] = r["metrics"]["final_loss"]
vs_torch = pd.DataFrame(
    [
        {
            "host": key[0],
            "schedule": key[1],
            "stages S": key[2],
            "micro-batches m": key[3],
            "batch": key[4],
            "hidden": key[5],
            "steps": key[6],
            "ours, median step (ms)": 1e3 * t["ours"],
            "torch.distributed.pipelining, median step (ms)": 1e3 * t["torch"],
            "ours / torch": t["ours"] / t["torch"],
            "final loss, ours": t["ours loss"],
            "final loss, torch": t["torch loss"],
        }
        for key, t in timing.items()
        if {"ours", "torch"} <= t.keys()
    ]
)
if len(vs_torch):
    vs_torch["within 10%"] = passed(vs_torch["ours / torch"] <= SPEED_TARGET)
# Pipelines timed on a host with no torch.distributed.pipelining run beside them.
torch_missing = sorted(set(bubble["host"] if len(bubble) else ()) - set(vs_torch.get("host", ())))

# Tensor parallelism: curves, step time, DTensor. Beside each level's reference, the reference
# once more with every batch's gradient accumulated over its two halves (the noise floor).
TP_FLOOR = "noise floor: accumulated halves vs whole batch"
tp = pd.DataFrame(
    [
        {
            "host": host(r),
            "data": r["config"]["data"],
            "level": r["config"]["level"],
            "activation": r["config"].get("activation", "relu"),
            "world size": r["config"]["world_size"],
            "dtype": r["config"]["dtype"],
            "steps": r["config"]["steps"],
            "final loss": r["metrics"]["final_loss"],
            "test accuracy": r["metrics"]["test_accuracy"],
            "losses": r["metrics"]["losses"],
            "variant": r["variant"],
        }
        for r in tp_curves
    ]
)
tp_gaps = tp[tp["variant"].str.endswith("_parallel")].copy() if len(tp) else tp


def single_process(row: pd.Series, variant: str) -> pd.DataFrame:
    """The single-process runs ``variant`` (reference, reference_halves) of ``row``'s level,
    activation, dtype, steps and host."""
    return tp[(tp["variant"] == f"{row['level']}_{variant}") & (tp["dtype"] == row["dtype"])
              & (tp["activation"] == row["activation"]) & (tp["steps"] == row["steps"])
              & (tp["host"] == row["host"])]  # fmt: skip


def reference_loss(row: pd.Series, variant: str = "reference") -> np.ndarray | None:
    ref = single_process(row, variant)
    return np.array(ref.iloc[-1]["losses"]) if len(ref) else None


def gap_to_reference(row: pd.Series) -> np.ndarray | None:
    return absolute_gap(np.array(row["losses"]), reference_loss(row))


def first_over(row: pd.Series) -> int | None:
    gap = gap_to_reference(row)
    over = np.flatnonzero(gap > GAP_TARGET) if gap is not None else []
    return int(over[0]) if len(over) else None


def noise_floor(row: pd.Series) -> float:
    return largest(absolute_gap(reference_loss(row, "reference_halves"), reference_loss(row)))


if len(tp_gaps):
    tp_gaps["max absolute gap"] = tp_gaps.apply(lambda r: largest(gap_to_reference(r)), axis=1)
    tp_gaps["first step with gap > 1e-3"] = tp_gaps.apply(first_over, axis=1).astype("object")
    tp_gaps[TP_FLOOR] = tp_gaps.apply(noise_floor, axis=1)
    tp_gaps[TOL] = tp_gaps.apply(
        lambda r: rounding_tolerance(r["dtype"], reference_loss(r)), axis=1
    )

step = pd.DataFrame(
    [
        {
            "host": host(r),
            "data": r["config"]["data"],
            "level": r["config"]["level"],
            "run": "single process" if r["variant"].endswith("_reference") else "tensor parallel",
            "world size": r["config"]["world_size"],
            "median step (ms)": r["metrics"]["step_ms_median"],
            "min step (ms)": r["metrics"]["step_ms_min"],
            "timed steps": r["metrics"]["timed_steps"],
        }
        for r in tp_step
    ]
)

dt = pd.DataFrame(
    [
        {
            "host": host(r),
            "impl": r["variant"].removeprefix("mlp_"),
            "world size": r["config"]["world_size"],
            "shape (batch, width, hidden)": (
                r["config"]["batch"],
                r["config"]["width"],
                r["config"]["hidden"],
            ),
            "fwd+bwd median (ms)": r["metrics"]["fwd_bwd_ms_median"],
        }
        for r in tp_dtensor
    ]
)
if len(dt):
    dt = dt.pivot_table(
        index=["host", "world size", "shape (batch, width, hidden)"],
        columns="impl",
        values="fwd+bwd median (ms)",
    ).reset_index()
    dt.columns.name = None
    dt["ours / DTensor"] = dt["ours"] / dt["dtensor"]
    dt["within 10%"] = passed(dt["ours / DTensor"] <= SPEED_TARGET)
    dt.insert(1, "data", "random input (generated)")


# The verdict, item by item and host by host.
box: list[dict[str, str]] = []


def add(
    requirement: str, where: str, measured: str, target: str, ok: bool | None, why: str = ""
) -> None:
    box.append({
        "requirement": requirement, "host": where, "measured": measured, "target": target,
        "verdict": why or verdict(ok), "ok": None if why else ok,
    })  # fmt: skip


for dtype in ("float64", "float32"):
    for sched in SCHEDULE_NAMES:
        what = f"1. pipeline {sched} curve = single process with accumulation ({dtype})"
        sub = pipe_gaps
        if len(sub):
            sub = sub[(sub["schedule"] == sched) & (sub["dtype"] == dtype)]
        if not len(sub):
            add(what, "-", NOT_MEASURED, "≤ 1e-3", None)
        for h, g in sub.groupby("host") if len(sub) else []:
            if g[GAP].isna().any():
                add(what, h, f"no accumulating reference (whole-batch gap {sci(g[GAP_WHOLE].max())})",
                    "≤ 1e-3", None)  # fmt: skip
                continue
            gap = g[GAP].max()
            add(what, h, f"max absolute gap {sci(gap)} (noise floor {sci(g[FLOOR].max())}; "
                f"rounding tolerance {sci(g[TOL].max())})",
                "≤ 1e-3", bool(gap <= GAP_TARGET))  # fmt: skip
TP_RUNS = sorted({("float64", "relu"), ("float32", "relu")}
                 | set(zip(tp_gaps.get("dtype", ()), tp_gaps.get("activation", ()), strict=True)), reverse=True)  # fmt: skip
for dtype, act in TP_RUNS:
    for level in ("mlp", "norm", "block"):
        what = f"1. tensor parallel {level} curve = single process ({dtype}, {act})"
        sub = tp_gaps[(tp_gaps["level"] == level) & (tp_gaps["dtype"] == dtype)
                      & (tp_gaps["activation"] == act)] if len(tp) else tp  # fmt: skip
        if not len(sub):
            add(what, "-", NOT_MEASURED, "≤ 1e-3", None)
        for h, g in sub.groupby("host") if len(sub) else []:
            gap = g["max absolute gap"].max()
            worlds = ", ".join(str(w) for w in sorted(g["world size"].unique()))
            add(what, h,
                f"max absolute gap {sci(gap)} (world size {worlds}; noise floor "
                f"{sci(g[TP_FLOOR].max())}; rounding tolerance {sci(g[TOL].max())})", "≤ 1e-3",
                bool(gap <= GAP_TARGET))  # fmt: skip

# 1F1B in flight: the curve and bubble runs, and the --long runs up to the largest m.
flight_cols = ["host", "stages S", "micro-batches m", "activations in flight per rank"]
parts = [f.loc[f["schedule"] == "1f1b", flight_cols] for f in (in_flight, memory) if len(f)]
flight = pd.concat(parts) if parts else pd.DataFrame(columns=flight_cols)
if not len(flight):
    add("2. 1F1B activations in flight ≤ S", "-", NOT_MEASURED, "≤ S", None)
for h, g in flight.groupby("host"):
    most = g["activations in flight per rank"].map(max)
    add("2. 1F1B activations in flight ≤ S", h,
        f"at most {most.max()} with S = {g['stages S'].max()}, m up to {g['micro-batches m'].max()}",
        "≤ S", bool((most <= g["stages S"]).all()))  # fmt: skip

mem = memory[memory["schedule"] == "1f1b"] if len(memory) else memory
what = "2. 1000 micro-batches × 4 stages, 1F1B peak memory flat in m"
if not len(mem):
    add(what, "-", NOT_MEASURED, "completes; within 10%", None)
for h, g in mem.groupby("host") if len(mem) else []:
    counts, peak = g["micro-batches m"], g["peak, max over ranks (MiB)"]
    if (g["memory counted"] == "max_memory_allocated").all():
        # The input of all m micro-batches is on the GPU before the region, so the peak grows
        # with the data; what the steps allocate is the growth. The first count's region holds
        # the process's first step, which also allocates what it keeps (gradients, optimizer).
        first = 1 if len(g) > 2 else 0
        flat = g["growth over the region, max over ranks (MiB)"].iloc[first:]
        flat_counts, measure = counts.iloc[first:], "growth over the region"
    else:
        flat, flat_counts, measure = peak, counts, "peak RSS"
    spread = flat.max() / flat.min() - 1
    text = (f"{counts.max()} micro-batches × {g['stages S'].max()} stages completed; {measure} at "
            f"m = {'/'.join(map(str, flat_counts))}: {flat.min():.1f} to {flat.max():.1f} MiB "
            f"(+{spread:.1%})")  # fmt: skip
    if measure != "peak RSS":
        text += f"; peak with the input data {peak.min():.1f} to {peak.max():.1f} MiB"
    else:  # the RSS holds the libraries too: GPipe's spread on it says how much the test can see
        gp = memory[(memory["schedule"] == "gpipe") & (memory["host"] == h)]
        if len(gp):
            gp_peak = gp["peak, max over ranks (MiB)"]
            text += f"; GPipe on the same measure: +{gp_peak.max() / gp_peak.min() - 1:.1%}"
    ok = spread <= MEMORY_TARGET and counts.max() >= 1000 and g["stages S"].max() >= 4
    add(what, h, text, "completes; within 10%", bool(ok))

if not len(bubble):
    add("3. bubble fraction within 20% of the formula", "-", NOT_MEASURED, "", None)
for (h, s, sched), g in (
    bubble.groupby(["host", "stages S", "schedule"], sort=False) if len(bubble) else []
):
    ratios = ", ".join(
        f"m={m}: {r:.2f}x"
        for m, r in zip(g["micro-batches m"], g["measured / formula"], strict=True)
    )
    n = int(g["within 20%"].str.startswith("pass").sum())
    shared = "stages on" in h
    add(f"3. bubble fraction of {sched}, S = {s}", h,
        f"measured / formula {ratios} ({n} of {len(g)} within 20%)", "within 20% of formula",
        None if shared else n == len(g),
        "formula does not apply: stages share GPUs" if shared else "")  # fmt: skip

for _, row in vs_torch.iterrows():
    add(f"4. {row['schedule']} step time vs torch.distributed.pipelining, S = {row['stages S']}",
        row["host"], f"ours / torch {row['ours / torch']:.2f} (m = {row['micro-batches m']})",
        "≤ 1.10", bool(row["ours / torch"] <= SPEED_TARGET))  # fmt: skip
SHARED_GPU = (
    "not run: torch.distributed.pipelining's communicator spans all ranks, and NCCL refuses two "
    "ranks on one GPU"
)
for h in torch_missing:
    add("4. GPipe/1F1B step time vs torch.distributed.pipelining", h,
        SHARED_GPU if "stages on" in h else NOT_MEASURED, "≤ 1.10", None)  # fmt: skip

if not len(dt):
    add("4. tensor-parallel MLP vs DTensor", "-", NOT_MEASURED, "≤ 1.10", None)
for (h, w), g in dt.groupby(["host", "world size"], sort=False) if len(dt) else []:
    r = g["ours / DTensor"]
    add(f"4. tensor-parallel MLP vs DTensor, world size {w}", h,
        f"ours / DTensor {r.min():.2f} to {r.max():.2f} over {len(g)} widths", "≤ 1.10",
        bool((r <= SPEED_TARGET).all()))  # fmt: skip


# The answers: one row per item of the two side quests.
def pipeline_answer(sched: str) -> str:
    g = pipe_gaps[pipe_gaps["schedule"] == sched] if len(pipe_gaps) else pipe_gaps
    if not len(g) or g[GAP].isna().all():
        return NOT_MEASURED
    gaps = ", ".join(f"{sci(x[GAP].max())} ({d})" for d, x in g.groupby("dtype", sort=False))
    return (f"{int(g['blocks'].max())} blocks, {int(g['steps'].max())} steps, loss "
            f"{g['first loss (pipeline)'].max():.2f} → {g['final loss (pipeline)'].min():.1e} nats; "
            f"max |gap| to one process {gaps} nats")  # fmt: skip


def tp_answer(level: str) -> str:
    g = (
        tp_gaps[(tp_gaps["level"] == level) & (tp_gaps["activation"] == "relu")]
        if len(tp_gaps)
        else tp_gaps
    )
    if not len(g):
        return NOT_MEASURED
    gaps = ", ".join(
        f"{sci(x['max absolute gap'].max())} ({d})" for d, x in g.groupby("dtype", sort=False)
    )
    worlds = "/".join(str(w) for w in sorted(g["world size"].unique()))
    return f"max |gap| to one process {gaps} nats, world size {worlds}"  # fmt: skip


def curve_answer() -> str:
    g = (
        tp_gaps[(tp_gaps["level"] == "block") & (tp_gaps["dtype"] == "float32")]
        if len(tp_gaps)
        else tp_gaps
    )
    if not len(g):
        return NOT_MEASURED
    row = g.iloc[0]
    ref = single_process(row, "reference")
    first = row["losses"][0]
    text = (f"Transformer block, {int(row['steps'])} steps: loss {first:.2f} → {row['final loss']:.3f} nats, "
            f"test accuracy {row['test accuracy']:.1%}")  # fmt: skip
    if len(ref):
        text += (
            f" (one process {ref.iloc[-1]['final loss']:.3f}, {ref.iloc[-1]['test accuracy']:.1%})"
        )
    return text


one_device = bubble[~bubble["host"].str.contains("stages on")] if len(bubble) else bubble
bubble_answer = (
    f"measured / (S−1)/(m+S−1) = {one_device['measured / formula'].min():.2f}x to "
    f"{one_device['measured / formula'].max():.2f}x (S = {'/'.join(map(str, sorted(one_device['stages S'].unique())))}, "
    f"m = {one_device['micro-batches m'].min()}–{one_device['micro-batches m'].max()}, one device per stage)"
    if len(one_device) else NOT_MEASURED
)  # fmt: skip
long_1f1b = memory[memory["schedule"] == "1f1b"] if len(memory) else memory
long_answer = NOT_MEASURED
if len(long_1f1b):
    g = long_1f1b[long_1f1b["micro-batches m"] == long_1f1b["micro-batches m"].max()]
    long_answer = (f"{g['micro-batches m'].max()} micro-batches × {g['stages S'].max()} stages completed; "
                   f"1F1B holds at most "
                   f"{max(map(max, g['activations in flight per rank']))} activations per rank")  # fmt: skip
flight_1f1b = (
    flight["activations in flight per rank"].map(max) if len(flight) else pd.Series(dtype=int)
)
memory_answer = (
    f"1F1B at most {flight_1f1b.max()} in flight with S = {flight['stages S'].max()} (bound S); GPipe holds m"
    if len(flight) else NOT_MEASURED
)  # fmt: skip
S1 = "1. Pipeline: loss curves against single-process training"
S2 = "2. Activations in flight and memory against the number of micro-batches"
S3 = "3. Bubble fraction: measured against (S − 1)/(m + S − 1)"
S4 = "4. Tensor parallelism: curves per level and world size"
answers = [
    Answer("Pipeline: GPipe, ≥ 4 stages, same convergence as one process", pipeline_answer("gpipe"), S1),
    Answer("Pipeline: 1F1B", pipeline_answer("1f1b"), S1),
    Answer("Pipeline bonus: interleaved 1F1B", pipeline_answer("interleaved"), S1),
    Answer("Pipeline bubble", bubble_answer, S3),
    Answer("Pipeline memory: activations in flight", memory_answer, S2),
    Answer("Pipeline bonus: 1000 micro-batches × 4 stages without OOM", long_answer, S2),
    Answer("Tensor parallel: Linear → ReLU → Linear", tp_answer("mlp"), S4),
    Answer("Tensor parallel: with LayerNorm", tp_answer("norm"), S4),
    Answer("Tensor parallel: train it, learning curves", curve_answer(), S4),
    Answer("Tensor parallel bonus: a Transformer block", tp_answer("block"), S4),
    Answer("Tensor parallel bonus: column + row, one collective",
           "column → activation → row MLP: one all-reduce forward, one backward; " + tp_answer("mlp"), S4),
]  # fmt: skip
