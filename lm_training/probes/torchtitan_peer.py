"""torchtitan's Llama 3 (its model, its ``parallelize_llama``: FSDP2, per-block compile, its
activation checkpointing) trained on random tokens and timed as lm_training/train.py times ours:
the peer that ``train.py --parallel fsdp`` is compared with, on the same GPUs of the same host.

Run it under torchrun beside ours with the same shape, sequence length, local batch and
checkpointing policy; FLOPs per token are counted by effdl's formula for both (6N + attention),
so the two MFUs compare. torchtitan is a probe's dependency, not the library's: 0.2.2 imports
with torch 2.11 (``pip install torchtitan==0.2.2``; offline, its wheels and those of torchdata,
datasets<4.8, dill<0.4.1, multiprocess<0.70.19, fsspec<=2026.2.0, tyro, docstring-parser,
typeguard and tomli with ``pip install --no-deps``).

    torchrun --nproc-per-node 4 lm_training/probes/torchtitan_peer.py --flavor 8B \\
        --sequence-length 8192 --batch-size 1 --activation-checkpoint selective:1 --compile
    torchrun --nproc-per-node 2 lm_training/probes/torchtitan_peer.py --quick   # CPU, gloo
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from effdl.cli import UsageError, base_parser, require_positive, run_main
from effdl.lm.processes import setup_distributed, teardown_distributed
from effdl.models.llama import TransformerModelArgs, llama_train_flops_per_token
from effdl.parallel.activation_checkpoint import ActivationCheckpointPolicy
from effdl.profiling.flops import peak_bf16_tflops
from effdl.profiling.timing import synchronize, take_peak_memory
from effdl.results import RunLog

LOG = "torchtitan_peer.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0], "runs/lm")
    p.add_argument("--flavor", default="8B", help="torchtitan's llama3 flavor (8B, debugmodel)")
    p.add_argument("--vocab-size", type=int, default=131072, help="effdl's 8b preset's")
    p.add_argument("--sequence-length", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timing-warmup", type=int, default=5, help="first steps, untimed")
    p.add_argument("--activation-checkpoint", default="selective:1",
                   help="none, full, selective:K (every K-th block) or op, as train.py takes")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="torchtitan's per-block compile")
    p.add_argument("--lr", type=float, default=3e-4)
    args = p.parse_args(argv)
    if args.quick:
        args.flavor, args.vocab_size, args.sequence_length = "debugmodel", 512, 64
        args.batch_size, args.steps, args.timing_warmup = 2, 4, 1
    require_positive(args, "vocab_size", "sequence_length", "batch_size", "steps")
    require_positive(args, "timing_warmup", minimum=0)
    require_positive(args, "lr", minimum=0)
    if args.steps <= args.timing_warmup:
        raise UsageError(f"--steps {args.steps} leaves no timed step after --timing-warmup")
    return args


def job_config(args: argparse.Namespace, policy: ActivationCheckpointPolicy, cuda: bool):
    """torchtitan's JobConfig for FSDP2 over every rank, bf16 compute with fp32 reduction."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.training.seq_len = args.sequence_length
    job.training.local_batch_size = args.batch_size
    job.training.mixed_precision_param = "bfloat16" if cuda else "float32"
    job.parallelism.data_parallel_shard_degree = -1
    job.compile.enable = args.compile
    job.compile.components = ["model"]
    mode, option = {"none": ("none", "1"), "full": ("full", "1"), "op": ("selective", "op")}.get(
        policy.mode, ("selective", str(policy.every))
    )
    job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option = mode, option
    return job


def effdl_args(titan, vocab_size: int, seq_len: int) -> TransformerModelArgs:
    """The same shape in effdl's terms, for its FLOP count."""
    return TransformerModelArgs(
        dim=titan.dim, n_layers=titan.n_layers, n_heads=titan.n_heads,
        n_kv_heads=titan.n_kv_heads, vocab_size=vocab_size, multiple_of=titan.multiple_of,
        ffn_dim_multiplier=titan.ffn_dim_multiplier, norm_eps=titan.norm_eps,
        rope_theta=titan.rope_theta, seq_len=seq_len,
    )  # fmt: skip


