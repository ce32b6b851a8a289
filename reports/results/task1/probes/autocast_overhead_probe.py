"""Own Autocast vs torch.autocast on the LM-precision model: where does the gap come from? (probe)

Model and batch as task1_loss_scaling/lm_precision.py's timing (d_model 1024, 4 layers, vocab
32768, fixed B x 256 batch, fp16). Per setup and batch size: host time to queue one gradient
computation (no sync), GPU time of back-to-back gradient computations (events), their spread,
the same with the garbage collector off, and how many calls the Autocast mode intercepts.
"""

import gc
import statistics as st
import sys
import time

import numpy as np
import torch

sys.path.insert(0, ".")
from effdl.amp import autocast as own
from effdl.amp.precision import PrecisionSpec, build_precision
from effdl.data.padding import pad_batch
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import LMCrossEntropyLoss

dev = torch.device("cuda")
V, T = 32768, 256
cfg = GPTLikeConfig(vocab_size=V, d_model=1024, n_heads=8, n_layers=4, d_ff=2048, max_length=T)
loss_fn = LMCrossEntropyLoss()
rng = np.random.default_rng(0)


def batch(rows):
    lens = rng.integers(T // 2, T + 1, rows)
    return pad_batch([rng.integers(2, V, n) for n in lens], 0, pad_to=T).to(dev)


def build(kind):
    torch.manual_seed(0)
    model = GPTLikeModel(cfg).to(dev)
    prec = build_precision(PrecisionSpec(kind, "torch"), dev, torch.float16)
    return model, prec


def grad_step(model, b, prec):
    with prec.autocast():
        logits = model(b.input_ids, b.padding_mask)
        loss = loss_fn(logits, b.input_ids, b.padding_mask)
    prec.scaler.scale(loss).backward()


def run(model, prec, b, n, gc_off=False):
    if gc_off:
        gc.disable()
    host, evs = [], []
    torch.cuda.synchronize()
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        grad_step(model, b, prec)
        e1.record()
        host.append(time.perf_counter() - t0)
        evs.append((e0, e1))
    torch.cuda.synchronize()
    gc.enable()
    gpu = [a.elapsed_time(z) for a, z in evs]
    return 1e3 * st.median(host), st.median(gpu), np.percentile(gpu, [0, 10, 90, 100])


def count_calls(model, prec, b):
    counts = {}
    orig = own._CastingMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        counts[name] = counts.get(name, 0) + 1
        return orig(self, func, types, args, kwargs)

    own._CastingMode.__torch_function__ = counting
    try:
        grad_step(model, b, prec)
    finally:
        own._CastingMode.__torch_function__ = orig
    return counts


models = {k: build(k) for k in ("torch", "own")}
for rows in (32, 128):
    b = batch(rows)
    for m, p in models.values():
        run(m, p, b, 10)
    res = {k: [] for k in models}
    for _ in range(4):  # interleaved rounds
        for k, (m, p) in models.items():
            res[k].append(run(m, p, b, 25))
    gcoff = {k: run(m, p, b, 50, gc_off=True) for k, (m, p) in models.items()}
    print(f"\n=== {rows}x{T} fp16, {torch.cuda.get_device_name()}")
    for k in models:
        host = st.median(r[0] for r in res[k])
        gpu = st.median(r[1] for r in res[k])
        pct = np.median([r[2] for r in res[k]], axis=0)
        print(
            f"{k:6s} autocast: host {host:.2f} ms/grad-step, GPU {gpu:.2f} ms "
            f"(p0 {pct[0]:.2f} p10 {pct[1]:.2f} p90 {pct[2]:.2f} max {pct[3]:.2f}); "
            f"gc off: host {gcoff[k][0]:.2f} GPU {gcoff[k][1]:.2f}"
        )
    g = {k: st.median(r[1] for r in res[k]) for k in models}
    print(
        f"own/torch GPU time per grad step: {g['own'] / g['torch']:.3f} "
        f"(gc off: {gcoff['own'][1] / gcoff['torch'][1]:.3f})"
    )
counts = count_calls(*models["own"], batch(32))
print(f"\nintercepted calls per gradient step: {sum(counts.values())}")
for name, c in sorted(counts.items(), key=lambda kv: -kv[1])[:25]:
    print(f"  {c:4d} {name}")
