"""Fine-tune GPT-2-Large inside 11 GiB of GPU memory with a CPU-offloaded Adam.

bf16 working weights on the GPU, fp32 master weights and Adam moments on the CPU
(effdl.optim.CPUOffloadAdam), 64 x 1024 tokens per step.

    python memory_efficient_gpt2/train.py --quick                           # CPU smoke run, tiny GPT-2
    python memory_efficient_gpt2/train.py --device cuda --steps 8           # training corpus
    python memory_efficient_gpt2/train.py --device cuda --fixed-batch --steps 30 --reference adamw
    # the fixed-batch test from pretrained weights (from random init the loss stops at the
    # batch's unigram entropy): pretrain.py first, never on the fixed batch's tokens
    python memory_efficient_gpt2/pretrain.py --device cuda --minutes 4.5 --save /tmp/ckpt
    python memory_efficient_gpt2/train.py --device cuda --model-path /tmp/ckpt --fixed-batch --steps 30 --reference adamw
    python memory_efficient_gpt2/train.py --device cuda --level 3 --steps 8   # GPT-2-XL, 11 GiB
    python memory_efficient_gpt2/train.py --device cuda --level 2 --steps 8 --baseline

The speed baselines (plain forward+backward) are ``baseline.py``; ``--baseline`` times the same
two models (Hugging Face's GPT-2 under fp16 autocast, and ours in bf16, both without offload,
cap or checkpointing) right after our run in the same process and logs ``speed_ratio``: our
median sequences/s over each baseline's best micro-batch. torchao's offload optimizer under the
same caps is ``peer_torchao.py``.

Data: by default Python's own documentation and source (effdl.data.stdlib_text), tokenized by a
byte-level BPE of ``--bpe-vocab`` ids trained on it (GPT-2's 50257 by default, so the model keeps
its shape; built once under ``--cache``), documents separated by ``<bos>``; with
``--model-path`` the folder's own tokenizer reads that text instead, ``<bos>`` kept when that
tokenizer has it (so a pretrain.py folder, which carries the BPE, reads the identical stream;
GPT-2's own tokenizer has no ``<bos>``, its documents are joined). ``--data FILE`` reads
WikiText or a parquet, ``--data generated`` the synthetic token stream. The learning rate warms
up linearly over ``--warmup-steps``, then stays (``--lr-schedule constant``) or decays along a
cosine to a tenth (``cosine``).

``--reference adamw`` trains the same initial weights on the same batches a second time with
``torch.optim.AdamW(fused=True)`` on fp32 weights under bf16 autocast, uncapped, with the same
micro-batches and learning rates, and logs both loss curves and their gap (``equivalence``).
The check is the gap: a mean |gap| above MAX_MEAN_GAP_NATS prints FAIL, says so on stderr and
exits 1 (after the log is written). Each run's loss fall is printed beside its target but not
judged: it is the batch's, the weights' and the steps' (both runs share it; from random init
the loss stops at the batch's unigram entropy), not the optimizer's.

``--checkpoint-layers -1`` checkpoints the fewest blocks whose estimated memory
(effdl.profiling.memory_budget, with the activation bytes measured on the GPU) fits the cap.
``--moments int8`` keeps the Adam moments block-wise 8-bit on the host; ``--update-on device``
runs that 8-bit step on the GPU, bucket by bucket. ``--grad-accumulation-dtype bf16`` sums the
micro-batches' gradients on the GPU in bf16 (2 B/param instead of 4). ``--level`` names the
GPT-2-XL presets (effdl.gpt2_offload.config.LEVELS: 1 and 2 in 16 GiB of GPU memory, 2 with
level 3's optimizer for speed; 3 in 11 GiB and 16 GiB of host memory); flags given beside it
win, and every record's config names the level. Past ``--memory-cap-gib`` (peak GPU memory) or
``--host-memory-cap-gib`` (the process's resident set, pinned buffers included, sampled after
set-up and after every step) the run stops with MemoryCapExceeded before that step's record is
written.
"""

from __future__ import annotations

import torch

from effdl.cli import (
    base_parser,
    check_failed,
    device_from_arg,
    print_table,
    run_main,
    start_run,
)
from effdl.gpt2_offload.baseline import BaselineConfig, run_baseline, speed_ratios
from effdl.gpt2_offload.budget import require_run_fits
from effdl.gpt2_offload.config import TrainConfig, parse_train_args
from effdl.gpt2_offload.inputs import make_batches, model_folder_config
from effdl.gpt2_offload.reference import (
    MAX_MEAN_GAP_NATS,
    MIN_FALL,
    equivalence_summary,
    run_reference,
)
from effdl.gpt2_offload.run import start_offload, summarize, train_offload
from effdl.models.gpt2 import gpt2_config
from effdl.profiling.memory import use_expandable_segments
from effdl.profiling.timing import GIB
from effdl.results import RunLog
from effdl.tables import format_measured

TASK = "gpt2"
TABLE_COLUMNS = ("step", "loss", "seq_per_s", "peak_gib", "host_rss_gib", "gpu_compute_s",
                 "d2h_s", "h2d_s", "cpu_update_s", "step_wait_s")  # fmt: skip


