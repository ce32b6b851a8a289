"""Adam/AdamW whose fp32 master weights and moments live in (pinned) CPU memory.

The model's parameters become working copies on ``device`` in ``working_dtype`` (bf16 default,
fp16 with loss scaling, fp32 for exact tests): views into flat per-bucket buffers. Pass them
still in fp32 so the masters start exact. A post-accumulate-grad hook takes each gradient as
autograd produces it and frees ``p.grad``, so the GPU never holds a full set. Micro-batches are
summed on the GPU (``grad_accumulation="gpu"``: one D2H copy per step; the accumulator fp32, or
bf16 with ``grad_accumulation_dtype`` for half the device bytes, each add then rounding to bf16,
a relative error of about 2**-9, below the gradient's mini-batch noise) or on the CPU
(``"cpu"``: a D2H copy per micro-batch on a side stream, summed in fp32). The update is torch's
fused CPU Adam/AdamW, one bucket at a time in a worker thread; after ``backward(loss,
final=True)`` each bucket is updated, and its weights copied back on a second side stream, as
soon as its gradients are complete, overlapping the rest of backward.

Semantics are torch.optim.Adam's and AdamW's: the fp32 masters equal
``torch.optim.Adam(fused=True)`` on the CPU bit for bit; per-group hyper-parameters are read at
every step, parameters without a gradient are skipped, ``state_dict`` is torch's layout plus a
``master`` per parameter. fp16 loss scaling (``scale=``) checks all gradients for inf/NaN before
any update and skips the whole step (:attr:`found_inf`); the in-backward overlap is then off.

``moments="int8"`` keeps the moments block-wise 8-bit (:mod:`effdl.optim.quantized_state`,
bitsandbytes' scheme): 2 bytes and a bit per parameter on the host instead of 8; the masters
stay fp32. ``state_dict`` then holds ``exp_avg_codes``, ``exp_avg_absmax``,
``exp_avg_sq_codes`` and ``exp_avg_sq_absmax``; either form loads into either mode.

With int8 moments, ``update_on="device"`` moves the 8-bit step, costly on the CPU, to the
working device: per bucket the masters and moments go up from the pinned host buffers, the step
runs on a side stream (the host path's code, so on a CPU device bit for bit the same), the
working weights are cast there, and masters and moments come back. Extra device memory: at
most :data:`DEVICE_BUCKETS_IN_FLIGHT` buckets of scratch, each ``bucket_numel * (6 B, + 4 B with
"cpu" accumulation) + 2 * bucket_numel / 2048 * 4 B``, plus the step's temporaries of
:data:`DEVICE_STEP_BYTES_PER_VALUE` per value of a chunk (:data:`DEVICE_CHUNK_BLOCKS` blocks).

:func:`plan_offload` lists the buffers a configuration allocates (what, where, dtype, bytes)
without allocating them, so a run can budget GPU and host memory before it builds anything.

Limits: no amsgrad, maximize, sparse gradients or gradient clipping (buckets update before the
global norm is known); one working device; parameters must not be replaced after construction;
not a ``torch.optim.Optimizer`` (for an lr schedule edit ``param_groups[i]["lr"]``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from effdl.amp.grads import unscale_and_check_
from effdl.optim.fused_adam import fused_adam_
from effdl.optim.quantized_state import (
    BLOCK_SIZE,
    CodeMaps,
    QuantizedMomentBuffers,
    dequantize,
    num_blocks,
    quantized_nbytes,
)
from effdl.profiling.timeline import Timeline

_GROUP_DEFAULT_KEYS = ("lr", "betas", "eps", "weight_decay")
GRAD_ACCUMULATION_MODES = ("cpu", "gpu")
GRAD_ACCUMULATION_DTYPES = (torch.float32, torch.bfloat16)  # of the "gpu" mode's accumulator
MOMENT_FORMATS = ("fp32", "int8")
UPDATE_LOCATIONS = ("host", "device")
# update_on="device": buckets whose scratch may live on the device at once (bounds its memory).
DEVICE_BUCKETS_IN_FLIGHT = 2
# update_on="device": blocks per chunk of the 8-bit step; its temporaries are
# DEVICE_STEP_BYTES_PER_VALUE per value, and with a bf16 accumulator the chunk's fp32 copy on top.
DEVICE_CHUNK_BLOCKS = 4096
DEVICE_STEP_BYTES_PER_VALUE = 40
DEVICE_STEP_BF16_GRAD_BYTES_PER_VALUE = 4
DEFAULT_BUCKET_NUMEL = 2**25
# Parameter offsets inside flat buffers are multiples of this many elements (256 B for fp32), so
# every working weight is as aligned as a fresh allocation and GEMMs pick their fast kernels.
ALIGN_ELEMENTS = 64


@dataclass(eq=False)
class _Bucket:
    """Parameters of one param group whose buffers are flat, contiguous slices."""

    group: dict[str, Any]
    params: list[Tensor]
    offsets: list[int]
    numel: int
    master: Tensor  # fp32, CPU
    exp_avg: Tensor  # fp32 moments; empty with int8 moments
    exp_avg_sq: Tensor
    grad: Tensor  # accumulated gradients, CPU (empty where they stay on the device)
    work: Tensor  # working weights on the device (params are views of it)
    steps: list[Tensor]  # one float32 scalar per param, as torch's fused Adam keeps them
    weight_stage: Tensor | None = None  # pinned, working dtype: H2D source
    grad_stage: Tensor | None = None  # pinned, working dtype: D2H target ("cpu" mode)
    gpu_acc: Tensor | None = None  # on the device ("gpu" mode), grad_accumulation_dtype
    quantized: QuantizedMomentBuffers | None = None  # int8 moments, CPU
    has_grad: list[bool] = field(default_factory=list)  # accumulated grad present
    on_host: list[bool] = field(default_factory=list)  # ...and already added into .grad
    reported: list[int] = field(default_factory=list)  # indices reported in this backward
    staged: list[int] = field(default_factory=list)  # "cpu" mode: in grad_stage, not yet added
    job: Future | None = None  # last worker job touching this bucket's host buffers
    h2d_done: Any = None  # CUDA event after the last weight copy-back
    d2h_done: Any = None  # CUDA event after the last grad copy (or device update's copy-back)
    grads_ready: Any = None  # CUDA event: compute stream done with this step's gradients

    index: int = 0  # position in the optimizer's bucket list (for the timeline)

    def view(self, flat: Tensor, i: int) -> Tensor:
        p = self.params[i]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)


class CPUOffloadAdam:
    """Adam (or AdamW with ``adamw=True``) with fp32 master weights and moments on the CPU.

    See the module docstring for the full contract. Typical loop::

        model = build_model()                       # fp32, on the CPU
        opt = CPUOffloadAdam(model.parameters(), lr=1e-4, device="cuda")
        model.to("cuda")                            # buffers; params already moved
        for step in range(steps):
            for i, mb in enumerate(micro_batches):
                opt.backward(loss_fn(model, mb) / len(micro_batches),
                             final=i == len(micro_batches) - 1)
            opt.step()

    Args:
        params: parameters or param-group dicts (``lr``, ``betas``, ``eps``, ``weight_decay``).
        device: where the working weights live (default: the first parameter's device).
        working_dtype: dtype of the working weights (bf16 default; fp16 needs ``scale``).
        grad_accumulation: ``"cpu"`` or ``"gpu"`` (see module docstring; on a CPU device
            ``"gpu"`` sums in the host gradient buffer itself).
        grad_accumulation_dtype: dtype of the ``"gpu"`` accumulator, ``torch.float32`` or
            ``torch.bfloat16`` (half the device bytes; see the module docstring).
        bucket_numel: target parameters per bucket (a larger tensor gets its own bucket).
        moments: ``"fp32"`` or ``"int8"`` (block-wise 8-bit; see the module docstring).
        update_on: ``"host"`` or, with int8 moments, ``"device"`` (see the module docstring).
        num_threads: if given, ``torch.set_num_threads(num_threads)`` (process-wide) for the
            CPU update.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adamw: bool = False,
        device: str | torch.device | None = None,
        working_dtype: torch.dtype = torch.bfloat16,
        grad_accumulation: str = "gpu",
        grad_accumulation_dtype: torch.dtype = torch.float32,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        num_threads: int | None = None,
        moments: str = "fp32",
        update_on: str = "host",
    ) -> None:
        if grad_accumulation not in GRAD_ACCUMULATION_MODES:
            raise ValueError(
                f"grad_accumulation must be one of {GRAD_ACCUMULATION_MODES}, got {grad_accumulation!r}"
            )
        if grad_accumulation_dtype not in GRAD_ACCUMULATION_DTYPES:
            raise ValueError(
                f"grad_accumulation_dtype must be fp32 or bf16, got {grad_accumulation_dtype}"
            )
        if grad_accumulation_dtype != torch.float32 and grad_accumulation != "gpu":
            raise ValueError('grad_accumulation_dtype=bf16 needs grad_accumulation="gpu"')
        if working_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"working_dtype must be bf16, fp16 or fp32, got {working_dtype}")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
        if moments not in MOMENT_FORMATS:
            raise ValueError(f"moments must be one of {MOMENT_FORMATS}, got {moments!r}")
        if update_on not in UPDATE_LOCATIONS:
            raise ValueError(f"update_on must be one of {UPDATE_LOCATIONS}, got {update_on!r}")
        if update_on == "device" and moments != "int8":
            raise ValueError('update_on="device" needs moments="int8"')
        self.moments = moments
        self.update_on = update_on
        self.adamw = adamw
        self.working_dtype = working_dtype
        self.grad_accumulation = grad_accumulation
        self.grad_accumulation_dtype = grad_accumulation_dtype
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.param_groups = _make_groups(params, defaults)
        first = self.param_groups[0]["params"][0]
        self.device = _check_device(device if device is not None else first.device)
        self._cuda = self.device.type == "cuda"
        self._on_device = update_on == "device"
        self._grads_stay_on_device = self._on_device and self._cuda and grad_accumulation == "gpu"
        if self._on_device:
            self._maps = CodeMaps.on(self.device)
            self._in_flight: deque[Any] = deque()  # download events of device updates
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self._d2h_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._h2d_stream = torch.cuda.Stream(self.device) if self._cuda else None
        # One worker: bucket jobs run in submission order, each parallel inside torch's kernels.
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="offload-adam",
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
        self._buckets: list[_Bucket] = []
        self._where: dict[Tensor, tuple[_Bucket, int]] = {}
        for group in self.param_groups:
            self._buckets.extend(self._build_buckets(group, bucket_numel))
        for k, b in enumerate(self._buckets):
            b.index = k
        self.timeline = Timeline(self._cuda)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._where]
        self._final = False
        self._scale: float | None = None
        self.found_inf = False

    # ----------------------------------------------------------------------------- set-up
    def _build_buckets(self, group: dict[str, Any], bucket_numel: int) -> list[_Bucket]:
        # Reverse order: gradients of the last layers arrive first in backward.
        params = list(reversed(group["params"]))
        chunks: list[list[Tensor]] = [[]]
        size = 0
        for p in params:
            if chunks[-1] and size + p.numel() > bucket_numel:
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += p.numel()
        return [self._make_bucket(group, chunk) for chunk in chunks if chunk]

    def _make_bucket(self, group: dict[str, Any], params: list[Tensor]) -> _Bucket:
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += -(-p.numel() // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        pin = self._cuda

        def host(dtype: torch.dtype) -> Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        master = host(torch.float32)
        for p, off in zip(params, offsets, strict=True):
            master[off : off + p.numel()].copy_(p.detach().reshape(-1))
        int8 = self.moments == "int8"
        moments_numel = 0 if int8 else n
        numels = [p.numel() for p in params]
        b = _Bucket(
            group=group,
            params=params,
            offsets=offsets,
            numel=n,
            master=master,
            exp_avg=torch.zeros(moments_numel, pin_memory=pin),
            exp_avg_sq=torch.zeros(moments_numel, pin_memory=pin),
            quantized=QuantizedMomentBuffers(numels, offsets, n, pin_memory=pin) if int8 else None,
            grad=torch.empty(0) if self._grads_stay_on_device else host(self._host_grad_dtype),
            work=torch.empty(n, dtype=self.working_dtype, device=self.device),
            steps=[torch.zeros((), dtype=torch.float32) for _ in params],
            has_grad=[False] * len(params),
            on_host=[False] * len(params),
        )
        if self._cuda:
            if not self._on_device:
                b.weight_stage = master.to(self.working_dtype).pin_memory()
            b.work.copy_(master)
            if self.grad_accumulation == "cpu":
                b.grad_stage = host(self.working_dtype)
            else:
                b.gpu_acc = torch.zeros(n, dtype=self.grad_accumulation_dtype, device=self.device)
        else:
            b.work.copy_(master)
        for i, p in enumerate(params):
            p.data = b.view(b.work, i)
            p.grad = None
            self._where[p] = (b, i)
        return b

    @property
    def _host_grad_dtype(self) -> torch.dtype:
        """The host gradient buffer's dtype: fp32 sums in "cpu" mode, else a copy (or, on a CPU
        device, the buffer itself) of the accumulator."""
        return torch.float32 if self.grad_accumulation == "cpu" else self.grad_accumulation_dtype

    # ----------------------------------------------------------------------------- backward
    def backward(self, loss: Tensor, *, final: bool = False, scale: float | None = None) -> None:
        """``loss.backward()`` for one micro-batch, accumulating its gradients.

        ``final=True`` marks the last micro-batch before :meth:`step`: buckets are then updated
        as soon as their gradients are complete, overlapping the rest of backward (not when a
        ``scale`` is given; see the module docstring). ``scale`` multiplies the loss (fp16
        loss scaling) and must be the same for every micro-batch of a step.
        """
        if scale is not None:
            scale = _check_scale(scale)
            if self._scale is not None and self._scale != scale:
                raise ValueError("scale changed between micro-batches of one optimizer step")
            self._scale = scale
            loss = loss * self._scale
        self._final = final
        try:
            loss.backward()
        finally:
            self._final = False
        self._flush_reported(update=final and self._scale is None)

    def _on_grad(self, p: Tensor) -> None:
        b, i = self._where[p]
        grad = p.grad
        p.grad = None
        if grad.is_sparse:
            raise RuntimeError("CPUOffloadAdam does not support sparse gradients")
        if not b.reported:
            self._wait_host(b)  # the previous job may still read this bucket's staging buffer
        b.reported.append(i)
        if not self._cuda:
            dst = b.view(b.grad, i)
            dst.add_(grad) if b.has_grad[i] else dst.copy_(grad)
            b.on_host[i] = True
        elif self.grad_accumulation == "gpu":
            dst = b.view(b.gpu_acc, i)
            dst.add_(grad) if b.has_grad[i] else dst.copy_(grad)
        else:
            self._d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
            start = self.timeline.mark(self._d2h_stream)
            with torch.cuda.stream(self._d2h_stream):
                b.view(b.grad_stage, i).copy_(grad, non_blocking=True)
            self.timeline.add("d2h", b.index, start, self.timeline.mark(self._d2h_stream))
            grad.record_stream(self._d2h_stream)  # keep the memory until the copy is done
            b.staged.append(i)
        b.has_grad[i] = True
        if len(b.reported) == len(b.params):
            self._bucket_ready(b, update=self._final and self._scale is None)

    def _flush_reported(self, update: bool) -> None:
        """End of a backward: hand on buckets that only some parameters reported to."""
        for b in self._buckets:
            if b.reported:
                self._bucket_ready(b, update=update)

    def _bucket_ready(self, b: _Bucket, update: bool) -> None:
        """All gradients of ``b`` for this backward are in: move them to the host (and update)."""
        b.reported = []
        if update:
            self._start_update(b)
            return
        if self._cuda and b.staged:
            self._start_d2h(b)
        if b.staged:
            b.job = self._submit(self._add_staged, b)

    def _start_update(self, b: _Bucket) -> None:
        """Enqueue ``b``'s update: its gradients towards where it runs, then the worker job."""
        if self._cuda and not self._grads_stay_on_device:
            self._start_d2h(b)
        if not self._on_device:
            b.job = self._submit(self._update, b)
            return
        if self._cuda:
            b.grads_ready = torch.cuda.Event()
            b.grads_ready.record(torch.cuda.current_stream(self.device))
        b.job = self._submit(self._update_on_device, b)

    def _start_d2h(self, b: _Bucket) -> None:
        """Enqueue the copy of ``b``'s pending gradients to the host on the D2H stream."""
        compute = torch.cuda.current_stream(self.device)
        self._d2h_stream.wait_stream(compute)
        if self.grad_accumulation == "gpu" and not self._grads_stay_on_device:
            pending = [i for i in range(len(b.params)) if b.has_grad[i] and not b.on_host[i]]
            if pending:
                start = self.timeline.mark(self._d2h_stream)
                with torch.cuda.stream(self._d2h_stream):
                    b.grad.copy_(b.gpu_acc, non_blocking=True)
                self.timeline.add("d2h", b.index, start, self.timeline.mark(self._d2h_stream))
                for i in pending:
                    b.on_host[i] = True
        ev = torch.cuda.Event()
        ev.record(self._d2h_stream)
        b.d2h_done = ev

    # ----------------------------------------------------------------------------- worker jobs
    def _add_staged(self, b: _Bucket) -> None:
        """Worker: add the working-dtype grads staged by D2H into the fp32 host buffer."""
        b.d2h_done.synchronize()
        start = time.perf_counter()
        for i in b.staged:
            dst, src = b.view(b.grad, i), b.view(b.grad_stage, i)
            dst.add_(src) if b.on_host[i] else dst.copy_(src)
            b.on_host[i] = True
        b.staged = []
        self.timeline.add("cpu_accumulate", b.index, start, time.perf_counter())

    def _update(self, b: _Bucket) -> None:
        """Worker: Adam on the bucket's params that have gradients, then copy weights back."""
        if self._cuda and b.staged:
            self._add_staged(b)
        elif self._cuda and b.d2h_done is not None:
            b.d2h_done.synchronize()
        idx = [i for i in range(len(b.params)) if b.has_grad[i]]
        if not idx:
            return
        start = time.perf_counter()
        hyper = _hyper(b.group)
        if b.quantized is not None:
            for i in idx:
                b.steps[i].add_(1.0)
                b.quantized.moments[i].step(
                    b.view(b.master, i).view(-1),
                    b.view(b.grad, i).view(-1),
                    b.steps[i],
                    adamw=self.adamw,
                    **hyper,
                )
        else:
            fused_adam_(  # counts the step too
                [b.view(b.master, i) for i in idx],
                [b.view(b.grad, i).float() for i in idx],  # a bf16 accumulator: fp32 copies
                [b.view(b.exp_avg, i) for i in idx],
                [b.view(b.exp_avg_sq, i) for i in idx],
                [b.steps[i] for i in idx],
                adamw=self.adamw,
                **hyper,
            )
        for i in idx:
            b.has_grad[i] = b.on_host[i] = False
        self._copy_back(b, idx)
        self.timeline.add("cpu_update", b.index, start, time.perf_counter())

    def _update_on_device(self, b: _Bucket) -> None:
        """Worker: the int8 Adam step of the bucket's params that have gradients, on the device.

        Masters and moments go up on the H2D stream, the step and the cast into the working
        weights run there after the compute stream's work on this bucket, and masters and
        moments come back on the D2H stream. Only enqueues work, except for waiting until at
        most :data:`DEVICE_BUCKETS_IN_FLIGHT` buckets hold device scratch.
        """
        if b.staged:
            self._add_staged(b)
        idx = [i for i in range(len(b.params)) if b.has_grad[i]]
        if not idx:
            return
        hyper = _hyper(b.group)
        steps = [b.steps[i] for i in idx]
        for s in steps:
            s.add_(1.0)
        while len(self._in_flight) >= DEVICE_BUCKETS_IN_FLIGHT:
            self._in_flight.popleft().synchronize()
        with self._stream(self._h2d_stream):
            start = self.timeline.mark(self._h2d_stream)
            master = b.master.to(self.device, non_blocking=True)
            moments = b.quantized.to(self.device, self._maps)
            grad = b.gpu_acc if self._grads_stay_on_device and not b.on_host[idx[0]] else b.grad
            grad = grad.to(self.device, non_blocking=True)
            device_steps = torch.stack(steps).to(self.device, non_blocking=True)
            uploaded = self.timeline.mark(self._h2d_stream)
            if self._cuda:
                self._h2d_stream.wait_event(b.grads_ready)
            for k, i in enumerate(idx):
                moments.moments[i].step(
                    b.view(master, i).view(-1),
                    b.view(grad, i).view(-1),
                    device_steps[k],
                    adamw=self.adamw,
                    chunk_blocks=DEVICE_CHUNK_BLOCKS,
                    **hyper,
                )
            b.work.copy_(master)
            self.timeline.add("h2d", b.index, start, uploaded)
            self.timeline.add("device_update", b.index, uploaded, self.timeline.mark())
        for i in idx:
            b.has_grad[i] = b.on_host[i] = False
        if not self._cuda:
            return  # the step ran in the host buffers themselves
        b.h2d_done = torch.cuda.Event()
        b.h2d_done.record(self._h2d_stream)
        self._d2h_stream.wait_event(b.h2d_done)
        with self._stream(self._d2h_stream):
            start = self.timeline.mark(self._d2h_stream)
            b.master.copy_(master, non_blocking=True)
            b.quantized.copy_(moments)
            self.timeline.add("d2h", b.index, start, self.timeline.mark(self._d2h_stream))
        scratch = [master, *moments.buffers.values()] + ([] if grad is b.gpu_acc else [grad])
        for t in scratch:
            t.record_stream(self._d2h_stream)  # keep the scratch until the copies are done
        b.d2h_done = torch.cuda.Event()
        b.d2h_done.record(self._d2h_stream)
        self._in_flight.append(b.d2h_done)

    def _stream(self, stream: Any) -> Any:
        """``torch.cuda.stream(stream)`` on CUDA; on the CPU work runs in order anyway."""
        return torch.cuda.stream(stream) if self._cuda else nullcontext()

    def _copy_back(self, b: _Bucket, idx: list[int]) -> None:
        """Cast updated masters to the working dtype and put them on the device."""
        if not self._cuda:
            for i in idx:
                b.view(b.work, i).copy_(b.view(b.master, i))
            return
        if b.weight_stage is None:  # device updates: the masters go up and are cast there
            with self._stream(self._h2d_stream):
                b.work.copy_(b.master.to(self.device, non_blocking=True))
            b.h2d_done = torch.cuda.Event()
            b.h2d_done.record(self._h2d_stream)
            return
        if b.h2d_done is not None:
            b.h2d_done.synchronize()  # the previous copy-back still reads weight_stage
        if len(idx) == len(b.params):
            b.weight_stage.copy_(b.master)
        else:
            for i in idx:
                b.view(b.weight_stage, i).copy_(b.view(b.master, i))
        # Ordered after the compute stream's last use of these weights (D2H waited for it).
        if b.d2h_done is not None:
            self._h2d_stream.wait_event(b.d2h_done)
        start = self.timeline.mark(self._h2d_stream)
        with torch.cuda.stream(self._h2d_stream):
            b.work.copy_(b.weight_stage, non_blocking=True)
        self.timeline.add("h2d", b.index, start, self.timeline.mark(self._h2d_stream))
        ev = torch.cuda.Event()
        ev.record(self._h2d_stream)
        b.h2d_done = ev

    def _submit(self, fn, b: _Bucket) -> Future:
        if not self._cuda:
            return self._pool.submit(fn, b)

        def on_device() -> None:
            with torch.cuda.device(self.device):
                fn(b)

        return self._pool.submit(on_device)

    def _wait_host(self, b: _Bucket) -> None:
        if b.job is not None:
            b.job.result()
            b.job = None

    # ----------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, scale: float | Tensor | None = None) -> bool:
        """Finish the optimizer step; returns False if it was skipped for inf/NaN gradients.

        ``scale``: the loss scale the gradients carry (overrides one given to :meth:`backward`).
        Blocks until every bucket is updated on the CPU; the working weights' copy-back is
        ordered before any later work on the current CUDA stream.
        """
        if scale is not None:
            self._scale = _check_scale(scale)
        self._flush_reported(update=False)
        self.found_inf = False
        if self._scale is not None:
            self.found_inf = self._unscale_and_check(self._scale)
        for b in self._buckets:
            self._wait_host(b)  # an update started in backward clears has_grad when done
            if self.found_inf:
                b.has_grad = [False] * len(b.params)
                b.on_host = [False] * len(b.params)
            elif any(b.has_grad):
                self._start_update(b)
        for b in self._buckets:
            self._wait_host(b)
        if self._on_device and self._cuda:
            for b in self._buckets:
                if b.d2h_done is not None:
                    b.d2h_done.synchronize()  # host masters and moments are this step's
            self._in_flight.clear()
        if self._cuda:
            # Later kernels must see the new weights, and must not overwrite gpu_acc mid-copy.
            compute = torch.cuda.current_stream(self.device)
            for b in self._buckets:
                for ev in (b.d2h_done, b.h2d_done):
                    if ev is not None:
                        compute.wait_event(ev)
        self._scale = None
        return not self.found_inf

    def _unscale_and_check(self, scale: float) -> bool:
        """Bring every gradient to the host, divide by ``scale``; True if any is inf/NaN."""
        for b in self._buckets:
            self._wait_host(b)
            if self._cuda and any(b.has_grad):
                self._start_d2h(b)
                if b.staged:
                    b.job = self._submit(self._add_staged, b)
        for b in self._buckets:
            self._wait_host(b)
            if b.d2h_done is not None:
                b.d2h_done.synchronize()
        grads = [
            b.view(b.gpu_acc if self._grads_stay_on_device else b.grad, i)
            for b in self._buckets
            for i, h in enumerate(b.has_grad)
            if h
        ]
        found_inf = unscale_and_check_(grads, 1.0 / scale)
        return found_inf is not None and bool(found_inf)  # the step's one host sync

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients accumulated since the last step (``set_to_none`` is accepted for
        compatibility; accumulated gradients are always discarded, not zero-filled)."""
        del set_to_none
        for b in self._buckets:
            self._wait_host(b)
            b.reported, b.staged = [], []
            b.has_grad = [False] * len(b.params)
            b.on_host = [False] * len(b.params)
            for p in b.params:
                p.grad = None
        self._scale = None

    # ----------------------------------------------------------------------------- state
    def _ordered_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torch.optim layout: ``{"state": {idx: {step, exp_avg, exp_avg_sq, master}},
        "param_groups": [...]}``; tensors are fresh CPU copies with the parameters' shapes.
        With int8 moments the four quantized tensors replace ``exp_avg``/``exp_avg_sq``."""
        for b in self._buckets:
            self._wait_host(b)
        state: dict[int, dict[str, Tensor]] = {}
        for idx, p in enumerate(self._ordered_params()):
            b, i = self._where[p]
            if float(b.steps[i]) == 0:
                continue  # never stepped: torch.optim has no state for it either
            if b.quantized is not None:
                moments = {k: t.clone() for k, t in b.quantized.moments[i].state_dict().items()}
            else:
                moments = {
                    "exp_avg": b.view(b.exp_avg, i).clone(),
                    "exp_avg_sq": b.view(b.exp_avg_sq, i).clone(),
                }
            state[idx] = {
                "step": b.steps[i].clone(),
                **moments,
                "master": b.view(b.master, i).clone(),
            }
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            entry = {k: v for k, v in g.items() if k != "params"}
            entry.update(
                amsgrad=False,
                maximize=False,
                decoupled_weight_decay=self.adamw,
                params=list(range(start, start + n)),
            )
            groups.append(entry)
            start += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyper-parameters, moments, step counts and masters; re-cast working weights.

        A state without ``master`` entries (e.g. from ``torch.optim.Adam``) keeps the current
        masters for those parameters. The state is checked as the constructor checks its
        arguments (hyper-parameters, tensor shapes, step counts) before anything is changed: a
        bad one raises ValueError naming the entry and leaves the optimizer as it was.
        """
        groups = self._check_state_kind(state_dict)
        if len(groups) != len(self.param_groups) or any(
            len(a["params"]) != len(g["params"])
            for a, g in zip(groups, self.param_groups, strict=True)
        ):
            raise ValueError("state_dict has a different number of param groups or parameters")
        hyper = []
        for j, saved in enumerate(groups):
            h = {k: tuple(saved[k]) if k == "betas" else saved[k] for k in _GROUP_DEFAULT_KEYS}
            try:
                _validate(h)
            except (TypeError, ValueError) as e:
                raise ValueError(f"state_dict param_groups[{j}]: {e}") from None
            hyper.append(h)
        params = self._ordered_params()
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        for idx, p in enumerate(params):
            _check_param_state(saved_state.get(idx), idx, p)
        self.zero_grad()
        for h, g in zip(hyper, self.param_groups, strict=True):
            g.update(h)
        for idx, p in enumerate(params):
            b, i = self._where[p]
            s = saved_state.get(idx)
            if s is None:
                b.steps[i].zero_()
                if b.quantized is not None:
                    b.quantized.moments[i].zero_()
                else:
                    b.view(b.exp_avg, i).zero_()
                    b.view(b.exp_avg_sq, i).zero_()
                continue
            _load_moments(b, i, s)
            b.steps[i].fill_(float(s["step"]))
            if "master" in s:
                b.view(b.master, i).copy_(s["master"])
        if self._cuda:  # queued kernels may still read the old weights
            self._h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
        for b in self._buckets:
            self._copy_back(b, list(range(len(b.params))))
            if self._cuda and b.h2d_done is not None:
                torch.cuda.current_stream(self.device).wait_event(b.h2d_done)

    def _check_state_kind(self, state_dict: Any) -> list[dict[str, Any]]:
        """``state_dict``'s param groups, once it is known to be an Adam state of this
        optimizer's kind: a dict of ``state`` and ``param_groups`` whose groups hold Adam's
        hyper-parameters, with decoupled weight decay as this optimizer has it (AdamW's state
        into an Adam, or the reverse, is a ValueError) and no amsgrad or maximize."""
        name = type(self).__name__
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"state_dict must be a dict of 'state' and 'param_groups', got {got}")
        groups = state_dict["param_groups"]
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ValueError("state_dict['param_groups'] must be a list of dicts")
        for j, g in enumerate(groups):
            missing = [k for k in (*_GROUP_DEFAULT_KEYS, "params") if k not in g]
            if missing:
                raise ValueError(
                    f"state_dict param_groups[{j}] lacks {missing}: not the state of an Adam "
                    f"optimizer (keys {sorted(g)}), cannot load it into {name}"
                )
            decoupled = g.get("decoupled_weight_decay", self.adamw)
            if bool(decoupled) != self.adamw:
                saved = "AdamW" if decoupled else "Adam"
                raise ValueError(
                    f"state_dict param_groups[{j}] is {saved}'s (decoupled_weight_decay="
                    f"{decoupled}); {name} is {'AdamW' if self.adamw else 'Adam'}"
                )
            for flag in ("amsgrad", "maximize"):
                if g.get(flag):
                    raise ValueError(f"state_dict param_groups[{j}] has {flag}=True: unsupported")
        if not isinstance(state_dict["state"], dict):
            raise ValueError("state_dict['state'] must be a dict of parameter index to state")
        return groups

    def moment_nbytes(self) -> int:
        """Host bytes held by the Adam moments (both; alignment padding included)."""
        total = 0
        for b in self._buckets:
            total += b.exp_avg.nbytes + b.exp_avg_sq.nbytes
            total += b.quantized.nbytes if b.quantized is not None else 0
        return total

    def master_params(self) -> list[Tensor]:
        """Views of the fp32 masters, in ``param_groups`` order (read-only use, please)."""
        out = []
        for p in self._ordered_params():
            b, i = self._where[p]
            out.append(b.view(b.master, i))
        return out

    def close(self) -> None:
        """Remove the gradient hooks and stop the worker thread."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._pool.shutdown(wait=True)


class CPUOffloadAdamW(CPUOffloadAdam):
    """:class:`CPUOffloadAdam` with decoupled weight decay (``torch.optim.AdamW``), wd 1e-2."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, adamw=True, **kwargs)


def _make_groups(
    params: Iterable[Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any]
) -> list[dict[str, Any]]:
    """Param groups as torch.optim builds them, validated the way torch validates them."""
    items = list(params)
    if not items:
        raise ValueError("CPUOffloadAdam got an empty parameter list")
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    out, seen = [], set()
    for g in groups:
        ps = [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])
        unknown = set(g) - {"params", *_GROUP_DEFAULT_KEYS}
        if unknown:
            raise ValueError(f"unsupported param-group options {sorted(unknown)}")
        group = {**defaults, **{k: v for k, v in g.items() if k != "params"}, "params": ps}
        _validate(group)
        for p in ps:
            if not p.is_leaf or not p.requires_grad:
                raise ValueError("CPUOffloadAdam needs leaf tensors that require grad")
            if not p.is_floating_point():
                raise ValueError(f"parameter of dtype {p.dtype} is not floating point")
            if p in seen:
                raise ValueError("a parameter appears in more than one param group")
            seen.add(p)
        out.append(group)
    return out


def _load_moments(b: _Bucket, i: int, s: dict[str, Any]) -> None:
    """Set parameter ``i``'s moments from a checked state entry, in either stored form."""
    if b.quantized is not None:
        if "exp_avg_codes" in s:
            b.quantized.moments[i].load_state_dict(s)
        else:
            b.quantized.moments[i].set(s["exp_avg"], s["exp_avg_sq"])
        return
    exp_avg, exp_avg_sq = b.view(b.exp_avg, i), b.view(b.exp_avg_sq, i)
    if "exp_avg_codes" in s:
        exp_avg.copy_(dequantize(s["exp_avg_codes"], s["exp_avg_absmax"], exp_avg.shape))
        exp_avg_sq.copy_(
            dequantize(s["exp_avg_sq_codes"], s["exp_avg_sq_absmax"], exp_avg.shape, signed=False)
        )
    else:
        exp_avg.copy_(s["exp_avg"])
        exp_avg_sq.copy_(s["exp_avg_sq"])


def _hyper(group: dict[str, Any]) -> dict[str, float]:
    """A param group's hyper-parameters as the fused Adam kernels take them."""
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "weight_decay": float(group["weight_decay"]),
        "eps": float(group["eps"]),
    }


