"""UNet segmentation under six precision setups: what loss scaling fixes, and what it costs.

Modes: fp32; AMP (torch.autocast fp16) without scaling; AMP + torch GradScaler (reference);
AMP + StaticGradScaler; AMP + DynamicGradScaler; own Autocast + DynamicGradScaler. The course's
pipeline otherwise: 256x256, batch 128, Adam lr 1e-4, 5 epochs, BCEWithLogitsLoss, pixel accuracy
``((logits > 0.5) == mask).mean()``. Logged per step: loss, accuracy, scale, skipped step,
fraction of exactly-zero gradient elements, step time; an fp32 loss that turns non-finite is
refused (lower ``--lr``), in the low-precision modes it is a result. A separate timing phase
times the training step alone on one fixed batch with the benchmark harness (modes alive side by
side, interleaved one step per round after a warm-up), in the same process.

Deviation from the course (documented on purpose): images are decoded and resized once, cached
as uint8 tensors and kept on the device, instead of a 4-worker DataLoader decoding JPEGs every
epoch, so step times measure the training step and not the input pipeline. 5% of the images are
held out for a validation accuracy.

    python task1_loss_scaling/train_unet.py --quick                  # CPU smoke run, < 60 s
    python task1_loss_scaling/train_unet.py --device cuda --seeds 3  # the GPU experiment
    python task1_loss_scaling/train_unet.py --data /path/to/carvana  # real Carvana layout
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from effdl.amp.grads import grads_of, zero_fraction
from effdl.amp.precision import LOW_DTYPES, Precision, PrecisionSpec, build_precision
from effdl.amp.training_step import scaled_step
from effdl.cli import (
    ConfigFlags,
    Run,
    UsageError,
    base_parser,
    decide_auto,
    print_table,
    require_choices,
    require_converged,
    require_fits,
    require_path,
    require_positive,
    require_processes,
    run_main,
    seed_everything,
    start_run,
)
from effdl.data.images import (
    CarvanaCacheError,
    CarvanaLayoutError,
    SegmentationTensors,
    SyntheticCarvanaConfig,
    generate_synthetic_carvana,
    load_carvana_tensors,
)
from effdl.models.unet import UNet
from effdl.profiling.harness import HarnessConfig, Regions, Variant, time_variants
from effdl.profiling.timing import RegionTimer, TimingStats

MODES = {
    "fp32": PrecisionSpec("none", "none"),
    "amp_noscale": PrecisionSpec("torch", "none"),
    "amp_torch_scaler": PrecisionSpec("torch", "torch"),
    "amp_static": PrecisionSpec("torch", "static"),
    "amp_dynamic": PrecisionSpec("torch", "dynamic"),
    "own_autocast_dynamic": PrecisionSpec("own", "dynamic"),
}
REFERENCE = "amp_torch_scaler"
LOGS = ("unet_steps.jsonl", "unet_epochs.jsonl", "unet_runs.jsonl", "unet_timing.jsonl")
# The settings every record's config carries (with the device and the run's identity).
RECORDED = ("size", "batch_size", "epochs", "lr", "amp_dtype", "static_scale", "growth_interval")


@dataclass
class UNetConfig:
    """Settings of one run; the defaults are the course's GPU experiment."""

    data: Path | None = None  # Carvana root; None: a generated synthetic set
    cache: Path = Path("runs/cache/task1")
    n_images: int = 5088
    size: int = 256
    batch_size: int = 128
    epochs: int = 5
    lr: float = 1e-4
    modes: list[str] = field(default_factory=lambda: list(MODES))
    seeds: int = 3
    multi_seed_modes: list[str] = field(default_factory=lambda: ["amp_static", "amp_dynamic"])
    amp_dtype: str = "auto"  # fp16 on CUDA, bf16 on the CPU
    static_scale: float = 2.0**16
    growth_interval: int = 50  # torch's default 2000 would never grow in ~190 steps
    timing_steps: int = 60
    timing_only: bool = False
    workers: int | None = None

    def validate(self) -> None:
        require_positive(self, "n_images", "size", "batch_size", "epochs", "seeds")
        require_positive(self, "growth_interval")
        require_positive(self, "lr", "timing_steps", minimum=0)
        require_choices(self, "modes", MODES)
        require_choices(self, "multi_seed_modes", MODES)
        require_choices(self, "amp_dtype", ["auto", *LOW_DTYPES])
        if self.size % 8:
            raise UsageError(
                f"--size must be a multiple of 8 (the UNet pools 3 times), got {self.size}"
            )
        if not self.static_scale > 0:
            raise UsageError(f"--static-scale must be > 0, got {self.static_scale!r}")
        numel = (self.n_images + self.batch_size) * 3 * self.size**2
        require_fits("--n-images --batch-size --size", numel, "the decoded images and a batch (a byte per value)", bytes_per_element=1)  # fmt: skip
        require_processes(self, "workers", minimum=1)

    def recorded(self, device: torch.device) -> dict:
        """The settings a log record's config carries."""
        return {**{name: getattr(self, name) for name in RECORDED}, "device": str(device)}


