"""Training a ViT pipeline: the model, optimizer and per-batch work on a device, and one timed
pass (epoch or validation) over a loader."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from effdl.cli import Interrupted
from effdl.models.vit import PRESETS as MODEL_PRESETS
from effdl.models.vit import ViT
from effdl.profiling.timing import RegionTimer, peak_memory
from effdl.vit_pipeline.config import PipelineConfig
from effdl.vit_pipeline.data import decoded_batches, input_transform


@dataclass
class Trainer:
    """The model, optimizer and per-batch work of one pipeline on one device."""

    cfg: PipelineConfig
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    prepare_train: Callable[[torch.Tensor], torch.Tensor]
    prepare_eval: Callable[[torch.Tensor], torch.Tensor]
    n_params: int

    def to_device(
        self, batch: tuple[torch.Tensor, torch.Tensor], train: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on the device, images as the model takes them (augmented when ``train``
        and AugMix runs on the device)."""
        images, labels = batch
        non_blocking = self.cfg.non_blocking
        prepare = self.prepare_train if train else self.prepare_eval
        x = prepare(images.to(self.device, non_blocking=non_blocking))
        return x, labels.to(self.device, non_blocking=non_blocking)

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast when the pipeline asks for it, else a context that does nothing."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.precision == "bf16")  # fmt: skip

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on (x, y); returns (loss, logits), detached."""
        self.optimizer.zero_grad(set_to_none=self.cfg.set_to_none)
        with self.autocast():
            logits = self.model(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        self.optimizer.step()
        return loss.detach(), logits.detach()

    def eval_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and logits of (x, y), detached; no optimizer step."""
        with self.autocast():
            logits = self.model(x)
            return F.cross_entropy(logits, y).detach(), logits.detach()


def build_trainer(cfg: PipelineConfig, device: torch.device, num_classes: int) -> Trainer:
    """The ViT preset at ``cfg.depth`` on ``device``, Adam, cuDNN flags set (process-wide)."""
    torch.backends.cudnn.deterministic = cfg.cudnn == "deterministic"
    torch.backends.cudnn.benchmark = cfg.cudnn == "benchmark"
    vit_cfg = replace(MODEL_PRESETS[cfg.model], depth=cfg.depth, num_classes=num_classes)
    model = ViT(vit_cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=cfg.fused_adam or None)
    compiled = torch.compile(model) if cfg.compile else model
    return Trainer(cfg, device, compiled, optimizer, input_transform(cfg, device, train=True),
                   input_transform(cfg, device, train=False), n_params)  # fmt: skip


class BatchStats:
    """Per-batch mean loss and accuracy. With ``sync_every_step`` each is read to the host at
    once (``.item()``: a host-device sync per step, as given); else they stay on the device and
    are read in one transfer by :meth:`host`."""

    def __init__(self, sync_every_step: bool) -> None:
        self.sync = sync_every_step
        self.losses: list = []
        self.accuracies: list = []
        self.sizes: list[int] = []

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Record one batch's mean loss and accuracy (read to the host now when syncing)."""
        accuracy = (logits.argmax(-1) == labels).float().mean()
        if self.sync:
            self.losses.append(loss.item())
            self.accuracies.append(accuracy.item())
        else:
            self.losses.append(loss.float())
            self.accuracies.append(accuracy)
        self.sizes.append(len(labels))

    def host(self) -> tuple[list[float], list[float]]:
        """(losses, accuracies) per batch as floats on the host."""
        if self.sync or not self.losses:
            return self.losses, self.accuracies
        both = torch.stack([torch.stack(self.losses), torch.stack(self.accuracies)]).tolist()
        return both[0], both[1]


@dataclass
class PhaseResult:
    """One pass (train or validation): per-batch means and sizes, host wait for each batch
    (``wait_s``, the first one includes worker start-up), device time of each step
    (``step_s``), wall time and peak GPU memory (None on the CPU: not measured)."""

    losses: list[float]
    accuracies: list[float]
    sizes: list[int]
    wait_s: list[float]
    step_s: list[float]
    wall_s: float
    peak_mem_gib: float | None

    @property
    def n_images(self) -> int:
        """Images in the pass."""
        return sum(self.sizes)

    def mean(self, values: list[float]) -> float:
        """Image-weighted mean of per-batch means: the metric over the pass."""
        return sum(v * n for v, n in zip(values, self.sizes, strict=True)) / self.n_images


def timed_batches(loader: DataLoader, waits: list[float], desc: str) -> Iterator:
    """The loader's batches (:func:`decoded_batches`); the host time each ``next()`` took is
    appended to ``waits``."""
    batches = iter(tqdm(decoded_batches(loader), desc=desc, unit="batch", leave=False,
                        total=len(loader)))  # fmt: skip
    while True:
        start = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            return
        waits.append(time.perf_counter() - start)
        yield batch


def run_phase(trainer: Trainer, loader: DataLoader, train: bool) -> PhaseResult:
    """One epoch (``train``) or one validation pass over ``loader``; every step is timed on the
    device (CUDA events, read once at the end) and every wait for a batch on the host clock.
    Ctrl-C raises :class:`effdl.cli.Interrupted` with the batches finished so far."""
    cfg = trainer.cfg
    trainer.model.train(train)
    stats, timer, waits = BatchStats(cfg.sync_every_step), RegionTimer(trainer.device), []
    if train:
        step, grad_mode = trainer.train_step, contextlib.nullcontext()
    else:
        step = trainer.eval_step
        grad_mode = torch.inference_mode() if cfg.val_no_grad else contextlib.nullcontext()
    interrupted = False
    with peak_memory(trainer.device) as mem, grad_mode:
        start = time.perf_counter()
        try:
            for batch in timed_batches(loader, waits, "train" if train else "val"):
                with timer.region():
                    x, y = trainer.to_device(batch, train)
                    loss, logits = step(x, y)
                    stats.add(loss, logits, y)
        except KeyboardInterrupt:
            interrupted = True
        losses, accuracies = stats.host()
        step_s = timer.times()  # one synchronize
        wall_s = time.perf_counter() - start
    done = len(stats.sizes)  # batches whose step finished (an interrupted one has no stats)
    result = PhaseResult(losses, accuracies, stats.sizes, waits[:done], step_s[:done], wall_s, mem.gib)  # fmt: skip
    if interrupted:
        raise Interrupted(result)
    return result
