"""The GPT-2-like LM under six precision setups: quality, divergence and gradient-step time.

Setups (seed 001's comparison plus torch's references):
``fp32``; ``pure_fp16`` (``model.half()``, no scaler; allowed to diverge); ``amp_static``
(torch.autocast + StaticGradScaler); ``amp_dynamic`` (torch.autocast + DynamicGradScaler);
``own_autocast_torch_scaler`` (own Autocast + torch.amp.GradScaler);
``torch_autocast_torch_scaler`` (the reference). Every setup trains a model built from the same
seed on the same list of batches (built once, kept on the device), so the curves differ only by
arithmetic. ``--seeds N`` trains every setup from N init seeds (same batches): the spread of each
setup's result, and in the reference's reruns how far two correct runs drift apart, the noise
own Autocast's curve should stay within.

Logged to ``--out``/lm_precision.jsonl, variant = setup, ``config.kind`` = ``step`` (loss,
accuracy, loss scale, skipped, and the norm of the unscaled gradients: inf/NaN where the scaled
ones overflowed), ``eval`` (held-out loss and accuracy every ``--eval-every`` steps), ``run``
(held-out figures as a run ends), ``final`` (with the gaps to the reference) or ``timing`` (a
whole training step and its fwd+bwd on one fixed batch, setups in rotating rounds; medians).

A run whose loss turns non-finite stops at the next check (every 25 steps), marked diverged; in
fp32 that is refused (lower ``--lr``). ``pure_fp16`` keeps AdamW's moments in fp16 (eps rounds
to 0): part of "naive fp16".

The defaults (:class:`LMPrecisionConfig`) are the GPU experiment: 4 post-norm decoder layers of
width 1024 without dropout (seeds only change the init), a basic_english vocabulary of 32768,
samples cut to 256 tokens in length-bucketed batches of 32 (BalancedBatchSampler, k=16), 500
AdamW steps. Data: ``--data`` (WikiText-103 files or parquet; a seeded subset of ``--n-samples``
lines) or, by default, that many paragraphs of the Python standard library's documentation and
source (real text, built under ``--cache``; WikiText lines are paragraphs too). Samples, not
documents, are split into training and held-out sets, as WikiText lines would be.
``--quick``: a CPU smoke run.

    python task1_loss_scaling/lm_precision.py --quick                  # CPU smoke run
    python task1_loss_scaling/lm_precision.py --device cuda            # the GPU experiment
    python task1_loss_scaling/lm_precision.py --data /path/wikitext-103-raw
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from effdl.amp.grads import grads_of, total_norm
from effdl.amp.precision import LOW_DTYPES, PrecisionSpec, build_precision
from effdl.amp.reference_gaps import add_reference_gaps
from effdl.amp.training_step import lm_forward, lm_heldout_metrics, scaled_step
from effdl.cli import (
    ConfigFlags,
    Run,
    UsageError,
    base_parser,
    print_table,
    require_choices,
    require_converged,
    require_fits,
    require_positive,
    run_main,
    seed_everything,
    start_run,
)
from effdl.data.lm_batches import LMData, fixed_lm_data, text_samples
from effdl.data.padding import Batch, pad_batch
from effdl.data.stdlib_text import DEFAULT_CACHE
from effdl.models.gpt_like import GPTLikeModel, config_from_sizes
from effdl.models.lm_objective import LMAccuracy, LMCrossEntropyLoss
from effdl.profiling.harness import HarnessConfig, Regions, Variant, time_variants
from effdl.profiling.timing import TimingStats
from effdl.results import RunLog
from effdl.tables import spread

SETUPS = {
    "fp32": PrecisionSpec("none", "none"),
    "pure_fp16": PrecisionSpec("none", "none"),  # the model itself is cast to the low dtype
    "amp_static": PrecisionSpec("torch", "static"),
    "amp_dynamic": PrecisionSpec("torch", "dynamic"),
    "own_autocast_torch_scaler": PrecisionSpec("own", "torch"),
    "torch_autocast_torch_scaler": PrecisionSpec("torch", "torch"),
}
PURE_LOW = {"pure_fp16"}
REFERENCE = "torch_autocast_torch_scaler"
PIPELINES = ("ultra", "bigbrain", "brain")  # length-bucketed, pad-to-batch-max, pad-to-max
CHECK_EVERY = 25  # steps between divergence checks (each is one host sync)
# The settings every record's config carries (with the vocabulary, device and corpus).
RECORDED = ("d_model", "n_layers", "n_heads", "d_ff", "max_length", "batch_size", "pipeline",
            "k", "steps", "lr", "warmup_steps", "amp_dtype", "static_scale",
            "growth_interval")  # fmt: skip


@dataclass
class LMPrecisionConfig:
    """Settings of one run; the defaults are the GPU experiment."""

    data: Path | None = None  # WikiText-103 files or a parquet; None: the stdlib's paragraphs
    cache: Path = DEFAULT_CACHE  # where the stdlib corpus is built once
    n_samples: int = 30_000
    setups: list[str] = field(default_factory=lambda: list(SETUPS))
    seeds: int = 3  # init seeds per setup
    steps: int = 500
    batch_size: int = 32
    max_length: int = 256
    max_vocab: int = 32768
    d_model: int = 1024
    n_layers: int = 4
    pipeline: str = "ultra"
    k: int = 16
    lr: float = 3e-4
    warmup_steps: int = 50
    eval_batches: int = 20
    eval_every: int = 100  # steps between held-out evaluations (0: only at the end)
    amp_dtype: str = "fp16"
    # One factor must fit the whole run, and gradients grow as the LM trains.
    static_scale: float = 2.0**10
    growth_interval: int = 100  # torch's default 2000 would never grow in 500 steps
    timing_batch_sizes: list[int] = field(default_factory=list)  # empty: --batch-size
    timing_reps: int = 100

    def validate(self) -> None:
        require_positive(self, "n_samples", "steps", "batch_size", "max_length", "max_vocab",
                         "d_model", "n_layers", "eval_batches", minimum=2)  # fmt: skip
        require_positive(self, "k", "lr", "warmup_steps", "timing_reps", "eval_every", minimum=0)
        require_positive(self, "seeds", "growth_interval", "timing_batch_sizes")
        require_choices(self, "setups", SETUPS)
        require_choices(self, "pipeline", PIPELINES)
        require_choices(self, "amp_dtype", LOW_DTYPES)
        if self.d_model % 8:
            raise UsageError(f"--d-model must be a multiple of 8 (the heads), got {self.d_model}")
        if not self.static_scale > 0:
            raise UsageError(f"--static-scale must be > 0, got {self.static_scale!r}")
        rows = max([self.batch_size, *self.timing_batch_sizes])
        numel = rows * self.max_length * self.d_model * self.n_layers + self.max_vocab * self.d_model  # fmt: skip
        require_fits("--batch-size --timing-batch-sizes --max-length --d-model --n-layers --max-vocab", numel, "a batch's activations and the embedding")  # fmt: skip
        require_fits("--n-samples --max-length", self.n_samples * self.max_length, "the tokenized samples", bytes_per_element=8)  # fmt: skip

    @property
    def n_heads(self) -> int:
        return 8 if self.d_model >= 256 else 4

    @property
    def d_ff(self) -> int:
        return 2 * self.d_model

    def recorded(self, data: LMData, device: torch.device) -> dict:
        """The settings a log record's config carries, with the vocabulary and corpus used."""
        return {**{name: getattr(self, name) for name in RECORDED}, "vocab_size": len(data.vocab),
                "device": str(device), "corpus": data.source}  # fmt: skip


