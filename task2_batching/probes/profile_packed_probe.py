"""Where does a packed batch's forward time go? CPU launch vs GPU kernels (probe, needs CUDA).

Forty batches already on the GPU per variant (after five warm-up batches), bf16 inference: the
median host time to queue one forward (``cpu_launch_ms_median``), the median CUDA-event time of
a forward (``event_ms_median``) and the GPU kernel time per batch summed by torch.profiler
(``gpu_kernel_ms_per_batch``). The packed rows' attention block lists are built by the
DataLoader workers (``config.attention_blocks_built = "loader"``). Writes
``--out/profile_packed.jsonl`` and prints the profiler's table for the packed batches.
"""

from __future__ import annotations

import argparse
import statistics as st
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from effdl.data.pipelines import make_loader
from effdl.data.tokenize import prepare_wikitext_ids
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import lm_inputs
from effdl.results import RunLog

MAX_LENGTH, BATCHES, WARMUP_BATCHES = 640, 40, 5


def packed_batches(model, corpus, pad_id: int, device: torch.device) -> list[dict]:
    loader = make_loader(
        "packed_bfd",
        corpus,
        64,
        k=0,
        max_length=MAX_LENGTH,
        pad_id=pad_id,
        seed=0,
        num_workers=4,
        pin_memory=True,
        attention_block_size=model.loader_block_size(device),
    )
    out = []
    for i, b in enumerate(loader):
        if i >= BATCHES + WARMUP_BATCHES:
            break
        out.append(lm_inputs(b).to(device).model_kwargs)
    return out


def measure(model, batches: list[dict]):
    """(metrics, profiler) of the forwards of ``batches`` after the warm-up ones."""
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        for kw in batches[:WARMUP_BATCHES]:
            model.features(**kw)
        torch.cuda.synchronize()
        batches = batches[WARMUP_BATCHES:]
        cpu, events = [], []
        for kw in batches:
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            a.record()
            model.features(**kw)
            b.record()
            cpu.append(time.perf_counter() - t)
            events.append((a, b))
        torch.cuda.synchronize()
        event_ms = [a.elapsed_time(b) for a, b in events]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for kw in batches:
                model.features(**kw)
            torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == cuda)
    metrics = {
        "cpu_launch_ms_median": 1e3 * st.median(cpu),
        "event_ms_median": st.median(event_ms),
        "gpu_kernel_ms_per_batch": kernel_us / 1e3 / len(batches),
    }
    return metrics, prof


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/task2/probes"), help="log folder")
    args = p.parse_args()
    log = RunLog(args.out / "profile_packed.jsonl", task="task2_profile_packed", create=True)
    dev = torch.device("cuda")
    corpus, vocab, _ = prepare_wikitext_ids(
        None,
        quick=False,
        seed=0,
        cache="runs/cache/wt103_full.npz",
        max_length=MAX_LENGTH,
        overflow="truncate",
    )
    model = GPTLikeModel(GPTLikeConfig(vocab_size=len(vocab), max_length=MAX_LENGTH)).to(dev).eval()
    dense = [
        {"input_ids": torch.randint(2, len(vocab), (64, MAX_LENGTH), device=dev)}
        for _ in range(BATCHES + WARMUP_BATCHES)
    ]
    variants = [
        ("dense 64x640", dense),
        ("packed_bfd flex", packed_batches(model, corpus, vocab.pad_id, dev)),
    ]
    for name, batches in variants:
        metrics, prof = measure(model, batches)
        config = {
            "attention_blocks_built": "loader",
            "batches": BATCHES,
            "warmup_batches": WARMUP_BATCHES,
            "shape": list(batches[0]["input_ids"].shape),
        }
        log.log(name, config, metrics)
        print(name, " ".join(f"{k} {v:.2f}" for k, v in metrics.items()), config["shape"])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
