"""Level 3's optimizer against fp32 Adam: a small GPT-2 trained hundreds of steps on real text.

Four runs from the same initial weights, each step 4 micro-batches of windows of the stdlib
corpus (Python's documentation and source, tokenized by its own byte-level BPE), linear lr
warm-up then cosine decay:

* ``adam_fp32``: ``torch.optim.Adam(fused=True)``, the reference;
* ``adam_fp32_reordered``: the same with the training windows in another order: the gap between
  two runs that differ only in which batch comes when is the noise yardstick;
* ``offload_fp32``: :class:`CPUOffloadAdam` with fp32 moments and an fp32 accumulator;
* ``offload_level3``: level 3's optimizer: int8 block-wise moments and a bf16 gradient
  accumulator, the update on the device when that is a GPU.

The working weights are fp32 in every run, so the optimizer (moments, accumulator) is the only
difference between the reference and the offloaded runs. Before every step each run's loss on
one fixed held-out batch is recorded (the tracking loss: the same tokens for every run, so its
gaps measure how far the models are apart, not which batch they saw); after the last step, the
loss on ``--eval-batches`` held-out batches. Each step is logged as it ends (``<run>_step``:
step, lr, tracking and training loss), each run as it ends (``<run>``: its curves, held-out
loss, seconds); the summary record gives, for each run, the mean and max |tracking-loss gap| to
the reference and the final held-out loss.

    python memory_efficient_gpt2/probes/optimizer_equivalence.py --out runs/gpt2   # CPU, ~8 min
    python memory_efficient_gpt2/probes/optimizer_equivalence.py --device cuda --out runs/gpt2
    python memory_efficient_gpt2/probes/optimizer_equivalence.py --quick          # seconds
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    print_table,
    require_fits,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.parquet import IterableParquetDataset
from effdl.data.stdlib_text import DEFAULT_CACHE, stdlib_bpe, stdlib_corpus
from effdl.data.tokenize import BOS_TOKEN, load_hf_tokenizer
from effdl.models.gpt2 import build_gpt2, gpt2_config, lm_loss
from effdl.optim import CPUOffloadAdam

REFERENCE = "adam_fp32"
REORDERED = "adam_fp32_reordered"
RUNS = (REFERENCE, REORDERED, "offload_fp32", "offload_level3")


@dataclass(frozen=True)
class ProbeConfig:
    steps: int = 300
    layers: int = 4
    d_model: int = 256
    heads: int = 4
    seq: int = 128
    micro_batch: int = 2  # sequences per micro-batch
    micro_batches: int = 4  # per step
    lr: float = 1e-3
    warmup: int = 30  # steps of linear warm-up, then cosine decay to lr / 10
    bpe_vocab: int = 8192
    corpus_bytes: int = 8 << 20
    eval_batches: int = 8  # held-out micro-batches of the final loss
    cache: Path = DEFAULT_CACHE

    def validate(self) -> None:
        require_positive(self, "steps", "layers", "d_model", "heads", "seq", "micro_batch")
        require_positive(self, "micro_batches", "bpe_vocab", "corpus_bytes", "eval_batches")
        require_positive(self, "lr", minimum=0)
        require_positive(self, "warmup", minimum=0)
        if self.d_model % self.heads:
            raise UsageError(f"--d-model {self.d_model} must divide by --heads {self.heads}")
        require_fits(
            "--layers --d-model --micro-batch --seq",
            self.layers * self.d_model * (12 * self.d_model + self.micro_batch * self.seq),
            "the blocks' weights and saved inputs (fp32)",
        )


QUICK = replace(ProbeConfig(), steps=8, layers=1, d_model=32, heads=2, seq=32, warmup=2,
                bpe_vocab=512, corpus_bytes=1 << 20, eval_batches=2)  # fmt: skip


def lr_at(step: int, cfg: ProbeConfig) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then cosine decay from ``cfg.lr`` to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class ProbeData:
    """Token windows ``(n, seq)`` int64: training pool, the tracking batch, held-out batches."""

    train: Tensor
    tracking: Tensor
    heldout: Tensor
    vocab_size: int
    corpus: str


def windows(parquet: Path, tokenizer, bos: int, seq: int, n: int) -> Tensor:
    """The first ``n`` non-overlapping ``seq``-token windows of the packed document stream."""
    stream = IterableParquetDataset(parquet, tokenizer, seq, bos)
    return torch.stack([inputs for inputs, _ in itertools.islice(stream, n)])


def load_data(cfg: ProbeConfig) -> ProbeData:
    corpus = stdlib_corpus(cfg.cache, max_bytes=cfg.corpus_bytes)
    tokenizer = load_hf_tokenizer(stdlib_bpe(corpus, cfg.bpe_vocab))
    bos = tokenizer.token_to_id(BOS_TOKEN)
    n_train = cfg.steps * cfg.micro_batches * cfg.micro_batch
    val = windows(corpus.val, tokenizer, bos, cfg.seq, (1 + cfg.eval_batches) * cfg.micro_batch)
    return ProbeData(
        train=windows(corpus.train, tokenizer, bos, cfg.seq, n_train),
        tracking=val[: cfg.micro_batch],
        heldout=val[cfg.micro_batch :],
        vocab_size=tokenizer.get_vocab_size(),
        corpus=corpus.name,
    )


def build_model(cfg: ProbeConfig, vocab_size: int, seed: int) -> torch.nn.Module:
    """A small GPT-2 (no dropout, so runs differ only by their optimizer and batch order),
    fp32 on the CPU, with the same initial weights for the same ``seed``."""
    config = gpt2_config("tiny", dropout=0.0)
    config.update({"n_layer": cfg.layers, "n_embd": cfg.d_model, "n_head": cfg.heads,
                   "vocab_size": vocab_size, "n_positions": cfg.seq})  # fmt: skip
    torch.manual_seed(seed)
    return build_gpt2(config)


Update = Callable[[list[Tensor], float], None]  # one step from its micro-batch losses, at lr


def torch_adam_update(model: torch.nn.Module, cfg: ProbeConfig) -> Update:
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True)

    def update(losses: list[Tensor], lr: float) -> None:
        opt.zero_grad(set_to_none=True)
        for loss in losses:
            loss.backward()
        opt.param_groups[0]["lr"] = lr
        opt.step()

    return update


def offload_update(opt: CPUOffloadAdam) -> Update:
    def update(losses: list[Tensor], lr: float) -> None:
        for group in opt.param_groups:  # before the final backward: buckets update inside it
            group["lr"] = lr
        for k, loss in enumerate(losses):
            opt.backward(loss, final=k == len(losses) - 1)
        opt.step()

    return update


ACCUMULATOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def offload_settings(name: str, device: torch.device) -> dict[str, str]:
    """CPUOffloadAdam's settings of an offloaded run (empty for the torch.optim.Adam runs)."""
    if name in (REFERENCE, REORDERED):
        return {}
    if name == "offload_fp32":
        return {"moments": "fp32", "grad_accumulation_dtype": "fp32", "update_on": "host"}
    update_on = "device" if device.type == "cuda" else "host"
    return {"moments": "int8", "grad_accumulation_dtype": "bf16", "update_on": update_on}


