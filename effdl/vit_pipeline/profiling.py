"""Profiling a ViT pipeline: a training iteration split into named ranges, every module's forward
as a torch.profiler range, and torch.profiler's records read back per range and per module, set
against the layer-level Profile's times of the same modules."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEventAvg
from torch.profiler import profile, record_function

from effdl.profiling.kernel_split import launched_kernel_us
from effdl.vit_pipeline.training import BatchStats, Trainer

MODULE_PREFIX = "module: "
RANGES = ("data_wait", "to_device", "train_step", "batch_stats")
STEP_PREFIX = "ProfilerStep"  # "ProfilerStep#N" per step, or one "ProfilerStep*" row


def run_iterations(trainer: Trainer, batches: Iterator, n: int, step: Callable[[], None]) -> None:
    """``n`` training iterations in named ranges, calling ``step()`` after each."""
    stats = BatchStats(trainer.cfg.sync_every_step)
    trainer.model.train()
    for _ in range(n):
        with record_function("data_wait"):
            batch = next(batches)
        with record_function("to_device"):
            x, y = trainer.to_device(batch)
        with record_function("train_step"):
            loss, logits = trainer.train_step(x, y)
        with record_function("batch_stats"):
            stats.add(loss, logits, y)
        step()


@contextlib.contextmanager
def module_ranges(model: nn.Module) -> Iterator[None]:
    """Every submodule's forward as a profiler range named ``module: <path>: <Class>``."""
    handles, open_ranges = [], {}

    def enter(name: str):
        def hook(module, args):
            open_ranges[name] = record_function(f"{MODULE_PREFIX}{name}: {type(module).__name__}")
            open_ranges[name].__enter__()

        return hook

    def leave(name: str):
        def hook(module, args, output):
            open_ranges.pop(name).__exit__(None, None, None)

        return hook

    for name, module in model.named_modules():
        name = name or "model"
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave(name)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def event_record(evt: FunctionEventAvg) -> dict:
    """What a key_averages row says, in microseconds and bytes (device fields 0 on the CPU)."""
    return {
        "name": evt.key,
        "input_shapes": str(evt.input_shapes) if evt.input_shapes else None,
        "calls": evt.count,
        "cpu_time_total_us": evt.cpu_time_total,
        "self_cpu_time_total_us": evt.self_cpu_time_total,
        "device_time_total_us": getattr(evt, "device_time_total", 0),
        "self_device_time_total_us": getattr(evt, "self_device_time_total", 0),
        "cpu_memory_bytes": evt.cpu_memory_usage,
        "device_memory_bytes": getattr(evt, "device_memory_usage", 0),
    }


def range_records(prof: profile, active: int) -> list[dict]:
    """Per named range (and the whole iteration, ``step``), per active iteration, in ms: its host
    time, the device time of the kernels launched inside it, and the length of its span on the
    GPU's timeline (torch.profiler keeps a CPU row and a GPU-annotation row per range name)."""
    cpu_rows, gpu_rows = {}, {}
    for e in prof.key_averages():
        name = "step" if e.key.startswith(STEP_PREFIX) else e.key
        if name not in ("step", *RANGES):
            continue
        rows = cpu_rows if e.device_type == DeviceType.CPU else gpu_rows
        rows.setdefault(name, []).append(e)
    out = []
    for name in ("step", *RANGES):
        if name not in cpu_rows:
            continue
        cpu, gpu = cpu_rows[name], gpu_rows.get(name, [])
        out.append({
            "range": name,
            "cpu_ms_per_iter": sum(e.cpu_time_total for e in cpu) / active / 1e3,
            "device_ms_per_iter": sum(getattr(e, "device_time_total", 0) for e in cpu) / active / 1e3,
            "gpu_span_ms_per_iter": sum(getattr(e, "device_time_total", 0) for e in gpu) / active / 1e3,
        })  # fmt: skip
    step_ms = out[0]["cpu_ms_per_iter"] if out and out[0]["range"] == "step" else None
    for row in out:
        row["share_of_step"] = row["cpu_ms_per_iter"] / step_ms if step_ms else None
    return out


def torch_module_times(prof: profile) -> tuple[dict[str, float], dict[str, float]]:
    """Per module path, torch.profiler's forward time per call in ms, two ways: the device time
    of the kernels launched inside the module's range, each kernel once (from the event tree;
    host time on the CPU, where there are no kernels), and key_averages' device total of the
    range (its table's number), which counts a kernel twice when its launch stalled on a full
    command queue (:data:`effdl.profiling.kernel_split.LAUNCH_STALL`): a GPU-bound step stalls often, at random places."""
    per_call: dict[str, list[float]] = {}
    for e in prof.events():
        if e.name.startswith(MODULE_PREFIX) and e.device_type == DeviceType.CPU:
            path = e.name[len(MODULE_PREFIX) :].rsplit(": ", 1)[0]
            per_call.setdefault(path, []).append(launched_kernel_us(e) or e.cpu_time_total)
    kernels = {path: sum(v) / len(v) / 1e3 for path, v in per_call.items()}
    averaged = {}
    for e in prof.key_averages():
        if e.key.startswith(MODULE_PREFIX) and e.count and e.device_type == DeviceType.CPU:
            path = e.key[len(MODULE_PREFIX) :].rsplit(": ", 1)[0]
            averaged[path] = (
                (getattr(e, "device_time_total", 0) or e.cpu_time_total) / e.count / 1e3
            )
    return kernels, averaged


def layer_comparison(prof: profile, layers: list[dict]) -> list[dict]:
    """Each module's forward per call: Profile's time against torch.profiler's kernel time of
    the module's range, counted once and as key_averages counts it (see
    :func:`torch_module_times`)."""
    kernels, averaged = torch_module_times(prof)
    rows = []
    for layer in layers:
        path, ours = layer["path"], layer["fwd_mean_ms"]
        theirs, table = kernels.get(path), averaged.get(path)
        if theirs is None or ours is None:
            continue
        rows.append({"path": path, "module": layer["module"], "calls": layer["calls"],
                     "profile_fwd_ms": ours, "torch_fwd_ms": theirs,
                     "ratio": ours / theirs if theirs else None, "torch_key_averages_ms": table,
                     "key_averages_ratio": ours / table if table else None})  # fmt: skip
    return rows


def agreement(rows: list[dict], min_ms: float = 1.0, tolerance: float = 0.10) -> dict:
    """Of the modules whose torch.profiler time is above ``min_ms``, how many of Profile's
    times are within ``tolerance`` of it, against the kernels counted once and against
    key_averages' total (shares None where no module is that slow)."""
    out = {"min_ms": min_ms, "tolerance": tolerance}
    for ref, theirs, ratio in (("kernels", "torch_fwd_ms", "ratio"),
                               ("key_averages", "torch_key_averages_ms", "key_averages_ratio")):  # fmt: skip
        slow = [r for r in rows if (r[theirs] or 0) > min_ms]
        within = sum(abs(r[ratio] - 1) <= tolerance for r in slow)
        out[f"modules_over_min_{ref}"] = len(slow)
        out[f"within_{ref}"] = within
        out[f"share_within_{ref}"] = within / len(slow) if slow else None
    return out
