"""Where does the main thread's time go in a token-budget ULTRA epoch? (probe, needs CUDA)

Same loader as mock_epoch (ULTRA, k=5, max_tokens 40960, 6 workers), ``--batches`` batches per
variant after a warm-up, host time split per batch: DataLoader wait, lm_inputs, copies, forward
launch. Variants change one thing each: what is copied, who pins, the GIL switch interval;
"preloaded" launches the same batches already on the GPU (the floor). The base loop is run once
more under cProfile (its statistics are printed, its times logged). Needs CUDA (the split is
measured against the GPU's forwards); ``--quick`` is a short smoke run on the GPU.

Writes one record per variant to ``--out/ultra_host.jsonl``: ``wall_s`` and ``gpu_s`` (summed
forward times) of the timed batches, ``wall_over_gpu``, and per batch the mean ``wait_ms``,
``inputs_ms``, ``copy_ms``, ``fwd_ms`` (launch), their sum ``host_ms``, and ``gpu_ms``.

    python task2_batching/probes/ultra_host_probe.py --out runs/task2/probes
"""

from __future__ import annotations

import cProfile
import io
import itertools
import pstats
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from effdl.amp.precision import forward_precision
from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    require_cuda,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.pipelines import make_loader
from effdl.data.tokenize import prepare_wikitext_ids
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import lm_inputs
from effdl.profiling.timing import RegionTimer
from effdl.results import RunLog

LOADER = {"pipeline": "ultra", "k": 5, "max_tokens": 40960, "num_workers": 6}
MAX_LENGTH = 640


@dataclass
class ProbeConfig:
    """Batches per variant; the defaults are the GPU experiment."""

    batches: int = 800  # timed batches per variant
    warmup_batches: int = 10

    def validate(self) -> None:
        require_positive(self, "batches")
        require_positive(self, "warmup_batches", minimum=0)


FULL = ProbeConfig()
QUICK = ProbeConfig(batches=50, warmup_batches=5)


def split_metrics(wall: float, gpu: list[float], split: dict[str, list[float]]) -> dict:
    """A variant's record metrics from the wall seconds of its timed batches, each batch's
    forward on the GPU (seconds) and the host seconds of each region (``split``) per batch."""
    metrics = {"wall_s": wall, "gpu_s": sum(gpu), "wall_over_gpu": wall / sum(gpu)}
    metrics.update({f"{k}_ms": 1e3 * float(np.mean(v)) for k, v in split.items()})
    metrics["host_ms"] = sum(metrics[f"{k}_ms"] for k in split)
    metrics["gpu_ms"] = 1e3 * sum(gpu) / len(gpu)
    return metrics


def log_variants(log: RunLog, cfg: ProbeConfig, variants: dict[str, Callable[[], dict]]) -> list:
    """Measure each variant in turn and log its metrics; returns the records."""
    config = {**LOADER, "batches": cfg.batches, "warmup_batches": cfg.warmup_batches}
    return [log.log(name, config, measure()) for name, measure in variants.items()]


class Probe:
    """The corpus, the model and the forward context shared by every variant."""

    def __init__(self, device: torch.device, cfg: ProbeConfig) -> None:
        self.device, self.batches, self.warmup = device, cfg.batches, cfg.warmup_batches
        # the generated WikiText-like corpus (seed 0) that mock_epoch.py reads, cut to MAX_LENGTH
        cache = "runs/cache/wt103_full.npz"
        self.corpus, vocab, _ = prepare_wikitext_ids(None, cache=cache, max_length=MAX_LENGTH)
        self.pad_id = vocab.pad_id
        config = GPTLikeConfig(vocab_size=len(vocab), max_length=MAX_LENGTH)
        self.model = GPTLikeModel(config).to(device).eval()
        self.autocast = forward_precision(device, "bf16")
        epoch = sum(1 for _ in self.loader(pin=False).batch_sampler)
        if self.warmup + self.batches > epoch:
            raise UsageError(f"--batches {self.batches} --warmup-batches {self.warmup}: "
                             f"an epoch of this loader has {epoch} batches")  # fmt: skip

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
            for _ in range(self.warmup):
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
        return split_metrics(wall, gpu, split)

    def preloaded(self) -> dict:
        """The same batches copied to the GPU first: only the forward's launch is timed."""
        dev, model = self.device, self.model
        with torch.inference_mode(), self.autocast():
            it = iter(self.loader())
            kws = [
                lm_inputs(b).to(dev).model_kwargs
                for b in itertools.islice(it, self.warmup + self.batches)
            ]
            del it
            for kw in kws[: self.warmup]:
                model.features(input_ids=kw["input_ids"])
            torch.cuda.synchronize()
            timer = RegionTimer(dev)
            launch = []
            start = time.perf_counter()
            for kw in kws[self.warmup :]:
                t0 = time.perf_counter()
                timer.start()
                model.features(input_ids=kw["input_ids"])
                timer.stop()
                launch.append(time.perf_counter() - t0)
            gpu = timer.times()
            wall = time.perf_counter() - start
        return split_metrics(wall, gpu, {"fwd": launch})


def variants(probe: Probe, prof: cProfile.Profile) -> dict[str, Callable[[], dict]]:
    """The variants in the order they run, each changing one thing of the base loop."""
    return {
        "base (mock_epoch loop)": lambda: probe.loop(),
        "ids only": lambda: probe.loop(what="ids"),
        "ids only, main-thread pin": lambda: probe.loop(pin=False, what="ids", main_pin=True),
        "base, switchinterval 0.2ms": lambda: probe.loop(switch=2e-4),
        "ids only, switchinterval 0.2ms": lambda: probe.loop(what="ids", switch=2e-4),
        "preloaded": probe.preloaded,
        "base under cProfile": lambda: probe.loop(profile=prof),
    }


def print_profile(prof: cProfile.Profile) -> None:
    for order, rows in (("tottime", 30), ("cumulative", 40)):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(order).print_stats(rows)
        print(s.getvalue())


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task2/probes")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("batches", type=int, help="timed batches per variant")
    flags.add("warmup_batches", type=int, help="untimed batches before them")
    args = p.parse_args()
    cfg = flags.resolve(args)
    require_cuda(args.device, "the ULTRA host-time probe")
    run = start_run(args, task="task2_ultra_host", logs="ultra_host.jsonl")
    probe = Probe(run.device, cfg)
    prof = cProfile.Profile()
    records = log_variants(run.log, cfg, variants(probe, prof))
    print_profile(prof)
    print(
        f"ULTRA k{LOADER['k']} max_tokens {LOADER['max_tokens']}, {cfg.batches} batches per "
        f"variant, {run.where}"
    )
    for r in records:
        print(r["variant"], " ".join(f"{k} {v:.3f}" for k, v in r["metrics"].items()))


if __name__ == "__main__":
    run_main(main)