def _check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device the optimizer can work on: the CPU, or a CUDA device that
    exists here (its copy streams need one); a ValueError naming ``device`` otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: cannot parse {device!r} ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"device must be the CPU or a CUDA device (the working weights' copies run on CUDA "
            f"streams), got {dev}"
        )
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {dev}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {dev}: this machine has {count} CUDA device(s)")
    return dev


def _check_scale(scale: float | Tensor) -> float:
    """The loss scale as a float; a ValueError naming ``scale`` unless it is finite and > 0
    (the gradients are divided by it)."""
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"scale must be one number, got a tensor of shape {tuple(scale.shape)}"
            )
        scale = scale.item()
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a number, got {scale!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be finite and > 0, got {value}")
    return value


def _check_param_state(s: dict[str, Any] | None, idx: int, p: Tensor) -> None:
    """ValueError unless ``s`` (one entry of a saved ``state``, or None) fits parameter ``p``."""
    if s is None:
        return
    if not isinstance(s, dict):
        raise ValueError(f"state_dict['state'][{idx}] must be a dict, got {type(s).__name__}")
    if "step" not in s:
        raise ValueError(
            f"state_dict['state'][{idx}] lacks 'step': not an Adam state (keys {sorted(s)})"
        )
    if "exp_avg_codes" in s:
        n = p.numel()
        code_shape, absmax_shape = torch.Size([n]), torch.Size([num_blocks(n)])
        expected = {
            "exp_avg_codes": (code_shape, torch.uint8),
            "exp_avg_absmax": (absmax_shape, torch.float32),
            "exp_avg_sq_codes": (code_shape, torch.uint8),
            "exp_avg_sq_absmax": (absmax_shape, torch.float32),
        }
    else:
        expected = {"exp_avg": (p.shape, None), "exp_avg_sq": (p.shape, None)}
    expected["master"] = (p.shape, None)
    for key, (shape, dtype) in expected.items():
        if key not in s:
            if key == "master":
                continue
            raise ValueError(f"state_dict['state'][{idx}] lacks {key!r}")
        t = s[key]
        where = f"state_dict['state'][{idx}][{key!r}]"
        if not isinstance(t, Tensor) or t.shape != shape:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            want = (
                f"parameter has {tuple(p.shape)}"
                if shape == p.shape
                else f"expected {tuple(shape)}"
            )
            raise ValueError(f"{where} has shape {got}, {want}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{where} has dtype {t.dtype}, expected {dtype}")
    step = float(s["step"])
    if not (math.isfinite(step) and step >= 1 and step == int(step)):
        raise ValueError(
            f"state_dict['state'][{idx}]['step'] must be a whole number >= 1, got {step}"
        )


def _validate(g: dict[str, Any]) -> None:
    lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
    if not (isinstance(lr, (int, float)) and lr >= 0 and math.isfinite(lr)):
        raise ValueError(f"invalid learning rate: {lr}")
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"invalid betas: {(b1, b2)}")
    if not eps >= 0.0:
        raise ValueError(f"invalid eps: {eps}")
    if not wd >= 0.0:
        raise ValueError(f"invalid weight_decay: {wd}")


