"""Own Autocast vs torch.autocast on the LM-precision model: where does the gap come from? (probe)

Model and batch as task1_loss_scaling/lm_precision.py's timing (d_model 1024, 4 layers, vocab
32768, fixed B x 256 batch, fp16). Per setup and batch size: host time to queue one gradient
computation (no sync), GPU time of back-to-back gradient computations (events), their spread,
the same with the garbage collector off, and how many calls the Autocast mode intercepts.
Needs CUDA (its numbers are CUDA-event times); ``--quick`` is a small smoke run on the GPU.
Writes ``--out/autocast_overhead.jsonl``:

- ``torch_autocast`` / ``own_autocast`` per batch (``config.rows``): medians over interleaved
  rounds of host and GPU ms per gradient computation, GPU percentiles, the same with GC off;
- ``own_over_torch`` per batch: own / torch GPU time, with GC on and off;
- ``intercepted_calls``: calls the own Autocast mode handles in one gradient computation.

    python task1_loss_scaling/probes/autocast_overhead_probe.py --out runs/task1/probes
"""

from __future__ import annotations

import gc
import statistics as st
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from effdl.amp import autocast as own
from effdl.amp.precision import PrecisionSpec, build_precision
from effdl.cli import (
    ConfigFlags,
    base_parser,
    require_cuda,
    require_fits,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.padding import pad_batch
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import LMCrossEntropyLoss
from effdl.results import RunLog

VOCAB, SEQ = 32768, 256
MODEL = GPTLikeConfig(
    vocab_size=VOCAB, d_model=1024, n_heads=8, n_layers=4, d_ff=2048, max_length=SEQ
)
SETUPS = ("torch", "own")
LOSS = LMCrossEntropyLoss()


@dataclass
class ProbeConfig:
    """Batch sizes and step counts; the defaults are the GPU experiment."""

    rows: list[int] = field(default_factory=lambda: [32, 128])  # batches of rows x SEQ tokens
    warmup_steps: int = 10
    rounds: int = 4  # interleaved rounds of each setup
    steps_per_round: int = 25
    gc_off_steps: int = 50

    def validate(self) -> None:
        require_positive(self, "rows", "rounds", "steps_per_round", "gc_off_steps")
        require_positive(self, "warmup_steps", minimum=0)
        require_fits("--rows", max(self.rows) * SEQ * VOCAB, "the fp32 logits of a batch")


FULL = ProbeConfig()
QUICK = ProbeConfig(rows=[8], warmup_steps=2, rounds=2, steps_per_round=3, gc_off_steps=3)


@dataclass
class Timing:
    """One batch of gradient computations: median host and GPU ms, GPU ms percentiles."""

    host_ms: float
    gpu_ms: float
    gpu_pct: list[float]  # p0, p10, p90, p100


def make_batch(rows: int, rng: np.random.Generator, device: torch.device):
    lens = rng.integers(SEQ // 2, SEQ + 1, rows)
    return pad_batch([rng.integers(2, VOCAB, n) for n in lens], 0, pad_to=SEQ).to(device)


def build(kind: str, device: torch.device, seed: int):
    torch.manual_seed(seed)
    model = GPTLikeModel(MODEL).to(device)
    return model, build_precision(PrecisionSpec(kind, "torch"), device, torch.float16)


def grad_step(model, batch, prec) -> None:
    with prec.autocast():
        logits = model(batch.input_ids, batch.padding_mask)
        loss = LOSS(logits, batch.input_ids, batch.padding_mask)
    prec.scaler.scale(loss).backward()


def timed_steps(model, prec, batch, n: int, gc_off: bool = False) -> Timing:
    """Host ms to queue a gradient computation and GPU ms of one, over ``n`` of them."""
    if gc_off:
        gc.disable()
    host, events = [], []
    torch.cuda.synchronize()
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        grad_step(model, batch, prec)
        e1.record()
        host.append(time.perf_counter() - t0)
        events.append((e0, e1))
    torch.cuda.synchronize()
    gc.enable()
    gpu = [a.elapsed_time(z) for a, z in events]
    pct = np.percentile(gpu, [0, 10, 90, 100]).tolist()
    return Timing(1e3 * st.median(host), st.median(gpu), pct)


def count_calls(model, prec, batch) -> Counter:
    """Calls the own Autocast mode's ``__torch_function__`` sees in one gradient computation."""
    counts: Counter = Counter()
    orig = own._CastingMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        counts[getattr(func, "__name__", str(func))] += 1
        return orig(self, func, types, args, kwargs)

    own._CastingMode.__torch_function__ = counting
    try:
        grad_step(model, batch, prec)
    finally:
        own._CastingMode.__torch_function__ = orig
    return counts


def measure_rows(cfg: ProbeConfig, models: dict, batch) -> tuple[dict, dict]:
    """Per setup: the timings of ``cfg.rounds`` interleaved rounds, and one run with GC off."""
    for model, prec in models.values():
        if cfg.warmup_steps:
            timed_steps(model, prec, batch, cfg.warmup_steps)
    rounds: dict[str, list[Timing]] = {k: [] for k in models}
    for _ in range(cfg.rounds):  # interleaved
        for k, (model, prec) in models.items():
            rounds[k].append(timed_steps(model, prec, batch, cfg.steps_per_round))
    gc_off = {
        k: timed_steps(model, prec, batch, cfg.gc_off_steps, gc_off=True)
        for k, (model, prec) in models.items()
    }
    return rounds, gc_off


def log_rows(
    log: RunLog, cfg: ProbeConfig, rows: int, rounds: dict[str, list[Timing]], gc_off: dict
) -> list[dict]:
    """The records of one batch size: per setup the medians over rounds, then own / torch."""
    shape = {"rows": rows, "seq": SEQ, "dtype": "fp16"}
    config = {
        **shape,
        "warmup_steps": cfg.warmup_steps,
        "rounds": cfg.rounds,
        "steps_per_round": cfg.steps_per_round,
        "gc_off_steps": cfg.gc_off_steps,
    }
    gpu, records = {}, []
    for k in SETUPS:
        gpu[k] = st.median(t.gpu_ms for t in rounds[k])
        pct = np.median([t.gpu_pct for t in rounds[k]], axis=0)
        metrics = {
            "host_ms_median": st.median(t.host_ms for t in rounds[k]),
            "gpu_ms_median": gpu[k],
            "gpu_ms_p0": pct[0],
            "gpu_ms_p10": pct[1],
            "gpu_ms_p90": pct[2],
            "gpu_ms_max": pct[3],
            "gc_off_host_ms_median": gc_off[k].host_ms,
            "gc_off_gpu_ms_median": gc_off[k].gpu_ms,
        }
        records.append(log.log(f"{k}_autocast", config, metrics))
    ratios = {
        "gpu_time_ratio": gpu["own"] / gpu["torch"],
        "gc_off_gpu_time_ratio": gc_off["own"].gpu_ms / gc_off["torch"].gpu_ms,
    }
    records.append(log.log("own_over_torch", shape, ratios))
    for r in records:
        print(r["variant"], shape, r["metrics"])
    return records


def log_calls(log: RunLog, rows: int, counts: Counter) -> dict:
    """The record of the calls own Autocast intercepted in one gradient computation."""
    record = log.log(
        "intercepted_calls",
        {"rows": rows, "seq": SEQ, "dtype": "fp16", "autocast": "own"},
        {"total": sum(counts.values()), "per_function": dict(counts.most_common())},
    )
    print(record["variant"], record["metrics"])
    return record


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task1/probes")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("rows", type=int, nargs="+", help=f"batch sizes (rows of {SEQ} tokens)")
    flags.add("warmup_steps", type=int, help="untimed gradient computations per setup")
    flags.add("rounds", type=int, help="interleaved timed rounds")
    flags.add("steps_per_round", type=int, help="gradient computations per round")
    flags.add("gc_off_steps", type=int, help="gradient computations timed with GC off")
    args = p.parse_args()
    cfg = flags.resolve(args)
    require_cuda(args.device, "the autocast overhead probe")
    run = start_run(args, task="task1_autocast_overhead", logs="autocast_overhead.jsonl")
    rng = np.random.default_rng(run.seed)
    models = {k: build(k, run.device, run.seed) for k in SETUPS}
    for rows in cfg.rows:
        batch = make_batch(rows, rng, run.device)
        log_rows(run.log, cfg, rows, *measure_rows(cfg, models, batch))
    counts = count_calls(*models["own"], make_batch(cfg.rows[0], rng, run.device))
    log_calls(run.log, cfg.rows[0], counts)


if __name__ == "__main__":
    run_main(main)