FULL = UNetConfig()
QUICK = UNetConfig(n_images=40, size=64, batch_size=8, epochs=1, seeds=1, timing_steps=4)


def parse_config() -> tuple[UNetConfig, Run]:
    """The config from the flags (validated) and the run's preamble."""
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task1")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("data", type=Path, help="Carvana root (train/, train_masks/); none: synthetic")
    flags.add("cache", type=Path, output=True, help="data caches")
    flags.add("n_images", type=int, help="synthetic set size")
    flags.add("size", type=int, help="image side, a multiple of 8")
    flags.add("batch_size", type=int)
    flags.add("epochs", type=int)
    flags.add("lr", type=float)
    flags.add("modes", nargs="+", help="a subset of the six modes")
    flags.add("seeds", type=int, help="seeds for --multi-seed-modes")
    flags.add("multi_seed_modes", nargs="+")
    flags.add("amp_dtype", help="fp16 | bf16 | auto: fp16 on CUDA, bf16 on the CPU")
    flags.add("static_scale", type=float)
    flags.add("growth_interval", type=int, help="both dynamic scalers")
    flags.add("timing_steps", type=int, help="timed steps per mode (0: no timing)")
    flags.add("timing_only", action="store_true", help="skip training, only time steps")
    flags.add("workers", type=int, help="processes for data generation (none: up to 16 CPUs)")
    args = p.parse_args()
    cfg = flags.resolve(args)
    run = start_run(args, task="task1_unet", logs=LOGS)
    return with_device_defaults(cfg, run.device), run


def with_device_defaults(cfg: UNetConfig, device: torch.device) -> UNetConfig:
    """``amp_dtype`` auto: fp16 on CUDA (the course's setting), bf16 on the CPU (no fp16 GEMMs)."""
    low = "fp16" if device.type == "cuda" else "bf16"
    return dataclasses.replace(cfg, amp_dtype=decide_auto(cfg.amp_dtype, low))


def prepare_data(cfg: UNetConfig) -> tuple[SegmentationTensors, str]:
    """Decoded tensors (cached under --cache) from --data or from a generated synthetic set."""
    if cfg.data is not None:
        require_path(cfg.data, "a Carvana folder with train/ and train_masks/", "--data")
        root, source = cfg.data, f"carvana:{cfg.data}"
    else:
        synthetic = SyntheticCarvanaConfig(n_images=cfg.n_images, seed=0)
        root = cfg.cache / f"synthetic_carvana_{cfg.n_images}_seed{synthetic.seed}"
        t0 = time.perf_counter()
        generate_synthetic_carvana(root, synthetic, workers=cfg.workers)
        print(f"synthetic Carvana-like set: {cfg.n_images} images in {root} "
              f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
        source = f"synthetic:{cfg.n_images}"
    try:
        data = load_carvana_tensors(
            root, cfg.size, cache_dir=cfg.cache / "tensors", workers=cfg.workers
        )
    except CarvanaLayoutError as e:
        raise UsageError(f"--data: {e}") from None
    except CarvanaCacheError as e:
        raise UsageError(f"--cache: {e}") from None
    return data, source


def split(data: SegmentationTensors, device: torch.device, val_fraction: float = 0.05):
    """Fixed (seed-independent) train/val split, moved to the device as uint8."""
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(1234))
    n_val = max(1, int(len(data) * val_fraction))
    pick = lambda idx: (data.images[idx].to(device), data.masks[idx].to(device))  # noqa: E731
    return pick(order[n_val:]), pick(order[:n_val])


def batch(images: torch.Tensor, masks: torch.Tensor, idx: torch.Tensor):
    """uint8 -> the course's ToTensor scale [0, 1]; mask -> float {0, 1}, N x 1 x H x W."""
    return images[idx].float().div_(255), masks[idx].unsqueeze(1).float()


def pixel_accuracy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # The course's metric: thresholds the logits (not the probabilities) at 0.5.
    return ((logits > 0.5) == target).float().mean()