def run_offload(
    cfg: TrainConfig,
    batches: list[torch.Tensor],
    device: torch.device,
    log: RunLog,
    seed: int,
    data: dict[str, str],
) -> tuple[list[dict], dict, dict]:
    """Train on ``batches`` with CPUOffloadAdam under the memory caps from the weights of
    ``seed`` (effdl.gpt2_offload.run): a ``memory_budget`` record, one record per step, then a
    summary; returns the step metrics, the summary's and the records' config. Past a cap,
    MemoryCapExceeded before the record it would spoil."""
    run = start_offload(cfg, device, log, seed, data)
    variant = "fixed_batch" if cfg.fixed_batch else "corpus"
    rows = train_offload(run, cfg, batches, device, log, variant)
    run.opt.close()
    summary = summarize(rows, cfg.fixed_batch, run.budget)
    log.log(f"{variant}_summary", run.config, summary)
    return rows, summary, run.config


def run_speed_baseline(
    cfg: TrainConfig, summary: dict, config: dict, device: torch.device, log: RunLog
) -> None:
    """The baselines of effdl.gpt2_offload.baseline at ``--baseline-micro-batches`` on this
    run's model size, sequence and weights, then a ``speed_ratio`` record (our run's config):
    our median speed over each baseline's best."""
    base = BaselineConfig(
        size=cfg.size, seq=cfg.seq, micro_batches=cfg.baseline_micro_batches,
        chunk_tokens=cfg.chunk_tokens, dropout=cfg.dropout, model_path=cfg.model_path,
    )  # fmt: skip
    rows, bests = run_baseline(base, device, log)
    ratios = speed_ratios(summary["seq_per_s_median"], bests)
    log.log("speed_ratio", config, ratios)
    print_table(rows, title="Baselines: forward+backward without offload (random token ids)")
    level = f"--level {cfg.level}" if cfg.level is not None else "our run"
    for variant, best in bests.items():
        print(
            f"{level}: {ratios['seq_per_s_median']:.2f} seq/s = "
            f"{ratios[f'ratio_to_{variant}']:.3f}x {variant} ({best['seq_per_s']:.2f} seq/s at "
            f"micro-batch {best['micro_batch']}: {ratios[f'{variant}_is']})"
        )


def print_offload(rows: list[dict], summary: dict, fixed_batch: bool, title: str) -> None:
    """Our run's step table, the state's placement and the peaks beside their estimates."""
    print_table([{k: r[k] for k in TABLE_COLUMNS} for r in rows], title=title)
    state = [{**r, "gib": r["bytes"] / GIB} for r in summary["state"]]
    print_table(state, title="Training state: where it lives (computed)")
    peak = format_measured(summary["peak_gib_max"])  # "-" off CUDA: not measured
    print(
        f"GPU: peak {peak} GiB measured, {summary['gpu_budget_gib']:.3f} GiB estimated;"
        f" host: resident set peak {summary['host_rss_peak_gib']:.3f} GiB "
        f"measured, state {summary['host_budget_gib']:.3f} GiB computed"
    )
    if fixed_batch:
        drop = summary["loss_drop"]
        print(f"fixed batch: loss fell by {drop:.1%} in {len(rows)} steps (target >= 50%)")


def print_equivalence(rows: list[dict], reference: list[dict], eq: dict, data: str) -> None:
    """Both loss curves step by step, their gap and its verdict, and each run's fall beside
    its target."""
    table = [{"step": r["step"], "lr": r["lr"], "ours": r["loss"], "reference": ref["loss"],
              "gap": gap} for r, ref, gap in zip(rows, reference, eq["abs_gap"], strict=True)]  # fmt: skip
    print_table(table, title=f"Equivalence with torch AdamW ({data})")
    print(
        f"equivalence: mean |gap| {eq['mean_abs_gap']:.4f} nats (max {eq['max_abs_gap']:.4f}; "
        f"target <= {MAX_MEAN_GAP_NATS}): {'PASS' if eq['gap_ok'] else 'FAIL'}"
    )
    print(
        f"loss fall: ours {eq['fall_ours']:.1%}, reference {eq['fall_reference']:.1%} "
        f"(fixed-batch target >= {MIN_FALL:.0%})"
    )


def main() -> int | None:
    args, cfg = parse_train_args(base_parser(__doc__.splitlines()[0], default_out="runs/gpt2"))
    # Before CUDA starts: without it the cap counts memory reserved between segments.
    use_expandable_segments()
    # Every input is checked before the log is opened: a refused run leaves no record.
    model_config = model_folder_config(cfg.model_path, cfg.size, cfg.seq) or gpt2_config(cfg.size)
    device = device_from_arg("cpu" if args.quick and args.device == "auto" else args.device)
    require_run_fits(cfg, model_config, device)  # before the data and the model are made
    batches, data = make_batches(cfg, model_config.vocab_size, args.seed)
    run = start_run(args, task=TASK, logs="gpt2.jsonl")
    rows, summary, config = run_offload(cfg, batches, run.device, run.log, args.seed, data)
    title = f"CPU-offloaded Adam on {run.where} (log: {run.log.path})"
    print_offload(rows, summary, cfg.fixed_batch, title)
    if cfg.reference == "adamw":
        reference = run_reference(cfg, batches, run.device, run.log, args.seed, config)
        eq = equivalence_summary(rows, reference)
        run.log.log("equivalence", config, eq)
        print_equivalence(rows, reference, eq, data["data"])
    if cfg.baseline:
        run_speed_baseline(cfg, summary, config, run.device, run.log)
    if cfg.reference == "adamw" and not eq["gap_ok"]:
        return check_failed(
            f"ours and torch AdamW apart: mean |loss gap| {eq['mean_abs_gap']:.4f} nats > "
            f"{MAX_MEAN_GAP_NATS}"
        )
    return None


if __name__ == "__main__":
    run_main(main)
