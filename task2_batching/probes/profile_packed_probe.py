"""Where does a packed batch's forward time go? CPU launch vs GPU kernels (probe, needs CUDA).

``--batches`` batches already on the GPU per variant (after ``--warmup-batches``), bf16
inference: the median host time to queue one forward (``cpu_launch_ms_median``), the median
CUDA-event time of a forward (``event_ms_median``) and the GPU kernel time per batch summed by
torch.profiler (``gpu_kernel_ms_per_batch``). Variants: random dense 64 x 640 rows; packed BFD
rows on FlexAttention and on the dense document mask; BIG BRAIN rows of 64 lines; ULTRA rows
under a 40960-token budget at k = 1 and 10. ``--attention-blocks`` says where the packed rows'
FlexAttention block lists are built: by the DataLoader workers (``loader``) or by the model on
the GPU from the document ids in each forward (``gpu``); every record's config names it
(``attention_blocks_built``). Needs CUDA; ``--quick`` is a short smoke run on the GPU. Writes
``--out/profile_packed.jsonl`` and prints the profiler's table for the packed BFD rows on
FlexAttention.

    python task2_batching/probes/profile_packed_probe.py --attention-blocks loader --out runs/task2/probes
    python task2_batching/probes/profile_packed_probe.py --attention-blocks gpu --out runs/task2/probes
"""

from __future__ import annotations

import statistics as st
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from effdl.cli import ConfigFlags, base_parser, require_cuda, require_positive, run_main, start_run
from effdl.data.pipelines import make_loader
from effdl.data.tokenize import prepare_wikitext_ids
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import lm_inputs
from effdl.results import RunLog

MAX_LENGTH, ROWS, MAX_TOKENS = 640, 64, 40960
# variant -> (pipeline, k, token budget, document attention of packed rows); None: random ids
VARIANTS = {
    f"dense {ROWS}x{MAX_LENGTH}": (None, 0, None, "flex"),
    "packed_bfd flex": ("packed_bfd", 0, None, "flex"),
    "packed_bfd dense-mask": ("packed_bfd", 0, None, "dense"),
    "bigbrain": ("bigbrain", 0, None, "flex"),
    f"ultra k1 mt{MAX_TOKENS}": ("ultra", 1, MAX_TOKENS, "flex"),
    f"ultra k10 mt{MAX_TOKENS}": ("ultra", 10, MAX_TOKENS, "flex"),
}
PROFILED = "packed_bfd flex"  # the variant whose profiler table is printed
BUILT_BY = ("loader", "gpu")


@dataclass
class ProbeConfig:
    """Batches per variant and where block lists are built; the defaults are the GPU run."""

    batches: int = 40  # timed batches per variant
    warmup_batches: int = 5
    attention_blocks: str = "loader"  # one of BUILT_BY

    def validate(self) -> None:
        require_positive(self, "batches")
        require_positive(self, "warmup_batches", minimum=0)


FULL = ProbeConfig()
QUICK = ProbeConfig(batches=5, warmup_batches=2)


def loader_blocks(cfg: ProbeConfig, model: GPTLikeModel, device: torch.device) -> int | None:
    """The ``attention_block_size`` the packed loader gets: the model's (block lists built in
    the workers) for ``loader``; None for ``gpu``, so each forward builds them from doc_ids."""
    return model.loader_block_size(device) if cfg.attention_blocks == "loader" else None


