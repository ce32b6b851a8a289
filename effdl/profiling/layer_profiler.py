"""Module-level (layer) timing of a training step from ``nn.Module`` hooks.

:class:`Profile` hooks every submodule of a model: forward pre/post hooks and full backward
pre/post hooks. Each hook takes a time stamp, so each call of a module gives one forward span and,
when it takes part in autograd, one backward span. The stamps are CUDA events on the model's
device (the spans lie on the GPU's timeline, correct under asynchronous execution, and are read
with one synchronize when the results are asked for) or ``time.perf_counter_ns`` on the CPU. A
:class:`Schedule` with ``torch.profiler.schedule``'s meaning picks which steps are recorded.

What it measures, and its limits:

- Module boundaries, not kernels: a span runs from the stamp before a module's work to the stamp
  after it, so it holds every kernel the module launched and, where the GPU waits for the host
  (a host-bound model, a data loader), that wait as well. Spans are inclusive: a parent's span
  holds its children's.
- A backward span starts when the gradient of the module's output is ready (full backward pre
  hook) and ends when the gradients of its inputs are computed (full backward hook). Where no
  positional input of the module requires grad (the first layer, the model itself under input
  images), torch fires the full backward hook before the module's backward has run; such a span
  is closed at the end of the backward pass instead, an upper bound that holds the module's
  weight gradients.
- Modules run under ``no_grad``/``inference_mode``, or whose outputs are not tensors or tuples of
  tensors, get no backward span.
- Full backward hooks forbid in-place changes of a module's inputs or outputs (torch raises);
  torch's warning about the early-firing hook is silenced inside the ``with`` block.
- Activation checkpointing re-runs forwards during backward: those count as more forward calls.
- One device; each stamp goes on the stream current where the hook runs (the autograd engine's
  in backward). Spans nest as torch's engine orders a single device's backward (later modules
  first); nothing here enforces it.
- The hooks cost host time (microseconds per module call): negligible while the GPU is the
  bottleneck, visible where the host is. Stamps are kept until the profile is dropped, so bound
  long runs with a :class:`Schedule` that has a ``repeat``.
"""

from __future__ import annotations

import functools
import json
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from effdl.cli import format_table

FORWARD = "forward"
BACKWARD = "backward"
STEP = "step"
_TRACKS = {STEP: 0, FORWARD: 1, BACKWARD: 2}
# torch warns about the case the backward hooks here handle by design (see the module docstring).
_NO_GRAD_INPUT_WARNING = "Full backward hook is firing when gradients are computed with respect"


class Phase(Enum):
    """What a step is for, as ``torch.profiler.ProfilerAction`` (its RECORD_AND_SAVE is RECORD)."""

    NONE = 0
    WARMUP = 1
    RECORD = 2