FULL = LMPrecisionConfig()
QUICK = LMPrecisionConfig(n_samples=2_500, seeds=2, steps=30, batch_size=8, max_length=64,
                          max_vocab=2048, d_model=64, n_layers=2, warmup_steps=5,
                          eval_batches=4, eval_every=10, timing_reps=4)  # fmt: skip


def parse_config() -> tuple[LMPrecisionConfig, Run]:
    """The config from the flags (validated) and the run's preamble."""
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task1")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("data", type=Path, help="wiki.train.raw/.tokens, their folder, or a parquet with "
              "a 'text' column; none: the standard library's paragraphs")  # fmt: skip
    flags.add("cache", type=Path, output=True,
              help="folder of the standard-library corpus (built once)")  # fmt: skip
    flags.add("n_samples", type=int, help="text lines used")
    flags.add("setups", nargs="+", help="a subset of the six setups")
    flags.add("seeds", type=int, help="init seeds per setup (same batches)")
    flags.add("steps", type=int, help="training steps per setup")
    flags.add("batch_size", type=int)
    flags.add("max_length", type=int, help="tokens per sample")
    flags.add("max_vocab", type=int)
    flags.add("d_model", type=int)
    flags.add("n_layers", type=int)
    flags.add("pipeline", help=f"one of {list(PIPELINES)}")
    flags.add("k", type=int, help="length span of a bucket (ultra)")
    flags.add("lr", type=float)
    flags.add("warmup_steps", type=int, help="linear lr warm-up")
    flags.add("eval_batches", type=int, help="held-out batches")
    flags.add("eval_every", type=int, help="steps between held-out evaluations (0: at the end)")
    flags.add("amp_dtype", help=f"one of {list(LOW_DTYPES)}")
    flags.add("static_scale", type=float, help="StaticGradScaler factor")
    flags.add("growth_interval", type=int, help="both dynamic scalers")
    flags.add("timing_batch_sizes", type=int, nargs="+", help="rows of the fixed timing "
              "batch(es) of --max-length tokens (none: --batch-size); a larger one shows the "
              "GPU-bound regime")  # fmt: skip
    flags.add("timing_reps", type=int, help="timed steps per setup (0: no timing)")
    args = p.parse_args()
    cfg = flags.resolve(args)
    return cfg, start_run(args, task="task1_lm_precision", logs="lm_precision.jsonl")