def train_step(model, x, y, optimizer, prec: Precision, loss_fn):
    """One training step on (x, y) under ``prec``; returns (logits, loss)."""

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(x)
        return logits, loss_fn(logits, y)

    return scaled_step(optimizer, prec, forward)


@torch.no_grad()
def evaluate(
    model, images, masks, prec: Precision, batch_size: int, loss_fn
) -> tuple[float, float]:
    model.eval()
    losses, accs, weights = [], [], []
    for start in range(0, len(images), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(images)), device=images.device)
        x, y = batch(images, masks, idx)
        with prec.autocast():
            logits = model(x)
            losses.append(loss_fn(logits, y).float())
        accs.append(pixel_accuracy(logits, y))
        weights.append(len(idx))
    model.train()
    w = torch.tensor(weights, dtype=torch.float32, device=images.device)
    mean = lambda values: ((torch.stack(values) * w).sum() / w.sum()).item()  # noqa: E731
    return mean(losses), mean(accs)


def build(mode: str, seed: int, cfg: UNetConfig, device: torch.device):
    seed_everything(seed)
    model = UNet().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    prec = build_precision(MODES[mode], device, LOW_DTYPES[cfg.amp_dtype],
                           static_scale=cfg.static_scale,
                           growth_interval=cfg.growth_interval)  # fmt: skip
    return model, optimizer, prec


def train_run(mode: str, seed: int, cfg: UNetConfig, run: Run, train, val) -> dict:
    """One training run; logs every step and every epoch, returns the run's summary row."""
    device = run.device
    model, optimizer, prec = build(mode, seed, cfg, device)
    loss_fn = nn.BCEWithLogitsLoss()
    images, masks = train
    n_batches = len(images) // cfg.batch_size  # drop_last: one batch shape for cuDNN
    config = {"run_id": run.run_id, "mode": mode, "seed": seed, **cfg.recorded(device)}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    step, step_times, last_epoch_acc, val_acc, val_loss = 0, [], [], float("nan"), float("nan")
    for epoch in range(cfg.epochs):
        perm = torch.randperm(len(images), generator=gen).to(device)
        timer = RegionTimer(device)
        losses, accs, zeros, scales, skipped = [], [], [], [], []
        for b in tqdm(range(n_batches), desc=f"{mode} s{seed} e{epoch}", leave=False):
            x, y = batch(images, masks, perm[b * cfg.batch_size : (b + 1) * cfg.batch_size])
            with timer.region():
                logits, loss = train_step(model, x, y, optimizer, prec, loss_fn)
            zeros.append(zero_fraction(grads_of(model.parameters())))
            losses.append(loss.detach().float())
            accs.append(pixel_accuracy(logits.detach(), y))
            scale, skip = prec.scale_and_skipped()
            scales.append(scale)
            skipped.append(skip)
        # one host sync per epoch for the device-side per-step values
        losses_h, accs_h, zeros_h = (torch.stack(v).tolist() for v in (losses, accs, zeros))
        times = timer.times()
        for i in range(n_batches):
            if mode == "fp32":  # the low-precision modes' non-finite losses are what they measure
                require_converged("--lr", f"the fp32 run at step {step}", losses_h[i])
            run.logs["unet_steps"].log(mode, config, {
                "step": step, "epoch": epoch, "loss": losses_h[i], "accuracy": accs_h[i],
                "scale": scales[i], "skipped": skipped[i], "zero_grad_fraction": zeros_h[i],
                "step_s": times[i],
            })  # fmt: skip
            step += 1
        step_times += times
        last_epoch_acc = accs_h
        val_loss, val_acc = evaluate(model, *val, prec, cfg.batch_size, loss_fn)
        run.logs["unet_epochs"].log(
            mode, config,
            {"epoch": epoch, "train_loss": statistics.fmean(losses_h),
             "train_accuracy": statistics.fmean(accs_h), "val_loss": val_loss,
             "val_accuracy": val_acc, "skipped_steps": sum(skipped),
             "zero_grad_fraction": statistics.fmean(zeros_h)},
        )  # fmt: skip
    warm = step_times[min(5, len(step_times) - 1) :]  # leave cuDNN autotuning steps out
    summary = {
        "final_train_accuracy": statistics.fmean(last_epoch_acc),
        "val_accuracy": val_acc,
        "val_loss": val_loss,
        "skipped_steps": int(getattr(prec.scaler, "skipped_steps", 0)),
        "final_scale": prec.scale_and_skipped()[0],
        "steps": step,
        **TimingStats.from_times(warm).as_dict("step_s_"),
    }
    run.logs["unet_runs"].log(mode, config, summary)
    return {"mode": mode, "seed": seed, **summary}


