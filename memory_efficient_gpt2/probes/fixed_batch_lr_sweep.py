"""How far torch AdamW brings GPT-2's loss down on one fixed real batch, and what stops it.

The reference run of ``train.py --reference adamw`` (fp32 weights, bf16 autocast, the same
initial weights, fixed batch, micro-batches and warm-up), repeated for each learning rate in
``--lrs``, each Adam beta2 in ``--beta2s`` and each fixed-batch size in ``--batches`` (default:
``--batch``; the batch of n sequences is the one ``train.py --batch n`` fixes: the first n of
the stream). Per batch size a ``batch_entropy`` record: the loss a model reaches by predicting
the batch's own token frequencies (unigram entropy) or each next token's frequencies after the
token before it (bigram conditional entropy), the levels to hold the curves against. One
``reference_adamw`` record per step (its config carries lr, beta2 and batch) and a ``fall``
record per run. Every other flag is ``memory_efficient_gpt2/train.py``'s
(effdl.gpt2_offload.config).

    python memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py --lrs 3e-4 1e-3 --device cuda --steps 30
    python memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py --lrs 3e-4 --batches 8 16 64 \
        --micro-batch 8 --device cuda --steps 30
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from effdl.cli import UsageError, base_parser, print_table, run_main, start_run
from effdl.data.token_streams import next_token_entropies
from effdl.gpt2_offload.config import FLAGS, parse_train_args
from effdl.gpt2_offload.inputs import make_batches
from effdl.gpt2_offload.reference import run_reference
from effdl.models.gpt2 import gpt2_config


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], default_out="runs/gpt2")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3])
    parser.add_argument("--beta2s", type=float, nargs="+", default=[0.999])
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    args, cfg = parse_train_args(parser, [n for n in FLAGS if not n.startswith("baseline")])
    cfg = dataclasses.replace(cfg, fixed_batch=True)
    for n in args.batches or []:
        try:
            dataclasses.replace(cfg, batch=n).validate()
        except UsageError as e:
            raise UsageError(f"--batches {n}: {e}") from None
    run = start_run(args, task="gpt2", logs="gpt2_fixed_batch_lr_sweep.jsonl")
    falls = []
    for batch in args.batches or [cfg.batch]:
        at_batch = dataclasses.replace(cfg, batch=batch)
        batches, data = make_batches(at_batch, gpt2_config(cfg.size).vocab_size, args.seed)
        floors = next_token_entropies(batches[0])
        run.log.log("batch_entropy", {"batch": batch, "seq": cfg.seq, **data}, floors)
        for lr, beta2 in itertools.product(args.lrs, args.beta2s):
            at = dataclasses.replace(at_batch, lr=lr)
            config = {**dataclasses.asdict(at), "beta2": beta2, **data}  # paths: the log writes str
            rows = run_reference(
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
