"""Mock one forward-only epoch per batching pipeline and time every batch (seed 000, Task 2).

Pipelines: BRAIN (pad to 640), BIG BRAIN (pad to the batch max), ULTRA DUPER BIG BRAIN
(length-bucketed batches, span k), and packed rows (streaming concatenation, Best-Fit
Decreasing) from effdl.data.packing. Model: Embedding + sinusoidal positions + one
nn.TransformerDecoder layer (d_model 1024, 8 heads), no LM head, under inference_mode.
Every batch's forward is timed with CUDA events (effdl.profiling.epoch); the "ideal" row is all
real tokens at the throughput of full dense (batch x 640) batches measured in the same run, and
every epoch is also set against dense batches of the same model timed right before it
(``*_adjacent``), so drift over a long run does not land on one pipeline.

    python task2_batching/mock_epoch.py --quick                   # CPU smoke run, tiny model
    python task2_batching/mock_epoch.py --device cuda --cache runs/cache/wt103_full.npz
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from effdl.amp.precision import PRECISION_NAMES, forward_precision
from effdl.cli import (
    Run,
    UsageError,
    print_table,
    require_choices,
    require_fits,
    require_memory,
    require_positive,
    run_main,
    start_run,
)
from effdl.data import pipeline_runs as runs
from effdl.models.gpt_like import GPTLikeModel, config_from_sizes, matmul_flops_per_token
from effdl.models.lm_objective import lm_inputs
from effdl.profiling.epoch import EpochTiming, time_epoch
from effdl.profiling.timing import TimingStats, benchmark

PERCENTILES = list(range(0, 101, 5))
OVERFLOW = ["truncate", "drop"]


@dataclass
class MockEpochConfig(runs.PipelineRunConfig):
    ks: list[int] = field(default_factory=lambda: [1, 5, 10, 20, 50, 640])
    batch_size: int = 64
    # ULTRA's batch rules, each run at every k: None = batch_size rows, N = a padded-token budget
    max_tokens: list[int | None] = field(default_factory=lambda: [None])
    overflow: str = "truncate"
    max_batches: int | None = None  # None: the whole epoch
    warmup_batches: int = 10
    dense_iters: int = 30
    repeats: int = 1  # timed epochs per variant, interleaved (A B C A B C)

    def validate(self) -> None:
        self.check_fields(list(PRECISION_NAMES), minimum=1)
        require_choices(self, "overflow", OVERFLOW)
        require_positive(self, "dense_iters", "repeats")
        require_positive(self, "warmup_batches", minimum=0)
        if self.max_batches is not None:
            require_positive(self, "max_batches")
        budgets = [n for n in self.max_tokens if n is not None]
        if budgets and min(budgets) < 1:
            raise UsageError(f"--max-tokens: budgets must be >= 1, got {min(budgets)}")
        if budgets:
            require_fits(
                "--max-tokens",
                max(budgets) * (self.d_model + self.d_ff),
                "a batch's activations in one layer (fp32)",
            )
        if budgets and "ultra" not in self.pipelines:
            raise UsageError("--max-tokens needs 'ultra' in --pipelines")


FULL = MockEpochConfig()
QUICK = replace(FULL, batch_size=16, max_length=128, d_model=64, n_heads=4, d_ff=128, dense_iters=3)


def budget_or_rows(text: str) -> int | None:
    """An argparse type: ``rows`` (None: a row cap) or a token budget."""
    return None if text == "rows" else int(text)


def parse_args() -> tuple[argparse.Namespace, MockEpochConfig]:
    p, flags = runs.pipeline_parser(__doc__.splitlines()[0], FULL, QUICK, list(PRECISION_NAMES))
    flags.add(
        "max_tokens",
        type=budget_or_rows,
        nargs="+",
        help="ULTRA's batch rules, each run at every k: 'rows' = --batch-size rows per batch, "
        "N = a padded-token budget (rows x batch max <= N, no row cap)",
    )
    flags.add("overflow", choices=OVERFLOW, help="samples longer than --max-length")
    flags.add(
        "max_batches", type=int, help="time only the first N batches of each epoch (None: all)"
    )
    flags.add("warmup_batches", type=int, help="untimed batches before each epoch")
    flags.add("dense_iters", type=int, help="timed batches of each dense yardstick")
    flags.add("repeats", type=int, help="timed epochs per variant, interleaved across variants")
    args = p.parse_args()
    return args, flags.resolve(args)


def dense_batch(model: GPTLikeModel, cfg: MockEpochConfig, device: torch.device) -> torch.Tensor:
    """Random token ids of one full (batch x max_length) batch: no padding, one shape."""
    shape = (cfg.batch_size, cfg.max_length)
    return torch.randint(2, model.cfg.vocab_size, shape, device=device)


def time_forward(
    model: GPTLikeModel, ids: torch.Tensor, autocast: Callable, iters: int, device: torch.device
) -> TimingStats:
    """Forward times of ``model`` on ``ids`` under ``autocast`` and inference mode."""
    with torch.inference_mode(), autocast():
        return benchmark(lambda: model.features(ids), warmup=5, iters=iters, device=device)


def time_dense(
    model: GPTLikeModel, cfg: MockEpochConfig, device: torch.device, autocast: Callable
) -> dict[str, TimingStats]:
    """Forward times of full dense (batch x max_length) batches, same weights and precision.

    A fixed shape lets cuDNN attention amortise its per-shape plan, so the yardstick is timed
    both as the pipelines run the model (no cuDNN attention) and with it; the faster counts.
    """
    dense = dense_batch(model, cfg, device)
    with_cudnn = GPTLikeModel(replace(model.cfg, cudnn_attention=True)).to(device).eval()
    with_cudnn.load_state_dict(model.state_dict())
    return {
        name: time_forward(m, dense, autocast, cfg.dense_iters, device)
        for name, m in (("dense", model), ("dense_cudnn", with_cudnn))
    }


def base_config(cfg: MockEpochConfig, corpus: runs.Corpus, model: GPTLikeModel, run: Run) -> dict:
    m = model.cfg
    return {
        "experiment": "mock_epoch",
        "corpus": corpus.source,
        "n_samples": len(corpus.ids),
        "corpus_tokens": corpus.ids.n_tokens,
        "batch_size": cfg.batch_size,
        "max_length": cfg.max_length,
        "overflow": cfg.overflow,
        "dtype": cfg.dtype,
        "device": str(run.device),
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "n_layers": m.n_layers,
        "d_ff": m.d_ff,
        "vocab_size": m.vocab_size,
        "max_batches": cfg.max_batches,
        "num_workers": cfg.workers,
        "seed": run.seed,
    }


def log_yardsticks(
    run: Run,
    base: dict,
    yardsticks: dict[str, TimingStats],
    tokens: int,
    flops: float,
    prep_s: float,
) -> list[dict[str, Any]]:
    """One record per dense yardstick (the faster one marked); their table rows."""
    best = min(yardsticks.values(), key=lambda st: st.median)
    rows = []
    for name, st in yardsticks.items():
        run.log.log(
            name,
            {**base, "pipeline": name, "cudnn_attention": name == "dense_cudnn"},
            {
                **st.as_dict("batch_s_"),
                "tokens_per_s": tokens / st.median,
                "tflops": flops * tokens / st.median / 1e12,
                "prep_s": prep_s,
                "is_yardstick": st is best,
            },
        )
        rows.append(
            {
                "variant": f"{name} (B x {base['max_length']})",
                "batches": st.n,
                "median_ms": st.median * 1e3,
                "real_Mtok_s": tokens / st.median / 1e6,
            }
        )
    return rows


def epoch_metrics(timing: EpochTiming, dense_tps: float, adjacent_tps: float) -> dict[str, Any]:
    """The log metrics of one timed epoch, against the ideal: its real tokens at dense speed,
    by the run's yardstick and by the dense batches timed right before this epoch (``_adjacent``:
    the model as the pipelines run it, so drift of the host or GPU over the run cancels)."""
    ideal_s = timing.real_tokens / dense_tps
    adjacent_s = timing.real_tokens / adjacent_tps
    return {
        **TimingStats.from_times(timing.batch_s).as_dict("batch_s_"),
        "n_batches": timing.n_batches,
        "epoch_s": timing.epoch_s,
        "compute_s": timing.compute_s,
        "real_tokens": timing.real_tokens,
        "slots": timing.slots,
        "padding_fraction": timing.padding_fraction,
        "real_tokens_per_s": timing.real_tokens / timing.epoch_s,
        "peak_mem_gib": timing.peak_mem_gib,
        "ideal_s": ideal_s,
        "compute_over_ideal": timing.compute_s / ideal_s,
        "epoch_over_ideal": timing.epoch_s / ideal_s,
        "dense_tokens_per_s_adjacent": adjacent_tps,
        "compute_over_ideal_adjacent": timing.compute_s / adjacent_s,
        "epoch_over_ideal_adjacent": timing.epoch_s / adjacent_s,
        **timing.host_split(),
        "batch_s_percentiles": np.percentile(timing.batch_s, PERCENTILES).tolist(),
        "width_percentiles": np.percentile(timing.widths, PERCENTILES).tolist(),
    }


def epoch_row(variant: str, m: dict[str, Any]) -> dict[str, Any]:
    return {
        "variant": variant,
        "batches": m["n_batches"],
        "median_ms": m["batch_s_median"] * 1e3,
        "mean_ms": m["batch_s_mean"] * 1e3,
        "max_ms": m["batch_s_max"] * 1e3,
        "epoch_s": m["epoch_s"],
        "wait_s": m["first_batch_s"] + m["wait_s"],
        "real_Mtok_s": m["real_tokens_per_s"] / 1e6,
        "pad_%": 100 * m["padding_fraction"],
        "peak_GiB": m["peak_mem_gib"],
        "x_ideal": m["compute_over_ideal"],
        "x_ideal_adjacent": m["compute_over_ideal_adjacent"],
    }


def epoch_variants(cfg: MockEpochConfig) -> list[tuple[str, int | None, int | None]]:
    """``(pipeline, k, max_tokens)`` of every timed epoch: ULTRA under each of its batch rules."""
    return [
        (name, k, budget)
        for name, k in runs.variants(cfg)
        for budget in (cfg.max_tokens if name == "ultra" else [None])
    ]


def time_pipelines(
    cfg: MockEpochConfig,
    corpus: runs.Corpus,
    model: GPTLikeModel,
    run: Run,
    autocast: Callable,
    base: dict,
    dense_tps: float,
) -> list[dict[str, Any]]:
    """``cfg.repeats`` timed epochs per variant, interleaved, each right after dense batches of
    the same model; logged; their table rows."""
    rows = []
    dense = dense_batch(model, cfg, run.device)
    timed = [(rep, v) for rep in range(cfg.repeats) for v in epoch_variants(cfg)]
    for rep, (name, k, max_tokens) in tqdm(timed, desc="epochs", unit="epoch"):
        adjacent = time_forward(model, dense, autocast, cfg.dense_iters, run.device)
        variant = runs.variant_name(name, k) + ("" if max_tokens is None else f"_mt{max_tokens}")
        rows_per_batch = None if max_tokens is not None else cfg.batch_size
        loader = runs.loader(name, k, cfg, corpus, model, run, rows_per_batch, max_tokens)
        timing = time_epoch(
            model.features,
            loader,
            run.device,
            inputs_of=lm_inputs,
            precision=autocast,
            max_batches=cfg.max_batches,
            warmup_batches=cfg.warmup_batches,
            progress=True,
        )
        metrics = epoch_metrics(timing, dense_tps, dense.numel() / adjacent.median)
        config = {**base, "pipeline": name, "k": k, "max_tokens": max_tokens, "repeat": rep}
        run.log.log(variant, config, metrics)
        rows.append(epoch_row(variant if cfg.repeats == 1 else f"{variant} #{rep}", metrics))
    return rows


def log_ideal(run: Run, base: dict, corpus: runs.Corpus, dense_tps: float) -> dict[str, Any]:
    """The whole corpus at dense throughput: the floor for one full epoch."""
    epoch_s = corpus.ids.n_tokens / dense_tps
    run.log.log(
        "ideal",
        {**base, "pipeline": "ideal"},
        {
            "epoch_s": epoch_s,
            "compute_s": epoch_s,
            "real_tokens": corpus.ids.n_tokens,
            "real_tokens_per_s": dense_tps,
            "padding_fraction": 0.0,
        },
    )
    return {
        "variant": "ideal (full epoch)",
        "epoch_s": epoch_s,
        "real_Mtok_s": dense_tps / 1e6,
        "pad_%": 0.0,
        "x_ideal": 1.0,
    }


def main() -> None:
    args, cfg = parse_args()
    run = start_run(args, task="task2", logs="mock_epoch.jsonl")
    cfg = runs.for_device(cfg, run.device)
    # The dense yardstick's batch: its ids and one (rows, length, d_ff) activation, at least.
    dense = cfg.batch_size * cfg.max_length * (8 + 4 * max(cfg.d_model, cfg.d_ff))
    require_memory(
        f"--batch-size {cfg.batch_size} x --max-length {cfg.max_length}", dense, run.device
    )
    corpus = runs.load_corpus(args, cfg.max_length, overflow=cfg.overflow)
    print(corpus.describe())
    model = GPTLikeModel(config_from_sizes(cfg, len(corpus.vocab))).to(run.device).eval()
    autocast = forward_precision(run.device, cfg.dtype)

    yardsticks = time_dense(model, cfg, run.device, autocast)
    tokens = cfg.batch_size * cfg.max_length
    dense_tps = tokens / min(st.median for st in yardsticks.values())
    base = base_config(cfg, corpus, model, run)
    flops = matmul_flops_per_token(model.cfg, cfg.max_length, lm_head=False)
    rows = log_yardsticks(run, base, yardsticks, tokens, flops, corpus.prep_s)
    rows += time_pipelines(cfg, corpus, model, run, autocast, base, dense_tps)
    rows.append(log_ideal(run, base, corpus, dense_tps))
    title = f"Mock epoch, forward only, {cfg.dtype}, on {run.where} (log: {run.log.path})"
    print_table(rows, title=title)


if __name__ == "__main__":
    run_main(main)
