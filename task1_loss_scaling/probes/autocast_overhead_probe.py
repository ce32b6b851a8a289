"""Own Autocast vs torch.autocast on the LM-precision model: where does the gap come from? (probe)

Model and batch as task1_loss_scaling/lm_precision.py's timing (d_model 1024, 4 layers, vocab
32768, fixed B x 256 batch, fp16). Per setup and batch size: host time to queue one gradient
computation (no sync), GPU time of back-to-back gradient computations (events), their spread,
the same with the garbage collector off, and how many calls the Autocast mode intercepts.
Needs CUDA. Writes ``--out/autocast_overhead.jsonl``:

- ``torch_autocast`` / ``own_autocast`` per batch (``config.rows``): medians over interleaved
  rounds of host and GPU ms per gradient computation, GPU percentiles, the same with GC off;
- ``own_over_torch`` per batch: own / torch GPU time, with GC on and off;
- ``intercepted_calls``: calls the own Autocast mode handles in one gradient computation.
"""

from __future__ import annotations

import argparse
import gc
import statistics as st
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from effdl.amp import autocast as own
from effdl.amp.precision import PrecisionSpec, build_precision
from effdl.data.padding import pad_batch
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import LMCrossEntropyLoss
from effdl.results import RunLog

VOCAB, SEQ = 32768, 256
MODEL = GPTLikeConfig(
    vocab_size=VOCAB, d_model=1024, n_heads=8, n_layers=4, d_ff=2048, max_length=SEQ
)
ROWS = (32, 128)
WARMUP_STEPS, ROUNDS, STEPS_PER_ROUND, GC_OFF_STEPS = 10, 4, 25, 50
SETUPS = ("torch", "own")
LOSS = LMCrossEntropyLoss()


def make_batch(rows: int, rng: np.random.Generator, device: torch.device):
    lens = rng.integers(SEQ // 2, SEQ + 1, rows)
    return pad_batch([rng.integers(2, VOCAB, n) for n in lens], 0, pad_to=SEQ).to(device)


def build(kind: str, device: torch.device):
    torch.manual_seed(0)
    model = GPTLikeModel(MODEL).to(device)
    return model, build_precision(PrecisionSpec(kind, "torch"), device, torch.float16)


def grad_step(model, batch, prec) -> None:
    with prec.autocast():
        logits = model(batch.input_ids, batch.padding_mask)
        loss = LOSS(logits, batch.input_ids, batch.padding_mask)
    prec.scaler.scale(loss).backward()


def timed_steps(model, prec, batch, n: int, gc_off: bool = False):
    """Median host ms to queue a gradient computation, median GPU ms, GPU ms percentiles."""
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
    return 1e3 * st.median(host), st.median(gpu), np.percentile(gpu, [0, 10, 90, 100])


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


def probe_rows(log: RunLog, models: dict, rows: int, rng: np.random.Generator, device) -> None:
    batch = make_batch(rows, rng, device)
    for model, prec in models.values():
        timed_steps(model, prec, batch, WARMUP_STEPS)
    rounds: dict[str, list] = {k: [] for k in models}
    for _ in range(ROUNDS):  # interleaved
        for k, (model, prec) in models.items():
            rounds[k].append(timed_steps(model, prec, batch, STEPS_PER_ROUND))
    gc_off = {
        k: timed_steps(model, prec, batch, GC_OFF_STEPS, gc_off=True)
        for k, (model, prec) in models.items()
    }
    shape = {"rows": rows, "seq": SEQ, "dtype": "fp16"}
    config = {
        **shape,
        "warmup_steps": WARMUP_STEPS,
        "rounds": ROUNDS,
        "steps_per_round": STEPS_PER_ROUND,
        "gc_off_steps": GC_OFF_STEPS,
    }
    gpu = {}
    for k in models:
        gpu[k] = st.median(r[1] for r in rounds[k])
        pct = np.median([r[2] for r in rounds[k]], axis=0)
        record = log.log(
            f"{k}_autocast",
            config,
            {
                "host_ms_median": st.median(r[0] for r in rounds[k]),
                "gpu_ms_median": gpu[k],
                "gpu_ms_p0": pct[0],
                "gpu_ms_p10": pct[1],
                "gpu_ms_p90": pct[2],
                "gpu_ms_max": pct[3],
                "gc_off_host_ms_median": gc_off[k][0],
                "gc_off_gpu_ms_median": gc_off[k][1],
            },
        )
        print(record["variant"], shape, record["metrics"])
    record = log.log(
        "own_over_torch",
        shape,
        {
            "gpu_time_ratio": gpu["own"] / gpu["torch"],
            "gc_off_gpu_time_ratio": gc_off["own"][1] / gc_off["torch"][1],
        },
    )
    print(record["variant"], shape, record["metrics"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/task1/probes"), help="log folder")
    args = p.parse_args()
    device = torch.device("cuda")
    log = RunLog(args.out / "autocast_overhead.jsonl", task="task1_autocast_overhead", create=True)
    rng = np.random.default_rng(0)
    models = {k: build(k, device) for k in SETUPS}
    for rows in ROWS:
        probe_rows(log, models, rows, rng, device)
    counts = count_calls(*models["own"], make_batch(ROWS[0], rng, device))
    record = log.log(
        "intercepted_calls",
        {"rows": ROWS[0], "seq": SEQ, "dtype": "fp16", "autocast": "own"},
        {"total": sum(counts.values()), "per_function": dict(counts.most_common())},
    )
    print(record["variant"], record["metrics"])


if __name__ == "__main__":
    main()