def make_optimizer(
    name: str, model: torch.nn.Module, cfg: ProbeConfig, device: torch.device
) -> tuple[Update, Callable[[], None]]:
    """The run's update and what releases the optimizer; moves ``model`` (fp32, CPU) to
    ``device``."""
    if name in (REFERENCE, REORDERED):
        model.to(device)
        return torch_adam_update(model, cfg), lambda: None
    settings = offload_settings(name, device)
    opt = CPUOffloadAdam(
        model.parameters(), lr=cfg.lr, device=device, working_dtype=torch.float32,
        moments=settings["moments"], update_on=settings["update_on"],
        grad_accumulation_dtype=ACCUMULATOR_DTYPES[settings["grad_accumulation_dtype"]],
    )  # fmt: skip
    model.to(device)
    return offload_update(opt), opt.close


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: Tensor, micro_batch: int) -> float:
    return sum(float(lm_loss(model, b)) for b in batches.split(micro_batch)) / math.ceil(
        len(batches) / micro_batch
    )


def train(
    name: str,
    data: ProbeData,
    cfg: ProbeConfig,
    device: torch.device,
    seed: int,
    log_step: Callable[[dict], None],
) -> dict:
    """One run: per-step training and tracking losses, final held-out loss, seconds. Each step's
    losses go to ``log_step`` as the step ends, so an interrupted run keeps the steps it made."""
    model = build_model(cfg, data.vocab_size, seed)
    update, close = make_optimizer(name, model, cfg, device)
    order_seed = 1 if name == REORDERED else 0
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(order_seed))
    per_step = cfg.micro_batches * cfg.micro_batch
    tracking = data.tracking.to(device)
    train_losses, tracking_losses = [], []
    start = time.perf_counter()
    for step in range(cfg.steps):
        tracking_losses.append(mean_loss(model, tracking, cfg.micro_batch))
        batch = data.train[order[step * per_step : (step + 1) * per_step]].to(device)
        losses = [lm_loss(model, mb) / cfg.micro_batches for mb in batch.split(cfg.micro_batch)]
        lr = lr_at(step, cfg)
        update(losses, lr)
        train_losses.append(float(sum(loss.detach() for loss in losses)))
        log_step({"step": step, "lr": lr, "tracking_loss": tracking_losses[-1],
                  "train_loss": train_losses[-1]})  # fmt: skip
    seconds = time.perf_counter() - start
    close()
    return {
        "train_loss": train_losses,
        "tracking_loss": tracking_losses,
        "final_tracking_loss": mean_loss(model, tracking, cfg.micro_batch),
        "heldout_loss": mean_loss(model, data.heldout.to(device), cfg.micro_batch),
        "seconds": seconds,
    }


