"""Where does the main thread's time go in a token-budget ULTRA epoch? (probe, needs CUDA)

Same loader as mock_epoch (ULTRA, k=5, max_tokens 40960, 6 workers), ``--batches`` batches per
variant after a warm-up, host time split per batch: DataLoader wait, lm_inputs, copies, forward
launch. Variants change one thing each: what is copied, who pins, the GIL switch interval;
"preloaded" launches the same batches already on the GPU (the floor). The base loop is run once
more under cProfile (its statistics are printed, its times logged).

Writes one record per variant to ``--out/ultra_host.jsonl``: ``wall_s`` and ``gpu_s`` (summed
forward times) of the timed batches, ``wall_over_gpu``, and per batch the mean ``wait_ms``,
``inputs_ms``, ``copy_ms``, ``fwd_ms`` (launch), their sum ``host_ms``, and ``gpu_ms``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

from effdl.amp.precision import forward_precision
from effdl.data.pipelines import make_loader
from effdl.data.tokenize import prepare_wikitext_ids
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import lm_inputs
from effdl.profiling.timing import RegionTimer
from effdl.results import RunLog

LOADER = {"pipeline": "ultra", "k": 5, "max_tokens": 40960, "num_workers": 6}
MAX_LENGTH, WARMUP_BATCHES = 640, 10


class Probe:
    """The corpus, the model and the forward context shared by every variant."""

    def __init__(self, device: torch.device, batches: int) -> None:
        self.device, self.batches = device, batches
        self.corpus, vocab, _ = prepare_wikitext_ids(
            None,
            quick=False,
            seed=0,
            cache="runs/cache/wt103_full.npz",
            max_length=MAX_LENGTH,
            overflow="truncate",
        )
        self.pad_id = vocab.pad_id
        config = GPTLikeConfig(vocab_size=len(vocab), max_length=MAX_LENGTH)
        self.model = GPTLikeModel(config).to(device).eval()
        self.autocast = forward_precision(device, "bf16")

    def loader(self, pin: bool = True):
        return make_loader(
            LOADER["pipeline"],
            self.corpus,
            None,
            k=LOADER["k"],
            max_length=MAX_LENGTH,
            pad_id=self.pad_id,
            seed=0,
            num_workers=LOADER["num_workers"],
            pin_memory=pin,
            max_tokens=LOADER["max_tokens"],
        )

    def loop(self, *, pin=True, what="all", main_pin=False, switch=None, profile=None) -> dict:
        """The mock_epoch loop (``what="all"``) or a copy of the token ids only."""
        dev, model = self.device, self.model
        old = sys.getswitchinterval()
        if switch:
            sys.setswitchinterval(switch)
        split: dict[str, list[float]] = {k: [] for k in ("wait", "inputs", "copy", "fwd")}
        timer = RegionTimer(dev)
        with torch.inference_mode(), self.autocast():
            it = iter(self.loader(pin))
            for _ in range(WARMUP_BATCHES):
                model.features(**lm_inputs(next(it)).to(dev).model_kwargs)
            torch.cuda.synchronize()
            if profile:
                profile.enable()
            start = time.perf_counter()
            for _ in range(self.batches):
                t0 = time.perf_counter()
                b = next(it)
                t1 = time.perf_counter()
                if what == "all":
                    inp = lm_inputs(b)
                    t2 = time.perf_counter()
                    kw = inp.to(dev, non_blocking=True).model_kwargs
                else:
                    ids = b.input_ids
                    _ = int(b.lengths.sum())
                    if main_pin:
                        ids = ids.pin_memory()
                    t2 = time.perf_counter()
                    kw = {"input_ids": ids.to(dev, non_blocking=True)}
                t3 = time.perf_counter()
                timer.start()
                model.features(**kw)
                timer.stop()
                t4 = time.perf_counter()
                for k, a, z in (
                    ("wait", t0, t1),
                    ("inputs", t1, t2),
                    ("copy", t2, t3),
                    ("fwd", t3, t4),
                ):
                    split[k].append(z - a)
            gpu = timer.times()
            wall = time.perf_counter() - start
            if profile:
                profile.disable()
        sys.setswitchinterval(old)
        del it
        metrics = {"wall_s": wall, "gpu_s": sum(gpu), "wall_over_gpu": wall / sum(gpu)}
        metrics.update({f"{k}_ms": 1e3 * float(np.mean(v)) for k, v in split.items()})
        metrics["host_ms"] = sum(metrics[f"{k}_ms"] for k in split)
        metrics["gpu_ms"] = 1e3 * sum(gpu) / self.batches
        return metrics

    def preloaded(self) -> dict:
        """The same batches copied to the GPU first: only the forward's launch is timed."""
        dev, model = self.device, self.model
        with torch.inference_mode(), self.autocast():
            it = iter(self.loader())
            kws = [
                lm_inputs(b).to(dev).model_kwargs
                for b in itertools.islice(it, WARMUP_BATCHES + self.batches)
            ]
            del it
            for kw in kws[:WARMUP_BATCHES]:
                model.features(input_ids=kw["input_ids"])
            torch.cuda.synchronize()
            timer = RegionTimer(dev)
            launch = []
            start = time.perf_counter()
            for kw in kws[WARMUP_BATCHES:]:
                t0 = time.perf_counter()
                timer.start()
                model.features(input_ids=kw["input_ids"])
                timer.stop()
                launch.append(time.perf_counter() - t0)
            gpu = timer.times()
            wall = time.perf_counter() - start
        fwd_ms = 1e3 * float(np.mean(launch))
        return {
            "wall_s": wall,
            "gpu_s": sum(gpu),
            "wall_over_gpu": wall / sum(gpu),
            "fwd_ms": fwd_ms,
            "host_ms": fwd_ms,
            "gpu_ms": 1e3 * sum(gpu) / self.batches,
        }


def print_profile(prof: cProfile.Profile) -> None:
    for order, rows in (("tottime", 30), ("cumulative", 40)):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(order).print_stats(rows)
        print(s.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=800, help="timed batches per variant")
    p.add_argument("--out", type=Path, default=Path("runs/task2/probes"), help="log folder")
    args = p.parse_args()
    log = RunLog(args.out / "ultra_host.jsonl", task="task2_ultra_host", create=True)
    probe = Probe(torch.device("cuda"), args.batches)
    prof = cProfile.Profile()
    variants = [
        ("base (mock_epoch loop)", lambda: probe.loop()),
        ("ids only", lambda: probe.loop(what="ids")),
        ("ids only, main-thread pin", lambda: probe.loop(pin=False, what="ids", main_pin=True)),
        ("base, switchinterval 0.2ms", lambda: probe.loop(switch=2e-4)),
        ("ids only, switchinterval 0.2ms", lambda: probe.loop(what="ids", switch=2e-4)),
        ("preloaded", probe.preloaded),
        ("base under cProfile", lambda: probe.loop(profile=prof)),
    ]
    config = {**LOADER, "batches": args.batches, "warmup_batches": WARMUP_BATCHES}
    records = [log.log(name, config, measure()) for name, measure in variants]
    print_profile(prof)
    print(
        f"ULTRA k{LOADER['k']} max_tokens {LOADER['max_tokens']}, {args.batches} batches per "
        f"variant, {log.env['gpu']}"
    )
    for r in records:
        print(r["variant"], " ".join(f"{k} {v:.3f}" for k, v in r["metrics"].items()))


if __name__ == "__main__":
    main()