class Batches:
    """The corpus and a model per document-attention path (same weights); each variant's
    batches on the GPU."""

    def __init__(self, cfg: ProbeConfig, device: torch.device, seed: int) -> None:
        self.cfg, self.device = cfg, device
        # the generated WikiText-like corpus (seed 0) that mock_epoch.py reads, cut to MAX_LENGTH
        cache = "runs/cache/wt103_full.npz"
        self.corpus, vocab, _ = prepare_wikitext_ids(None, cache=cache, max_length=MAX_LENGTH)
        self.vocab_size, self.pad_id = len(vocab), vocab.pad_id
        self.models = {}
        for attention in ("flex", "dense"):
            torch.manual_seed(seed)  # the same weights on both paths
            config = GPTLikeConfig(
                vocab_size=self.vocab_size, max_length=MAX_LENGTH, doc_attention=attention
            )
            self.models[attention] = GPTLikeModel(config).to(device).eval()

    def of(self, variant: str) -> tuple[GPTLikeModel, list[dict]]:
        """The model and the forward kwargs of ``variant``'s warm-up and timed batches."""
        pipeline, k, max_tokens, attention = VARIANTS[variant]
        model, n = self.models[attention], self.cfg.warmup_batches + self.cfg.batches
        if pipeline is None:
            shape = (ROWS, MAX_LENGTH)
            return model, [
                {"input_ids": torch.randint(2, self.vocab_size, shape, device=self.device)}
                for _ in range(n)
            ]
        blocks = loader_blocks(self.cfg, model, self.device) if attention == "flex" else None
        loader = make_loader(
            pipeline,
            self.corpus,
            None if max_tokens else ROWS,
            k=k,
            max_length=MAX_LENGTH,
            pad_id=self.pad_id,
            seed=0,
            num_workers=4,
            pin_memory=True,
            max_tokens=max_tokens,
            attention_block_size=blocks,
        )
        out = []
        for b in loader:
            if len(out) == n:
                break
            out.append(lm_inputs(b).to(self.device).model_kwargs)
        return model, out


def forward_metrics(cpu_s: list[float], event_ms: list[float], kernel_us: float) -> dict:
    """A variant's record metrics from the host seconds to queue each forward, each forward's
    CUDA-event milliseconds and the profiler's kernel microseconds over all of them."""
    return {
        "cpu_launch_ms_median": 1e3 * st.median(cpu_s),
        "event_ms_median": st.median(event_ms),
        "gpu_kernel_ms_per_batch": kernel_us / 1e3 / len(event_ms),
    }


def measure(model: GPTLikeModel, batches: list[dict], warmup: int):
    """(metrics, profiler) of the forwards of ``batches`` after the ``warmup`` first ones."""
    with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16):
        for kw in batches[:warmup]:
            model.features(**kw)
        torch.cuda.synchronize()
        batches = batches[warmup:]
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
    return forward_metrics(cpu, event_ms, kernel_us), prof


def log_variant(
    log: RunLog, cfg: ProbeConfig, variant: str, batches: list[dict], metrics: dict
) -> dict:
    """Log (and print) ``variant``'s record: its metrics, where block lists were built, the
    batch counts and the shape of its first batch."""
    config = {
        "attention_blocks_built": cfg.attention_blocks,
        "batches": cfg.batches,
        "warmup_batches": cfg.warmup_batches,
        "shape": list(batches[0]["input_ids"].shape),
    }
    print(variant, " ".join(f"{k} {v:.2f}" for k, v in metrics.items()), config["shape"])
    return log.log(variant, config, metrics)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/task2/probes")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("batches", type=int, help="timed batches per variant")
    flags.add("warmup_batches", type=int, help="untimed batches before them")
    flags.add("attention_blocks", choices=BUILT_BY,
              help="who builds the packed rows' FlexAttention block lists: the DataLoader "
              "workers, or the model on the GPU in each forward")  # fmt: skip
    args = p.parse_args()
    cfg = flags.resolve(args)
    require_cuda(args.device, "the packed-forward profile probe")
    run = start_run(args, task="task2_profile_packed", logs="profile_packed.jsonl")
    source = Batches(cfg, run.device, run.seed)
    for variant in VARIANTS:
        model, batches = source.of(variant)
        metrics, prof = measure(model, batches, cfg.warmup_batches)
        log_variant(run.log, cfg, variant, batches, metrics)
        if variant == PROFILED:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    print(f"{PROFILED}, {run.where}:\n{table}")


if __name__ == "__main__":
    run_main(main)
