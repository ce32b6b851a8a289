"""The GPT-2-like LM under six precision setups: quality, divergence and gradient-step time.

Setups (seed 001's comparison plus the references the issue asks for):
``fp32``; ``pure_fp16`` (``model.half()``, no scaler; allowed to diverge); ``amp_static``
(torch.autocast + StaticGradScaler); ``amp_dynamic`` (torch.autocast + DynamicGradScaler);
``own_autocast_torch_scaler`` (own Autocast + torch.amp.GradScaler);
``torch_autocast_torch_scaler`` (the reference). Every setup trains a model built from the same
seed on the same list of batches (built once, kept on the device), so the curves differ only by
arithmetic. ``--noise-seeds N`` reruns the reference with N other init seeds (same batches) to
show how far two correct runs drift apart: own Autocast's curve should stay within that spread.

Logged to ``--out``/lm_precision.jsonl (variant = setup; ``config.kind`` says the record type):
``step`` (loss, accuracy, scale, skipped), ``final`` (held-out loss/accuracy, diverged flag,
gaps to the reference), ``timing`` (one gradient computation = forward + loss + scaled
backward, and one training step = that + unscale/skip check/optimizer step, each timed in a
separate phase on one fixed (batch, max_length) batch: warm-up, CUDA events, setups interleaved
in rounds, median).

A run whose training loss turns non-finite is stopped at the next check (every 25 steps) and
marked diverged; the script goes on. Note for ``pure_fp16``: AdamW keeps its moments in fp16
too, and its eps (1e-8) rounds to 0 there; that is part of what "naive fp16" means.

GPU defaults (the whole run takes about 3-4 min on one H100): d_model 1024, 8 heads, 4 post-norm
decoder layers, d_ff 2048, no dropout (so seeds only change the init), vocabulary 32768
(basic_english), samples cut to 256 tokens, length-bucketed batches of 32 (BalancedBatchSampler,
k=16), 500 AdamW steps at lr 3e-4 after 50 warm-up steps, held-out set of 20 batches, 2 noise
seeds, growth interval 100 for both dynamic scalers (initial scale 2**16), static scale 2**10,
100 timed reps per setup and quantity. Data: ``--data`` (WikiText-103 files or parquet; a seeded
subset of ``--n-samples`` = 30000 lines is used) or a generated WikiText-like corpus of that
many samples. CPU ``--quick``: d_model 64, 2 layers, 64 tokens, batch 8, 30 steps (~25 s).

    python task1_loss_scaling/lm_precision.py --quick                  # CPU smoke run, < 60 s
    python task1_loss_scaling/lm_precision.py --device cuda            # the GPU experiment
    python task1_loss_scaling/lm_precision.py --data /path/wikitext-103-raw
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm import tqdm

from effdl.amp.precision import Precision, PrecisionSpec, build_precision
from effdl.cli import (
    UsageError,
    add_text_corpus_args,
    base_parser,
    device_from_arg,
    print_table,
    require_path,
    run_main,
    seed_everything,
)
from effdl.data.corpus import (
    CorpusFormatError,
    SyntheticCorpusConfig,
    read_wikitext,
    synthetic_corpus,
)
from effdl.data.padding import Batch, pad_batch
from effdl.data.pipelines import make_loader
from effdl.data.tokenize import TokenizedCorpus, fit_basic_english
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import LMAccuracy, LMCrossEntropyLoss
from effdl.profiling.timing import RegionTimer, TimingStats
from effdl.results import RunLog

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
LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
PIPELINES = ("ultra", "bigbrain", "brain")  # length-bucketed, pad-to-batch-max, pad-to-max
CHECK_EVERY = 25  # steps between divergence checks (each is one host sync)


def parse_args():
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task1")
    add_text_corpus_args(p, cache=False)
    p.add_argument("--n-samples", type=int, default=None,
                   help="text lines used (30000; quick 2500)")  # fmt: skip
    p.add_argument("--setups", nargs="+", default=list(SETUPS), help=f"subset of {list(SETUPS)}")
    p.add_argument("--noise-seeds", type=int, default=None,
                   help="extra reference runs with other seeds (2; quick 1)")  # fmt: skip
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per setup (500; quick 30)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="32; quick 8")
    p.add_argument("--max-length", type=int, default=None, help="tokens per sample (256; quick 64)")
    p.add_argument("--max-vocab", type=int, default=None, help="32768; quick 2048")
    p.add_argument("--d-model", type=int, default=None, help="1024; quick 64")
    p.add_argument("--n-layers", type=int, default=None, help="4; quick 2")
    p.add_argument("--pipeline", choices=PIPELINES, default="ultra")
    p.add_argument("--k", type=int, default=16, help="length span of a bucket (ultra)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=None, help="linear lr warm-up (50; quick 5)")
    p.add_argument("--eval-batches", type=int, default=None, help="held-out batches (20; quick 4)")
    p.add_argument("--amp-dtype", choices=list(LOW_DTYPES), default="fp16")
    p.add_argument("--static-scale", type=float, default=2.0**10,
                   help="StaticGradScaler factor; one factor must fit the whole run, and gradients "
                   "grow as the LM trains (2**16 overflowed on ~1 step in 6 in the CPU smoke run)")  # fmt: skip
    p.add_argument("--growth-interval", type=int, default=100,
                   help="both dynamic scalers (torch's default 2000 would never grow in 500 steps)")  # fmt: skip
    p.add_argument("--timing-batch-sizes", type=int, nargs="+", default=None,
                   help="rows of the fixed timing batch(es) of --max-length tokens (default: "
                   "--batch-size); a larger one shows the GPU-bound regime")  # fmt: skip
    p.add_argument("--timing-reps", type=int, default=None,
                   help="timed reps per setup and quantity (100; quick 4; 0 = no timing)")  # fmt: skip
    return p.parse_args()


@dataclass
class Config:
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    vocab_size: int
    max_length: int
    batch_size: int
    pipeline: str
    k: int
    steps: int
    lr: float
    warmup_steps: int
    amp_dtype: str
    static_scale: float
    growth_interval: int
    device: str
    corpus: str

    def model_config(self) -> GPTLikeConfig:
        return GPTLikeConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            d_ff=self.d_ff,
            dropout=0.0,  # seeds then only change the init: a clean run-to-run noise estimate
            max_length=self.max_length,
        )


def load_lines(args, n_samples: int, quick: bool) -> tuple[list[str], str]:
    """Text samples: a seeded subset of --data's lines, or the generated corpus."""
    if args.data is None:
        # Non-empty lines are ~65% of the generated lines; ask for enough to get n_samples.
        cfg = SyntheticCorpusConfig(n_lines=int(n_samples / 0.6) + 100, seed=args.seed,
                                    vocab_size=20_000 if quick else 200_000)  # fmt: skip
        return synthetic_corpus(cfg)[:n_samples], f"synthetic(n={n_samples}, seed={args.seed})"
    require_path(args.data, "WikiText-103 files or a parquet with a 'text' column", "--data")
    try:
        lines = read_wikitext(args.data)
    except CorpusFormatError as e:
        raise UsageError(f"--data: {e}") from None
    if len(lines) > n_samples:
        pick = np.random.default_rng(args.seed).choice(len(lines), n_samples, replace=False)
        lines = [lines[i] for i in np.sort(pick)]
    return lines, f"{args.data} ({len(lines)} lines)"