def prepare_data(cfg: LMPrecisionConfig, run: Run) -> LMData:
    """The fixed batches of every run; a timing batch larger than the training set is a usage
    error."""
    lines, source = text_samples(cfg.data, cfg.n_samples, run.seed, cfg.cache)
    data = fixed_lm_data(lines, source, max_vocab=cfg.max_vocab, max_length=cfg.max_length,
                         pipeline=cfg.pipeline, batch_size=cfg.batch_size, k=cfg.k,
                         steps=cfg.steps, eval_batches=cfg.eval_batches, seed=run.seed,
                         device=run.device)  # fmt: skip
    if max(cfg.timing_batch_sizes, default=1) > len(data.train_corpus):
        raise UsageError(f"--timing-batch-sizes: each must be in 1..{len(data.train_corpus)} "
                         f"(training samples); got {cfg.timing_batch_sizes}")  # fmt: skip
    return data


def build(setup: str, seed: int, cfg: LMPrecisionConfig, vocab_size: int, device: torch.device):
    seed_everything(seed)
    # No dropout: seeds then only change the init, a clean run-to-run noise estimate.
    model = GPTLikeModel(config_from_sizes(cfg, vocab_size, dropout=0.0)).to(device)
    if setup in PURE_LOW:
        model.to(LOW_DTYPES[cfg.amp_dtype])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    prec = build_precision(SETUPS[setup], device, LOW_DTYPES[cfg.amp_dtype],
                           static_scale=cfg.static_scale,
                           growth_interval=cfg.growth_interval)  # fmt: skip
    return model, optimizer, prec