def main() -> None:
    args = parse_args()
    try:
        from torchtitan.distributed import ParallelDims
        from torchtitan.models.llama3 import Transformer, llama3_args, parallelize_llama
    except ImportError as e:
        raise UsageError(f"needs torchtitan 0.2.2 and its dependencies ({e})") from None
    if args.flavor not in llama3_args:
        raise UsageError(f"--flavor {args.flavor!r} is not one of {sorted(llama3_args)}")
    policy = ActivationCheckpointPolicy.parse(args.activation_checkpoint)
    d = setup_distributed("fsdp", args.device)
    cuda = d.device.type == "cuda"
    job = job_config(args, policy, cuda)
    titan_args = copy.deepcopy(llama3_args[args.flavor])
    titan_args.vocab_size = args.vocab_size
    titan_args.update_from_config(job)
    if not cuda:  # torchtitan assumes CUDA where it finds no accelerator: its meshes on the CPU
        import torchtitan.distributed.parallel_dims as titan_dims

        titan_dims.device_type = "cpu"
    dims = ParallelDims(dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                        world_size=d.world)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(titan_args)
    model = parallelize_llama(model, dims, job)  # its FSDP2 sums gradients over the ranks
    if not cuda:  # gloo has no pre-multiplied sum, which FSDP2 uses for that
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=d.device)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model.init_weights(buffer_device=d.device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=cuda)  # fmt: skip
    loss_of = torch.compile(F.cross_entropy) if args.compile else F.cross_entropy

    ours = effdl_args(titan_args, args.vocab_size, args.sequence_length)
    flops_per_token = llama_train_flops_per_token(ours, args.sequence_length)
    gpu = torch.cuda.get_device_name(d.device) if cuda else None
    peak = peak_bf16_tflops(gpu) if gpu else None
    tokens_per_gpu = args.batch_size * args.sequence_length
    config = {**{k: v for k, v in vars(args).items() if k != "out"}, "world": d.world,
              "torchtitan_args": repr(titan_args), "flops_per_token": flops_per_token}  # fmt: skip
    log = (
        RunLog(args.out / LOG, task="torchtitan_peer", create=True, seed=args.seed)
        if d.main
        else None
    )
    gen = torch.Generator().manual_seed(args.seed + d.rank)
    step_s = []
    for step in range(args.steps):
        rows = torch.randint(0, args.vocab_size, (args.batch_size, args.sequence_length + 1),
                             generator=gen).to(d.device)  # fmt: skip
        synchronize(d.device)
        start = time.perf_counter()
        logits = model(rows[:, :-1])
        loss = loss_of(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
        del logits
        (loss / d.world).backward()  # the mean over every rank's tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(d.device)
        seconds = time.perf_counter() - start
        if step >= args.timing_warmup:
            step_s.append(seconds)
        if log is not None:
            tflops = tokens_per_gpu * flops_per_token / seconds / 1e12
            log.log("torchtitan_step", {**config, "step": step}, {
                "loss": loss.item(), "step_s": seconds, "tokens_per_s_per_gpu": tokens_per_gpu / seconds,
                "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
                "peak_gib": take_peak_memory(d.device),
            })  # fmt: skip
    if log is not None:
        median = statistics.median(step_s)
        tflops = tokens_per_gpu * flops_per_token / median / 1e12
        summary = {"step_s_median": median, "tokens_per_s_per_gpu": tokens_per_gpu / median,
                   "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
                   "timed_steps": len(step_s)}  # fmt: skip
        log.log("torchtitan_summary", config, summary)
        print(f"torchtitan {args.flavor} on {d.world} x {gpu or 'CPU'}: {summary}")
    teardown_distributed(True)


if __name__ == "__main__":
    run_main(main)