# ----------------------------------------------------------------------------- accounting
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class StateBuffer:
    """One buffer of the training state: what it holds, where (``"gpu"`` or ``"host"``), its
    dtype's name and its bytes."""

    state: str
    where: str
    dtype: str
    bytes: int


@dataclass(frozen=True)
class OffloadPlan:
    """The buffers :class:`CPUOffloadAdam` allocates on a CUDA run, without allocating them
    (:func:`plan_offload`); zero-byte buffers are left out."""

    buffers: tuple[StateBuffer, ...]

    def bytes_on(self, where: str) -> int:
        """Bytes of the buffers that live ``where`` (``"gpu"`` or ``"host"``)."""
        return sum(b.bytes for b in self.buffers if b.where == where)

    def optimizer_gpu_bytes(self) -> dict[str, int]:
        """The optimizer's own GPU buffers by name (the gradient accumulator, the device
        update's scratch): what the device holds beyond the working weights."""
        return {
            b.state: b.bytes
            for b in self.buffers
            if b.where == "gpu" and b.state != "working_weights"
        }

    def records(self) -> list[dict[str, Any]]:
        """One dict per buffer (``state``, ``where``, ``dtype``, ``bytes``), as run logs keep it."""
        return [asdict(b) for b in self.buffers]


def largest_buckets(
    param_numels: Sequence[int], bucket_numel: int = DEFAULT_BUCKET_NUMEL
) -> list[int]:
    """Upper bounds of the :data:`DEVICE_BUCKETS_IN_FLIGHT` largest buckets over parameters of
    ``param_numels`` values: a tensor larger than ``bucket_numel`` gets a bucket of its own, the
    others share buckets of at most ``bucket_numel``."""
    biggest = sorted(param_numels, reverse=True)[:DEVICE_BUCKETS_IN_FLIGHT]
    return [max(bucket_numel, n) for n in biggest]


