"""Forward+backward speed of GPT-2 without offload: the baselines of train.py's offloaded run.

Two models, each timed at every ``--micro-batches`` size on random token ids: Hugging Face's
``GPT2LMHeadModel`` as shipped (fp32 weights, ``gelu_new``, its own full-logits loss) under fp16
autocast (bf16 on the CPU), and ours as train.py computes (bf16 weights, tanh GELU, the chunked
loss), without the offload, the memory cap or checkpointing (effdl.gpt2_offload.baseline). One
record per model and micro-batch size (``baseline``, ``baseline_own``), then each model's
fastest (``*_best``); a size that runs out of GPU memory is shown as OOM and not logged.
``train.py --baseline`` runs the same after its own run, in one process.

    python memory_efficient_gpt2/baseline.py --quick                        # CPU smoke run
    python memory_efficient_gpt2/baseline.py --device cuda                  # GPT-2-Large
    python memory_efficient_gpt2/baseline.py --device cuda --size xl        # GPT-2-XL
"""

from __future__ import annotations

import argparse
from pathlib import Path

from effdl.cli import ConfigFlags, base_parser, print_table, run_main, start_run
from effdl.gpt2_offload.baseline import BaselineConfig, run_baseline
from effdl.gpt2_offload.inputs import model_folder_config
from effdl.models.gpt2 import SHAPES
from effdl.profiling.memory import use_expandable_segments

TASK = "gpt2"
FULL = BaselineConfig()
QUICK = BaselineConfig(size="tiny", seq=64, micro_batches=(2, 4), warmup=1, iters=2)


def parse_args() -> tuple[argparse.Namespace, BaselineConfig]:
    """The command line: the common flags, then the config's; returns (args, config)."""
    p = base_parser(__doc__.splitlines()[0], default_out="runs/gpt2")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("size", choices=sorted(SHAPES))
    flags.add("seq", type=int, help="sequence length")
    flags.add("micro_batches", type=int, nargs="+", help="sequences per forward/backward")
    flags.add("warmup", type=int, help="untimed calls before each measurement")
    flags.add("iters", type=int, help="timed calls per measurement (median)")
    flags.add("chunk_tokens", type=int, help="tokens per chunk of our loss")
    flags.add("dropout", type=float, help="of every GPT-2 dropout layer")
    flags.add("model_path", type=Path, help="local HF GPT-2 folder")
    args = p.parse_args()
    return args, flags.resolve(args)


def main() -> None:
    args, cfg = parse_args()
    use_expandable_segments()  # as in train.py, so peaks compare
    model_folder_config(cfg.model_path, cfg.size, cfg.seq)  # refused before the log opens
    run = start_run(args, task=TASK, logs="gpt2.jsonl")
    rows, _ = run_baseline(cfg, run.device, run.log)
    print_table(rows, title=f"Baseline fwd+bwd on {run.where} (log: {run.log.path})")


if __name__ == "__main__":
    run_main(main)
