"""Mock one forward-only epoch per batching pipeline and time every batch (seed 000, Task 2).

Pipelines: BRAIN (pad to 640), BIG BRAIN (pad to the batch max), ULTRA DUPER BIG BRAIN
(length-bucketed batches, span k), and packed rows (streaming concatenation, Best-Fit
Decreasing) from effdl.data.packing. Model: Embedding + sinusoidal positions + one
nn.TransformerDecoder layer (d_model 1024, 8 heads), no LM head, under inference_mode.
Every batch's forward is timed with CUDA events (effdl RegionTimer); the "ideal" row is all
real tokens at the throughput of full dense (batch x 640) batches measured in the same run.

    python task2_batching/mock_epoch.py --quick                   # CPU smoke run, tiny model
    python task2_batching/mock_epoch.py --device cuda --cache runs/cache/wt103_full.npz
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from effdl.amp.precision import PRECISION_NAMES, forward_precision
from effdl.cli import (
    UsageError,
    add_text_corpus_args,
    base_parser,
    device_from_arg,
    print_table,
    run_main,
    seed_everything,
)
from effdl.data.corpus import CorpusFormatError
from effdl.data.pipelines import PIPELINES, make_loader
from effdl.data.tokenize import prepare_wikitext_ids
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel, matmul_flops_per_token
from effdl.models.lm_objective import lm_inputs
from effdl.profiling.timing import RegionTimer, TimingStats, benchmark, peak_memory
from effdl.results import RunLog

PERCENTILES = list(range(0, 101, 5))


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task2")
    add_text_corpus_args(p)
    p.add_argument("--batch-size", type=int, default=None, help="default 64 (16 with --quick)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 5, 10, 20, 50, 640])
    p.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    p.add_argument("--max-length", type=int, default=None, help="default 640 (128 with --quick)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="ULTRA only: size batches by a padded-token budget (rows x batch max <= N, no row "
        "cap); --batch-size then sets only the dense yardstick (default: --batch-size rows)",
    )
    p.add_argument("--overflow", choices=["truncate", "drop"], default="truncate")
    p.add_argument(
        "--dtype",
        choices=PRECISION_NAMES,
        default=None,
        help="default bf16 autocast on CUDA, fp32 on CPU",
    )
    p.add_argument("--n-layers", type=int, default=1)
    p.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="time only the first N batches of each epoch (default: the full epoch)",
    )
    p.add_argument("--warmup-batches", type=int, default=10)
    p.add_argument("--dense-iters", type=int, default=30)
    p.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers (default 6 on CUDA, 0 on CPU)"
    )
    return p.parse_args()


def run_epoch(model, loader, device, autocast, max_batches, warmup_batches):
    """Warm up on a few batches, then time each batch's forward over one full epoch.

    Besides the per-batch GPU times it splits the epoch's wall time on the main thread:
    ``first_batch_s`` (worker start-up until the first batch arrives), ``wait_s`` (later
    waits for the DataLoader) and ``launch_s`` (host time to queue each forward).
    """
    with torch.inference_mode(), autocast():
        for i, batch in enumerate(loader):
            if i >= warmup_batches:
                break
            model.features(**lm_inputs(batch).to(device, labels=False).model_kwargs)
        timer = RegionTimer(device)
        real = slots = 0
        widths = []
        waits, launches = [], []
        with peak_memory(device) as mem:
            start = time.perf_counter()
            batches = iter(tqdm(loader, desc="  epoch", unit="batch", leave=False))
            for i in itertools.count():
                if max_batches is not None and i >= max_batches:
                    break
                t0 = time.perf_counter()
                batch = next(batches, None)
                t1 = time.perf_counter()
                if batch is None:
                    break
                waits.append(t1 - t0)
                inputs = lm_inputs(batch)  # counts taken on the CPU batch: no device sync
                real += inputs.n_real_tokens
                slots += inputs.n_slots
                widths.append(inputs.model_kwargs["input_ids"].shape[1])
                inputs = inputs.to(device, non_blocking=True, labels=False)
                timer.start()
                model.features(**inputs.model_kwargs)
                timer.stop()
                launches.append(time.perf_counter() - t1)
            times = timer.times()  # one synchronize
            epoch_s = time.perf_counter() - start
    host = {
        "first_batch_s": waits[0],
        "wait_s": float(np.sum(waits[1:])),
        "launch_s": float(np.sum(launches)),
    }
    return times, epoch_s, real, slots, widths, mem.gib, host


def main() -> None:
    args = parse_args()
    device = device_from_arg("cpu" if args.quick and args.device == "auto" else args.device)
    seed_everything(args.seed)
    args.batch_size = args.batch_size or (16 if args.quick else 64)
    args.max_length = args.max_length or (128 if args.quick else 640)
    args.workers = args.workers if args.workers is not None else (6 if device.type == "cuda" else 0)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if min(args.batch_size, args.max_length) < 1 or min(args.ks) < 0:
        raise UsageError("--batch-size and --max-length must be positive, --ks non-negative")
    if args.max_tokens is not None and (args.max_tokens < 1 or "ultra" not in args.pipelines):
        raise UsageError("--max-tokens must be positive and needs 'ultra' in --pipelines")

    t0 = time.perf_counter()
    try:
        corpus, vocab, source = prepare_wikitext_ids(
            args.data,
            quick=args.quick,
            seed=args.seed,
            cache=args.cache,
            max_length=args.max_length,
            overflow=args.overflow,
        )
    except CorpusFormatError as e:
        raise UsageError(f"--data/--cache: {e}") from None
    prep_s = time.perf_counter() - t0
    print(
        f"corpus: {source}: {len(corpus):,} samples, {corpus.n_tokens:,} tokens, "
        f"vocab {len(vocab):,} ({prep_s:.1f} s to read/generate + tokenize)"
    )

    if args.quick:
        cfg = GPTLikeConfig(
            vocab_size=len(vocab),
            d_model=64,
            n_heads=4,
            n_layers=1,
            d_ff=128,
            max_length=args.max_length,
        )
    else:
        cfg = GPTLikeConfig(
            vocab_size=len(vocab), n_layers=args.n_layers, max_length=args.max_length
        )
    model = GPTLikeModel(cfg).to(device).eval()
    autocast = forward_precision(device, dtype)

    # The yardstick: full dense batches (no padding), same weights, same precision. A fixed
    # shape lets cuDNN attention amortise its per-shape plan, so the ideal takes the faster of
    # the model as the pipelines run it (no cuDNN attention) and the model with it.
    dense = torch.randint(2, len(vocab), (args.batch_size, args.max_length), device=device)
    with_cudnn = GPTLikeModel(replace(cfg, cudnn_attention=True)).to(device).eval()
    with_cudnn.load_state_dict(model.state_dict())
    yardsticks = {}
    for name, m in (("dense", model), ("dense_cudnn", with_cudnn)):
        with torch.inference_mode(), autocast():
            yardsticks[name] = benchmark(
                lambda m=m: m.features(dense),
                warmup=5,
                iters=3 if args.quick else args.dense_iters,
                device=device,
            )
    del with_cudnn
    dense_stats = min(yardsticks.values(), key=lambda st: st.median)
    dense_tps = dense.numel() / dense_stats.median

    log = RunLog(args.out / "mock_epoch.jsonl", task="task2")
    base_cfg = {
        "experiment": "mock_epoch",
        "corpus": source,
        "n_samples": len(corpus),
        "corpus_tokens": corpus.n_tokens,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "overflow": args.overflow,
        "dtype": dtype,
        "device": str(device),
        "d_model": cfg.d_model,
        "n_heads": cfg.n_heads,
        "n_layers": cfg.n_layers,
        "d_ff": cfg.d_ff,
        "vocab_size": cfg.vocab_size,
        "max_batches": args.max_batches,
        "num_workers": args.workers,
        "seed": args.seed,
    }
    flops = matmul_flops_per_token(cfg, args.max_length, lm_head=False)
    rows = []
    for name, st in yardsticks.items():
        log.log(
            name,
            {**base_cfg, "pipeline": name, "cudnn_attention": name == "dense_cudnn"},
            {
                **st.as_dict("batch_s_"),
                "tokens_per_s": dense.numel() / st.median,
                "tflops": flops * dense.numel() / st.median / 1e12,
                "prep_s": prep_s,
                "is_yardstick": st is dense_stats,
            },
        )
        rows.append(
            {
                "variant": f"{name} (B x {args.max_length})",
                "batches": st.n,
                "median_ms": st.median * 1e3,
                "real_Mtok_s": dense.numel() / st.median / 1e6,
            }
        )

    variants = [(p, k) for p in args.pipelines for k in (args.ks if p == "ultra" else [None])]
    for name, k in tqdm(variants, desc="variants", unit="variant"):
        # The token budget is an ULTRA option; it replaces that pipeline's row cap.
        max_tokens = args.max_tokens if name == "ultra" else None
        variant = name if k is None else f"{name}_k{k}"
        if max_tokens is not None:
            variant += f"_mt{max_tokens}"
        loader = make_loader(
            name,
            corpus,
            None if max_tokens is not None else args.batch_size,
            k=k or 0,
            max_length=args.max_length,
            pad_id=vocab.pad_id,
            seed=args.seed,
            num_workers=args.workers,
            pin_memory=device.type == "cuda",
            attention_block_size=model.loader_block_size(device),
            max_tokens=max_tokens,
        )
        times, epoch_s, real, slots, widths, peak, host = run_epoch(
            model, loader, device, autocast, args.max_batches, args.warmup_batches
        )
        stats = TimingStats.from_times(times)
        compute_s = float(np.sum(times))
        ideal_s = real / dense_tps
        metrics = {
            **stats.as_dict("batch_s_"),
            "n_batches": len(times),
            "epoch_s": epoch_s,
            "compute_s": compute_s,
            "real_tokens": real,
            "slots": slots,
            "padding_fraction": 1 - real / slots,
            "real_tokens_per_s": real / epoch_s,
            "peak_mem_gib": peak,
            "ideal_s": ideal_s,
            "compute_over_ideal": compute_s / ideal_s,
            "epoch_over_ideal": epoch_s / ideal_s,
            **host,
            "batch_s_percentiles": np.percentile(times, PERCENTILES).tolist(),
            "width_percentiles": np.percentile(widths, PERCENTILES).tolist(),
        }
        log.log(variant, {**base_cfg, "pipeline": name, "k": k, "max_tokens": max_tokens}, metrics)
        rows.append(
            {
                "variant": variant,
                "batches": len(times),
                "median_ms": stats.median * 1e3,
                "mean_ms": stats.mean * 1e3,
                "max_ms": stats.max * 1e3,
                "epoch_s": epoch_s,
                "wait_s": host["first_batch_s"] + host["wait_s"],
                "real_Mtok_s": real / epoch_s / 1e6,
                "pad_%": 100 * (1 - real / slots),
                "peak_GiB": peak,
                "x_ideal": compute_s / ideal_s,
            }
        )
    # The whole corpus at dense throughput: the floor for one full epoch.
    ideal_epoch_s = corpus.n_tokens / dense_tps
    log.log(
        "ideal",
        {**base_cfg, "pipeline": "ideal"},
        {
            "epoch_s": ideal_epoch_s,
            "compute_s": ideal_epoch_s,
            "real_tokens": corpus.n_tokens,
            "real_tokens_per_s": dense_tps,
            "padding_fraction": 0.0,
        },
    )
    rows.append(
        {
            "variant": "ideal (full epoch)",
            "epoch_s": ideal_epoch_s,
            "real_Mtok_s": dense_tps / 1e6,
            "pad_%": 0.0,
            "x_ideal": 1.0,
        }
    )
    where = log.env["gpu"] or f"CPU ({log.env['cpu']})"
    print_table(rows, title=f"Mock epoch, forward only, {dtype}, on {where} (log: {log.path})")


if __name__ == "__main__":
    run_main(main)