def gap_summary(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per run: mean and max |tracking-loss gap| to the reference, and its final held-out loss."""
    ref = torch.tensor(results[REFERENCE]["tracking_loss"], dtype=torch.float64)
    summary = {}
    for name, metrics in results.items():
        gap = (torch.tensor(metrics["tracking_loss"], dtype=torch.float64) - ref).abs()
        summary[name] = {
            "mean_abs_gap": float(gap.mean()),
            "max_abs_gap": float(gap.max()),
            "heldout_loss": metrics["heldout_loss"],
        }
    return summary


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/gpt2")
    flags = ConfigFlags(p, ProbeConfig(), QUICK)
    for name in ("steps", "layers", "d_model", "heads", "seq", "micro_batch", "micro_batches",
                 "warmup", "bpe_vocab", "corpus_bytes", "eval_batches"):  # fmt: skip
        flags.add(name, type=int)
    flags.add("lr", type=float)
    flags.add("cache", type=Path, output=True, help="folder of the corpus and tokenizer")
    args = p.parse_args()
    cfg = flags.resolve(args)
    run = start_run(args, task="gpt2", logs="optimizer_equivalence.jsonl")
    data = load_data(cfg)
    config = {**asdict(cfg), "cache": str(cfg.cache), "device": str(run.device),
              "corpus": data.corpus, "vocab_size": data.vocab_size, "seed": args.seed,
              "threads": torch.get_num_threads(), "data": "real (stdlib text)"}  # fmt: skip
    results = {}
    for name in RUNS:
        at = {**config, **offload_settings(name, run.device)}
        log_step = functools.partial(run.log.log, f"{name}_step", at)
        results[name] = train(name, data, cfg, run.device, args.seed, log_step)
        run.log.log(name, at, results[name])
        print(f"{name}: {results[name]['seconds']:.0f} s", flush=True)
    summary = gap_summary(results)
    run.log.log("summary", config, summary)
    rows = [{"run": name, **{k: round(v, 4) for k, v in s.items()}} for name, s in summary.items()]
    print_table(rows, title=f"|tracking-loss gap| to {REFERENCE}, {cfg.steps} steps, {run.where}")


if __name__ == "__main__":
    run_main(main)