@dataclass(frozen=True)
class Schedule:
    """Which steps are recorded: ``torch.profiler.schedule``'s rule.

    The first ``skip_first`` steps are ignored; then cycles of ``wait`` idle steps, ``warmup``
    steps whose spans are taken and dropped (the hooks' own start-up stays out of the numbers),
    and ``active`` recorded steps. ``repeat`` cycles, or without end when it is 0.
    """

    wait: int
    warmup: int
    active: int
    repeat: int = 0
    skip_first: int = 0

    def __post_init__(self) -> None:
        if min(self.wait, self.warmup, self.repeat, self.skip_first) < 0 or self.active < 1:
            raise ValueError(
                f"Schedule needs wait, warmup, repeat, skip_first >= 0 and active >= 1; got {self}"
            )

    def phase(self, step: int) -> Phase:
        """The phase of step number ``step`` (counted from 0)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.skip_first:
            return Phase.NONE
        cycle = self.wait + self.warmup + self.active
        step -= self.skip_first
        if self.repeat and step >= self.repeat * cycle:
            return Phase.NONE
        pos = step % cycle
        if pos < self.wait:
            return Phase.NONE
        return Phase.WARMUP if pos < self.wait + self.warmup else Phase.RECORD


@dataclass(frozen=True)
class Span:
    """One timed interval in nanoseconds since the profile began.

    ``kind`` is ``"forward"``, ``"backward"`` or ``"step"``; ``name`` is the module's label
    (a step's is ``"step <n>"``), ``path`` its dotted path (empty for a step).
    """

    name: str
    path: str
    kind: str
    step: int
    start_ns: int
    end_ns: int

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


class _HostClock:
    """Stamps from ``perf_counter_ns``, relative to the clock's creation."""

    def __init__(self) -> None:
        self._origin = time.perf_counter_ns()

    def mark(self) -> int:
        return time.perf_counter_ns()

    def to_ns(self, marks: list[int]) -> list[int]:
        return [m - self._origin for m in marks]


class _CudaClock:
    """Stamps are CUDA events on the device's current stream, relative to an origin event."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._origin = self.mark()

    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        # The current stream of the calling thread: the autograd engine's, inside backward.
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def to_ns(self, marks: list[torch.cuda.Event]) -> list[int]:
        torch.cuda.synchronize(self.device)  # the one sync: every stamp is read after it
        return [round(self._origin.elapsed_time(m) * 1e6) for m in marks]


def _model_device(model: nn.Module) -> torch.device:
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _label(path: str, module: nn.Module) -> str:
    """A leaf by its class (``Linear``), any other module as ``"path: Class"``."""
    cls = type(module).__name__
    return cls if next(module.children(), None) is None else f"{path}: {cls}"


class Profile:
    """Per-module forward and backward times of a model, as a context manager.

    ``with Profile(model) as prof:`` registers the hooks on ``model`` and every submodule (the
    model's own path is ``name``); leaving the block removes them and leaves the model as it
    was. Call :meth:`step` once per training iteration: it ends a step and starts the next. With
    ``schedule`` only its RECORD steps are kept; without one every step is. Step time is the
    time between consecutive :meth:`step` calls (the first step starts on entry), on the same
    clock as the spans. ``device`` picks the clock (default: the device of the model's first
    parameter or buffer; CUDA events there, the host clock on the CPU).

    Reading results (:meth:`spans`, :meth:`records`, :meth:`summary`, :meth:`to_perfetto`)
    synchronizes the device once. A profile records one ``with`` block.
    """

    def __init__(
        self,
        model: nn.Module,
        name: str = "model",
        schedule: Schedule | None = None,
        *,
        device: str | torch.device | None = None,
    ) -> None:
        self.model = model
        self.name = name
        self.schedule = schedule
        self._device = torch.device(device) if device is not None else None
        self._modules = [(path or name, m) for path, m in model.named_modules()]
        self._labels = [_label(path, m) for path, m in self._modules]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._full_hook_flags: list[bool | None] = []
        self._warnings: warnings.catch_warnings | None = None
        self._entered = False
        self._active = False
        self._clock: _HostClock | _CudaClock | None = None
        self._step = 0
        self._phase = Phase.NONE
        self._step_start: Any = None
        self._open: dict[tuple[int, str], list[Any]] = defaultdict(list)
        self._pending: list[tuple[int, str, int, Any, Any]] = []
        self._deferred: list[tuple[int, Any]] = []
        self._spans: list[tuple[int, str, int, Any, Any]] = []
        self._steps: list[tuple[int, Any, Any]] = []

    # -- the with block ------------------------------------------------------------------------

    def __enter__(self) -> Profile:
        if self._entered:
            raise RuntimeError("a Profile records one `with` block; make a new one")
        self._entered = True
        device = self._device or _model_device(self.model)
        self._clock = _CudaClock(device) if device.type == "cuda" else _HostClock()
        self._full_hook_flags = [m._is_full_backward_hook for _, m in self._modules]
        try:
            for i, (_, module) in enumerate(self._modules):
                self._register(i, module)
        except BaseException:
            self._remove_hooks()
            raise
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message=_NO_GRAD_INPUT_WARNING, category=UserWarning)
        self._active = True
        self._begin_step(None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._phase is Phase.RECORD and self._pending:
            self._finish_step(self._clock.mark())  # a block without a final step()
        self._active = False
        self._phase = Phase.NONE
        self._remove_hooks()
        self._warnings.__exit__(*exc)

    def step(self) -> None:
        """End the current step (kept if it is a RECORD step) and start the next."""
        if not self._active:
            raise RuntimeError("Profile.step() called outside its `with` block")
        now = self._clock.mark() if self._phase is not Phase.NONE else None
        self._finish_step(now)
        self._step += 1
        self._begin_step(now)

    def _register(self, i: int, module: nn.Module) -> None:
        # Our pre hooks run last and post hooks first, so spans hold the module, not other hooks.
        self._handles += [
            module.register_forward_pre_hook(functools.partial(self._start, i, FORWARD)),
            module.register_forward_hook(
                functools.partial(self._end_forward, i), prepend=True, always_call=True
            ),
            module.register_full_backward_pre_hook(functools.partial(self._start, i, BACKWARD)),
            module.register_full_backward_hook(
                functools.partial(self._end_backward, i), prepend=True
            ),
        ]

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for (_, module), flag in zip(self._modules, self._full_hook_flags, strict=True):
            module._is_full_backward_hook = flag  # lets the model take old-style hooks again

    # -- steps ---------------------------------------------------------------------------------

    def _begin_step(self, now: Any) -> None:
        self._phase = self.schedule.phase(self._step) if self.schedule else Phase.RECORD
        if self._phase is Phase.NONE:
            self._step_start = None
        else:
            self._step_start = now if now is not None else self._clock.mark()

    def _finish_step(self, now: Any) -> None:
        if self._phase is Phase.RECORD:
            self._spans += self._pending
            self._steps.append((self._step, self._step_start, now))
        self._pending = []
        self._open.clear()
        self._deferred.clear()

    # -- hooks ---------------------------------------------------------------------------------

    def _start(self, i: int, kind: str, *_: object) -> None:
        if self._phase is not Phase.NONE:
            self._open[i, kind].append(self._clock.mark())

    def _end(self, i: int, kind: str) -> Any:
        """Pop the module's open span of ``kind``: its start stamp, or None if none is open."""
        opened = self._open.get((i, kind))
        return opened.pop() if opened else None

    def _end_forward(self, i: int, *_: object) -> None:
        start = self._end(i, FORWARD)
        if start is not None:
            self._pending.append((i, FORWARD, self._step, start, self._clock.mark()))

    def _end_backward(self, i: int, _module: nn.Module, grad_input: tuple, *_: object) -> None:
        start = self._end(i, BACKWARD)
        if start is None:
            return
        if any(g is not None for g in grad_input):
            self._pending.append((i, BACKWARD, self._step, start, self._clock.mark()))
            return
        # No input requires grad: torch calls this hook before the module's backward runs.
        if not self._deferred:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_deferred)
        self._deferred.append((i, start))

    def _end_deferred(self) -> None:
        """Close the spans of modules without grad inputs when the backward pass ends."""
        if self._deferred:
            end = self._clock.mark()
            self._pending += [(i, BACKWARD, self._step, s, end) for i, s in self._deferred]
            self._deferred.clear()

    # -- results -------------------------------------------------------------------------------

    def _resolve(self) -> tuple[list[Span], list[tuple[int, Span]]]:
        """The recorded steps, and the module spans each with its module's index."""
        stamps = [m for _, a, b in self._steps for m in (a, b)]
        stamps += [m for *_, a, b in self._spans for m in (a, b)]
        ns = iter(self._clock.to_ns(stamps) if stamps else [])
        steps = [Span(f"step {k}", "", STEP, k, next(ns), next(ns)) for k, _, _ in self._steps]
        modules = [
            (i, Span(self._labels[i], self._modules[i][0], kind, k, next(ns), next(ns)))
            for i, kind, k, _, _ in self._spans
        ]
        return steps, modules

    def spans(self) -> list[Span]:
        """Every recorded span: the steps, then module spans in the order they ended."""
        steps, modules = self._resolve()
        return steps + [s for _, s in modules]

    def step_times_ms(self) -> list[float]:
        """Duration of each recorded step, in milliseconds."""
        return [s.dur_ns / 1e6 for s in self._resolve()[0]]

    def records(self) -> list[dict[str, Any]]:
        """One row per module, slowest first (forward + backward total), for logs and tables.

        Keys: ``module`` (label), ``path``, ``calls`` and ``bwd_calls`` (spans over the recorded
        steps), ``fwd_total_ms``, ``fwd_mean_ms``, ``bwd_total_ms``, ``bwd_mean_ms`` (None
        without calls) and ``step_pct``: forward + backward total over the recorded steps'
        total. Modules never called in a recorded step are listed last with zero calls.
        """
        return self._rows(*self._resolve())

    def _rows(self, steps: list[Span], modules: list[tuple[int, Span]]) -> list[dict[str, Any]]:
        step_ns = sum(s.dur_ns for s in steps)
        durations: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, s in modules:
            durations[i, s.kind].append(s.dur_ns)
        rows = []
        for i, (path, _) in enumerate(self._modules):
            fwd, bwd = durations[i, FORWARD], durations[i, BACKWARD]
            total_ns = sum(fwd) + sum(bwd)
            rows.append(
                {
                    "module": self._labels[i],
                    "path": path,
                    "calls": len(fwd),
                    "fwd_total_ms": sum(fwd) / 1e6,
                    "fwd_mean_ms": sum(fwd) / len(fwd) / 1e6 if fwd else None,
                    "bwd_calls": len(bwd),
                    "bwd_total_ms": sum(bwd) / 1e6,
                    "bwd_mean_ms": sum(bwd) / len(bwd) / 1e6 if bwd else None,
                    "step_pct": 100 * total_ns / step_ns if step_ns else None,
                }
            )
        rows.sort(key=lambda r: -(r["fwd_total_ms"] + r["bwd_total_ms"]))  # stable: model order
        return rows

    def summary(self, top: int | None = None) -> str:
        """A plain-text table of :meth:`records` (the ``top`` slowest modules, or all)."""
        steps, modules = self._resolve()
        clock = "CUDA events" if isinstance(self._clock, _CudaClock) else "host clock"
        head = f"{self.name}: {len(steps)} recorded steps"
        if steps:
            head += f", {sum(s.dur_ns for s in steps) / len(steps) / 1e6:.3f} ms per step ({clock})"
        return f"{head}\n{format_table(self._rows(steps, modules)[:top])}"

    def to_perfetto(self, path: str | Path = "trace.json") -> Path:
        """Write the spans as Chrome trace-event JSON (opens in Perfetto and chrome://tracing).

        ``{"traceEvents": [...]}``: one complete event (``"ph": "X"``, ``ts``/``dur`` in
        microseconds since the profile began) per step and per module call in each direction,
        on three tracks (``tid``) named by metadata events: steps, forward, backward. Creates
        the folder; returns the path written.
        """
        pid = 1
        meta = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": self.name}}
        ]
        for kind, tid in _TRACKS.items():
            meta.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": kind}}
            )
            meta.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        # Parents first where spans start together, so viewers nest them.
        spans = sorted(self.spans(), key=lambda s: (_TRACKS[s.kind], s.start_ns, -s.end_ns))
        events = [
            {
                "name": s.name,
                "cat": s.kind,
                "ph": "X",
                "ts": s.start_ns / 1e3,
                "dur": s.dur_ns / 1e3,
                "pid": pid,
                "tid": _TRACKS[s.kind],
                "args": {"path": s.path, "step": s.step},
            }
            for s in spans
        ]
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"traceEvents": meta + events}), encoding="utf-8")
        return out
