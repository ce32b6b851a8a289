"""Where does a packed/bucketed batch's time go? CPU launch vs GPU kernels, per variant."""

import statistics as st
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from effdl.data.pipelines import make_loader
from effdl.data.tokenize import prepare_wikitext_ids
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import lm_inputs

dev = torch.device("cuda")
corpus, vocab, _ = prepare_wikitext_ids(
    None,
    quick=False,
    seed=0,
    cache="runs/cache/wt103_full.npz",
    max_length=640,
    overflow="truncate",
)
cfg = GPTLikeConfig(vocab_size=len(vocab), max_length=640)
model = GPTLikeModel(cfg).to(dev).eval()
NB = 40


def batches(name, k=0, backend="auto", max_tokens=None):
    loader = make_loader(
        name,
        corpus,
        None if max_tokens else 64,
        k=k,
        max_length=640,
        pad_id=vocab.pad_id,
        seed=0,
        num_workers=4,
        pin_memory=True,
        max_tokens=max_tokens,
        attention_block_size=model.loader_block_size(dev),
    )
    out = []
    for i, b in enumerate(loader):
        if i >= NB + 5:
            break
        out.append(lm_inputs(b).to(dev).model_kwargs)
    return out


def measure(label, m, bs):
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        for kw in bs[:5]:
            m.features(**kw)
        torch.cuda.synchronize()
        bs = bs[5:]
        cpu, evs = [], []
        for kw in bs:
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            a.record()
            m.features(**kw)
            b.record()
            cpu.append(time.perf_counter() - t)
            evs.append((a, b))
        torch.cuda.synchronize()
        ev = [a.elapsed_time(b) for a, b in evs]
        # GPU-only: CPU far ahead (sync, then launch one batch while GPU idles? no: queue 3 copies)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for kw in bs:
                m.features(**kw)
            torch.cuda.synchronize()
    ka = prof.key_averages()
    gpu_total = (
        sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
        / 1e3
        / len(bs)
    )
    print(
        f"{label:28s} cpu launch med {1e3 * st.median(cpu):6.2f} ms | event med {st.median(ev):6.2f} ms | GPU kernels {gpu_total:6.2f} ms/batch | width {bs[0]['input_ids'].shape}"
    )
    return prof


dense = [{"input_ids": torch.randint(2, len(vocab), (64, 640), device=dev)} for _ in range(NB + 5)]
measure("dense 64x640", model, dense)
pb = batches("packed_bfd")
prof = measure("packed_bfd flex", model, pb)
print(
    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50)
)
