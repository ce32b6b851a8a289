"""The GPU commands the READMEs show, each with the short form `make gpu-check` runs.

One entry per command: the command line exactly as a README shows it, its short form (the same
script with a few steps and small sizes, on ``--device cuda``), a time limit, the GPUs it needs
and where its headline figure is in the run log it writes. The README.md lines between the
``gpu-commands`` markers are generated from this list; lines of another README are checked
against it (tests/test_gpu_commands.py), where a line that differs from a README.md one only in
``python``/``python3`` and ``--out`` counts as that command.

Short forms are format strings: ``{out}`` is the command's own log folder, ``{run}`` the
check's fresh folder (shared by the commands of one check), ``{cache}`` a data cache kept
across checks. ``python3`` and ``torchrun`` run with the checking Python.

    python3 tools/gpu_commands.py                   # the README lines, one per command
    python3 tools/gpu_commands.py --write-readme    # regenerate README.md's command blocks
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCKS = ("gpu-commands", "gpu-commands-multi")  # one GPU; torchrun on several


@dataclass(frozen=True)
class Headline:
    """The figure a run is summed up by: ``metric`` of the last record whose variant matches
    ``variant`` (a glob), times ``scale``, in ``unit``."""

    variant: str
    metric: str
    unit: str
    scale: float = 1.0


@dataclass(frozen=True)
class GpuCommand:
    name: str  # short and unique: the check's table, --only
    command: str  # as the README shows it
    check: str  # the short form: same script, few steps, small sizes
    limit_s: int
    headline: Headline | None  # None: the script writes no run log
    min_gpus: int = 1
    comment: str = ""  # the README line's trailing comment
    readme: str = "README.md"  # the README that shows the command
    after: str | None = None  # a command whose output this one reads
    requires: tuple[str, ...] = ()  # optional modules; without them the command is skipped
    exclusive: bool = False  # a GPU of its own: large, or its figure is a speed ratio

    @property
    def script(self) -> str:
        """The script's path, relative to the repository root."""
        return next(word for word in self.command.split() if word.endswith(".py"))


# The stdlib corpus at the --quick size, one small BPE: every LM script shares the cache.
STDLIB = "--bpe-vocab 512 --corpus-bytes 1048576 --cache {cache}/lm"
GPT2 = f"--size tiny --batch 8 --micro-batch 4 --seq 128 {STDLIB}"
LM = f"--steps 6 --timing-warmup 2 --log-every 1 {STDLIB} --device cuda"
TOKENS = Headline("*_summary", "tokens_per_s", "tokens/s")
VIT = "--n-images 320 --min-side 160 --max-side 480 --data-cache {cache}/task3 --depth 4 --batch-size 64"

