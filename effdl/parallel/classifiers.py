"""Small image classifiers that the parallelism experiments train on digits (or CIFAR-10).

The pipeline's MLP of equal-work blocks (:func:`equal_work_mlp`), the tensor-parallel levels'
single-process models (:func:`level_model`) and their sharded twins (:func:`parallelize`), and
the seeded batch order that every rank and every single-process reference share
(:func:`epoch_batches`), and Adam training of any of them (:func:`train_classifier`).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch
from torch import nn

from effdl.data.digits import DigitsData
from effdl.parallel.pipeline import accumulated_backward
from effdl.parallel.tensor import (
    ColumnParallelLinear,
    ParallelLayerNorm,
    ParallelMLP,
    ParallelTransformerBlock,
    RowParallelLinear,
)
from effdl.profiling.timing import RegionTimer, TimingStats

LEVELS = ("mlp", "norm", "block")
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


def epoch_batches(n: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """The ``batch`` row indices of each of ``steps`` steps over ``n`` rows: seeded shuffles,
    epoch after epoch, so every rank and every reference see the same batches in one order."""
    gen = torch.Generator().manual_seed(seed)
    epochs = -(-steps * batch // n)
    order = torch.cat([torch.randperm(n, generator=gen) for _ in range(epochs)])
    return list(order[: steps * batch].view(steps, batch))


def equal_work_mlp(features: int, hidden: int, classes: int, pieces: int) -> nn.Sequential:
    """``pieces`` blocks of equal work, two ``hidden x hidden`` layers each (the bubble formula
    assumes equal stage times): the input projection rides in front of the first block and the
    classifier behind the last, both small beside a block when ``features`` and ``classes`` are
    small beside ``hidden``. He initialization keeps the signal's scale through the deep ReLU
    stack (torch's default shrinks it layer by layer, and the loss then stalls for many steps)."""
    widths = [features] + [hidden] * (2 * pieces + 1) + [classes]
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(itertools.pairwise(widths)):
        linear = nn.Linear(a, b)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if k < len(widths) - 2:
            layers.append(nn.ReLU())
    # Block k: the layers (and ReLUs) of linears 2k + 1 and 2k + 2; linear 0 joins block 0,
    # the classifier the last block.
    bounds = [0] + [4 * k + 2 for k in range(1, pieces)] + [len(layers)]
    return nn.Sequential(*(nn.Sequential(*layers[a:b]) for a, b in itertools.pairwise(bounds)))


def multiply_adds(module: nn.Module) -> int:
    """Multiply-adds per row of ``module``'s Linear layers (the work of a stage)."""
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


class RowTokenClassifier(nn.Module):
    """Image rows as tokens: (N, C, H, W) -> H tokens of C*W pixels -> linear embedding plus a
    learned position embedding -> ``block`` -> LayerNorm -> mean over tokens -> class logits."""

    def __init__(self, image_shape: tuple[int, int, int], block: nn.Module, d_model: int) -> None:
        super().__init__()
        channels, height, width = image_shape
        self.embed = nn.Linear(channels * width, d_model)
        self.position = nn.Parameter(0.02 * torch.randn(height, d_model))
        self.block = block
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = images.permute(0, 2, 1, 3).flatten(2)
        return self.head(self.norm(self.block(self.embed(tokens) + self.position)).mean(1))


def level_model(
    level: str,
    image_shape: tuple[int, int, int],
    *,
    hidden: int,
    d_model: int,
    heads: int,
    activation: str,
    dtype: torch.dtype,
    seed: int,
) -> nn.Module:
    """The single-process model of a tensor-parallel ``level`` (:data:`LEVELS`); the same
    ``seed`` gives the same weights. ``mlp``: Flatten -> Linear -> act -> Linear; ``norm``: a
    LayerNorm before the activation; ``block``: a pre-norm Transformer encoder layer over the
    image rows (:class:`RowTokenClassifier`)."""
    torch.manual_seed(seed)
    features = image_shape[0] * image_shape[1] * image_shape[2]
    if level == "block":
        layer = nn.TransformerEncoderLayer(
            d_model, heads, hidden, dropout=0.0, activation=activation,
            batch_first=True, norm_first=True,
        )  # fmt: skip
        model = RowTokenClassifier(image_shape, layer, d_model)
    else:
        norm = [nn.LayerNorm(hidden)] if level == "norm" else []
        first, last = nn.Linear(features, hidden), nn.Linear(hidden, 10)
        model = nn.Sequential(nn.Flatten(), first, *norm, ACTIVATIONS[activation](), last)
    return model.to(dtype)


def parallelize(level: str, model: nn.Module) -> nn.Module:
    """The tensor-parallel twin of ``level_model(level)`` over the default process group
    (this rank's shards of its weights; replicated layers are used as they are)."""
    if level == "block":
        model.block = ParallelTransformerBlock.from_encoder_layer(model.block)
        return model
    if level == "mlp":
        flatten, first, act, last = model
        return nn.Sequential(flatten, ParallelMLP.from_linears(first, act, last))
    flatten, first, norm, act, last = model
    return nn.Sequential(
        flatten,
        ColumnParallelLinear.from_linear(first, gather_output=False),
        ParallelLayerNorm.from_layer_norm(norm),
        act,
        RowParallelLinear.from_linear(last, input_is_parallel=True),
    )


@dataclass(frozen=True)
class TrainResult:
    """A classifier's training: the loss of every step (before its update), the test accuracy
    after the last step, and the step times after warm-up (seconds)."""

    losses: list[float]
    test_accuracy: float
    step_time: TimingStats

    def metrics(self) -> dict:
        """The run-log metrics: the loss curve, final loss, test accuracy, step-time stats (ms)."""
        return {
            "losses": self.losses,
            "final_loss": self.losses[-1],
            "test_accuracy": self.test_accuracy,
            **{f"step_ms_{k}": v * 1e3 for k, v in asdict(self.step_time).items() if k != "n"},
            "timed_steps": self.step_time.n,
        }

    def max_relative_gap(self, reference: TrainResult) -> float:
        """The largest relative difference of this loss curve from ``reference``'s, step by step."""
        pairs = zip(self.losses, reference.losses, strict=True)
        return max(abs(a - b) / abs(b) for a, b in pairs)


def train_classifier(
    model: nn.Module,
    data: DigitsData,
    *,
    steps: int,
    batch: int,
    lr: float,
    warmup: int,
    dtype: torch.dtype,
    seed: int,
    device: torch.device,
    parts: int = 1,
) -> TrainResult:
    """``steps`` Adam steps of cross-entropy on the seeded batches (:func:`epoch_batches`), each
    batch's gradient accumulated over ``parts`` slices (:func:`accumulated_backward`); the first
    ``warmup`` steps are left out of the timing. Moves ``model`` to ``device``."""
    model.to(device)
    x_train, y_train = data.x_train.to(device, dtype), data.y_train.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    timer, losses = RegionTimer(device), []
    for step, rows in enumerate(epoch_batches(len(y_train), batch, steps, seed)):
        rows = rows.to(device)
        if step >= warmup:
            timer.start()
        optimizer.zero_grad(set_to_none=True)
        loss = accumulated_backward(model, x_train[rows], y_train[rows], parts)
        optimizer.step()
        if step >= warmup:
            timer.stop()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(data.x_test.to(device, dtype))
    accuracy = (logits.argmax(-1).cpu() == data.y_test).float().mean().item()
    return TrainResult(losses, accuracy, timer.stats())
