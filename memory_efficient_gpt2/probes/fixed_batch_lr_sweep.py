"""How far torch AdamW brings GPT-2's loss down on one fixed real batch, and what stops it.

The reference run of ``train.py --reference adamw`` (fp32 weights, bf16 autocast, the same
initial weights, fixed batch, micro-batches and warm-up), repeated for each learning rate in
``--lrs``, each Adam beta2 in ``--beta2s`` and each fixed-batch size in ``--batches`` (default:
``--batch``; the batch of n sequences is the one ``train.py --batch n`` fixes: the first n of
the stream). Per batch size a ``batch_entropy`` record: the loss a model reaches by predicting
the batch's own token frequencies (unigram entropy) or each next token's frequencies after the
token before it (bigram conditional entropy), the levels to hold the curves against. One
``reference_adamw`` record per step (its config carries lr, beta2 and batch) and a ``fall``
record per run. Every other flag is ``memory_efficient_gpt2/train.py``'s.

    python memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py --lrs 3e-4 1e-3 --device cuda --steps 30
    python memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py --lrs 3e-4 --batches 8 16 64 \
        --micro-batch 8 --device cuda --steps 30
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import sys
from pathlib import Path

import torch

from effdl.cli import UsageError, print_table, run_main, start_run
from effdl.data.token_streams import next_token_entropies
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
    sweep.add_argument("--beta2s", type=float, nargs="+", default=[0.999])
    sweep.add_argument("--batches", type=int, nargs="+", default=None)
    known, rest = sweep.parse_known_args()
    train = load_train()
    sys.argv = [sys.argv[0], "--fixed-batch", *rest]
    args, cfg = train.parse_args()
    for n in known.batches or []:
        try:
            dataclasses.replace(cfg, batch=n).validate()
        except UsageError as e:
            raise UsageError(f"--batches {n}: {e}") from None
    run = start_run(args, task=train.TASK, logs="gpt2_fixed_batch_lr_sweep.jsonl")
    falls = []
    for batch in known.batches or [cfg.batch]:
        at_batch = dataclasses.replace(cfg, batch=batch)
        batches, data = train.make_batches(at_batch, gpt2_config(cfg.size).vocab_size, args.seed)
        floors = next_token_entropies(batches[0])
        run.log.log("batch_entropy", {"batch": batch, "seq": cfg.seq, **data}, floors)
        for lr, beta2 in itertools.product(known.lrs, known.beta2s):
            at = dataclasses.replace(at_batch, lr=lr)
            config = {**dataclasses.asdict(at), "beta2": beta2, **data}  # paths: the log writes str
            rows = train.run_reference(
                at, batches, run.device, run.log, args.seed, config, betas=(0.9, beta2)
            )
            losses = [r["loss"] for r in rows]
            fall = {"batch": batch, "lr": lr, "beta2": beta2, "first": losses[0],
                    "last": losses[-1], "min": min(losses), "fall": 1 - losses[-1] / losses[0],
                    "fall_at_30": 1 - losses[min(29, len(losses) - 1)] / losses[0],
                    "unigram_entropy": floors["unigram"], "bigram_entropy": floors["bigram"],
                    "last_minus_unigram": losses[-1] - floors["unigram"],
                    "fall_to_unigram": 1 - floors["unigram"] / losses[0]}  # fmt: skip
            run.log.log("fall", config, fall)
            falls.append(fall)
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(
        [{k: f[k] for k in ("batch", "lr", "beta2", "first", "last", "fall", "unigram_entropy",
                            "fall_to_unigram")} for f in falls],
        title=f"torch AdamW on one fixed batch ({data['data']}), {run.where}",
    )  # fmt: skip


if __name__ == "__main__":
    run_main(main)