COMMANDS: tuple[GpuCommand, ...] = (
    # -- several GPUs: first, so a budget that runs out on a multi-GPU host cuts 1-GPU work
    GpuCommand(
        "pipeline-nccl",
        "torchrun --nproc-per-node 4 memory_efficient_gpt2/pipeline_parallel.py --backend nccl",
        "torchrun --nproc-per-node 2 memory_efficient_gpt2/pipeline_parallel.py --backend nccl"
        " --stages 2 --steps 20 --timed-steps 10 --out {out}",
        60,
        Headline("1f1b_summary", "median_step_s", "ms/step", 1e3),
        min_gpus=2,
    ),
    GpuCommand(
        "tensor-nccl",
        "torchrun --nproc-per-node 2 memory_efficient_gpt2/tensor_parallel.py --backend nccl",
        "torchrun --nproc-per-node 2 memory_efficient_gpt2/tensor_parallel.py --backend nccl"
        " --steps 20 --warmup 5 --out {out}",
        60,
        Headline("block_parallel", "step_ms_median", "ms/step"),
        min_gpus=2,
    ),
    GpuCommand(
        "tensor-dtensor",
        "torchrun --nproc-per-node 2 memory_efficient_gpt2/tensor_parallel.py --backend nccl --compare-dtensor --bench-width 64 512 4096",
        "torchrun --nproc-per-node 2 memory_efficient_gpt2/tensor_parallel.py --backend nccl"
        " --compare-dtensor --bench-width 64 512 4096 --bench-rounds 5 --warmup 2 --out {out}",
        60,
        Headline("mlp_ours", "fwd_bwd_ms_median", "ms fwd+bwd, width 4096"),
        min_gpus=2,
        comment="our tensor-parallel MLP against DTensor's",
    ),
    GpuCommand(
        "lm-ddp",
        "torchrun --nproc-per-node 2 lm_training/train.py --model 1b --parallel ddp --fused-optimizer --compile",
        f"torchrun --nproc-per-node 2 lm_training/train.py --model 125m --parallel ddp --fused-optimizer --compile {LM} --out {{out}}",
        90,
        TOKENS,
        min_gpus=2,
    ),
    GpuCommand(
        "lm-fsdp",
        "torchrun --nproc-per-node 2 lm_training/train.py --model 1b --parallel fsdp --precision fsdp-mp --fused-optimizer --compile",
        f"torchrun --nproc-per-node 2 lm_training/train.py --model 125m --parallel fsdp --precision fsdp-mp --fused-optimizer --compile {LM} --out {{out}}",
        90,
        TOKENS,
        min_gpus=2,
    ),
    # -- one GPU: the runs behind the committed reports
    GpuCommand(
        "ceilings",
        "python3 swiglu_checkpoint/gpu_ceilings.py --device cuda --out runs/ceilings",
        "python3 swiglu_checkpoint/gpu_ceilings.py --device cuda --sizes 4096 --copy-gib 1 --iters 5 --out {out}",
        30,
        Headline("matmul_bf16", "tflops", "TFLOP/s"),
    ),
    GpuCommand(
        "task1-unet",
        "python3 task1_loss_scaling/train_unet.py --device cuda --seeds 3 --out runs/task1",
        "python3 task1_loss_scaling/train_unet.py --device cuda --seeds 1 --n-images 96 --size 128"
        " --batch-size 16 --epochs 1 --timing-steps 5 --cache {cache}/task1 --out {out}",
        60,
        Headline("amp_dynamic", "step_s_median", "ms/step", 1e3),
    ),
    GpuCommand(
        "task1-lm-precision",
        "python3 task1_loss_scaling/lm_precision.py --device cuda --timing-batch-sizes 32 128 --out runs/task1",
        "python3 task1_loss_scaling/lm_precision.py --device cuda --timing-batch-sizes 32 128"
        " --n-samples 2500 --cache {cache}/lm --max-vocab 4096 --d-model 256 --steps 20"
        " --warmup-steps 2 --seeds 2 --eval-batches 2 --timing-reps 5 --out {out}",
        45,
        Headline("amp_dynamic", "step_s_median", "ms/step", 1e3),
    ),
    GpuCommand(
        "task2-mock-epoch",
        "python3 task2_batching/mock_epoch.py --device cuda --pipelines brain bigbrain ultra packed_concat packed_bfd --ks 1 5 10 20 50 640 --out runs/task2",
        "python3 task2_batching/mock_epoch.py --device cuda --quick --pipelines brain bigbrain ultra"
        " packed_concat packed_bfd --ks 1 5 10 20 50 640 --max-batches 20 --warmup-batches 2"
        " --cache {cache}/task2/wt103_quick.npz --out {out}",
        60,
        Headline("packed_bfd", "real_tokens_per_s", "tokens/s"),
    ),
    GpuCommand(
        "task2-mock-epoch-k640",
        "python3 task2_batching/mock_epoch.py --device cuda --pipelines bigbrain ultra --ks 640 --out runs/task2",
        "python3 task2_batching/mock_epoch.py --device cuda --quick --pipelines bigbrain ultra --ks 640"
        " --max-batches 20 --warmup-batches 2 --cache {cache}/task2/wt103_quick.npz --out {out}",
        20,
        Headline("ultra_k640", "real_tokens_per_s", "tokens/s"),
    ),
    GpuCommand(
        "task2-mock-epoch-budget",
        "python3 task2_batching/mock_epoch.py --device cuda --pipelines ultra packed_concat packed_bfd --ks 5 --max-tokens 40960 --repeats 3 --out runs/task2",
        "python3 task2_batching/mock_epoch.py --device cuda --quick --pipelines ultra packed_concat"
        " packed_bfd --ks 5 --max-tokens 40960 --repeats 2 --max-batches 20 --warmup-batches 2"
        " --cache {cache}/task2/wt103_quick.npz --out {out}",
        60,
        Headline("ultra_k5_mt40960", "real_tokens_per_s", "tokens/s"),
    ),
    GpuCommand(
        "task2-train-pipelines",
        "python3 task2_batching/train_pipelines.py --device cuda --out runs/task2",
        "python3 task2_batching/train_pipelines.py --device cuda --quick --token-budget 40000"
        " --cache {cache}/task2/wt103_quick_v4k.npz --out {out}",
        30,
        Headline("packed_bfd", "real_tokens_per_s", "tokens/s"),
    ),
    GpuCommand(
        "task2-sampler-costs",
        "python3 task2_batching/sampler_costs.py --out runs/task2",
        "python3 task2_batching/sampler_costs.py --ns 10000 100000 --batches 200 --repeats 1 --out {out}",
        15,
        Headline("sampler_n100000_k640", "batch_s_mean", "µs/batch", 1e6),
    ),
    GpuCommand(
        "task2-packing-costs",
        "python3 task2_batching/packing_costs.py --out runs/task2",
        "python3 task2_batching/packing_costs.py --sizes 10000 100000 --iters 1 --warmup 0 --out {out}",
        15,
        Headline("packing_bfd", "time_s_median", "ms", 1e3),
    ),
    GpuCommand(
        "gpt2-baseline",
        "python3 memory_efficient_gpt2/baseline.py --device cuda --out runs/gpt2",
        "python3 memory_efficient_gpt2/baseline.py --device cuda --size tiny --seq 128 --micro-batches 2 4 --out {out}",
        40,
        Headline("baseline_own_best", "seq_per_s", "seq/s"),
    ),
    GpuCommand(
        "gpt2-offload",
        "python3 memory_efficient_gpt2/train.py --device cuda --steps 8 --out runs/gpt2",
        f"python3 memory_efficient_gpt2/train.py --device cuda --steps 3 {GPT2} --out {{out}}",
        45,
        Headline("*_summary", "peak_gib_max", "GiB"),
    ),
    GpuCommand(
        "gpt2-fixed-batch",
        "python3 memory_efficient_gpt2/train.py --device cuda --fixed-batch --steps 30 --reference adamw --out runs/gpt2",
        f"python3 memory_efficient_gpt2/train.py --device cuda --fixed-batch --steps 4 --reference adamw {GPT2} --out {{out}}",
        45,
        Headline("fixed_batch_summary", "seq_per_s_median", "seq/s"),
        comment="ours in 11 GiB, then torch AdamW from the same weights",
    ),
    GpuCommand(
        "gpt2-pretrain",
        "python3 memory_efficient_gpt2/pretrain.py --device cuda --minutes 4.5 --save /tmp/ckpt --out runs/gpt2",
        "python3 memory_efficient_gpt2/pretrain.py --device cuda --minutes 0.1 --save {run}/gpt2-pretrained"
        " --size tiny --steps 10 --batch 8 --micro-batch 4 --seq 128 --skip-tokens 1024"
        f" {STDLIB} --out {{out}}",
        45,
        Headline("pretrain_summary", "tokens_per_s_median", "tokens/s"),
        comment="GPT-2-Large pretrained on the stdlib corpus, never on the fixed batch",
    ),
    GpuCommand(
        "gpt2-pretrained-fixed-batch",
        "python3 memory_efficient_gpt2/train.py --device cuda --model-path /tmp/ckpt --fixed-batch --steps 30 --reference adamw --out runs/gpt2",
        "python3 memory_efficient_gpt2/train.py --device cuda --model-path {run}/gpt2-pretrained"
        f" --fixed-batch --steps 4 --reference adamw {GPT2} --out {{out}}",
        45,
        Headline("fixed_batch_summary", "seq_per_s_median", "seq/s"),
        comment="the fixed-batch test from those weights",
        after="gpt2-pretrain",
    ),
    GpuCommand(
        "gpt2-xl-level2",
        "python3 memory_efficient_gpt2/train.py --device cuda --level 2 --steps 8 --baseline --out runs/gpt2",
        "python3 memory_efficient_gpt2/train.py --device cuda --level 2 --steps 3 --baseline"
        f" --baseline-micro-batches 2 4 {GPT2} --out {{out}}",
        60,
        Headline("speed_ratio", "ratio_to_baseline", "x HF fwd+bwd"),
        comment="then the plain forward+backward of HF's GPT-2 and ours, same process",
        exclusive=True,
    ),
    GpuCommand(
        "gpt2-pretrain-docs",
        "python3 memory_efficient_gpt2/pretrain.py --device cuda --corpus docs --size xl --batch 16 --skip-tokens 16384 --steps 40 --warmup-steps 4 --save runs/gpt2/xl-docs --out runs/gpt2",
        "python3 memory_efficient_gpt2/pretrain.py --device cuda --corpus docs --minutes 0.1 --save {run}/gpt2-docs"
        " --size tiny --steps 10 --batch 8 --micro-batch 4 --seq 128 --skip-tokens 1024"
        f" {STDLIB} --out {{out}}",
        45,
        Headline("pretrain_summary", "heldout_loss", "nats"),
        comment="GPT-2-XL on the stdlib's documentation alone: no code file seen",
    ),
    GpuCommand(
        "gpt2-finetune-code",
        "python3 memory_efficient_gpt2/finetune_code.py --device cuda --model-path runs/gpt2/xl-docs --out runs/gpt2",
        "python3 memory_efficient_gpt2/finetune_code.py --device cuda --model-path {run}/gpt2-docs"
        f" --steps 3 --max-new-tokens 8 --heldout-windows 16 {GPT2} --out {{out}}",
        90,
        Headline("finetune_summary", "heldout_loss_after", "nats"),
        comment="level 3 on the training code files; held-out loss and generations before/after",
        after="gpt2-pretrain-docs",
    ),
    GpuCommand(
        "gpt2-torchao",
        "python3 memory_efficient_gpt2/peer_torchao.py --device cuda --steps 8 --out runs/gpt2",
        f"python3 memory_efficient_gpt2/peer_torchao.py --device cuda --steps 3 {GPT2} --out {{out}}",
        45,
        Headline("torchao_summary", "seq_per_s_median", "seq/s"),
        comment="torchao's CPUOffloadOptimizer, right after ours on the same host",
        requires=("torchao",),
    ),
    GpuCommand(
        "swiglu-benchmark",
        "python3 swiglu_checkpoint/benchmark.py --device cuda --out runs/swiglu",
        "python3 swiglu_checkpoint/benchmark.py --device cuda --configs 8,512,1024,4096,3 --dtypes bf16"
        " --reps 3 --rounds 3 --warmup-time 0 --min-time 0 --settle 0 --out {out}",
        30,
        Headline("level0", "step_s_median", "ms/step", 1e3),
    ),
    GpuCommand(
        "vit-train",
        "python3 task3_vit_profiling/train.py --device cuda --pipeline as_given --out runs/vit",
        f"python3 task3_vit_profiling/train.py --device cuda --pipeline as_given {VIT} --out {{out}}",
        60,
        Headline("as_given", "train_images_per_s", "images/s"),
        comment="and --pipeline fixed, and fixed with one flag undone",
    ),
    GpuCommand(
        "vit-profile",
        "python3 task3_vit_profiling/profile_model.py --device cuda --pipeline fixed --compare-batch-size 8192 --out runs/vit/profile",
        f"python3 task3_vit_profiling/profile_model.py --device cuda --pipeline fixed {VIT}"
        " --compare-batch-size 64 --wait 0 --warmup 1 --active 1 --overhead-rounds 1"
        " --overhead-seconds 0 --overhead-steps 1 --sample-every 2 --compare-sample-every 2"
        " --out {out}",
        45,
        Headline("fixed", "bare_step_ms_median", "ms/step"),
        comment="and --pipeline as_given",
    ),
    GpuCommand(
        "lm-1b-compile",
        "python3 lm_training/train.py --model 1b --fused-optimizer --compile --out runs/lm",
        f"python3 lm_training/train.py --model 125m --fused-optimizer --compile {LM} --out {{out}}",
        60,
        TOKENS,
        comment="lm_training/README.md lists the whole study",
    ),
    GpuCommand(
        "lm-1b-accumulate",
        "python3 lm_training/train.py --model 1b --sequence-length 2048 --batch-size 8 --grad-accumulation 4 --fused-optimizer --compile --out runs/lm",
        "python3 lm_training/train.py --model 125m --sequence-length 2048 --batch-size 8"
        f" --grad-accumulation 2 --fused-optimizer --compile {LM} --out {{out}}",
        60,
        TOKENS,
    ),
    GpuCommand(
        "lm-layer-norm",
        "python3 lm_training/layer_norm_benchmark.py --device cuda --out runs/lm",
        "python3 lm_training/layer_norm_benchmark.py --device cuda --shapes 16384x1024 --dtypes bf16"
        " --warmup 2 --warmup-time 0 --reps 3 --rounds 3 --min-time 0 --graph-replays 3 --out {out}",
        60,
        Headline("fused", "gb_per_s", "GB/s"),
    ),
    GpuCommand(
        "lm-loss-kernels",
        "python3 lm_training/probes/loss_kernels.py --device cuda",
        "python3 lm_training/probes/loss_kernels.py --device cuda --tokens 1024 --vocab 32768"
        " --iters 3 --out {out}",
        90,
        Headline("effdl", "median_ms", "ms"),
        readme="lm_training/README.md",
    ),
    GpuCommand(
        "lm-speedup-stages",
        "python3 lm_training/speedup_stages.py --device cuda --out runs/lm",
        "python3 lm_training/speedup_stages.py --device cuda --steps 5 --warmup-steps 1 --profile-steps 1"
        f" --tokens-per-step 4096 {STDLIB} --out {{out}}",
        120,
        Headline("stage*_compile", "tokens_per_s", "tokens/s"),
    ),
    GpuCommand(
        "gpt2-xl-baseline",
        "python3 memory_efficient_gpt2/baseline.py --device cuda --size xl --out runs/gpt2",
        "python3 memory_efficient_gpt2/baseline.py --device cuda --size xl --seq 128"
        " --micro-batches 2 --out {out}",
        90,
        Headline("baseline_own_best", "seq_per_s", "seq/s"),
        comment="then train.py --level 1, --level 3 on the same host",
    ),
    GpuCommand(
        "gpt2-int8-update",
        "python3 memory_efficient_gpt2/probes/int8_update_speed.py --device cuda --out runs/gpt2",
        "python3 memory_efficient_gpt2/probes/int8_update_speed.py --device cuda --values 16777216"
        " --tensor-numel 4194304 --bucket-numel 8388608 --steps 2 --out {out}",
        20,
        Headline("int8_update_device", "ns_per_value", "ns/value"),
    ),
    GpuCommand(
        "gpt2-lr-sweep",
        "python3 memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py --lrs 3e-4 1e-3 --beta2s 0.999 0.95 --micro-batch 8 --steps 30 --device cuda --out runs/gpt2",
        "python3 memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py --lrs 3e-4 1e-3 --beta2s 0.999 0.95"
        " --micro-batch 4 --steps 3 --device cuda --size tiny --batch 8 --seq 128"
        f" {STDLIB} --out {{out}}",
        40,
        Headline("fall", "fall", "loss fall"),
    ),
    GpuCommand(
        "gpt2-lr-sweep-batches",
        "python3 memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py --lrs 3e-4 --batches 8 16 32 --micro-batch 8 --steps 30 --device cuda --out runs/gpt2",
        "python3 memory_efficient_gpt2/probes/fixed_batch_lr_sweep.py --lrs 3e-4 --batches 8 16 32"
        " --micro-batch 8 --steps 3 --device cuda --size tiny --batch 8 --seq 128"
        f" {STDLIB} --out {{out}}",
        45,
        Headline("fall", "fall", "loss fall"),
        comment="each batch's loss floor",
    ),
    GpuCommand(
        "vit-profiler-host-cost",
        "python3 task3_vit_profiling/probes/layer_profiler_host_cost.py --device cuda",
        "python3 task3_vit_profiling/probes/layer_profiler_host_cost.py --device cuda --rounds 3 --steps 10",
        20,
        None,
        comment="Profile's host time per hooked module call",
    ),
    # -- one GPU: lm_training/README.md's study
    GpuCommand(
        "lm-1b",
        "python3 lm_training/train.py --model 1b",
        f"python3 lm_training/train.py --model 125m {LM} --out {{out}}",
        30,
        TOKENS,
        readme="lm_training/README.md",
    ),
    # seed 002's deliverable 5: each setting alone against the baseline's batch
    GpuCommand(
        "lm-1b-fused-only",
        "python3 lm_training/train.py --model 1b --fused-optimizer",
        f"python3 lm_training/train.py --model 125m --fused-optimizer {LM} --out {{out}}",
        30,
        TOKENS,
        readme="lm_training/README.md",
    ),
    GpuCommand(
        "lm-1b-compile-only",
        "python3 lm_training/train.py --model 1b --compile",
        f"python3 lm_training/train.py --model 125m --compile {LM} --out {{out}}",
        60,
        TOKENS,
        readme="lm_training/README.md",
    ),
    GpuCommand(
        "lm-1b-seq4096",
        "python3 lm_training/train.py --model 1b --sequence-length 4096",
        f"python3 lm_training/train.py --model 125m --sequence-length 4096 {LM} --out {{out}}",
        30,
        TOKENS,
        readme="lm_training/README.md",
    ),
    GpuCommand(
        "lm-1b-seq4096-same-tokens",
        "python3 lm_training/train.py --model 1b --sequence-length 4096 --batch-size 2",
        f"python3 lm_training/train.py --model 125m --sequence-length 4096 --batch-size 2 {LM} --out {{out}}",
        30,
        TOKENS,
        readme="lm_training/README.md",
    ),
    GpuCommand(
        "lm-1b-long",
        "python3 lm_training/train.py --model 1b --fused-optimizer --compile --sequence-length 4096 --batch-size 2",
        "python3 lm_training/train.py --model 125m --fused-optimizer --compile --sequence-length 4096"
        f" --batch-size 2 {LM} --out {{out}}",
        60,
        TOKENS,
        readme="lm_training/README.md",
    ),
    GpuCommand(
        "lm-1b-fsdp-mp",
        "python3 lm_training/train.py --model 1b --parallel fsdp --precision fsdp-mp --fused-optimizer --compile",
        "python3 lm_training/train.py --model 125m --parallel fsdp --precision fsdp-mp"
        f" --fused-optimizer --compile {LM} --out {{out}}",
        60,
        TOKENS,
        readme="lm_training/README.md",
    ),
    GpuCommand(
        "lm-1b-master",
        "python3 lm_training/train.py --model 1b --precision master --batch-size 8 --grad-accumulation 16 --workers 8 --fused-optimizer --compile",
        "python3 lm_training/train.py --model 125m --precision master --batch-size 8"
        f" --grad-accumulation 2 --workers 8 --fused-optimizer --compile {LM} --out {{out}}",
        60,
        TOKENS,
        readme="lm_training/README.md",
    ),
    GpuCommand(
        "lm-1b-profile",
        "python3 lm_training/train.py --model 1b --profile --steps 12",
        f"python3 lm_training/train.py --model 125m --profile --profile-steps 2 {LM} --out {{out}}",
        40,
        TOKENS,
        readme="lm_training/README.md",
    ),
    GpuCommand(
        "lm-125m-curve",
        "python3 lm_training/train.py --model 125m --steps 600 --batch-size 16 --eval-every 50 --log-every 50",
        "python3 lm_training/train.py --model 125m --batch-size 16 --sequence-length 256 --eval-every 3"
        f" --eval-batches 1 {LM} --out {{out}}",
        40,
        TOKENS,
        readme="lm_training/README.md",
    ),
    GpuCommand(
        "lm-speedup-stages-7-8",
        "python3 lm_training/speedup_stages.py --device cuda --stages 7,8",
        "python3 lm_training/speedup_stages.py --device cuda --stages 7,8 --steps 5 --warmup-steps 1"
        f" --profile-steps 1 --tokens-per-step 4096 {STDLIB} --out {{out}}",
        45,
        Headline("stage8_*", "tokens_per_s", "tokens/s"),
        readme="lm_training/README.md",
    ),
)


