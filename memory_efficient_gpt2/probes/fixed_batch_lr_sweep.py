"""How far torch AdamW brings GPT-2's loss down on one fixed real batch, for several learning rates.

The reference run of ``train.py --reference adamw`` (fp32 weights, bf16 autocast, the same
initial weights, fixed batch, micro-batches and warm-up), repeated for each ``--lrs`` value: whether
the fall the equivalence run reaches in 30 steps depends on the learning rate, and after how many
steps the loss leaves the plateau where it predicts the batch's token frequencies. Every other flag
is ``memory_efficient_gpt2/train.py``'s. One ``reference_adamw`` record per step (its config
carries the lr) and a ``fall`` record per lr.

    python memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py --lrs 3e-4 1e-3 --device cuda --steps 60
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch

from effdl.cli import print_table, run_main, start_run
from effdl.models.gpt2 import gpt2_config

SCRIPT = Path(__file__).resolve().parent.parent / "train.py"


def load_train():
    """memory_efficient_gpt2/train.py as a module."""
    spec = importlib.util.spec_from_file_location("gpt2_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    sweep = argparse.ArgumentParser(add_help=False)
    sweep.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3])
    known, rest = sweep.parse_known_args()
    train = load_train()
    sys.argv = [sys.argv[0], "--fixed-batch", *rest]
    args, cfg = train.parse_args()
    run = start_run(args, task=train.TASK, logs="gpt2_fixed_batch_lr_sweep.jsonl")
    batches, data = train.make_batches(cfg, gpt2_config(cfg.size).vocab_size, args.seed)
    falls = []
    for lr in known.lrs:
        at = dataclasses.replace(cfg, lr=lr)
        config = {**{k: str(v) if isinstance(v, Path) else v
                     for k, v in dataclasses.asdict(at).items()}, **data}  # fmt: skip
        rows = train.run_reference(at, batches, run.device, run.log, args.seed, config)
        losses = [r["loss"] for r in rows]
        fall = {"lr": lr, "first": losses[0], "last": losses[-1], "min": min(losses),
                "fall": 1 - losses[-1] / losses[0],
                "fall_at_30": 1 - losses[min(29, len(losses) - 1)] / losses[0]}  # fmt: skip
        run.log.log("fall", config, fall)
        falls.append(fall)
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(falls, title=f"torch AdamW on one fixed batch ({data['data']}), {run.where}")


if __name__ == "__main__":
    run_main(main)
