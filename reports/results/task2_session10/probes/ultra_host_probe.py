"""Where does the main thread's time go in a token-budget ULTRA epoch? (probe, H100)

Same loader as mock_epoch (ULTRA, k=5, max_tokens 40960, 6 workers), NB batches per variant
after a warm-up, host time split per batch: DataLoader wait, lm_inputs, copies, forward launch.
Variants change one thing each: what is copied, who pins, the GIL switch interval; "preloaded"
launches the same batches already on the GPU (the floor). Then a cProfile of the base loop.
"""

import cProfile
import io
import itertools
import pstats
import sys
import time

import numpy as np
import torch

sys.path.insert(0, ".")
from effdl.amp.precision import forward_precision
from effdl.data.pipelines import make_loader
from effdl.data.tokenize import prepare_wikitext_ids
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import lm_inputs
from effdl.profiling.timing import RegionTimer

NB, WARM = int(sys.argv[1]) if len(sys.argv) > 1 else 800, 10
dev = torch.device("cuda")
corpus, vocab, _ = prepare_wikitext_ids(
    None,
    quick=False,
    seed=0,
    cache="runs/cache/wt103_full.npz",
    max_length=640,
    overflow="truncate",
)
model = GPTLikeModel(GPTLikeConfig(vocab_size=len(vocab), max_length=640)).to(dev).eval()
autocast = forward_precision(dev, "bf16")


def loader(pin=True):
    return make_loader(
        "ultra",
        corpus,
        None,
        k=5,
        max_length=640,
        pad_id=vocab.pad_id,
        seed=0,
        num_workers=6,
        pin_memory=pin,
        max_tokens=40960,
    )


def run(name, *, pin=True, what="all", main_pin=False, switch=None, profile=None):
    old = sys.getswitchinterval()
    if switch:
        sys.setswitchinterval(switch)
    split = {k: [] for k in ("wait", "inputs", "copy", "fwd")}
    timer = RegionTimer(dev)
    with torch.inference_mode(), autocast():
        it = iter(loader(pin))
        for _ in range(WARM):
            model.features(**lm_inputs(next(it)).to(dev).model_kwargs)
        torch.cuda.synchronize()
        if profile:
            profile.enable()
        start = time.perf_counter()
        for _ in range(NB):
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
    row = {"variant": name, "wall_s": wall, "gpu_s": sum(gpu), "wall/gpu": wall / sum(gpu)}
    row.update({f"{k}_ms": 1e3 * float(np.mean(v)) for k, v in split.items()})
    row["host_ms"] = sum(row[f"{k}_ms"] for k in split)
    row["gpu_ms"] = 1e3 * sum(gpu) / NB
    return row


def preloaded():
    with torch.inference_mode(), autocast():
        it = iter(loader())
        kws = [lm_inputs(b).to(dev).model_kwargs for b in itertools.islice(it, WARM + NB)]
        del it
        for kw in kws[:WARM]:
            model.features(input_ids=kw["input_ids"])
        torch.cuda.synchronize()
        timer = RegionTimer(dev)
        launch = []
        start = time.perf_counter()
        for kw in kws[WARM:]:
            t0 = time.perf_counter()
            timer.start()
            model.features(input_ids=kw["input_ids"])
            timer.stop()
            launch.append(time.perf_counter() - t0)
        gpu = timer.times()
        wall = time.perf_counter() - start
    return {
        "variant": "preloaded",
        "wall_s": wall,
        "gpu_s": sum(gpu),
        "wall/gpu": wall / sum(gpu),
        "fwd_ms": 1e3 * float(np.mean(launch)),
        "host_ms": 1e3 * float(np.mean(launch)),
        "gpu_ms": 1e3 * sum(gpu) / NB,
    }


rows = [
    run("base (mock_epoch loop)"),
    run("ids only", what="ids"),
    run("ids only, main-thread pin", pin=False, what="ids", main_pin=True),
    run("base, switchinterval 0.2ms", switch=2e-4),
    run("ids only, switchinterval 0.2ms", what="ids", switch=2e-4),
    preloaded(),
]
prof = cProfile.Profile()
rows.append(run("base under cProfile", profile=prof))
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
print(s.getvalue())
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
print(s.getvalue())
keys = [
    "variant",
    "wall_s",
    "gpu_s",
    "wall/gpu",
    "wait_ms",
    "inputs_ms",
    "copy_ms",
    "fwd_ms",
    "host_ms",
    "gpu_ms",
]
print(f"ULTRA k5 max_tokens 40960, {NB} batches per variant, {torch.cuda.get_device_name()}")
print(" | ".join(keys))
for r in rows:
    print(" | ".join(f"{r.get(k, float('nan')):.3f}" if k != "variant" else r[k] for k in keys))
