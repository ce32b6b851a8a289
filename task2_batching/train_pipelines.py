"""Train the GPT-2-like LM on the same token budget with each batching pipeline (seed 001).

Each pipeline (BRAIN, BIG BRAIN, ULTRA DUPER BIG BRAIN = BalancedBatchSampler at each k, packed
rows) trains a freshly initialised model (same seed) with forward + backward + AdamW until it
has consumed ``--token-budget`` real (non-padding) tokens. Reported: total wall time (data
loading included, one synchronize at the end), peak GPU memory, steps, and the mean loss of the
last steps, so the pipelines compare at equal useful work rather than equal step counts.

    python task2_batching/train_pipelines.py --quick            # CPU smoke run, tiny model
    python task2_batching/train_pipelines.py --device cuda --cache runs/cache/wt103_v32k.npz
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from tqdm import tqdm

from effdl.amp.precision import forward_precision
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
from effdl.models.lm_objective import LMInputs, lm_cross_entropy, lm_inputs, next_token_labels
from effdl.profiling.timing import peak_memory
from effdl.results import RunLog


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task2")
    add_text_corpus_args(p)
    p.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    p.add_argument("--ks", type=int, nargs="+", default=[5, 50], help="spans for 'ultra'")
    p.add_argument("--token-budget", type=int, default=None, help="default 5e6 (4e4 with --quick)")
    p.add_argument("--batch-size", type=int, default=None, help="default 32 (8 with --quick)")
    p.add_argument("--max-length", type=int, default=None, help="default 640 (128 with --quick)")
    p.add_argument("--max-vocab", type=int, default=None, help="default 32768 (4096 with --quick)")
    p.add_argument("--n-layers", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument(
        "--dtype",
        choices=["bf16", "tf32", "fp32"],
        default=None,
        help="default bf16 autocast on CUDA, fp32 on CPU",
    )
    p.add_argument("--workers", type=int, default=None, help="default 6 on CUDA, 0 on CPU")
    return p.parse_args()


def endless(loader) -> Iterator:
    """Batches of ``loader``, epoch after epoch (samplers advance their epoch on each pass)."""
    while True:
        yield from loader


def train_step(model, opt, inputs: LMInputs, autocast) -> torch.Tensor:
    with autocast():
        loss = lm_cross_entropy(model(**inputs.model_kwargs), inputs.labels)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def main() -> None:
    args = parse_args()
    device = device_from_arg("cpu" if args.quick and args.device == "auto" else args.device)
    batch_size = args.batch_size or (8 if args.quick else 32)
    max_length = args.max_length or (128 if args.quick else 640)
    budget = args.token_budget or (40_000 if args.quick else 5_000_000)
    max_vocab = args.max_vocab or (4096 if args.quick else 32768)
    workers = args.workers if args.workers is not None else (6 if device.type == "cuda" else 0)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if min(batch_size, max_length, budget, max_vocab) < 2 or min(args.ks) < 0:
        raise UsageError("sizes must be >= 2 and --ks non-negative")
    autocast = forward_precision(device, dtype)

    try:
        corpus, vocab, source = prepare_wikitext_ids(
            args.data,
            quick=args.quick,
            seed=args.seed,
            cache=args.cache,
            max_size=max_vocab,
            max_length=max_length,
        )
    except CorpusFormatError as e:
        raise UsageError(f"--data/--cache: {e}") from None
    print(f"corpus: {source}: {len(corpus):,} samples, {corpus.n_tokens:,} tokens")
    if args.quick:
        cfg = GPTLikeConfig(len(vocab), d_model=64, n_heads=4, d_ff=128, max_length=max_length)
    else:
        cfg = GPTLikeConfig(len(vocab), n_layers=args.n_layers, max_length=max_length)

    # Warm up CUDA, cuBLAS and the allocator once on a throwaway model, outside every timing.
    warm = GPTLikeModel(cfg).to(device)
    warm_opt = torch.optim.AdamW(warm.parameters(), lr=args.lr)
    dense = torch.randint(2, len(vocab), (batch_size, max_length), device=device)
    dense_inputs = LMInputs(
        {"input_ids": dense}, next_token_labels(dense), dense.numel(), dense.numel()
    )
    for _ in range(3):
        train_step(warm, warm_opt, dense_inputs, autocast)
    del warm, warm_opt

    log = RunLog(args.out / "train_pipelines.jsonl", task="task2")
    base_cfg = {
        "experiment": "train_pipelines",
        "corpus": source,
        "token_budget": budget,
        "batch_size": batch_size,
        "max_length": max_length,
        "dtype": dtype,
        "device": str(device),
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "vocab_size": cfg.vocab_size,
        "lr": args.lr,
        "num_workers": workers,
        "seed": args.seed,
    }
    variants = [(p, k) for p in args.pipelines for k in (args.ks if p == "ultra" else [None])]
    rows = []
    for name, k in tqdm(variants, desc="pipelines", unit="pipeline"):
        variant = name if k is None else f"{name}_k{k}"
        seed_everything(args.seed)
        model = GPTLikeModel(cfg).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        loader = make_loader(
            name,
            corpus,
            batch_size,
            k=k or 0,
            max_length=max_length,
            pad_id=vocab.pad_id,
            seed=args.seed,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            attention_block_size=model.loader_block_size(device),
        )
        real = slots = 0
        losses = []
        with peak_memory(device) as mem:
            start = time.perf_counter()
            bar = tqdm(total=budget, desc=f"  {variant}", unit="tok", unit_scale=True, leave=False)
            for batch in endless(loader):
                inputs = lm_inputs(batch)
                real += inputs.n_real_tokens
                slots += inputs.n_slots
                losses.append(
                    train_step(model, opt, inputs.to(device, non_blocking=True), autocast)
                )
                bar.update(inputs.n_real_tokens)
                if real >= budget:
                    break
            bar.close()
            tail = torch.stack(losses[-20:]).float().mean().item()  # the one synchronize
            total_s = time.perf_counter() - start
        flops = 3 * matmul_flops_per_token(cfg, max_length) * slots
        metrics = {
            "total_s": total_s,
            "steps": len(losses),
            "real_tokens": real,
            "slots": slots,
            "padding_fraction": 1 - real / slots,
            "real_tokens_per_s": real / total_s,
            "peak_mem_gib": mem.gib,
            "final_loss": tail,
            "approx_tflops": flops / total_s / 1e12,
        }
        log.log(variant, {**base_cfg, "pipeline": name, "k": k}, metrics)
        rows.append(
            {
                "pipeline": variant,
                "steps": len(losses),
                "total_s": total_s,
                "real_Mtok_s": real / total_s / 1e6,
                "pad_%": 100 * (1 - real / slots),
                "peak_GiB": mem.gib,
                "final_loss": tail,
            }
        )
        del model, opt, loader
    where = log.env["gpu"] or f"CPU ({log.env['cpu']})"
    print_table(
        rows, title=f"Training on {budget:,} real tokens, {dtype}, on {where} (log: {log.path})"
    )


if __name__ == "__main__":
    run_main(main)
