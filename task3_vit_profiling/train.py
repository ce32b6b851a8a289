"""One epoch of ViT training on Clothing, then one validation pass: the course's pipeline as given
or fixed (seed 000, Task 3), timed and logged.

``--pipeline`` picks the preset (effdl.vit_pipeline lists what differs); every other flag overrides
one setting, so each fix can be measured alone. Measured: the epoch's wall time (train +
validation) and images/s over it, the host's wait for every batch against the device time of
every step (CUDA events), peak GPU memory of each pass, and loss/accuracy (validation both as
the pipeline reports it and image-weighted). One record per run in ``vit_pipeline.jsonl``; the
training pass's own record goes to ``vit_train_epoch.jsonl`` before validation starts, so a run
stopped during validation keeps it. A training loss that turns non-finite is refused (``--lr``).

    python task3_vit_profiling/train.py --quick --pipeline as_given          # CPU smoke run
    python task3_vit_profiling/train.py --device cuda --pipeline as_given
    python task3_vit_profiling/train.py --device cuda --pipeline fixed
    python task3_vit_profiling/train.py --device cuda --pipeline fixed --workers 0   # one fix off
    python task3_vit_profiling/train.py --data /path/to/clothing-dataset-full ...
"""

from __future__ import annotations

import effdl.vit_pipeline as vp
from effdl.cli import Interrupted, Run, print_table, require_converged, run_main, start_run
from effdl.profiling.timing import TimingStats, largest_measured

LOG = "vit_pipeline.jsonl"
TRAIN_LOG = "vit_train_epoch.jsonl"  # the training pass alone, written before validation


def wait_over_step(phase: vp.PhaseResult) -> float | None:
    """Host time waiting for batches / device time of the steps, after the first batch (whose
    wait is the workers' start-up); None with a single batch (no step to measure)."""
    if len(phase.step_s) < 2:
        return None
    return sum(phase.wait_s[1:]) / sum(phase.step_s[1:])


def phase_metrics(prefix: str, phase: vp.PhaseResult) -> dict:
    return {
        f"{prefix}_s": phase.wall_s,
        f"{prefix}_images_per_s": phase.n_images / phase.wall_s,
        f"{prefix}_batches": len(phase.sizes),
        f"{prefix}_first_wait_s": phase.wait_s[0],
        f"{prefix}_wait_s": sum(phase.wait_s),
        f"{prefix}_step_s": sum(phase.step_s),
        f"{prefix}_wait_over_step": wait_over_step(phase),
        **TimingStats.from_times(phase.wait_s).as_dict(f"{prefix}_wait_s_"),
        **TimingStats.from_times(phase.step_s).as_dict(f"{prefix}_step_s_"),
        f"{prefix}_peak_mem_gib": phase.peak_mem_gib,
        f"{prefix}_loss": phase.mean(phase.losses),
        f"{prefix}_accuracy": phase.mean(phase.accuracies),
    }


def epoch_metrics(cfg: vp.PipelineConfig, train: vp.PhaseResult, val: vp.PhaseResult) -> dict:
    """The record's metrics. ``val_*_reported``: the averages the pipeline itself prints (as
    given: sums of batch means over the training loader's length); ``val_loss``/``val_accuracy``
    are image-weighted for every pipeline."""
    divisor = len(train.sizes) if cfg.val_divisor == "train_batches" else None
    reported = {
        f"val_{name}_reported": sum(values) / divisor if divisor else val.mean(values)
        for name, values in (("loss", val.losses), ("accuracy", val.accuracies))
    }
    epoch_s = train.wall_s + val.wall_s
    return {
        "epoch_s": epoch_s,
        "images": train.n_images + val.n_images,
        "images_per_s": (train.n_images + val.n_images) / epoch_s,
        "n_train": train.n_images,
        "n_val": val.n_images,
        "peak_mem_gib": largest_measured([train.peak_mem_gib, val.peak_mem_gib]),
        **phase_metrics("train", train),
        **phase_metrics("val", val),
        **reported,
    }


def log_training(run: Run, variant: str, config: dict, train: vp.PhaseResult) -> None:
    """The training pass's record in vit_train_epoch.jsonl (none for a pass with no batch); a
    loss that is not finite ends the run naming --lr, before the record."""
    for step, loss in enumerate(train.losses):
        require_converged("--lr", f"training at step {step}", loss)
    if train.sizes:
        metrics = {"n_train": train.n_images, **phase_metrics("train", train)}
        run.logs["vit_train_epoch"].log(variant, config, metrics)


def summary_row(cfg: vp.PipelineConfig, m: dict) -> dict:
    return {
        "pipeline": cfg.pipeline,
        "images": m["images"],
        "epoch_s": m["epoch_s"],
        "images_per_s": m["images_per_s"],
        "train_wait/step": m["train_wait_over_step"],
        "peak_GiB": m["peak_mem_gib"],
        "train_acc": m["train_accuracy"],
        "val_acc": m["val_accuracy"],
        "val_loss": m["val_loss"],
    }


def main() -> None:
    args, cfg = vp.parse_config(__doc__.splitlines()[0], default_out="runs/vit")
    run: Run = start_run(args, task="task3_vit", logs=(LOG, TRAIN_LOG))
    cfg = vp.for_device(cfg, run.device)
    data = vp.prepare_data(cfg)
    train_loader, val_loader = vp.make_loaders(cfg, data)
    trainer = vp.build_trainer(cfg, run.device, len(data.classes))
    print(f"{cfg.pipeline}: {data.source}, {len(train_loader.dataset)} train / "
          f"{len(val_loader.dataset)} val images, {trainer.n_params:,} parameters, on {run.where}")  # fmt: skip
    config = {**cfg.recorded(), "source": data.source, "n_params": trainer.n_params,
              "device": str(run.device), "seed": run.seed, "run_id": run.run_id}  # fmt: skip
    try:
        train = vp.run_phase(trainer, train_loader, train=True)
    except Interrupted as stop:  # Ctrl-C: the batches trained so far are logged first
        log_training(run, cfg.pipeline, {**config, "interrupted": True}, stop.partial)
        raise KeyboardInterrupt from None
    log_training(run, cfg.pipeline, config, train)
    val = vp.run_phase(trainer, val_loader, train=False)
    metrics = epoch_metrics(cfg, train, val)
    run.log.log(cfg.pipeline, config, metrics)
    print_table([summary_row(cfg, metrics)], title=f"One epoch on {run.where} (logs: {run.out})")


if __name__ == "__main__":
    run_main(main)