def device_update_scratch_bytes(
    buckets: Sequence[int],
    grad_accumulation: str = "gpu",
    grad_accumulation_dtype: torch.dtype = torch.float32,
) -> int:
    """Device bytes ``update_on="device"`` adds at most: the scratch of the buckets in flight
    (``buckets`` values each: fp32 masters, int8 moments with their absmaxes, fp32 gradients
    when they come from the host) and the temporaries of one chunk of the 8-bit step (with a
    bf16 accumulator, its chunk read as fp32 too)."""
    per_value = 4 + 2 + (4 if grad_accumulation == "cpu" else 0)
    scratch = sum(n * per_value + 2 * num_blocks(n) * 4 for n in buckets)
    step_per_value = DEVICE_STEP_BYTES_PER_VALUE
    if grad_accumulation_dtype == torch.bfloat16:
        step_per_value += DEVICE_STEP_BF16_GRAD_BYTES_PER_VALUE
    return scratch + step_per_value * DEVICE_CHUNK_BLOCKS * BLOCK_SIZE


def plan_offload(
    param_numels: Sequence[int],
    *,
    working_dtype: torch.dtype = torch.bfloat16,
    grad_accumulation: str = "gpu",
    grad_accumulation_dtype: torch.dtype = torch.float32,
    moments: str = "fp32",
    update_on: str = "host",
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> OffloadPlan:
    """What :class:`CPUOffloadAdam` with these arguments allocates on a CUDA run for parameters
    of ``param_numels`` values, where and in which dtype (alignment padding left out), so a
    caller can budget memory before building the model on the device."""
    n = sum(param_numels)
    work = _DTYPE_NAMES[working_dtype], working_dtype.itemsize * n
    if moments == "int8":
        moment = "uint8 + fp32 absmax", quantized_nbytes(n)
    else:
        moment = "fp32", 4 * n
    gpu_accumulates = grad_accumulation == "gpu"
    on_device = update_on == "device"
    # the host gradient buffer sums in fp32 ("cpu") or receives the GPU accumulator as it is
    acc_dtype = grad_accumulation_dtype if gpu_accumulates else torch.float32
    acc = _DTYPE_NAMES[acc_dtype], acc_dtype.itemsize * n
    scratch = 0
    if on_device:
        buckets = largest_buckets(param_numels, bucket_numel)
        scratch = device_update_scratch_bytes(buckets, grad_accumulation, grad_accumulation_dtype)
    rows = [
        ("working_weights", "gpu", *work),
        ("master_weights", "host", "fp32", 4 * n),
        ("exp_avg", "host", *moment),
        ("exp_avg_sq", "host", *moment),
        ("grad_accumulation", "gpu", acc[0], acc[1] if gpu_accumulates else 0),
        ("grad", "host", acc[0], 0 if on_device and gpu_accumulates else acc[1]),
        ("grad_stage", "host", work[0], 0 if gpu_accumulates else work[1]),
        ("weight_stage", "host", work[0], 0 if on_device else work[1]),
        ("device_update_scratch", "gpu", "fp32 + uint8", scratch),
    ]
    return OffloadPlan(tuple(StateBuffer(*row) for row in rows if row[3]))