def block_of(command: GpuCommand) -> str | None:
    """The README.md block a command is generated into (None: another README shows it)."""
    if command.readme != "README.md":
        return None
    return BLOCKS[1] if command.min_gpus > 1 else BLOCKS[0]


def readme_line(command: GpuCommand) -> str:
    return f"{command.command}   # {command.comment}" if command.comment else command.command


def block_text(block: str) -> str:
    """A marked block: its markers around a bash fence of its commands' README lines."""
    lines = [readme_line(c) for c in COMMANDS if block_of(c) == block]
    return "\n".join([f"<!-- {block}:begin -->", "```bash", *lines, "```", f"<!-- {block}:end -->"])


def render_readme(text: str) -> str:
    """``text`` with every marked block replaced by the one generated from COMMANDS."""
    for block in BLOCKS:
        pattern = re.compile(rf"<!-- {block}:begin -->.*?<!-- {block}:end -->", re.DOTALL)
        if len(pattern.findall(text)) != 1:
            raise ValueError(f"README.md needs one <!-- {block}:begin/end --> pair")
        text = pattern.sub(lambda _, b=block: block_text(b), text)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write-readme", action="store_true", help="regenerate README.md's blocks")
    args = p.parse_args()
    if not args.write_readme:
        for c in COMMANDS:
            print(readme_line(c))
        return 0
    old = README.read_text(encoding="utf-8")
    new = render_readme(old)
    if new != old:
        README.write_text(new, encoding="utf-8")
    print(f"{README.name}: {'rewritten' if new != old else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
