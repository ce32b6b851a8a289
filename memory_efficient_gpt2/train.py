"""Fine-tune GPT-2-Large inside 11 GiB of GPU memory: bf16 working weights on the GPU, fp32
master weights and Adam moments on the CPU (effdl.optim.CPUOffloadAdam), 64 x 1024 tokens per step.

    python memory_efficient_gpt2/train.py --quick                           # CPU smoke run, tiny GPT-2
    python memory_efficient_gpt2/train.py --device cuda --baseline          # HF fp16 autocast fwd+bwd
    python memory_efficient_gpt2/train.py --device cuda --steps 8           # training corpus
    python memory_efficient_gpt2/train.py --device cuda --fixed-batch --steps 30

Budget (GPT-2-Large, bf16, micro-batch 4): GPU = 1.44 GiB working weights + 2.88 GiB fp32
gradient accumulation (``--grad-accumulation gpu``) + activations (~36 d bytes per token per
block, a checkpointed block 2 d) + one loss chunk; host = ~13 GiB pinned. One step is
64 x 1024 x ~5.2 GFLOP = 0.34 PFLOP of GPU work; the CPU update (~0.3-0.6 s) overlaps the last
micro-batch's backward only, so it is the main exposed cost. ``memory_budget`` picks how many
blocks to checkpoint (``--checkpoint-layers -1``) so the estimate stays under the cap.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from effdl.cli import (
    UsageError,
    base_parser,
    device_from_arg,
    print_table,
    require_path,
    run_main,
    seed_everything,
)
from effdl.models.gpt2 import (
    SHAPES,
    build_gpt2,
    checkpoint_blocks,
    count_params,
    gpt2_config,
    lm_loss,
)
from effdl.optim import CPUOffloadAdam
from effdl.profiling.memory_budget import ESTIMATE_HEADROOM_GIB, host_budget, memory_budget
from effdl.profiling.timing import GIB, benchmark
from effdl.results import RunLog

TASK = "gpt2"


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/gpt2")
    p.add_argument("--baseline", action="store_true", help="HF fp16-autocast fwd+bwd speed only")
    p.add_argument("--fixed-batch", action="store_true", help="train on one fixed batch")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--batch", type=int, default=64, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, default=1024, help="sequence length")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward")
    p.add_argument(
        "--checkpoint-layers",
        type=int,
        default=-1,
        help="blocks to recompute in backward; -1 = fewest that fit the cap (estimate)",
    )
    p.add_argument("--grad-accumulation", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--memory-cap-gib", type=float, default=11.0)
    p.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per loss chunk")
    p.add_argument("--cpu-threads", type=int, default=None, help="default: cores - 2")
    p.add_argument("--size", choices=sorted(SHAPES), default="large")
    p.add_argument("--model-path", type=Path, default=None, help="local HF GPT-2 folder")
    p.add_argument("--data", type=Path, default=None, help="text file (e.g. wiki.train.raw)")
    p.add_argument("--baseline-micro-batches", type=int, nargs="+", default=[4, 8, 16])
    return p.parse_args()


# ----------------------------------------------------------------------------------- data
def synthetic_stream(n_tokens: int, vocab: int, seed: int) -> torch.Tensor:
    """A learnable token stream: Zipf-distributed draws from 512 fixed random phrases of 4-32
    tokens each (inside a phrase the next token is predictable)."""
    g = torch.Generator().manual_seed(seed)
    phrases = [
        torch.randint(0, vocab, (int(torch.randint(4, 33, (1,), generator=g)),), generator=g)
        for _ in range(512)
    ]
    weights = 1.0 / torch.arange(1, len(phrases) + 1, dtype=torch.float64)
    out, n = [], 0
    while n < n_tokens:
        for k in torch.multinomial(weights, 4096, replacement=True, generator=g).tolist():
            out.append(phrases[k])
            n += len(phrases[k])
    return torch.cat(out)[:n_tokens]


def text_stream(path: Path, model_path: Path | None, n_tokens: int, vocab: int) -> torch.Tensor:
    """Tokens of a text file: the GPT-2 tokenizer from ``--model-path`` if it has one, else
    raw UTF-8 bytes (ids < 256, a valid if crude tokenization that needs no download)."""
    require_path(path, "a UTF-8 text file such as WikiText-103's wiki.train.raw", "--data")
    with path.open("rb") as f:
        raw = f.read(n_tokens * 8)
    tok_file = model_path / "tokenizer.json" if model_path is not None else None
    if tok_file is not None and tok_file.exists():
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tok_file)).encode(raw.decode("utf-8", "ignore")).ids
        tokens = torch.tensor(ids, dtype=torch.long)
    else:
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    if tokens.numel() < n_tokens or int(tokens.max()) >= vocab:
        raise UsageError(f"--data: {path} gives {tokens.numel()} tokens, need {n_tokens}")
    return tokens[:n_tokens]


def make_batches(args, vocab: int, steps: int) -> list[torch.Tensor]:
    """One (batch, seq) int64 tensor per step (the same one with --fixed-batch)."""
    distinct = 1 if args.fixed_batch else steps
    n = distinct * args.batch * args.seq
    if args.data is not None:
        tokens = text_stream(args.data, args.model_path, n, vocab)
    else:
        tokens = synthetic_stream(n, vocab, args.seed)
    chunks = list(tokens.view(distinct, args.batch, args.seq))
    return [chunks[0]] * steps if args.fixed_batch else chunks


# ----------------------------------------------------------------------------------- baseline
def run_baseline(args, device: torch.device, log: RunLog) -> list[dict]:
    """Plain HF GPT2LMHeadModel (fp32 weights, gelu_new), fp16 autocast, forward+backward."""
    model = build_gpt2(gpt2_config(args.size, fast_gelu=False), args.model_path, fast_gelu=False)
    model.to(device).train()
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    vocab = model.config.vocab_size
    rows = []
    for mb in args.baseline_micro_batches:
        ids = torch.randint(0, vocab, (mb, args.seq), device=device)

        def fwd_bwd(ids=ids) -> None:
            with torch.autocast(device.type, dtype=amp_dtype):
                loss = model(ids, labels=ids).loss
            loss.backward()

        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            stats = benchmark(
                fwd_bwd,
                warmup=1 if args.quick else 2,
                iters=2 if args.quick else 5,
                device=device,
                setup=lambda: model.zero_grad(set_to_none=True),
            )
        except torch.cuda.OutOfMemoryError:
            rows.append({"micro_batch": mb, "seq_per_s": float("nan"), "note": "OOM"})
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else math.nan
        row = {"micro_batch": mb, "seq_per_s": mb / stats.median, "peak_gib": peak}
        log.log(
            "baseline",
            {"size": args.size, "seq": args.seq, "micro_batch": mb, "amp": str(amp_dtype)},
            {**row, **stats.as_dict("fwd_bwd_s_")},
        )
        rows.append(row)
    ok = [r for r in rows if not math.isnan(r["seq_per_s"])]
    if not ok:
        raise RuntimeError("baseline: every micro-batch size ran out of memory")
    best = max(ok, key=lambda r: r["seq_per_s"])
    log.log("baseline_best", {"size": args.size, "seq": args.seq}, best)
    return rows


# ----------------------------------------------------------------------------------- ours
def measure_activation_bytes(model, opt: CPUOffloadAdam, device: torch.device, args) -> float:
    """Bytes autograd keeps per token per block, measured on one sequence with no block
    checkpointed (also a warm-up); the gradients it makes are discarded."""
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), device=device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    loss = lm_loss(model, ids, args.chunk_tokens)
    held = torch.cuda.memory_allocated(device) - before
    # the loss function keeps its fp32 LM-head gradient and the hidden-state gradient
    held -= model.lm_head.weight.numel() * 4 + args.seq * model.config.n_embd * 2
    opt.backward(loss)
    opt.zero_grad()
    return held / (args.seq * model.config.n_layer)


def pick_checkpoint_layers(args, n_params: int, cap_gib: float, act_bytes: float | None) -> int:
    shape = SHAPES[args.size]
    if args.checkpoint_layers >= 0:
        return args.checkpoint_layers
    for n in range(shape.n_layer + 1):
        est = memory_budget(
            shape, n_params, args.micro_batch, args.seq, n, args.grad_accumulation,
            args.chunk_tokens, act_bytes_per_token_layer=act_bytes,
        )  # fmt: skip
        if est["total"] + ESTIMATE_HEADROOM_GIB <= cap_gib:
            return n
    raise UsageError(
        f"--micro-batch {args.micro_batch}: does not fit {cap_gib} GiB even with every block "
        "checkpointed; use a smaller micro-batch"
    )


def set_memory_cap(device: torch.device, cap_gib: float) -> float:
    """Enforce the cap with the caching allocator; returns the fraction set."""
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    frac = min(1.0, cap_gib / total)
    torch.cuda.set_per_process_memory_fraction(frac, device)
    return frac


def run_offload(args, device: torch.device, log: RunLog) -> list[dict]:
    cuda = device.type == "cuda"
    cap_gib = args.memory_cap_gib
    if cuda:
        set_memory_cap(device, cap_gib)
    threads = args.cpu_threads or max(1, (os.cpu_count() or 2) - 2)
    model = build_gpt2(gpt2_config(args.size), args.model_path).train()
    n_params = count_params(model)
    opt = CPUOffloadAdam(
        model.parameters(),
        lr=args.lr,
        weight_decay=args.weight_decay,
        device=device,
        working_dtype=torch.bfloat16,
        grad_accumulation=args.grad_accumulation,
        num_threads=threads,
    )
    model.to(device)  # buffers; parameters are already bf16 working copies on the device
    static_gib = torch.cuda.memory_allocated(device) / GIB if cuda else math.nan
    act_bytes = measure_activation_bytes(model, opt, device, args) if cuda else None
    ckpt = pick_checkpoint_layers(args, n_params, cap_gib, act_bytes)
    checkpoint_blocks(model, ckpt)
    opt.timeline.enabled = True
    n_micro = args.batch // args.micro_batch
    variant = "fixed_batch" if args.fixed_batch else "corpus"
    config = {
        "size": args.size,
        "n_params": n_params,
        "seq": args.seq,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "n_micro": n_micro,
        "checkpoint_layers": ckpt,
        "grad_accumulation": args.grad_accumulation,
        "lr": args.lr,
        "cpu_threads": threads,
        "memory_cap_gib": cap_gib,
        "chunk_tokens": args.chunk_tokens,
        "data": str(args.data) if args.data else "synthetic",
        "pretrained": args.model_path is not None,
    }
    budget = memory_budget(
        SHAPES[args.size], n_params, args.micro_batch, args.seq, ckpt,
        args.grad_accumulation, args.chunk_tokens, act_bytes_per_token_layer=act_bytes,
    )  # fmt: skip
    log.log(
        "memory_budget",
        config,
        {
            **{f"gpu_{k}_gib": v for k, v in budget.items()},
            **{
                f"host_{k}_gib": v for k, v in host_budget(n_params, args.grad_accumulation).items()
            },
            "measured_static_gib": static_gib,
            "measured_act_bytes_per_token_layer": act_bytes if act_bytes else math.nan,
            "estimated_act_bytes_per_token_layer": 36 * SHAPES[args.size].n_embd,
        },
    )
    batches = make_batches(args, model.config.vocab_size, args.steps)
    proc = psutil.Process()
    rows = []
    for step, batch in enumerate(tqdm(batches, desc=variant, unit="step")):
        opt.timeline.reset()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        losses = []
        for i, mb in enumerate(batch.split(args.micro_batch)):
            start = opt.timeline.mark()
            loss = lm_loss(model, mb.to(device, non_blocking=True), args.chunk_tokens) / n_micro
            opt.backward(loss, final=i == n_micro - 1)
            opt.timeline.add("gpu_compute", i, start, opt.timeline.mark())
            losses.append(loss.detach())
        t_step = time.perf_counter()
        opt.step()
        opt.timeline.add("step_wait", -1, t_step, time.perf_counter())
        loss_value = float(torch.stack(losses).sum())  # the one sync per step
        wall = time.perf_counter() - t0
        peak_gib = torch.cuda.max_memory_allocated(device) / GIB if cuda else math.nan
        if peak_gib > cap_gib:
            raise RuntimeError(
                f"step {step}: peak GPU memory {peak_gib:.3f} GiB exceeds the {cap_gib} GiB cap"
            )
        totals = opt.timeline.totals()
        metrics = {
            "step": step,
            "loss": loss_value,
            "step_s": wall,
            "seq_per_s": args.batch / wall,
            "peak_gib": peak_gib,
            "host_rss_gib": proc.memory_info().rss / GIB,
            "gpu_compute_s": totals.get("gpu_compute", 0.0),
            "d2h_s": totals.get("d2h", 0.0),
            "h2d_s": totals.get("h2d", 0.0),
            "cpu_update_s": totals.get("cpu_update", 0.0),
            "cpu_accumulate_s": totals.get("cpu_accumulate", 0.0),
            "step_wait_s": totals.get("step_wait", 0.0),
        }
        if step == len(batches) - 1:
            metrics["timeline"] = opt.timeline.spans()
        log.log(variant, config, metrics)
        rows.append(metrics)
    opt.close()
    summarize(args, log, config, rows, variant)
    return rows


def summarize(args, log: RunLog, config: dict, rows: list[dict], variant: str) -> None:
    timed = rows[1:] or rows  # the first step pays warm-up (cuBLAS, allocator growth)
    speeds = sorted(r["seq_per_s"] for r in timed)
    first, last = rows[0]["loss"], rows[-1]["loss"]
    metrics = {
        "steps": len(rows),
        "seq_per_s_median": speeds[len(speeds) // 2],
        "peak_gib_max": max(r["peak_gib"] for r in rows),
        "loss_first": first,
        "loss_last": last,
        "loss_drop": 1.0 - last / first,
    }
    if args.fixed_batch:
        metrics["loss_halved"] = last <= 0.5 * first
    log.log(f"{variant}_summary", config, metrics)


def main() -> None:
    args = parse_args()
    if args.quick:
        args.size, args.seq, args.batch, args.micro_batch = "tiny", 64, 8, 2
        args.steps = min(args.steps, 4)
        args.baseline_micro_batches = [2, 4]
        args.lr = 1e-3 if args.lr == 1e-4 else args.lr
    device = device_from_arg("cpu" if args.quick and args.device == "auto" else args.device)
    seed_everything(args.seed)
    if args.batch % args.micro_batch:
        raise UsageError(
            f"--batch {args.batch} is not a multiple of --micro-batch {args.micro_batch}"
        )
    if min(args.steps, args.seq, args.micro_batch) < 1:
        raise UsageError("--steps, --seq and --micro-batch must be positive")
    if args.seq > SHAPES[args.size].n_positions:
        raise UsageError(
            f"--seq {args.seq} exceeds GPT-2's {SHAPES[args.size].n_positions} positions"
        )
    if args.model_path is not None:
        require_path(
            args.model_path,
            "a local Hugging Face GPT-2 folder (config.json + weights)",
            "--model-path",
        )
    log = RunLog(args.out / "gpt2.jsonl", task=TASK)
    if args.baseline:
        rows = run_baseline(args, device, log)
        print_table(
            rows, title=f"Baseline fwd+bwd (HF, autocast) on {log.env['gpu'] or log.env['cpu']}"
        )
        return
    rows = run_offload(args, device, log)
    table = [
        {k: r[k] for k in ("step", "loss", "seq_per_s", "peak_gib", "host_rss_gib", "gpu_compute_s",
                           "d2h_s", "h2d_s", "cpu_update_s", "step_wait_s")}
        for r in rows
    ]  # fmt: skip
    print_table(
        table, title=f"CPU-offloaded Adam on {log.env['gpu'] or log.env['cpu']} (log: {log.path})"
    )
    if args.fixed_batch:
        drop = 1.0 - rows[-1]["loss"] / rows[0]["loss"]
        print(f"fixed batch: loss fell by {drop:.1%} in {len(rows)} steps (target >= 50%)")


if __name__ == "__main__":
    run_main(main)
