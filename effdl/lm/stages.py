"""The stages of the LM speed-up study and the training step each stage runs.

Stage 0 is the GPT-like LM trained the way a first attempt would write it: fp32, every document
padded to the maximum length (BRAIN), and a loop with the inefficiencies a profiler reveals.
Each later stage switches on exactly one more :class:`Stage` flag, in :data:`STAGE_FLAGS`
order, so the table can say what each stage changed and the stages are cumulative.

Every stage trains on the same :class:`StepPlan`: step ``i`` gets the same documents, hence the
same real tokens, whether they are padded one per row or packed into rows (padding is never
counted), so tokens/s compares equal work and the loss curves compare equal data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from effdl.amp.precision import LOW_DTYPES, Precision, PrecisionSpec, build_precision
from effdl.data.bin_packing import best_fit_decreasing
from effdl.data.packing import collate_bins
from effdl.data.padding import pad_batch
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import LMInputs, lm_cross_entropy, lm_inputs
from effdl.ops.layer_norm import (
    FusedLayerNorm,
    InputDtypeLayerNorm,
    TritonLayerNorm,
    swap_layer_norms,
)
from effdl.profiling.timing import PeakMemory, RegionTimer, peak_memory

# (flag, what switching it on changes), in stage order: stage i has the first i flags on.
STAGE_FLAGS: tuple[tuple[str, str], ...] = (
    ("amp", "mixed precision: autocast (bf16, or fp16 + DynamicGradScaler)"),
    ("packing", "documents packed into rows (best-fit decreasing) instead of padded to the max"),
    ("loader_workers", "DataLoader with worker processes and pinned memory"),
    ("no_empty_cache", "no torch.cuda.empty_cache() after every step (the allocator keeps blocks)"),
    ("fused_adam", "Adam(fused=True) instead of a per-parameter loop (foreach=False)"),
    ("async_copy", "host-to-device copies with non_blocking=True (from pinned memory)"),
    ("masks_from_loader", "attention masks come with the batch, built in the loader workers"),
    ("loss_read_once", "losses stay on the device, read once at the end (no .item()/print)"),
    ("grads_to_none", "zero_grad(set_to_none=True) instead of filling gradients with zeros"),
    ("fused_layer_norm", "the decoder's LayerNorms swapped for effdl's FusedLayerNorm"),
    ("compile", "torch.compile of the model"),
)
# The loop mistakes come in the order their fixes can show: the ones that cost host time per step
# first, then the host syncs (a sync costs only once no other one is left in the step: the
# blocking copy and the per-step loss read each drain the GPU's queue).


@dataclass(frozen=True)
class Stage:
    """Which fixes a stage has: every flag False is stage 0 (see :data:`STAGE_FLAGS`)."""

    amp: bool = False
    packing: bool = False
    loader_workers: bool = False
    no_empty_cache: bool = False
    fused_adam: bool = False
    async_copy: bool = False
    masks_from_loader: bool = False
    loss_read_once: bool = False
    grads_to_none: bool = False
    fused_layer_norm: bool = False
    compile: bool = False

    @property
    def fixes(self) -> list[str]:
        return [name for name, _ in STAGE_FLAGS if getattr(self, name)]


def stages() -> list[Stage]:
    """Stage 0 and one stage per flag, each with all the flags of the stages before it."""
    names = [name for name, _ in STAGE_FLAGS]
    return [Stage(**{n: True for n in names[:i]}) for i in range(len(names) + 1)]


def stage_name(index: int) -> str:
    """``stage0_baseline``, ``stage1_amp``, ...: the records' variant."""
    return f"stage{index}_" + ("baseline" if index == 0 else STAGE_FLAGS[index - 1][0])


# ------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class StepPlan:
    """The documents of every step: ``steps[i]`` lists token arrays that hold exactly
    ``tokens_per_step`` tokens together; ``rows_packed`` is the most packed rows any step
    needs (every packed batch is topped up to it, so packed shapes are static)."""

    steps: list[list[np.ndarray]]
    tokens_per_step: int
    max_length: int
    rows_packed: int


def plan_steps(
    docs: Sequence[np.ndarray], n_steps: int, tokens_per_step: int, max_length: int, seed: int
) -> StepPlan:
    """Documents (each at most ``max_length`` tokens) in a seeded random order, epoch after
    epoch, dealt into steps of exactly ``tokens_per_step`` tokens: a step's last document is cut
    to fill it and its cut-off rest is dropped.

    Raises ValueError on an empty corpus or a document longer than ``max_length``."""
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    if not lengths.sum():
        raise ValueError("plan_steps: the corpus holds no token")
    if lengths.max() > max_length:
        raise ValueError(f"a document has {lengths.max()} tokens, more than {max_length}")
    rng = np.random.default_rng(seed)
    order: list[int] = []
    steps = []
    for _ in range(n_steps):
        step, need = [], tokens_per_step
        while need:
            if not order:
                order = rng.permutation(len(docs)).tolist()[::-1]
            take = docs[order.pop()][:need]
            if len(take):
                step.append(take)
                need -= len(take)
        steps.append(step)
    rows = max(len(best_fit_decreasing([len(d) for d in s], max_length).bins) for s in steps)
    return StepPlan(steps, tokens_per_step, max_length, rows)


