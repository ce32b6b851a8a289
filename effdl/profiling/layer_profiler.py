"""Module-level (layer) timing of a training step from ``nn.Module`` hooks.

:class:`Profile` hooks every submodule of a model with forward pre/post hooks; the backward is
timed from autograd hooks those set up on the module's tensors. Each call of a module gives one
forward span and, when it takes part in autograd, one backward span, from time stamps: CUDA
events on the model's device (read with one synchronize when results are asked for) or
``time.perf_counter`` on the CPU (:class:`effdl.profiling.timing.Clock`). A :class:`Schedule` with ``torch.profiler.schedule``'s
meaning picks which steps are recorded.

What a span holds, and the limits:

- Module boundaries, not kernels: every kernel the module launched and, where the GPU waits for
  the host, that wait. Spans are inclusive: a parent's span holds its children's.
- A backward span starts when the gradient of the module's output is complete (a pre hook on
  the autograd node that made each output tensor) and ends when the gradients of all its
  positional tensor inputs that require grad are (each input passes through an alias,
  ``a[...]``, whose node's pre hook marks that point). Where no such input gets a gradient (the
  first layer, an input used without grad), the span ends when every parameter taking part in
  the pass has its gradient (``torch.autograd.graph.register_multi_grad_hook``): an upper bound.
- Modules run under ``no_grad``/``inference_mode``, or whose outputs are not tensors or plain
  tuples of tensors, get no backward span; only positional inputs count. In-place changes of a
  module's output after it returns, and modules that change their input in place
  (``nn.ReLU(inplace=True)``), are handled.
- Activation checkpointing re-runs forwards during backward: those count as more forward calls.
- One device; each stamp goes on the stream current where the hook runs. Spans nest as torch's
  engine orders a single device's backward; nothing here enforces it.
- The hooks cost host time while on (the schedule's WARMUP and RECORD steps): per module call
  two forward hooks, one alias node per input with grad, two node pre hooks and about four
  stamps; per backward pass one hook call per parameter. Where the host bounds the step, hook
  the blocks only (``max_depth``) or spread the modules over steps (``sample_every``). Stamps
  are kept until the profile is dropped, so bound long runs with a :class:`Schedule` that has
  a ``repeat``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from effdl.profiling.timing import Clock
from effdl.tables import format_table

FORWARD = "forward"
BACKWARD = "backward"
STEP = "step"
_TRACKS = {STEP: 0, FORWARD: 1, BACKWARD: 2}
# A backward call in flight: [module index, start stamp or None, inputs left, inputs with grad,
# the number of the outermost forward it ran in].
_MODULE, _START, _LEFT, _INPUTS, _FORWARD = range(5)


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
        counts = (self.wait, self.warmup, self.active, self.repeat, self.skip_first)
        if any(isinstance(n, bool) or not isinstance(n, int) for n in counts):
            raise ValueError(f"Schedule needs whole numbers of steps; got {self}")
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


def _model_device(model: nn.Module) -> torch.device:
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _label(path: str, module: nn.Module) -> str:
    """A leaf by its class (``Linear``), any other module as ``"path: Class"``."""
    cls = type(module).__name__
    return cls if next(module.children(), None) is None else f"{path}: {cls}"


def _grad_output_nodes(output: object) -> list[Any]:
    """The autograd nodes that made the tensors of a module's output (a tensor or a plain
    tuple)."""
    if isinstance(output, torch.Tensor):
        output = (output,)
    elif type(output) is not tuple:
        return []
    return [t.grad_fn for t in output if isinstance(t, torch.Tensor) and t.grad_fn is not None]


class Profile:
    """Per-module forward and backward times of a model, as a context manager.

    ``with Profile(model) as prof:`` registers the hooks on ``model`` and every submodule (the
    model's own path is ``name``); leaving the block removes them and leaves the model as it
    was. Call :meth:`step` once per training iteration: it ends a step and starts the next. With
    ``schedule`` only its RECORD steps are kept; without one every step is. Step time is the
    time between consecutive :meth:`step` calls (the first step starts on entry), on the same
    clock as the spans. ``device`` picks the clock (default: the device of the model's first
    parameter or buffer; CUDA events there, the host clock on the CPU). The module hooks are
    on only during the schedule's WARMUP and RECORD steps. ``max_depth`` hooks only the modules
    at most that many levels below the model (0: the model alone; 2 in a model with a
    ``blocks`` ModuleList: each block); None hooks every module. Each hooked module costs host
    time per call, so a model whose step is bound by the host (many small kernels) runs slower
    by that much while recorded: a shallow profile of its blocks keeps the cost small, and
    ``sample_every=n`` spreads it: each recorded step hooks one n-th of the modules (the k-th
    module in model order in the recorded steps numbered k modulo n, counting recorded steps
    only, so a schedule's idle steps skip no share; a warm-up step hooks the share of the
    recorded step after it), so every module is still timed, in one recorded step of every n,
    and a step pays for a tenth of the hooks with n = 10. A module's ``calls`` and
    ``step_pct`` then count the recorded steps it was hooked in.

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
        max_depth: int | None = None,
        sample_every: int = 1,
    ) -> None:
        if max_depth is not None and max_depth < 0:
            raise ValueError(f"max_depth must be >= 0 or None, got {max_depth}")
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        self.sample_every = sample_every
        self.model = model
        self.name = name
        self.schedule = schedule
        self._device = torch.device(device) if device is not None else None
        self._modules = [
            (path or name, m)
            for path, m in model.named_modules()
            if max_depth is None or (path.count(".") + 1 if path else 0) <= max_depth
        ]
        self._labels = [_label(path, m) for path, m in self._modules]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # The modules each step hooks (by step number modulo sample_every), and those hooked now.
        self._shares = [range(k, len(self._modules), sample_every) for k in range(sample_every)]
        self._hooked: range = range(0)
        self._hook_fns: list[tuple[Callable, Callable] | None] = [None] * len(self._modules)
        self._entered = False
        self._active = False
        self._clock: Clock | None = None
        self._step = 0
        self._recorded_steps = 0  # RECORD steps finished: picks the share of sampled modules
        self._phase = Phase.NONE
        self._step_start: Any = None
        # Per module, its forward calls in flight: (start stamp, backward call, input views and their versions).
        self._calls: list[list[tuple[Any, list | None, list | None]]] = [[] for _ in self._modules]
        self._bwd_open: list[list] = []  # backward calls started and maybe still open
        # Output nodes of the forward in flight, each with the calls whose backward it starts:
        # a parent returning its child's output shares the child's hook and stamp.
        self._starts: dict[Any, list[list]] = {}
        self._depth = 0  # hooked module calls in flight
        # The multi-grad hook on the model's parameters that marks the end of a backward pass,
        # the last stamp taken in backward, and whether a pass ended since the last start.
        self._pass_hook: torch.utils.hooks.RemovableHandle | None = None
        self._last_bwd: Any = None
        self._pass_done = False
        self._forward = 0  # outermost hooked forward calls so far
        self._pending: list[tuple[int, str, int, Any, Any]] = []
        self._spans: list[tuple[int, str, int, Any, Any]] = []
        self._steps: list[tuple[int, Any, Any]] = []

    # -- the with block ------------------------------------------------------------------------

    def __enter__(self) -> Profile:
        if self._entered:
            raise RuntimeError("a Profile records one `with` block; make a new one")
        self._entered = True
        device = self._device or _model_device(self.model)
        self._clock = Clock(device)
        self._active = True
        self._begin_step(None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._phase is Phase.RECORD and (self._pending or self._bwd_open):
            self._finish_step(self._clock.mark())  # a block without a final step()
        self._active = False
        self._phase = Phase.NONE
        self._remove_hooks()
        self._hook_passes(False)

    def step(self) -> None:
        """End the current step (kept if it is a RECORD step) and start the next."""
        if not self._active:
            raise RuntimeError("Profile.step() called outside its `with` block")
        now = self._clock.mark() if self._phase is not Phase.NONE else None
        self._finish_step(now)
        self._step += 1
        self._begin_step(now)

    def _register_hooks(self) -> None:
        self._hooked = self._shares[self._recorded_steps % self.sample_every]
        try:
            for i in self._hooked:
                module = self._modules[i][1]
                if self._hook_fns[i] is None:
                    self._hook_fns[i] = (self._pre_hook(i), self._post_hook(i))
                pre, post = self._hook_fns[i]
                # Our pre hook runs last and post hook first, so spans hold the module alone.
                self._handles += [
                    module.register_forward_pre_hook(pre),
                    module.register_forward_hook(post, prepend=True, always_call=True),
                ]
        except BaseException:
            self._remove_hooks()
            raise

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook_passes(self, on: bool) -> None:
        """Hook (or unhook) the end of each backward pass: the moment every parameter of the
        model that takes part in it has its gradient."""
        if on and self._pass_hook is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            if params:
                # The hook finds each parameter's gradient accumulator through autograd.
                with torch.inference_mode(False), torch.enable_grad():
                    self._pass_hook = torch.autograd.graph.register_multi_grad_hook(
                        params, self._end_backward_pass
                    )
        elif not on and self._pass_hook is not None:
            self._pass_hook.remove()
            self._pass_hook = None

    # -- steps ---------------------------------------------------------------------------------

    def _begin_step(self, now: Any) -> None:
        self._phase = self.schedule.phase(self._step) if self.schedule else Phase.RECORD
        if self._phase is Phase.NONE:
            self._step_start = None
            self._remove_hooks()  # the model runs bare between recorded cycles
            self._hook_passes(False)
        else:
            self._step_start = now if now is not None else self._clock.mark()
            if self.sample_every > 1:
                self._remove_hooks()  # this step's share of the modules
            if not self._handles:
                self._register_hooks()
            self._hook_passes(True)

    def _finish_step(self, now: Any) -> None:
        self._close_open()
        if self._phase is Phase.RECORD:
            self._spans += self._pending
            self._steps.append((self._step, self._step_start, now))
            self._recorded_steps += 1
        elif self._phase is Phase.WARMUP:
            # Spans share stamps (a backward start or end closes several calls at once): each
            # event goes back to the pool once, or two later stamps would be one event.
            marks = {id(m): m for *_, a, b in self._pending for m in (a, b)}
            self._clock.release(list(marks.values()))
        self._pending.clear()
        for i in self._hooked:
            self._calls[i].clear()
        self._starts.clear()
        self._depth = 0
        self._last_bwd = None

    # -- hooks ---------------------------------------------------------------------------------

    def _pre_hook(self, i: int) -> Callable[..., tuple | None]:
        push = self._calls[i].append
        mark = self._clock.mark
        bwd_end = self._bwd_end
        is_grad_enabled = torch.is_grad_enabled
        tensor = torch.Tensor

        def pre_hook(_module: nn.Module, args: tuple) -> tuple | None:
            if not self._depth:
                self._forward += 1
                if self._pass_done:
                    self._close_open()  # a new forward: the last pass's open spans are done
            self._depth += 1
            if not is_grad_enabled():
                push((mark(), None, None))
                return None
            call = [i, None, 0, 0, self._forward]
            new_args = list(args)
            views = []
            for k, a in enumerate(args):
                if isinstance(a, tensor) and a.requires_grad:
                    # A node of this call's own: its gradient is this module's use of ``a``.
                    view = new_args[k] = a[...]
                    node = view.grad_fn
                    node.register_prehook(partial(bwd_end, call))
                    views.append((view, node))
            call[_LEFT] = call[_INPUTS] = len(views)
            push((mark(), call, views or None))
            return tuple(new_args) if views else None

        return pre_hook

    def _post_hook(self, i: int) -> Callable[..., object]:
        calls = self._calls[i]
        mark = self._clock.mark
        pending = self._pending.append  # the list lives as long as the profile
        starts = self._starts
        bwd_start = self._bwd_start
        bwd_end_after = self._bwd_end_after
        tensor = torch.Tensor

        def post_hook(_module: nn.Module, _args: tuple, output: object) -> object:
            end = mark()
            if not calls:
                return None
            start, call, views = calls.pop()
            pending((i, FORWARD, self._step, start, end))
            if call is not None:
                if views:
                    for v, node in views:
                        if v.grad_fn is not node:
                            # Changed in place: the view's node left the graph. Its new node
                            # leads to its base's (CopySlices), which holds the module's
                            # backward: the input's gradient is complete when that has run.
                            base_node = v.grad_fn.next_functions[0][0]
                            base_node.register_hook(partial(bwd_end_after, call))
                        # An identity's output needs a node of its own, after its input's.
                        if v is output:
                            output = output[...]
                        elif type(output) is tuple and any(t is v for t in output):
                            output = tuple(t[...] if t is v else t for t in output)
                if type(output) is tensor:  # most calls: the loop below, less its tuples
                    node = output.grad_fn
                    nodes = (node,) if node is not None else ()
                else:
                    nodes = _grad_output_nodes(output)
                for node in nodes:
                    starting = starts.get(node)
                    if starting is None:
                        starts[node] = starting = [call]
                        node.register_prehook(partial(bwd_start, starting))
                    else:
                        starting.append(call)  # a child's output: start with the child
            self._depth -= 1
            if not self._depth:
                starts.clear()  # the outermost call returned: its graph is no longer held
            return output

        return post_hook

    def _bwd_start(self, starting: list[list], _grad: object) -> None:
        """An output's gradient is complete: the backward of the modules that returned it starts."""
        if self._phase is Phase.NONE:
            return
        if self._pass_done:
            self._pass_done = False
            # After a pass, a start belongs to a new one if it re-runs a call still open (a
            # retained graph) or comes from another forward than the open calls; otherwise the
            # pass that ended was nested in this one (a reentrant checkpoint's).
            forwards = {call[_FORWARD] for call in self._bwd_open if call[_START] is not None}
            if starting[0][_FORWARD] not in forwards or any(
                call[_START] is not None for call in starting
            ):
                self._close_open()
        now = None
        for call in starting:
            if call[_START] is None:
                if now is None:
                    now = self._last_bwd = self._clock.mark()
                call[_START] = now
                self._bwd_open.append(call)

    def _bwd_end(self, call: list, _grad: object) -> None:
        """The gradient of one of the call's inputs is complete; the last one ends the span."""
        if self._phase is Phase.NONE or call[_START] is None:
            return
        call[_LEFT] -= 1
        if call[_LEFT] == 0:
            end = self._last_bwd = self._clock.mark()
            self._pending.append((call[_MODULE], BACKWARD, self._step, call[_START], end))
            call[_START] = None
            call[_LEFT] = call[_INPUTS]  # ready for another backward through the same graph

    def _bwd_end_after(self, call: list, _grad_inputs: tuple, grad_outputs: tuple) -> None:
        self._bwd_end(call, grad_outputs)

    def _end_backward_pass(self, _grads: object) -> None:
        """Every parameter that takes part in a backward pass has its gradient: the pass is over
        (or a nested one), and so are the backward calls without inputs that take gradients.
        Their spans end here, closed at the next backward start of another pass, forward or
        step."""
        if self._phase is Phase.NONE:
            self._bwd_open.clear()
            return
        if any(call[_START] is not None for call in self._bwd_open):
            self._last_bwd = self._clock.mark()
            self._pass_done = True

    def _close_open(self) -> None:
        """Close the spans still open at the last stamp of the backward pass that ended."""
        for call in self._bwd_open:
            if call[_START] is not None:
                self._close(call, self._last_bwd)
        self._bwd_open.clear()
        self._pass_done = False

    def _close(self, call: list, end: Any) -> None:
        self._pending.append((call[_MODULE], BACKWARD, self._step, call[_START], end))
        call[_START] = None
        call[_LEFT] = call[_INPUTS]

    # -- results -------------------------------------------------------------------------------

    def _resolve(self) -> tuple[list[Span], list[tuple[int, Span]]]:
        """The recorded steps, and the module spans each with its module's index."""
        stamps = [m for _, a, b in self._steps for m in (a, b)]
        stamps += [m for *_, a, b in self._spans for m in (a, b)]
        ns = iter(round(t * 1e9) for t in self._clock.since_origin(stamps)) if stamps else iter([])
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
        without calls) and ``step_pct``: forward + backward total over the total of the recorded
        steps (those the module was hooked in, with ``sample_every``). Modules never called in a
        recorded step are listed last with zero calls; with ``sample_every``, give the schedule
        at least that many active steps so that every module is hooked in one.
        """
        return self._rows(*self._resolve())

    def _rows(self, steps: list[Span], modules: list[tuple[int, Span]]) -> list[dict[str, Any]]:
        n = self.sample_every
        step_ns = [sum(s.dur_ns for s in steps if s.step % n == share) for share in range(n)]
        durations: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, s in modules:
            durations[i, s.kind].append(s.dur_ns)
        rows = []
        for i, (path, _) in enumerate(self._modules):
            fwd, bwd = durations[i, FORWARD], durations[i, BACKWARD]
            total_ns, hooked_ns = sum(fwd) + sum(bwd), step_ns[i % n]
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
                    "step_pct": 100 * total_ns / hooked_ns if hooked_ns else None,
                }
            )
        rows.sort(key=lambda r: -(r["fwd_total_ms"] + r["bwd_total_ms"]))  # stable: model order
        return rows

    def summary(self, top: int | None = None) -> str:
        """A plain-text table of :meth:`records` (the ``top`` slowest modules, or all)."""
        steps, modules = self._resolve()
        clock = "CUDA events" if self._clock.cuda else "host clock"
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