def train_run(setup: str, seed: int, role: str, cfg: LMPrecisionConfig, run: Run,
              data: LMData) -> dict:  # fmt: skip
    """Train one setup; log every step and the run's record; return the summary and the curve."""
    model, optimizer, prec = build(setup, seed, cfg, len(data.vocab), run.device)
    loss_fn, acc_fn = LMCrossEntropyLoss(), LMAccuracy()
    losses, accs, scales, skipped, norms = [], [], [], [], []
    config = {"kind": "step", "run_id": run.run_id, "setup": setup, "seed": seed, "role": role,
              **cfg.recorded(data, run.device)}  # fmt: skip
    params = list(model.parameters())
    logged = 0  # steps already on disk: a killed run keeps every checked window
    evals = []  # held-out records, logged at the next window check (none while fp32 diverges)
    for step in tqdm(range(cfg.steps), desc=f"{setup} s{seed}", leave=False):
        for g in optimizer.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
        batch = data.train[step]
        logits, loss = scaled_step(optimizer, prec, lm_forward(model, batch, loss_fn),
                                   unscaled_grads=lambda: norms.append(total_norm(grads_of(params))))  # fmt: skip
        losses.append(loss.detach().float())
        accs.append(acc_fn(logits.detach(), batch.input_ids, batch.padding_mask).float())
        scale, skip = prec.scale_and_skipped()
        scales.append(scale)
        skipped.append(skip)
        if (step + 1) % CHECK_EVERY == 0 or step + 1 == cfg.steps:  # one sync per window
            window = [torch.stack(x[logged:]) for x in (losses, accs, norms)]
            host = torch.stack(window).tolist()
            new = zip(*host, scales[logged:], skipped[logged:], strict=True)
            for i, (lo, ac, gn, sc, sk) in enumerate(new, start=logged):
                if setup == "fp32":  # no precision effect: the step size is wrong
                    require_converged("--lr", f"the fp32 run at step {i}", lo)
                run.log.log(setup, config, {"step": i, "loss": lo, "accuracy": ac, "scale": sc,
                                        "skipped": sk, "grad_norm": gn})  # fmt: skip
            for record in evals:
                run.log.log(setup, {**config, "kind": "eval"}, record)
            logged, evals = len(losses), []
            if not all(map(math.isfinite, host[0])):
                break
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            val_loss, val_acc = lm_heldout_metrics(model, data.heldout, prec)
            evals.append({"step": step, "heldout_loss": val_loss, "heldout_accuracy": val_acc})
    losses_h, accs_h = torch.stack(losses).tolist(), torch.stack(accs).tolist()
    diverged_at = next((i for i, lo in enumerate(losses_h) if not math.isfinite(lo)), None)
    val_loss = val_acc = math.nan
    if diverged_at is None:
        val_loss, val_acc = lm_heldout_metrics(model, data.heldout, prec)
    diverged = diverged_at is not None or not math.isfinite(val_loss)
    summary = {
        "heldout_loss": val_loss,
        "heldout_accuracy": val_acc,
        "final_train_loss": float(np.mean(losses_h[-20:])),
        "final_train_accuracy": float(np.mean(accs_h[-20:])),
        "diverged": diverged,
        "diverged_at_step": diverged_at,
        "steps_done": len(losses_h),
        "skipped_steps": int(sum(skipped)),
        "final_scale": scales[-1],
    }
    run.log.log(setup, {**config, "kind": "run"}, summary)  # the final record needs every run
    return {"setup": setup, "seed": seed, "role": role, "config": config, **summary,
            "curve": np.asarray(losses_h)}  # fmt: skip


def log_finals(runs: list[dict], log: RunLog) -> None:
    """One ``final`` record per run, with its gaps to the reference run of the main seed
    (:func:`effdl.amp.reference_gaps.add_reference_gaps`)."""
    add_reference_gaps(runs, REFERENCE)
    for r in runs:
        metrics = {k: v for k, v in r.items() if k not in ("setup", "seed", "role", "config",
                                                            "curve")}  # fmt: skip
        log.log(r["setup"], {**r["config"], "kind": "final"}, metrics)


def train_all(cfg: LMPrecisionConfig, run: Run, data: LMData) -> list[dict]:
    """Every setup from --seeds init seeds: the main one (--seed), then its reruns."""
    jobs = [
        (s, run.seed + i, "rerun" if i else "main") for i in range(cfg.seeds) for s in cfg.setups
    ]
    with tqdm(jobs, desc="runs", unit="run") as bar:  # closed before an error is printed
        return [train_run(s, seed, role, cfg, run, data) for s, seed, role in bar]