def split_corpus(corpus: TokenizedCorpus, n_heldout: int, seed: int):
    """(train, held-out) corpora of disjoint samples, chosen by a seeded permutation."""
    order = np.random.default_rng(seed).permutation(len(corpus))
    take = lambda idx: TokenizedCorpus.from_sequences(corpus[int(i)] for i in idx)  # noqa: E731
    return take(order[n_heldout:]), take(order[:n_heldout])


def batches_of(corpus, n: int, cfg: Config, pad_id: int, seed: int, device) -> list[Batch]:
    """The first ``n`` batches of the pipeline (epoch after epoch), moved to the device once."""
    loader = make_loader(cfg.pipeline, corpus, cfg.batch_size, k=cfg.k,
                         max_length=cfg.max_length, pad_id=pad_id, seed=seed)  # fmt: skip
    out: list[Batch] = []
    while len(out) < n:
        for batch in loader:
            out.append(batch.to(device))
            if len(out) == n:
                break
    return out


def build(setup: str, seed: int, cfg: Config, device: torch.device):
    seed_everything(seed)
    model = GPTLikeModel(cfg.model_config()).to(device)
    if setup in PURE_LOW:
        model.to(LOW_DTYPES[cfg.amp_dtype])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    prec = build_precision(SETUPS[setup], device, LOW_DTYPES[cfg.amp_dtype],
                           static_scale=cfg.static_scale, init_scale=2.0**16,
                           growth_interval=cfg.growth_interval)  # fmt: skip
    return model, optimizer, prec