def train_all(cfg: UNetConfig, run: Run, train, val) -> list[dict]:
    """Every mode once, the --multi-seed-modes with --seeds seeds; one summary row per run."""
    rows = []
    for mode in cfg.modes:
        n = cfg.seeds if mode in cfg.multi_seed_modes else 1
        for seed in range(run.seed, run.seed + n):
            rows.append(train_run(mode, seed, cfg, run, train, val))
    return rows


def time_steps(cfg: UNetConfig, run: Run, train) -> list[dict]:
    """Time of the training step alone, per mode, on one fixed batch: ``--timing-steps`` steps,
    one per round of the harness (modes alive side by side, the start rotating each round)."""
    steps = cfg.timing_steps
    warmup = 2 if steps < 10 else 10
    harness = HarnessConfig(rounds=steps, min_steps=steps, max_steps=steps, min_time=0.0,
                            warmup_steps=warmup, warmup_time=0.0, memory_steps=1)  # fmt: skip
    images, masks = train
    x, y = batch(images, masks, torch.arange(cfg.batch_size, device=run.device) % len(images))

    def variant(mode: str) -> Variant:
        def build_step():
            model, opt, prec = build(mode, 0, cfg, run.device)
            loss_fn = nn.BCEWithLogitsLoss()

            def step(n: int, regions: Regions | None) -> None:
                for _ in range(n):
                    train_step(model, x, y, opt, prec, loss_fn)
                    opt.zero_grad(set_to_none=True)  # an idle mode holds no gradients

            return step

        return Variant(mode, build_step)

    results = time_variants([variant(m) for m in cfg.modes], harness, run.device)
    ref = results.get(REFERENCE)
    ref_median = statistics.median(ref.step) if ref and not ref.oom else float("nan")
    rows = []
    for mode, result in results.items():
        config = {"run_id": run.run_id, "mode": mode, "warmup": warmup, **cfg.recorded(run.device)}
        if result.oom:
            run.logs["unet_timing"].log(mode, config, {"oom": True})
            rows.append({"mode": mode, "oom": True})
            continue
        s = TimingStats.from_times(result.step)
        ratio = s.median / ref_median
        run.logs["unet_timing"].log(
            mode, config, {**s.as_dict("step_s_"), "ratio_to_torch_scaler": ratio}
        )
        rows.append({"mode": mode, "median_ms": s.median * 1e3, "min_ms": s.min * 1e3,
                     "n": s.n, "ratio_to_torch_scaler": ratio})  # fmt: skip
    return rows


def load_split(cfg: UNetConfig, run: Run):
    """(train, val) image/mask tensors on the device; a batch larger than the training set is
    a usage error."""
    data, source = prepare_data(cfg)
    train, val = split(data, run.device)
    if len(train[0]) < cfg.batch_size:
        raise UsageError(
            f"--batch-size {cfg.batch_size} exceeds the {len(train[0])} training images"
        )
    print(f"data: {source}, {len(train[0])} train / {len(val[0])} val at {cfg.size}px; "
          f"device: {run.where}; low precision: {cfg.amp_dtype}")  # fmt: skip
    return train, val


def print_runs(rows: list[dict], run: Run) -> None:
    print_table(
        [{"mode": r["mode"], "seed": r["seed"], "train_acc": r["final_train_accuracy"],
          "val_acc": r["val_accuracy"], "skipped": r["skipped_steps"],
          "final_scale": r["final_scale"], "median_step_ms": r["step_s_median"] * 1e3}
         for r in rows],
        title=f"Training runs on {run.where} (logs: {run.out})",
    )  # fmt: skip


def print_timing(rows: list[dict], run: Run) -> None:
    print_table(rows, title=f"Training-step time alone, fixed batch, on {run.where}")
    by_mode = {r["mode"]: r for r in rows}
    own, ref = by_mode.get("amp_dynamic"), by_mode.get(REFERENCE)
    if own and ref and not own.get("oom"):
        print(f"own DynamicGradScaler / torch GradScaler step time: "
              f"{own['ratio_to_torch_scaler']:.3f} (target <= 1.03)")  # fmt: skip


def main() -> None:
    cfg, run = parse_config()
    torch.backends.cudnn.benchmark = True
    train, val = load_split(cfg, run)
    if not cfg.timing_only:
        print_runs(train_all(cfg, run, train, val), run)
    if cfg.timing_steps > 0:
        print_timing(time_steps(cfg, run, train), run)


if __name__ == "__main__":
    run_main(main)