def time_setups(cfg: LMPrecisionConfig, run: Run, data: LMData, batch: Batch) -> list[dict]:
    """Time of one training step and of its gradient computation, per setup, on one fixed
    batch: ``--timing-reps`` steps of fresh models (same seed), one per round of the harness."""
    reps = cfg.timing_reps
    warmup = 2 if reps < 10 else 10
    harness = HarnessConfig(rounds=reps, min_steps=reps, max_steps=reps, min_time=0.0,
                            warmup_steps=warmup, warmup_time=0.0, memory_steps=1)  # fmt: skip

    def variant(setup: str) -> Variant:
        def build_step():
            model, opt, prec = build(setup, 0, cfg, len(data.vocab), run.device)
            loss_fn = LMCrossEntropyLoss()

            def step(n: int, regions: Regions | None) -> None:
                for _ in range(n):
                    grad = regions["grad"].region() if regions is not None else None
                    scaled_step(opt, prec, lm_forward(model, batch, loss_fn), grad)
                opt.zero_grad(set_to_none=True)  # an idle setup holds no gradients

            return step

        return Variant(setup, build_step)

    results = time_variants([variant(s) for s in cfg.setups], harness, run.device)
    medians = {s: {"grad": statistics.median(r.regions["grad"]), "step": statistics.median(r.step)}
               for s, r in results.items() if not r.oom}  # fmt: skip
    ref = medians.get(REFERENCE, {"grad": math.nan, "step": math.nan})
    rows = []
    for s, result in results.items():
        config = {"kind": "timing", "run_id": run.run_id, "setup": s, "warmup": warmup,
                  "batch_shape": list(batch.input_ids.shape),
                  **cfg.recorded(data, run.device)}  # fmt: skip
        if result.oom:
            run.log.log(s, config, {"oom": True})
            rows.append({"setup": s, "oom": True})
            continue
        grad, step = (TimingStats.from_times(t) for t in (result.regions["grad"], result.step))
        ratio = {q: medians[s][q] / ref[q] for q in ("grad", "step")}
        run.log.log(s, config, {**grad.as_dict("grad_s_"), **step.as_dict("step_s_"),
                                "grad_ratio_to_reference": ratio["grad"],
                                "step_ratio_to_reference": ratio["step"]})  # fmt: skip
        rows.append({"setup": s, "grad_median_ms": grad.median * 1e3,
                     "step_median_ms": step.median * 1e3, "n": step.n,
                     "grad_vs_ref": ratio["grad"], "step_vs_ref": ratio["step"]})  # fmt: skip
    return rows


def time_all(cfg: LMPrecisionConfig, run: Run, data: LMData) -> None:
    """Time the setups on each fixed timing batch and print the table and the targets."""
    for rows in cfg.timing_batch_sizes or [cfg.batch_size]:
        fixed = pad_batch([data.train_corpus[i] for i in range(rows)], data.vocab.pad_id,
                          pad_to=cfg.max_length).to(run.device)  # fmt: skip
        timing = time_setups(cfg, run, data, fixed)
        print_table(timing, title=f"One gradient computation (fwd+bwd) and one training step, "
                    f"fixed {rows}x{cfg.max_length} batch, median, on {run.where}")  # fmt: skip
        by = {t["setup"]: t for t in timing if not t.get("oom")}
        if REFERENCE in by and "own_autocast_torch_scaler" in by:
            own = by["own_autocast_torch_scaler"]
            print(f"own Autocast / torch.autocast: grad {own['grad_vs_ref']:.3f}, "
                  f"step {own['step_vs_ref']:.3f} (target <= 1.05)")  # fmt: skip
        if REFERENCE in by and "amp_dynamic" in by:
            print(f"own DynamicGradScaler / torch GradScaler (both torch.autocast): step "
                  f"{by['amp_dynamic']['step_vs_ref']:.3f} (target <= 1.03)")  # fmt: skip


def print_runs(runs: list[dict], cfg: LMPrecisionConfig, run: Run) -> None:
    print_table(
        [{"setup": r["setup"], "seed": r["seed"], "role": r["role"],
          "heldout_loss": r["heldout_loss"], "heldout_acc": r["heldout_accuracy"],
          "train_loss": r["final_train_loss"], "diverged": r["diverged"],
          "skipped": r["skipped_steps"], "final_scale": r["final_scale"],
          "curve_gap_ref": r.get("curve_gap_to_reference"),
          "within_noise": r.get("within_noise")} for r in runs],
        title=f"Training, {cfg.steps} steps per run, on {run.where} (log: {run.log.path}); "
        f"noise = the reference's reruns with other seeds",
    )  # fmt: skip
    print_table(spread(runs, "setup", ("heldout_loss", "heldout_accuracy", "diverged")), title=f"Per setup over {cfg.seeds} seeds (held-out figures of runs that did not diverge; diverged_mean: their share)")  # fmt: skip


def main() -> None:
    cfg, run = parse_config()
    t0 = time.perf_counter()
    data = prepare_data(cfg, run)
    print(f"data: {data.source}: {len(data.train_corpus):,} train / "
          f"{cfg.eval_batches * cfg.batch_size:,} held-out samples, vocab {len(data.vocab):,}, "
          f"{time.perf_counter() - t0:.1f} s; device: {run.where}; "
          f"low precision: {cfg.amp_dtype}")  # fmt: skip
    runs = train_all(cfg, run, data)
    log_finals(runs, run.log)
    if cfg.timing_reps > 0:
        time_all(cfg, run, data)
    print_runs(runs, cfg, run)


if __name__ == "__main__":
    run_main(main)