class StepBatches(Dataset):
    """Item ``i`` = the batch of step ``i``, collated here (so in the DataLoader's workers when
    it has any): padded one document per row to ``max_length`` (BRAIN), or packed into
    ``rows_packed`` rows of ``max_length`` (with FlexAttention block lists when
    ``attention_block_size`` is given)."""

    def __init__(
        self, plan: StepPlan, packed: bool, pad_id: int, attention_block_size: int | None
    ) -> None:
        self.plan, self.packed, self.pad_id = plan, packed, pad_id
        self.attention_block_size = attention_block_size

    def __len__(self) -> int:
        return len(self.plan.steps)

    def __getitem__(self, i: int) -> Any:
        docs = self.plan.steps[i]
        if not self.packed:
            return pad_batch(docs, pad_id=self.pad_id, pad_to=self.plan.max_length)
        packing = best_fit_decreasing([len(d) for d in docs], self.plan.max_length)
        rows = [
            [docs[j][a:z] for j, a, z in packing.bin_slices(b)] for b in range(len(packing.bins))
        ]
        return collate_bins(
            rows,
            self.plan.max_length,
            self.pad_id,
            n_rows=self.plan.rows_packed,
            attention_block_size=self.attention_block_size,
        )


def step_loader(
    plan: StepPlan,
    stage: Stage,
    pad_id: int,
    attention_block_size: int | None,
    workers: int,
    device: torch.device,
) -> DataLoader:
    """The batches of every step in plan order. Before ``loader_workers``: collated in the
    training process, not pinned (``DataLoader(dataset)`` as written first); after: in
    ``workers`` processes, pinned on CUDA. Block lists only with ``masks_from_loader``."""
    blocks = attention_block_size if stage.masks_from_loader else None
    dataset = StepBatches(plan, stage.packing, pad_id, blocks)
    if not stage.loader_workers:
        return DataLoader(dataset, batch_size=None)
    return DataLoader(
        dataset, batch_size=None, num_workers=workers, pin_memory=device.type == "cuda"
    )


# ---------------------------------------------------------------------- model and optimizer
LAYER_NORMS = {
    "fused": FusedLayerNorm,
    "torch": InputDtypeLayerNorm,
    "triton": TritonLayerNorm,
}  # what fused_layer_norm swaps in


def build_model(
    cfg: GPTLikeConfig, stage: Stage, device: torch.device, seed: int, layer_norm: str = "fused"
) -> nn.Module:
    """The seeded GPT-like LM of ``stage``: before ``masks_from_loader`` it passes the padding
    mask to attention (a masked kernel instead of the causal one); from ``fused_layer_norm`` on
    its LayerNorms are ``LAYER_NORMS[layer_norm]`` ("torch": torch's kernel in the activations'
    dtype, "triton": the Triton kernels at any size; the ablations of the fused one);
    compilation as the stage says. Same initial weights in every stage."""
    torch.manual_seed(seed)
    model = GPTLikeModel(dataclasses.replace(cfg, mask_padding_keys=not stage.masks_from_loader))
    model.to(device).train()
    if stage.fused_layer_norm:
        swap_layer_norms(model, LAYER_NORMS[layer_norm])
    if stage.compile:
        model.compile()
    return model


def build_optimizer(model: nn.Module, stage: Stage, lr: float) -> torch.optim.Adam:
    """Adam; before ``fused_adam`` with ``foreach=False`` (one small kernel per parameter and
    operation), after it with ``fused=True`` (one kernel for the whole update)."""
    if stage.fused_adam:
        return torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    return torch.optim.Adam(model.parameters(), lr=lr, foreach=False)


def stage_precision(stage: Stage, device: torch.device, amp_dtype: str) -> Precision:
    """fp32 before ``amp``; after it torch.autocast to ``amp_dtype`` ("fp16" with effdl's
    DynamicGradScaler, "bf16" without a scaler: its range needs none)."""
    if not stage.amp:
        return build_precision(PrecisionSpec(), device)
    if amp_dtype not in LOW_DTYPES:
        raise ValueError(f"amp_dtype must be one of {sorted(LOW_DTYPES)}, got {amp_dtype!r}")
    scaler = "dynamic" if amp_dtype == "fp16" else "none"
    return build_precision(PrecisionSpec("torch", scaler), device, LOW_DTYPES[amp_dtype])


