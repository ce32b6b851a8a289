"""GPU kernel time of a torch.profiler Chrome trace, split by what the kernels do.

Where a training step's GPU time goes, in a few kinds (GEMM, attention, fused elementwise code
that torch.compile generated, the optimizer, the loss, copies, collectives, the rest), read from
the kernel names: enough to say how far the GEMMs run from the GPU's GEMM ceiling, what the other
kernels cost around them and how much collective time no computation hides. Kernels named like none of the kinds count as "other elementwise". Also the
kernel time of one profiler range with each kernel counted once (:func:`launched_kernel_us`),
and a step's host and device time split by its named ranges (:func:`step_breakdown`).
"""

from __future__ import annotations

import gzip
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (kind, name fragments); the first kind whose fragment occurs in the lower-cased name wins, so
# attention comes before gemm (cuDNN's attention kernels carry "sm90" too)
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_tem")),
    ("optimizer", ("adam", "multi_tensor")),
    ("loss", ("nll_loss", "log_softmax", "cross_entropy")),
    ("fused elementwise (triton)", ("triton",)),
    ("copy/fill", ("memcpy", "memset")),
)
OTHER = "other elementwise"
COMMUNICATION = "communication"
# kineto's marker for a kernel launch that waited on a full CUDA command queue: it lists the
# launched kernels again, beside the op that launched them, so sums over a range count them twice
LAUNCH_STALL = "Command Buffer Full"
KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def kernel_kind(name: str) -> str:
    """The kind of a kernel from its name (see :data:`KINDS`)."""
    low = name.lower()
    for kind, fragments in KINDS:
        if any(f in low for f in fragments):
            return kind
    return OTHER


def launched_kernel_us(event: Any) -> float:
    """Device time (us) of the kernels launched inside a torch.profiler event's range (a
    ``FunctionEvent`` of ``prof.events()``: an op or a ``record_function`` range), each kernel
    once. ``event.device_time_total`` adds the kernels listed again under :data:`LAUNCH_STALL`
    events: a GPU-bound loop stalls often, at random places, and reads too high there."""
    total, stack = 0.0, [event]
    while stack:
        e = stack.pop()
        if e.name != LAUNCH_STALL:
            total += sum(k.duration for k in e.kernels)
            stack.extend(e.cpu_children)
    return total


def read_trace_events(path: str | Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a Chrome trace file (``.json`` or ``.json.gz``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kernel_split(events: list[dict[str, Any]], top: int = 15) -> dict[str, Any]:
    """GPU time by kind over a trace's kernels, copies and fills: ``span_ms`` (first start to
    last end), ``kernel_ms`` (their summed durations), ``busy_share``,
    ``communication_exposed_ms`` (collective kernels running alone), ``idle_ms`` (no kernel
    running), ``by_kind_ms`` (largest first), ``by_kind_share`` (of the span) and the ``top``
    kernels by total time."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in KERNEL_CATEGORIES]
    if not kernels:
        raise ValueError("the trace holds no GPU kernels (was CUDA activity recorded?)")
    by_kind, by_name = Counter(), Counter()
    for e in kernels:
        by_kind[kernel_kind(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    busy = sum(by_kind.values())
    comm, compute = [], []
    for e in kernels:
        is_comm = kernel_kind(e["name"]) == COMMUNICATION
        (comm if is_comm else compute).append((e["ts"], e["ts"] + e["dur"]))
    covered = _busy(comm + compute)
    return {
        "span_ms": span / 1e3,
        "kernel_ms": busy / 1e3,
        "busy_share": busy / span,
        # collectives while no other kernel runs: the communication a step waits for
        "communication_exposed_ms": (covered - _busy(compute)) / 1e3,
        "idle_ms": (span - covered) / 1e3,
        "by_kind_ms": {k: v / 1e3 for k, v in by_kind.most_common()},
        "by_kind_share": {k: v / span for k, v in by_kind.most_common()},
        "top_kernels": [
            {"name": n, "kind": kernel_kind(n), "ms": v / 1e3} for n, v in by_name.most_common(top)
        ],
    }


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def kind_shares(split: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """Rows of :func:`kernel_split`'s time by kind: milliseconds per step over ``steps``
    profiled steps, and the share of the span."""
    return [
        {"kind": kind, "ms per step": ms / steps, "share of span": split["by_kind_share"][kind]}
        for kind, ms in split["by_kind_ms"].items()
    ]


def waits(split: dict[str, Any], steps: int) -> str:
    """One line of what a step of :func:`kernel_split`'s trace waits for on the GPU: collectives
    running alone and time with no kernel, in milliseconds per step over ``steps`` steps."""
    alone, idle = (split[k] / steps for k in ("communication_exposed_ms", "idle_ms"))
    return f"{steps} steps: a step has {alone:.2f} ms of collectives alone and {idle:.2f} ms idle"


def step_breakdown(
    events: list[dict[str, Any]], n_steps: int, ranges: Sequence[str]
) -> dict[str, Any]:
    """Per-step seconds from the ``traceEvents`` of a Chrome trace of ``n_steps`` steps, each run
    in a ``step`` range (a ``record_function``) that holds the named ``ranges``.

    ``host``: wall time the training thread spent in each of ``ranges``, and ``host_gap`` = the
    rest of the step (logging, syncs, Python between the ranges). ``device`` (None without GPU
    events): kernel and copy time launched from inside each range (by the launch's time stamp,
    so backward kernels launched by autograd's thread count for the range that ran backward),
    and ``device_idle`` = step wall time minus the device's busy time."""
    events = [e for e in events if e.get("ph") == "X"]
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in (*ranges, "step")}
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"] in spans:
            spans[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    per_step = 1e-6 / n_steps
    host = {name: sum(b - a for a, b in spans[name]) * per_step for name in ranges}
    step_s = sum(b - a for a, b in spans["step"]) * per_step
    host["host_gap"] = step_s - sum(host.values())
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    kernels = [e for e in events if e.get("cat") in KERNEL_CATEGORIES]
    if not kernels:
        return {"step_s": step_s, "host": host, "device": None}
    device = dict.fromkeys(ranges, 0.0)
    for k in kernels:
        launched = launches.get(k.get("args", {}).get("correlation"))
        for name in ranges:
            if launched is not None and any(a <= launched <= b for a, b in spans[name]):
                device[name] += k["dur"] * per_step
                break
    busy = _busy([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    device["device_idle"] = step_s - busy * per_step
    return {"step_s": step_s, "host": host, "device": device}
