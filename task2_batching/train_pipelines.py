"""Train the GPT-2-like LM on the same token budget with each batching pipeline (seed 001).

Each pipeline (BRAIN, BIG BRAIN, ULTRA DUPER BIG BRAIN = BalancedBatchSampler at each k, packed
rows) trains a freshly initialised model (same seed) with forward + backward + AdamW until it
has consumed ``--token-budget`` real (non-padding) tokens. Reported: total wall time (data
loading included, one synchronize at the end), peak GPU memory (of the run: its largest batch;
and the median step's own peak), steps, and the mean loss of the last steps, so the pipelines
compare at equal useful work rather than equal step counts. One record per pipeline as it ends;
a Ctrl-C writes the interrupted pipeline's record of its finished steps (``config.interrupted``).

    python task2_batching/train_pipelines.py --quick            # CPU smoke run, tiny model
    python task2_batching/train_pipelines.py --device cuda --cache runs/cache/wt103_v32k.npz
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from tqdm import tqdm

from effdl.amp.precision import forward_precision
from effdl.cli import (
    Interrupted,
    Run,
    UsageError,
    print_table,
    require_converged,
    require_fits,
    require_positive,
    run_main,
    seed_everything,
    start_run,
)
from effdl.data import pipeline_runs as runs
from effdl.models.gpt_like import (
    GPTLikeConfig,
    GPTLikeModel,
    config_from_sizes,
    matmul_flops_per_token,
)
from effdl.models.lm_objective import LMInputs, lm_cross_entropy, lm_inputs, next_token_labels
from effdl.profiling.timing import (
    largest_measured,
    median_measured,
    peak_memory,
    take_peak_memory,
)

DTYPES = ["bf16", "tf32", "fp32"]
MAX_EPOCHS = 100  # a token budget needing more passes over the corpus is refused
LOSS_TAIL = 20  # final_loss: the mean loss of this many last steps


@dataclass
class TrainPipelinesConfig(runs.PipelineRunConfig):
    token_budget: int = 5_000_000  # real (non-padding) tokens each pipeline trains on
    max_vocab: int = 32768
    lr: float = 3e-4

    def validate(self) -> None:
        self.check_fields(DTYPES, minimum=2)
        require_positive(self, "token_budget", "max_vocab", minimum=2)
        require_positive(self, "lr", minimum=0)
        require_fits(
            "--batch-size --max-length",
            self.batch_size * self.max_length * (self.d_model + self.d_ff),
            "a batch's activations in one layer (fp32)",
        )


FULL = TrainPipelinesConfig()
QUICK = replace(
    FULL,
    token_budget=40_000,
    batch_size=8,
    max_length=128,
    max_vocab=4096,
    d_model=64,
    n_heads=4,
    d_ff=128,
)


def parse_args() -> tuple[argparse.Namespace, TrainPipelinesConfig]:
    p, flags = runs.pipeline_parser(__doc__.splitlines()[0], FULL, QUICK, DTYPES)
    flags.add("token_budget", type=int, help="real tokens each pipeline trains on")
    flags.add("max_vocab", type=int, help="vocabulary size, specials included")
    flags.add("lr", type=float, help="AdamW learning rate")
    args = p.parse_args()
    return args, flags.resolve(args)


def endless(loader) -> Iterator:
    """Batches of ``loader``, epoch after epoch (samplers advance their epoch on each pass)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise RuntimeError("the loader yielded no batch in a whole epoch")


def train_step(model, opt, inputs: LMInputs, autocast) -> torch.Tensor:
    with autocast():
        loss = lm_cross_entropy(model(**inputs.model_kwargs), inputs.labels)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def warm_up(cfg: TrainPipelinesConfig, model_cfg: GPTLikeConfig, run: Run, autocast) -> None:
    """Warm up CUDA, cuBLAS and the allocator once on a throwaway model, outside every timing."""
    warm = GPTLikeModel(model_cfg).to(run.device)
    opt = torch.optim.AdamW(warm.parameters(), lr=cfg.lr)
    shape = (cfg.batch_size, cfg.max_length)
    dense = torch.randint(2, model_cfg.vocab_size, shape, device=run.device)
    inputs = LMInputs({"input_ids": dense}, next_token_labels(dense), dense.numel(), dense.numel())
    for _ in range(3):
        train_step(warm, opt, inputs, autocast)


