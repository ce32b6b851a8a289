"""UNet segmentation under six precision setups: what loss scaling fixes, and what it costs.

Modes: fp32; AMP (torch.autocast fp16) without scaling; AMP + torch GradScaler (reference);
AMP + StaticGradScaler; AMP + DynamicGradScaler; own Autocast + DynamicGradScaler. The course's
pipeline otherwise: 256x256, batch 128, Adam lr 1e-4, 5 epochs, BCEWithLogitsLoss, pixel accuracy
``((logits > 0.5) == mask).mean()``. Logged per step: loss, accuracy, scale, skipped step,
fraction of exactly-zero gradient elements, step time. A separate timing phase times the
training step alone (fixed batch, warm-up, median, modes interleaved) in the same process.

Deviation from the course (documented on purpose): images are decoded and resized once, cached
as uint8 tensors and kept on the device, instead of a 4-worker DataLoader decoding JPEGs every
epoch, so step times measure the training step and not the input pipeline. 5% of the images are
held out for a validation accuracy.

    python task1_loss_scaling/train_unet.py --quick                  # CPU smoke run, < 60 s
    python task1_loss_scaling/train_unet.py --device cuda --seeds 3  # the GPU experiment
    python task1_loss_scaling/train_unet.py --data /path/to/carvana  # real Carvana layout
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from effdl.amp.grads import grads_of, zero_fraction
from effdl.amp.precision import Precision, PrecisionSpec, build_precision
from effdl.cli import (
    UsageError,
    base_parser,
    device_from_arg,
    print_table,
    require_path,
    run_main,
    seed_everything,
)
from effdl.data.images import (
    CarvanaLayoutError,
    SegmentationTensors,
    SyntheticCarvanaConfig,
    generate_synthetic_carvana,
    load_carvana_tensors,
)
from effdl.models.unet import UNet
from effdl.profiling.timing import RegionTimer, TimingStats
from effdl.results import RunLog

MODES = {
    "fp32": PrecisionSpec("none", "none"),
    "amp_noscale": PrecisionSpec("torch", "none"),
    "amp_torch_scaler": PrecisionSpec("torch", "torch"),
    "amp_static": PrecisionSpec("torch", "static"),
    "amp_dynamic": PrecisionSpec("torch", "dynamic"),
    "own_autocast_dynamic": PrecisionSpec("own", "dynamic"),
}
LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task1")
    p.add_argument("--data", type=Path, default=None, help="Carvana root (train/, train_masks/)")
    p.add_argument("--cache", type=Path, default=Path("runs/cache/task1"), help="data caches")
    p.add_argument("--n-images", type=int, default=None, help="synthetic set size (5088; quick 40)")
    p.add_argument("--size", type=int, default=None, help="image side (256; quick 64)")
    p.add_argument("--batch-size", type=int, default=None, help="128; quick 8")
    p.add_argument("--epochs", type=int, default=None, help="5; quick 1")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--modes", nargs="+", default=list(MODES), help=f"subset of {list(MODES)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds for --multi-seed-modes (quick: 1)")
    p.add_argument("--multi-seed-modes", nargs="+", default=["amp_static", "amp_dynamic"])
    p.add_argument("--amp-dtype", choices=list(LOW_DTYPES), default=None,
                   help="fp16 on CUDA, bf16 on CPU by default")  # fmt: skip
    p.add_argument("--static-scale", type=float, default=2.0**16)
    p.add_argument("--growth-interval", type=int, default=50,
                   help="both dynamic scalers (torch's default 2000 would never grow in ~190 steps)")  # fmt: skip
    p.add_argument(
        "--timing-steps", type=int, default=None, help="timed steps per mode (60; quick 4)"
    )
    p.add_argument("--timing-only", action="store_true", help="skip training, only time steps")
    p.add_argument("--workers", type=int, default=None, help="processes for data generation")
    return p.parse_args()


@dataclass
class Config:
    size: int
    batch_size: int
    epochs: int
    lr: float
    amp_dtype: str
    static_scale: float
    growth_interval: int
    device: str


def prepare_data(args, quick: bool) -> tuple[SegmentationTensors, str]:
    """Decoded tensors (cached under --cache) from --data or from a generated synthetic set."""
    size = args.size or (64 if quick else 256)
    tensors_cache = args.cache / "tensors"
    if args.data is not None:
        require_path(args.data, "a Carvana folder with train/ and train_masks/", "--data")
        root, source = args.data, f"carvana:{args.data}"
    else:
        n = args.n_images or (40 if quick else 5088)
        cfg = SyntheticCarvanaConfig(n_images=n, seed=0)
        root = args.cache / f"synthetic_carvana_{n}_seed{cfg.seed}"
        t0 = time.perf_counter()
        generate_synthetic_carvana(root, cfg, workers=args.workers)
        print(
            f"synthetic Carvana-like set: {n} images in {root} ({time.perf_counter() - t0:.1f} s)"
        )
        source = f"synthetic:{n}"
    try:
        data = load_carvana_tensors(root, size, cache_dir=tensors_cache, workers=args.workers)
    except CarvanaLayoutError as e:
        raise UsageError(f"--data: {e}") from None
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
    optimizer.zero_grad(set_to_none=True)
    with prec.autocast():
        logits = model(x)
        loss = loss_fn(logits, y)
    prec.scaler.scale(loss).backward()
    prec.scaler.step(optimizer)
    prec.scaler.update()
    return logits, loss


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
    return ((torch.stack(losses) * w).sum() / w.sum()).item(), (
        (torch.stack(accs) * w).sum() / w.sum()
    ).item()


def build(mode: str, seed: int, cfg: Config, device: torch.device):
    seed_everything(seed)
    model = UNet().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    prec = build_precision(
        MODES[mode],
        device,
        LOW_DTYPES[cfg.amp_dtype],
        static_scale=cfg.static_scale,
        init_scale=2.0**16,
        growth_interval=cfg.growth_interval,
    )
    return model, optimizer, prec


def train_run(mode, seed, cfg, device, train, val, logs, run_id) -> dict:
    """One training run; logs every step and every epoch, returns the run's summary row."""
    model, optimizer, prec = build(mode, seed, cfg, device)
    loss_fn = nn.BCEWithLogitsLoss()
    images, masks = train
    n_batches = len(images) // cfg.batch_size  # drop_last: one batch shape for cuDNN
    config = {"run_id": run_id, "mode": mode, "seed": seed, **cfg.__dict__}
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
            logs["steps"].log(
                mode,
                config,
                {
                    "step": step, "epoch": epoch, "loss": losses_h[i], "accuracy": accs_h[i],
                    "scale": scales[i], "skipped": skipped[i], "zero_grad_fraction": zeros_h[i],
                    "step_s": times[i],
                },
            )  # fmt: skip
            step += 1
        step_times += times
        last_epoch_acc = accs_h
        val_loss, val_acc = evaluate(model, *val, prec, cfg.batch_size, loss_fn)
        logs["epochs"].log(
            mode,
            config,
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
    logs["runs"].log(mode, config, summary)
    return {"mode": mode, "seed": seed, **summary}


def time_steps(modes, cfg, device, train, steps: int, logs, run_id) -> list[dict]:
    """Median time of the training step alone, per mode, on one fixed batch.

    Modes are interleaved in rounds after a warm-up, so clock or thermal drift hits all alike.
    """
    warmup, rounds = (2, 2) if steps < 10 else (10, 5)
    per_round = max(1, steps // rounds)
    images, masks = train
    x, y = batch(images, masks, torch.arange(cfg.batch_size, device=device) % len(images))
    loss_fn = nn.BCEWithLogitsLoss()
    built = {m: build(m, 0, cfg, device) for m in modes}
    for model, opt, prec in built.values():
        for _ in range(warmup):
            train_step(model, x, y, opt, prec, loss_fn)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in tqdm(range(rounds), desc="timing", leave=False):
        for m, (model, opt, prec) in built.items():
            timer = RegionTimer(device)
            for _ in range(per_round):
                with timer.region():
                    train_step(model, x, y, opt, prec, loss_fn)
            times[m] += timer.times()
    stats = {m: TimingStats.from_times(t) for m, t in times.items()}
    ref = stats.get("amp_torch_scaler")
    rows = []
    for m, s in stats.items():
        ratio = s.median / ref.median if ref else float("nan")
        config = {"run_id": run_id, "mode": m, "warmup": warmup, **cfg.__dict__}
        logs["timing"].log(m, config, {**s.as_dict("step_s_"), "ratio_to_torch_scaler": ratio})
        rows.append({"mode": m, "median_ms": s.median * 1e3, "min_ms": s.min * 1e3,
                     "n": s.n, "ratio_to_torch_scaler": ratio})  # fmt: skip
    return rows


def main() -> None:
    args = parse_args()
    device = (
        torch.device("cpu")
        if args.quick and args.device == "auto"
        else device_from_arg(args.device)
    )
    unknown = sorted(set(args.modes + args.multi_seed_modes) - set(MODES))
    if unknown:
        raise UsageError(f"--modes/--multi-seed-modes: unknown {unknown}; expected {list(MODES)}")
    amp_dtype = args.amp_dtype or ("fp16" if device.type == "cuda" else "bf16")
    cfg = Config(
        size=args.size or (64 if args.quick else 256),
        batch_size=args.batch_size or (8 if args.quick else 128),
        epochs=args.epochs or (1 if args.quick else 5),
        lr=args.lr,
        amp_dtype=amp_dtype,
        static_scale=args.static_scale,
        growth_interval=args.growth_interval,
        device=str(device),
    )
    if cfg.size % 8 or min(cfg.size, cfg.batch_size, cfg.epochs) <= 0:
        raise UsageError("--size must be a positive multiple of 8; --batch-size, --epochs > 0")
    seeds = 1 if args.quick else args.seeds
    timing_steps = args.timing_steps if args.timing_steps is not None else (4 if args.quick else 60)
    torch.backends.cudnn.benchmark = True

    data, source = prepare_data(args, args.quick)
    train, val = split(data, device)
    if len(train[0]) < cfg.batch_size:
        raise UsageError(
            f"--batch-size {cfg.batch_size} exceeds the {len(train[0])} training images"
        )
    run_id = time.strftime("%Y%m%dT%H%M%S")
    logs = {name: RunLog(args.out / f"unet_{name}.jsonl", task="task1_unet")
            for name in ("steps", "epochs", "runs", "timing")}  # fmt: skip
    where = logs["runs"].env["gpu"] or logs["runs"].env["cpu"]
    print(f"data: {source}, {len(train[0])} train / {len(val[0])} val at {cfg.size}px; "
          f"device: {where}; low precision: {amp_dtype}")  # fmt: skip

    rows = []
    if not args.timing_only:
        for mode in args.modes:
            n = seeds if mode in args.multi_seed_modes else 1
            for seed in range(args.seed, args.seed + n):
                rows.append(train_run(mode, seed, cfg, device, train, val, logs, run_id))
        print_table(
            [{"mode": r["mode"], "seed": r["seed"], "train_acc": r["final_train_accuracy"],
              "val_acc": r["val_accuracy"], "skipped": r["skipped_steps"],
              "final_scale": r["final_scale"], "median_step_ms": r["step_s_median"] * 1e3}
             for r in rows],
            title=f"Training runs on {where} (logs: {args.out})",
        )  # fmt: skip
    if timing_steps > 0:
        timing = time_steps(args.modes, cfg, device, train, timing_steps, logs, run_id)
        print_table(timing, title=f"Training-step time alone, fixed batch, on {where}")
        own = next((t for t in timing if t["mode"] == "amp_dynamic"), None)
        if own and "amp_torch_scaler" in args.modes:
            print(f"own DynamicGradScaler / torch GradScaler step time: "
                  f"{own['ratio_to_torch_scaler']:.3f} (target <= 1.03)")  # fmt: skip


if __name__ == "__main__":
    run_main(main)