def grad_step(model, batch: Batch, prec: Precision, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """One gradient computation: forward, loss, scaled backward. Returns (logits, loss)."""
    with prec.autocast():
        logits = model(batch.input_ids, batch.padding_mask)
        loss = loss_fn(logits, batch.input_ids, batch.padding_mask)
    prec.scaler.scale(loss).backward()
    return logits, loss


def train_step(model, batch: Batch, optimizer, prec: Precision, loss_fn):
    optimizer.zero_grad(set_to_none=True)
    logits, loss = grad_step(model, batch, prec, loss_fn)
    prec.scaler.step(optimizer)
    prec.scaler.update()
    return logits, loss


@torch.no_grad()
def evaluate(model, batches: list[Batch], prec: Precision) -> tuple[float, float]:
    """Target-token-weighted mean loss and accuracy over the held-out batches."""
    model.eval()
    loss_fn, acc_fn = LMCrossEntropyLoss(), LMAccuracy()
    sums, accs, weights = [], [], []
    for b in batches:
        with prec.autocast():
            logits = model(b.input_ids, b.padding_mask)
            sums.append(loss_fn(logits, b.input_ids, b.padding_mask).float())
        accs.append(acc_fn(logits, b.input_ids, b.padding_mask).float())
        weights.append((b.lengths - 1).clamp(min=0).sum())
    model.train()
    w = torch.stack(weights).float()
    loss = (torch.stack(sums) * w).sum() / w.sum()
    acc = (torch.stack(accs) * w).sum() / w.sum()
    return loss.item(), acc.item()


def train_run(setup, seed, role, cfg, device, train, heldout, log, run_id) -> dict:
    """Train one setup; log every step and a final record; return the summary and the curve."""
    model, optimizer, prec = build(setup, seed, cfg, device)
    loss_fn, acc_fn = LMCrossEntropyLoss(), LMAccuracy()
    losses, accs, scales, skipped = [], [], [], []
    diverged_at = None
    for step in tqdm(range(cfg.steps), desc=f"{setup} s{seed}", leave=False):
        for g in optimizer.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
        batch = train[step]
        logits, loss = train_step(model, batch, optimizer, prec, loss_fn)
        losses.append(loss.detach().float())
        accs.append(acc_fn(logits.detach(), batch.input_ids, batch.padding_mask).float())
        scale, skip = prec.scale_and_skipped()
        scales.append(scale)
        skipped.append(skip)
        if (step + 1) % CHECK_EVERY == 0 or step + 1 == cfg.steps:
            window = torch.stack(losses[-CHECK_EVERY:])
            if not bool(window.isfinite().all()):  # one sync per window
                bad = (~window.isfinite()).nonzero()[0, 0].item()
                diverged_at = len(losses) - len(window) + bad
                break
    losses_h, accs_h = torch.stack(losses).tolist(), torch.stack(accs).tolist()
    config = {"kind": "step", "run_id": run_id, "setup": setup, "seed": seed, "role": role,
              **asdict(cfg)}  # fmt: skip
    for i, (lo, ac, sc, sk) in enumerate(zip(losses_h, accs_h, scales, skipped, strict=True)):
        log.log(setup, config, {"step": i, "loss": lo, "accuracy": ac, "scale": sc,
                                "skipped": sk})  # fmt: skip
    if diverged_at is None:
        val_loss, val_acc = evaluate(model, heldout, prec)
    else:
        val_loss = val_acc = float("nan")
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
    del model, optimizer
    return {"setup": setup, "seed": seed, "role": role, "config": config, **summary,
            "curve": np.asarray(losses_h)}  # fmt: skip


def curve_gap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean |a - b| over the steps both runs completed (NaN if one diverged at once)."""
    n = min(len(a), len(b))
    return float(np.mean(np.abs(a[:n] - b[:n]))) if n else float("nan")


def log_finals(runs: list[dict], log: RunLog) -> None:
    """One ``final`` record per run, with its gaps to the reference run of the main seed.

    ``noise_*`` are the largest gaps between the reference and its reruns with other seeds:
    a setup whose gaps are no larger is within run-to-run noise of the reference.
    """
    ref = next((r for r in runs if r["setup"] == REFERENCE and r["role"] == "main"), None)
    noise = [r for r in runs if r["role"] == "noise"]
    noise_curve = max((curve_gap(r["curve"], ref["curve"]) for r in noise), default=math.nan)
    noise_loss = max((abs(r["heldout_loss"] - ref["heldout_loss"]) for r in noise),
                     default=math.nan) if ref else math.nan  # fmt: skip
    for r in runs:
        extra = {}
        if ref is not None:
            extra = {"curve_gap_to_reference": curve_gap(r["curve"], ref["curve"]),
                     "heldout_loss_gap_to_reference": abs(r["heldout_loss"] - ref["heldout_loss"]),
                     "noise_curve_gap": noise_curve, "noise_heldout_loss_gap": noise_loss}  # fmt: skip
            extra["within_noise"] = (
                extra["curve_gap_to_reference"] <= noise_curve
                and extra["heldout_loss_gap_to_reference"] <= noise_loss
            )
        r.update(extra)
        metrics = {k: v for k, v in r.items() if k not in ("setup", "seed", "role", "config",
                                                            "curve")}  # fmt: skip
        log.log(r["setup"], {**r["config"], "kind": "final"}, metrics)


def time_setups(setups, cfg, device, batch: Batch, reps: int, log, run_id) -> list[dict]:
    """Median time of one gradient computation and of one training step per setup.

    Fresh models (same seed) on one fixed batch; after a warm-up, setups are interleaved in
    rounds so clock or thermal drift hits all alike. Each rep is one CUDA-event region.
    """
    warmup, rounds = (2, 2) if reps < 10 else (10, 5)
    per_round = max(1, reps // rounds)
    loss_fn = LMCrossEntropyLoss()
    built = {s: build(s, 0, cfg, device) for s in setups}
    for model, opt, prec in built.values():
        for _ in range(warmup):
            train_step(model, batch, opt, prec, loss_fn)
    times = {s: {"grad": [], "step": []} for s in setups}
    for _ in tqdm(range(rounds), desc="timing", leave=False):
        for s, (model, opt, prec) in built.items():
            grad_timer, step_timer = RegionTimer(device), RegionTimer(device)
            for _ in range(per_round):
                opt.zero_grad(set_to_none=True)
                with grad_timer.region():
                    grad_step(model, batch, prec, loss_fn)
            for _ in range(per_round):
                with step_timer.region():
                    train_step(model, batch, opt, prec, loss_fn)
            times[s]["grad"] += grad_timer.times()
            times[s]["step"] += step_timer.times()
    stats = {s: {q: TimingStats.from_times(t) for q, t in v.items()} for s, v in times.items()}
    ref = stats.get(REFERENCE)
    rows = []
    for s, st in stats.items():
        ratio = {q: st[q].median / ref[q].median if ref else math.nan for q in ("grad", "step")}
        config = {"kind": "timing", "run_id": run_id, "setup": s, "warmup": warmup,
                  "batch_shape": list(batch.input_ids.shape), **asdict(cfg)}  # fmt: skip
        log.log(s, config, {**st["grad"].as_dict("grad_s_"), **st["step"].as_dict("step_s_"),
                            "grad_ratio_to_reference": ratio["grad"],
                            "step_ratio_to_reference": ratio["step"]})  # fmt: skip
        rows.append({"setup": s, "grad_median_ms": st["grad"].median * 1e3,
                     "step_median_ms": st["step"].median * 1e3, "n": st["grad"].n,
                     "grad_vs_ref": ratio["grad"], "step_vs_ref": ratio["step"]})  # fmt: skip
    return rows


def main() -> None:
    args = parse_args()
    quick = args.quick
    device = device_from_arg("cpu" if quick and args.device == "auto" else args.device)
    unknown = sorted(set(args.setups) - set(SETUPS))
    if unknown:
        raise UsageError(f"--setups: unknown {unknown}; expected some of {list(SETUPS)}")
    pick = lambda value, full, small: value if value is not None else (small if quick else full)  # noqa: E731
    n_samples = pick(args.n_samples, 30_000, 2_500)
    eval_batches = pick(args.eval_batches, 20, 4)
    noise_seeds = pick(args.noise_seeds, 2, 1)
    reps = pick(args.timing_reps, 100, 4)
    d_model = pick(args.d_model, 1024, 64)
    sizes = {"--steps": pick(args.steps, 500, 30), "--batch-size": pick(args.batch_size, 32, 8),
             "--max-length": pick(args.max_length, 256, 64), "--n-samples": n_samples,
             "--max-vocab": pick(args.max_vocab, 32768, 2048), "--eval-batches": eval_batches,
             "--d-model": d_model, "--n-layers": pick(args.n_layers, 4, 2)}  # fmt: skip
    bad = [flag for flag, v in sizes.items() if v < 2]
    timing_rows = args.timing_batch_sizes or []
    if bad or d_model % 8 or min(noise_seeds, reps, args.k) < 0:
        raise UsageError(f"{bad or '--d-model'}: sizes must be >= 2, --d-model a multiple of 8, "
                         "--noise-seeds/--timing-reps/--k non-negative")  # fmt: skip
    if args.static_scale <= 0 or args.growth_interval < 1:
        raise UsageError("--static-scale must be > 0 and --growth-interval >= 1")

    t0 = time.perf_counter()
    lines, source = load_lines(args, n_samples, quick)
    corpus, vocab = fit_basic_english(lines, max_size=sizes["--max-vocab"])
    # A sample needs two tokens to have a target; a bucket of one-token samples would have none.
    corpus = corpus.truncate(sizes["--max-length"], min_length=2)
    n_heldout = eval_batches * sizes["--batch-size"]
    if len(corpus) < n_heldout + sizes["--batch-size"]:
        raise UsageError(f"--data/--n-samples: {len(corpus)} usable samples, need more than "
                         f"{n_heldout + sizes['--batch-size']} (held-out set plus one batch)")  # fmt: skip
    cfg = Config(
        d_model=d_model, n_layers=sizes["--n-layers"], n_heads=8 if d_model >= 256 else 4,
        d_ff=2 * d_model, vocab_size=len(vocab), max_length=sizes["--max-length"],
        batch_size=sizes["--batch-size"], pipeline=args.pipeline, k=args.k,
        steps=sizes["--steps"], lr=args.lr, warmup_steps=pick(args.warmup_steps, 50, 5),
        amp_dtype=args.amp_dtype, static_scale=args.static_scale,
        growth_interval=args.growth_interval, device=str(device), corpus=source,
    )  # fmt: skip
    train_corpus, heldout_corpus = split_corpus(corpus, n_heldout, args.seed)
    if timing_rows and not 1 <= min(timing_rows) <= max(timing_rows) <= len(train_corpus):
        raise UsageError(f"--timing-batch-sizes: each must be in 1..{len(train_corpus)} "
                         f"(training samples); got {timing_rows}")  # fmt: skip
    train = batches_of(train_corpus, cfg.steps, cfg, vocab.pad_id, args.seed, device)
    heldout = batches_of(heldout_corpus, eval_batches, cfg, vocab.pad_id, args.seed, device)
    log = RunLog(args.out / "lm_precision.jsonl", task="task1_lm_precision")
    where = log.env["gpu"] or f"CPU ({log.env['cpu']})"
    run_id = time.strftime("%Y%m%dT%H%M%S")
    print(f"data: {source}: {len(train_corpus):,} train / {len(heldout_corpus):,} held-out "
          f"samples, vocab {len(vocab):,}, {time.perf_counter() - t0:.1f} s; device: {where}; "
          f"low precision: {cfg.amp_dtype}")  # fmt: skip

    jobs = [(s, args.seed, "main") for s in args.setups]
    if REFERENCE in args.setups:
        jobs += [(REFERENCE, args.seed + i, "noise") for i in range(1, noise_seeds + 1)]
    runs = [train_run(s, seed, role, cfg, device, train, heldout, log, run_id)
            for s, seed, role in tqdm(jobs, desc="runs", unit="run")]  # fmt: skip
    log_finals(runs, log)

    for rows in args.timing_batch_sizes or ([cfg.batch_size] if reps > 0 else []):
        fixed = pad_batch([train_corpus[i] for i in range(rows)], vocab.pad_id,
                          pad_to=cfg.max_length).to(device)  # fmt: skip
        timing = time_setups(args.setups, cfg, device, fixed, reps, log, run_id)
        print_table(timing, title=f"One gradient computation (fwd+bwd) and one training step, "
                    f"fixed {rows}x{cfg.max_length} batch, median, on {where}")  # fmt: skip
        by = {t["setup"]: t for t in timing}
        if REFERENCE in by and "own_autocast_torch_scaler" in by:
            print(
                f"own Autocast / torch.autocast: grad {by['own_autocast_torch_scaler']['grad_vs_ref']:.3f}, "
                f"step {by['own_autocast_torch_scaler']['step_vs_ref']:.3f} (target <= 1.05)"
            )
        if REFERENCE in by and "amp_dynamic" in by:
            print(
                f"own DynamicGradScaler / torch GradScaler (both torch.autocast): step "
                f"{by['amp_dynamic']['step_vs_ref']:.3f} (target <= 1.03)"
            )

    print_table(
        [{"setup": r["setup"], "seed": r["seed"], "role": r["role"],
          "heldout_loss": r["heldout_loss"], "heldout_acc": r["heldout_accuracy"],
          "train_loss": r["final_train_loss"], "diverged": r["diverged"],
          "skipped": r["skipped_steps"], "final_scale": r["final_scale"],
          "curve_gap_ref": r.get("curve_gap_to_reference"),
          "within_noise": r.get("within_noise")} for r in runs],
        title=f"Training, {cfg.steps} steps per run, on {where} (log: {log.path}); "
        f"noise = reference rerun with other seeds",
    )  # fmt: skip


if __name__ == "__main__":
    run_main(main)