def train_on_budget(
    cfg: TrainPipelinesConfig,
    model: GPTLikeModel,
    loader,
    run: Run,
    autocast: Callable,
    variant: str,
) -> dict[str, Any]:
    """Train ``model`` on ``loader`` until it has seen ``cfg.token_budget`` real tokens. Ctrl-C
    raises :class:`effdl.cli.Interrupted` with the metrics of the steps finished (None if none)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    real = slots = 0
    losses = []
    step_peaks = []
    interrupted = False
    with peak_memory(run.device) as mem:
        start = time.perf_counter()
        bar = tqdm(
            total=cfg.token_budget, desc=f"  {variant}", unit="tok", unit_scale=True, leave=False
        )
        try:
            for batch in endless(loader):
                inputs = lm_inputs(batch)
                device_inputs = inputs.to(run.device, non_blocking=True)
                losses.append(train_step(model, opt, device_inputs, autocast))
                real += inputs.n_real_tokens  # counted once the step is done
                slots += inputs.n_slots
                step_peaks.append(take_peak_memory(run.device))
                bar.update(inputs.n_real_tokens)
                if real >= cfg.token_budget:
                    break
        except KeyboardInterrupt:
            interrupted = True
        bar.close()
        tail = torch.stack(losses[-LOSS_TAIL:]).float().mean().item() if losses else math.nan
        total_s = time.perf_counter() - start

    def metrics() -> dict[str, Any]:
        flops = 3 * matmul_flops_per_token(model.cfg, cfg.max_length) * slots
        return {
            "total_s": total_s,
            "steps": len(losses),
            "real_tokens": real,
            "slots": slots,
            "padding_fraction": 1 - real / slots,
            "real_tokens_per_s": real / total_s,
            "peak_mem_gib": largest_measured([mem.gib, *step_peaks]),  # None on the CPU
            "step_peak_gib_median": median_measured(step_peaks),
            "final_loss": tail,
            "approx_tflops": flops / total_s / 1e12,
        }

    if interrupted:
        raise Interrupted(metrics() if losses and math.isfinite(tail) else None)
    require_converged("--lr", f"the {variant} run", tail)  # the one synchronize read it
    return metrics()


def base_config(
    cfg: TrainPipelinesConfig, corpus: runs.Corpus, model_cfg: GPTLikeConfig, run: Run
) -> dict:
    return {
        "experiment": "train_pipelines",
        "corpus": corpus.source,
        "token_budget": cfg.token_budget,
        "batch_size": cfg.batch_size,
        "max_length": cfg.max_length,
        "dtype": cfg.dtype,
        "device": str(run.device),
        "d_model": model_cfg.d_model,
        "n_layers": model_cfg.n_layers,
        "vocab_size": model_cfg.vocab_size,
        "lr": cfg.lr,
        "num_workers": cfg.workers,
        "seed": run.seed,
    }


def train_pipelines(
    cfg: TrainPipelinesConfig, corpus: runs.Corpus, model_cfg: GPTLikeConfig, run: Run, autocast
) -> list[dict[str, Any]]:
    """One seeded model per variant trained on the budget, logged; their table rows."""
    base = base_config(cfg, corpus, model_cfg, run)
    rows = []
    for name, k in tqdm(runs.variants(cfg), desc="pipelines", unit="pipeline"):
        variant = runs.variant_name(name, k)
        seed_everything(run.seed)
        model = GPTLikeModel(model_cfg).to(run.device).train()
        loader = runs.loader(name, k, cfg, corpus, model, run, cfg.batch_size)
        config = {**base, "pipeline": name, "k": k}
        try:
            m = train_on_budget(cfg, model, loader, run, autocast, variant)
        except Interrupted as stop:  # Ctrl-C: the steps trained so far are logged first
            if stop.partial is not None:
                run.log.log(variant, {**config, "interrupted": True}, stop.partial)
            raise KeyboardInterrupt from None
        run.log.log(variant, config, m)
        rows.append(
            {
                "pipeline": variant,
                "steps": m["steps"],
                "total_s": m["total_s"],
                "real_Mtok_s": m["real_tokens_per_s"] / 1e6,
                "pad_%": 100 * m["padding_fraction"],
                "peak_GiB": m["peak_mem_gib"],
                "median_step_peak_GiB": m["step_peak_gib_median"],
                "final_loss": m["final_loss"],
            }
        )
    return rows


def require_epochs(cfg: TrainPipelinesConfig, corpus: runs.Corpus) -> None:
    """UsageError unless the budget takes at most MAX_EPOCHS passes over the corpus."""
    epochs = cfg.token_budget / corpus.ids.n_tokens
    if epochs > MAX_EPOCHS:
        raise UsageError(
            f"--token-budget {cfg.token_budget:,} needs {epochs:,.0f} epochs of {corpus.source} "
            f"({corpus.ids.n_tokens:,} tokens), at most {MAX_EPOCHS}: give a larger --data or "
            "a smaller --token-budget"
        )


def main() -> None:
    args, cfg = parse_args()
    run = start_run(args, task="task2", logs="train_pipelines.jsonl")
    cfg = runs.for_device(cfg, run.device)
    autocast = forward_precision(run.device, cfg.dtype)
    corpus = runs.load_corpus(args, cfg.max_length, max_size=cfg.max_vocab)
    print(corpus.describe())
    require_epochs(cfg, corpus)
    model_cfg = config_from_sizes(cfg, len(corpus.vocab))
    warm_up(cfg, model_cfg, run, autocast)
    rows = train_pipelines(cfg, corpus, model_cfg, run, autocast)
    title = f"Training on {cfg.token_budget:,} real tokens, {cfg.dtype}, on {run.where}"
    print_table(rows, title=f"{title} (log: {run.log.path})")


if __name__ == "__main__":
    run_main(main)