# ------------------------------------------------------------------------------ the step
RANGES = ("data_wait", "to_device", "forward", "backward", "optimizer")  # profiler ranges


def step_inputs(batch: Any, stage: Stage, device: torch.device, pad_id: int) -> LMInputs:
    """Model inputs of ``batch`` on ``device``. Before ``masks_from_loader`` a padded batch's
    mask is rebuilt here, on the CPU, every step (a packed batch then comes without block
    lists, so the model builds them on the device); before ``async_copy`` copies block."""
    inputs = lm_inputs(batch)
    if not stage.masks_from_loader and "padding_mask" in inputs.model_kwargs:
        inputs.model_kwargs["padding_mask"] = inputs.model_kwargs["input_ids"] == pad_id
    return inputs.to(device, non_blocking=stage.async_copy)


@dataclass
class StepParts:
    """What one training step works with."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision
    stage: Stage
    device: torch.device
    pad_id: int


def train_step(batches: Any, parts: StepParts) -> tuple[torch.Tensor, int]:
    """One optimizer step on the next batch of the iterator ``batches``, each phase in a named
    profiler range (:data:`RANGES`); before ``no_empty_cache`` the optimizer range ends by
    emptying the CUDA caching allocator. Returns the loss (on the device) and the token slots of
    the batch (real tokens plus padding)."""
    record = torch.profiler.record_function
    with record("data_wait"):
        batch = next(batches)
    with record("to_device"):
        inputs = step_inputs(batch, parts.stage, parts.device, parts.pad_id)
    with record("forward"), parts.precision.autocast():
        loss = lm_cross_entropy(parts.model(**inputs.model_kwargs), inputs.labels)
    with record("backward"):
        parts.precision.backward(loss)
    with record("optimizer"):
        parts.precision.step(parts.optimizer)
        parts.optimizer.zero_grad(set_to_none=parts.stage.grads_to_none)
        if not parts.stage.no_empty_cache and parts.device.type == "cuda":
            torch.cuda.empty_cache()  # "free memory": every block is cudaFree'd, then re-cudaMalloc'd
    return loss.detach(), inputs.n_slots


class LossLog:
    """The loss of every step. Before ``loss_read_once`` each one is read with ``.item()`` and
    printed as it comes (a host-device sync per step); after it they stay on the device and
    :meth:`values` reads them all with one copy."""

    def __init__(self, read_once: bool) -> None:
        self.read_once = read_once
        self._losses: list[torch.Tensor | float] = []

    def add(self, step: int, loss: torch.Tensor) -> None:
        if self.read_once:
            self._losses.append(loss)
            return
        value = loss.item()
        print(f"step {step}: loss {value:.4f}")
        self._losses.append(value)

    def values(self) -> list[float]:
        if self.read_once and self._losses:
            return torch.stack(self._losses).float().cpu().tolist()
        return [float(v) for v in self._losses]


# ------------------------------------------------------------------- stages taking turns
def block_sizes(steps: int, block_steps: int) -> list[int]:
    """``steps`` split into blocks of about ``block_steps + 1`` steps (at least one block):
    the steps each stage runs in turn, the first of every block untimed."""
    n = max(1, steps // (block_steps + 1))
    return [len(b) for b in np.array_split(np.arange(steps), n)]


@dataclass
class StageRun:
    """One stage while the study runs: its step, its next batches, its losses so far, the
    timed steps and its own peak memory (bytes above what was allocated before it was built)."""

    index: int
    parts: StepParts
    batches: Iterator
    losses: LossLog
    step: int = 0
    resident: int = 0  # bytes it keeps between steps (weights, gradients, Adam state)
    peak: int | None = None  # None on the CPU: not measured
    step_s: list[float] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    def train(self, n: int, timer: RegionTimer | None = None) -> None:
        for _ in range(n):
            if timer is None:
                loss, n_slots = train_step(self.batches, self.parts)
            else:
                with timer.region():
                    loss, n_slots = train_step(self.batches, self.parts)
                self.slots.append(n_slots)
            self.losses.add(self.step, loss)
            self.step += 1

    def add_peak(self, mem: PeakMemory, held: int) -> None:
        """A region's peak: its rise above ``mem.start_bytes`` plus the ``held`` bytes of this
        stage that were alive at the region's start."""
        if mem.gib is not None:
            self.peak = max(self.peak or 0, mem.bytes - mem.start_bytes + held)


def timed_block(sr: StageRun, steps: int) -> None:
    """One untimed step (the switch from the stage before: its queued work, a cold allocator),
    then ``steps - 1`` steps timed with CUDA events, no host sync: the GPU's own pace, its idle
    waits for the host included."""
    timer = RegionTimer(sr.parts.device)
    with peak_memory(sr.parts.device) as mem:
        sr.train(1)
        sr.train(steps - 1, timer)
        sr.step_s += timer.times()
    sr.add_peak(mem, held=sr.resident)
