"""Fine-tune GPT-2-Large inside 11 GiB of GPU memory with a CPU-offloaded Adam.

bf16 working weights on the GPU, fp32 master weights and Adam moments on the CPU
(effdl.optim.CPUOffloadAdam), 64 x 1024 tokens per step.

    python memory_efficient_gpt2/train.py --quick                           # CPU smoke run, tiny GPT-2
    python memory_efficient_gpt2/train.py --device cuda --baseline          # fwd+bwd: HF, and ours
    python memory_efficient_gpt2/train.py --device cuda --steps 8           # training corpus
    python memory_efficient_gpt2/train.py --device cuda --fixed-batch --steps 30

``--checkpoint-layers -1`` checkpoints the fewest blocks whose estimated memory
(effdl.profiling.memory_budget, with the activation bytes measured on the GPU) fits the cap.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from effdl.cli import (
    ConfigFlags,
    UsageError,
    base_parser,
    print_table,
    require_choices,
    require_path,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.corpus import CorpusFormatError, read_wikitext
from effdl.data.token_streams import step_batches, synthetic_stream, text_stream
from effdl.models.gpt2 import (
    SHAPES,
    build_gpt2,
    checkpoint_blocks,
    count_params,
    gpt2_config,
    lm_loss,
)
from effdl.optim import CPUOffloadAdam
from effdl.optim.offload import GRAD_ACCUMULATION_MODES
from effdl.profiling.memory_budget import (
    ACT_BYTES_PER_TOKEN_LAYER,
    fewest_checkpointed_blocks,
    host_budget,
    memory_budget,
)
from effdl.profiling.timing import GIB, benchmark
from effdl.results import RunLog

TASK = "gpt2"
TIMELINE_KINDS = ("gpu_compute", "d2h", "h2d", "cpu_update", "cpu_accumulate", "step_wait")
MODEL_FOLDER = (
    "a local Hugging Face GPT-2 folder: config.json + model.safetensors or pytorch_model.bin"
)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # fmt: skip
TABLE_COLUMNS = ("step", "loss", "seq_per_s", "peak_gib", "host_rss_gib", "gpu_compute_s",
                 "d2h_s", "h2d_s", "cpu_update_s", "step_wait_s")  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one run: the offloaded training (default) or the baselines (``baseline``)."""

    baseline: bool = False
    fixed_batch: bool = False
    steps: int = 8
    batch: int = 64
    seq: int = 1024
    micro_batch: int = 4
    checkpoint_layers: int = -1  # -1: the fewest that fit the cap (estimate)
    grad_accumulation: str = "gpu"
    lr: float = 1e-4
    weight_decay: float = 0.0
    memory_cap_gib: float = 11.0
    chunk_tokens: int = 1024
    cpu_threads: int | None = None  # None: all cores but two
    size: str = "large"
    model_path: Path | None = None
    data: Path | None = None
    baseline_micro_batches: tuple[int, ...] = (4, 8, 16)
    baseline_warmup: int = 2
    baseline_iters: int = 5

    def validate(self) -> None:
        require_choices(self, "size", sorted(SHAPES))
        require_choices(self, "grad_accumulation", GRAD_ACCUMULATION_MODES)
        require_positive(
            self, "steps", "batch", "seq", "micro_batch", "chunk_tokens", "baseline_micro_batches"
        )
        require_positive(self, "lr", "weight_decay", minimum=0)
        if self.cpu_threads is not None:
            require_positive(self, "cpu_threads")
        if not self.memory_cap_gib > 0:
            raise UsageError(f"--memory-cap-gib must be > 0, got {self.memory_cap_gib}")
        shape = SHAPES[self.size]
        if not -1 <= self.checkpoint_layers <= shape.n_layer:
            raise UsageError(
                f"--checkpoint-layers must be -1 (auto) or 0..{shape.n_layer} for --size "
                f"{self.size}, got {self.checkpoint_layers}"
            )
        if self.batch % self.micro_batch:
            raise UsageError(
                f"--batch {self.batch} is not a multiple of --micro-batch {self.micro_batch}"
            )
        if self.seq > shape.n_positions:
            raise UsageError(f"--seq {self.seq} exceeds GPT-2's {shape.n_positions} positions")
        if self.model_path is not None:
            require_path(self.model_path, MODEL_FOLDER, "--model-path")
        if self.data is not None:
            require_path(
                self.data, "WikiText-103 files or a parquet with a 'text' column", "--data"
            )


FULL = TrainConfig()
QUICK = TrainConfig(
    steps=4,
    batch=8,
    seq=64,
    micro_batch=2,
    lr=1e-3,
    size="tiny",
    baseline_micro_batches=(2, 4),
    baseline_warmup=1,
    baseline_iters=2,
)


def parse_args() -> tuple[argparse.Namespace, TrainConfig]:
    """The command line: the common flags, then the config's; returns (args, config)."""
    p = base_parser(__doc__.splitlines()[0], default_out="runs/gpt2")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add(
        "baseline",
        action="store_true",
        help="fwd+bwd speed only: HF's model (fp32, fp16 autocast) and ours (bf16), no offload",
    )
    flags.add("fixed_batch", action="store_true", help="train on one fixed batch")
    flags.add("steps", type=int, help="optimizer steps")
    flags.add("batch", type=int, help="sequences per optimizer step")
    flags.add("seq", type=int, help="sequence length")
    flags.add("micro_batch", type=int, help="sequences per forward/backward")
    flags.add(
        "checkpoint_layers",
        type=int,
        help="blocks to recompute in backward; -1 = fewest that fit the cap (estimate)",
    )
    flags.add("grad_accumulation", choices=GRAD_ACCUMULATION_MODES)
    flags.add("lr", type=float)
    flags.add("weight_decay", type=float)
    flags.add("memory_cap_gib", type=float)
    flags.add("chunk_tokens", type=int, help="tokens per loss chunk")
    flags.add("cpu_threads", type=int, help="threads of the CPU update; None = cores - 2")
    flags.add("size", choices=sorted(SHAPES))
    flags.add("model_path", type=Path, help="local HF GPT-2 folder")
    flags.add("data", type=Path, help="text file (e.g. wiki.train.raw); None = synthetic")
    flags.add("baseline_micro_batches", type=int, nargs="+")
    args = p.parse_args()
    return args, flags.resolve(args)


# ----------------------------------------------------------------------------------- inputs
def check_model_folder(cfg: TrainConfig):
    """The ``GPT2Config`` of ``--model-path`` (None without one), refusing in one line what
    ``from_pretrained`` would fail on or load wrongly: no config.json or weights, another
    model type, another shape than ``--size``, ``--seq`` beyond its positions, missing weights
    (which Hugging Face would initialize at random with only a warning)."""
    from transformers import GPT2Config

    folder = cfg.model_path
    if folder is None:
        return None
    if not folder.is_dir():
        raise UsageError(f"--model-path: {folder} is not a folder (expected {MODEL_FOLDER})")
    config_file = folder / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(
            f"--model-path: {folder} has no config.json (expected {MODEL_FOLDER})"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(
            f"--model-path: {config_file} is not a readable JSON config ({e})"
        ) from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type != "gpt2":
        raise UsageError(
            f"--model-path: {config_file} has model_type {model_type!r}, expected 'gpt2'"
        )
    try:
        config = GPT2Config.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--model-path: {config_file}: not a GPT-2 config ({e})") from None
    shape = SHAPES[cfg.size]
    found = {k: getattr(config, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size")}
    if found != {k: getattr(shape, k) for k in found}:
        sizes = [name for name, s in SHAPES.items() if found == {k: getattr(s, k) for k in found}]
        hint = f"give --size {sizes[0]}" if sizes else f"--size is one of {sorted(SHAPES)}"
        raise UsageError(
            f"--model-path: {config_file} describes {found}, not --size {cfg.size} ({hint})"
        )
    if cfg.seq > config.n_positions:
        raise UsageError(
            f"--seq {cfg.seq} exceeds the {config.n_positions} positions of {config_file}"
        )
    missing = expected_weights(config) - checkpoint_weights(folder)
    if missing:
        raise UsageError(
            f"--model-path: the weights in {folder} lack {len(missing)} tensors of GPT-2 "
            f"(e.g. {sorted(missing)[0]})"
        )
    return config


def _weight_name(key: str) -> str:
    """A checkpoint key without the ``transformer.`` prefix (hub checkpoints omit it)."""
    return key.removeprefix("transformer.")


def expected_weights(config) -> set[str]:
    """Names of the tensors a GPT-2 of ``config`` loads (the tied LM head excluded)."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        names = GPT2LMHeadModel(config).state_dict().keys()
    tied = config.tie_word_embeddings
    return {_weight_name(k) for k in names if not (tied and k == "lm_head.weight")}


def checkpoint_weights(folder: Path) -> set[str]:
    """Names of the tensors stored in ``folder`` (read from headers, no weights loaded)."""
    from safetensors import SafetensorError, safe_open

    present = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        raise UsageError(f"--model-path: {folder} has no weights (expected {MODEL_FOLDER})")
    path = present[0]
    try:
        if path.name.endswith(".index.json"):
            keys = json.loads(path.read_text(encoding="utf-8"))["weight_map"].keys()
        elif path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                keys = list(f.keys())
        else:
            keys = torch.load(path, map_location="meta", weights_only=True, mmap=True).keys()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError,
            SafetensorError, json.JSONDecodeError) as e:  # fmt: skip
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"--model-path: cannot read the weights {path} ({msg})") from None
    return {_weight_name(k) for k in keys}


def load_model(cfg: TrainConfig, fast_gelu: bool = True) -> torch.nn.Module:
    """The GPT-2 to train: random init for ``--size``, or ``--model-path``'s weights."""
    from safetensors import SafetensorError

    config = gpt2_config(cfg.size, fast_gelu=fast_gelu)
    try:
        return build_gpt2(config, cfg.model_path, fast_gelu=fast_gelu)
    except (OSError, SafetensorError) as e:  # e.g. weights truncated past their header
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"--model-path: cannot load {cfg.model_path} ({msg})") from None


def make_batches(cfg: TrainConfig, vocab: int, seed: int) -> list[torch.Tensor]:
    """One (batch, seq) int64 tensor per step (the same one with --fixed-batch), from the
    synthetic stream or ``--data`` read as the other scripts read it (checked in full)."""
    if cfg.data is None:
        stream = functools.partial(synthetic_stream, vocab=vocab, seed=seed)
    else:
        try:
            lines = read_wikitext(cfg.data)
        except CorpusFormatError as e:
            raise UsageError(f"--data: {e}") from None
        if not lines:
            raise UsageError(f"--data: {cfg.data} holds no non-empty text")
        stream = functools.partial(
            text_stream, lines, vocab=vocab, tokenizer_dir=cfg.model_path, source=cfg.data
        )
    try:
        return step_batches(stream, cfg.steps, cfg.batch, cfg.seq, fixed=cfg.fixed_batch)
    except CorpusFormatError as e:
        raise UsageError(f"--data: {e}") from None


# ----------------------------------------------------------------------------------- baseline
BASELINE_COLUMNS = ("micro_batch", "seq_per_s", "peak_gib")


def time_fwd_bwd(
    model: torch.nn.Module,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    cfg: TrainConfig,
    micro_batch: int,
    device: torch.device,
) -> dict | None:
    """Metrics of one micro-batch's fwd+bwd (``loss_of(ids)`` then backward); None when it runs
    out of memory."""
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, cfg.seq), device=device)

    def fwd_bwd() -> None:
        loss_of(ids).backward()

    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        stats = benchmark(
            fwd_bwd,
            warmup=cfg.baseline_warmup,
            iters=cfg.baseline_iters,
            device=device,
            setup=lambda: model.zero_grad(set_to_none=True),
        )
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return None
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else math.nan
    return {
        "micro_batch": micro_batch,
        "seq_per_s": micro_batch / stats.median,
        "peak_gib": peak,
        **stats.as_dict("fwd_bwd_s_"),
    }


def hf_loss(model: torch.nn.Module, ids: torch.Tensor, amp_dtype: torch.dtype) -> torch.Tensor:
    """Hugging Face's own loss (full logits) under autocast."""
    with torch.autocast(ids.device.type, dtype=amp_dtype):
        return model(ids, labels=ids).loss


def baseline_models(cfg: TrainConfig, device: torch.device):
    """(variant, model, loss_of, amp, weights) of each baseline: Hugging Face's model as shipped
    (fp32 weights, gelu_new) under fp16 autocast, and ours as the offloaded run computes (bf16
    weights, tanh GELU, the chunked loss) without the offload, the cap or checkpointing."""
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    hf = load_model(cfg, fast_gelu=False)
    hf.to(device).train()
    yield (
        "baseline",
        hf,
        functools.partial(hf_loss, hf, amp_dtype=amp_dtype),
        str(amp_dtype),
        "fp32",
    )
    del hf
    own = load_model(cfg).to(device, torch.bfloat16).train()
    own_loss = functools.partial(lm_loss, own, chunk_tokens=cfg.chunk_tokens)
    yield "baseline_own", own, own_loss, "none", "bf16"


def run_baseline(cfg: TrainConfig, device: torch.device, log: RunLog) -> list[dict]:
    """Forward+backward speed of each baseline model at every micro-batch size, and the best."""
    rows = []
    for variant, model, loss_of, amp, weights in baseline_models(cfg, device):
        found = []
        for mb in cfg.baseline_micro_batches:
            metrics = time_fwd_bwd(model, loss_of, cfg, mb, device)
            if metrics is None:
                found.append({"micro_batch": mb, "seq_per_s": float("nan"), "note": "OOM"})
                continue
            config = {"size": cfg.size, "seq": cfg.seq, "micro_batch": mb, "amp": amp,
                      "weights": weights}  # fmt: skip
            log.log(variant, config, metrics)
            found.append({k: metrics[k] for k in BASELINE_COLUMNS})
        ok = [r for r in found if not math.isnan(r["seq_per_s"])]
        if not ok:
            raise RuntimeError(f"{variant}: every micro-batch size ran out of memory")
        best = max(ok, key=lambda r: r["seq_per_s"])
        log.log(f"{variant}_best", {"size": cfg.size, "seq": cfg.seq}, best)
        rows += [{"variant": variant, **r} for r in found]
        del model, loss_of
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------- ours
def resolve_cpu_threads(requested: int | None) -> int:
    """Threads for the CPU update: as requested, or all cores but two (left to data and launch)."""
    return requested or max(1, (os.cpu_count() or 2) - 2)


def set_memory_cap(device: torch.device, cap_gib: float) -> float:
    """Enforce the cap with the caching allocator; returns the fraction set."""
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    frac = min(1.0, cap_gib / total)
    torch.cuda.set_per_process_memory_fraction(frac, device)
    return frac


def measure_activation_bytes(
    model: torch.nn.Module, opt: CPUOffloadAdam, device: torch.device, cfg: TrainConfig
) -> float:
    """Bytes autograd keeps per token per block, measured on one sequence with no block
    checkpointed (also a warm-up); the gradients it makes are discarded."""
    ids = torch.randint(0, model.config.vocab_size, (1, cfg.seq), device=device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    loss = lm_loss(model, ids, cfg.chunk_tokens)
    held = torch.cuda.memory_allocated(device) - before
    # the loss function keeps its fp32 LM-head gradient and the hidden-state gradient
    held -= model.lm_head.weight.numel() * 4 + cfg.seq * model.config.n_embd * 2
    opt.backward(loss)
    opt.zero_grad()
    return held / (cfg.seq * model.config.n_layer)


def pick_checkpoint_layers(cfg: TrainConfig, n_params: int, act_bytes: float | None) -> int:
    """``--checkpoint-layers`` if given, else the fewest blocks whose estimate fits the cap."""
    if cfg.checkpoint_layers >= 0:
        return cfg.checkpoint_layers
    n = fewest_checkpointed_blocks(
        SHAPES[cfg.size], n_params, cfg.micro_batch, cfg.seq, cfg.grad_accumulation,
        cfg.memory_cap_gib, cfg.chunk_tokens, act_bytes_per_token_layer=act_bytes,
    )  # fmt: skip
    if n is None:
        raise UsageError(
            f"--micro-batch {cfg.micro_batch}: does not fit {cfg.memory_cap_gib} GiB even with "
            "every block checkpointed; use a smaller micro-batch"
        )
    return n


def run_config(cfg: TrainConfig, n_params: int, ckpt: int, threads: int) -> dict:
    """The ``config`` of every record of an offloaded run."""
    return {
        "size": cfg.size,
        "n_params": n_params,
        "seq": cfg.seq,
        "batch": cfg.batch,
        "micro_batch": cfg.micro_batch,
        "n_micro": cfg.batch // cfg.micro_batch,
        "checkpoint_layers": ckpt,
        "grad_accumulation": cfg.grad_accumulation,
        "lr": cfg.lr,
        "cpu_threads": threads,
        "memory_cap_gib": cfg.memory_cap_gib,
        "chunk_tokens": cfg.chunk_tokens,
        "data": str(cfg.data) if cfg.data else "synthetic",
        "pretrained": cfg.model_path is not None,
    }


def log_budget(
    log: RunLog, cfg: TrainConfig, config: dict, static_gib: float, act_bytes: float | None
) -> None:
    """The ``memory_budget`` record: estimated GPU and host GiB beside what was measured."""
    n_params, ckpt = config["n_params"], config["checkpoint_layers"]
    gpu = memory_budget(
        SHAPES[cfg.size], n_params, cfg.micro_batch, cfg.seq, ckpt,
        cfg.grad_accumulation, cfg.chunk_tokens, act_bytes_per_token_layer=act_bytes,
    )  # fmt: skip
    host = host_budget(n_params, cfg.grad_accumulation)
    log.log(
        "memory_budget",
        config,
        {
            **{f"gpu_{k}_gib": v for k, v in gpu.items()},
            **{f"host_{k}_gib": v for k, v in host.items()},
            "measured_static_gib": static_gib,
            "measured_act_bytes_per_token_layer": act_bytes if act_bytes else math.nan,
            "estimated_act_bytes_per_token_layer": ACT_BYTES_PER_TOKEN_LAYER
            * SHAPES[cfg.size].n_embd,
        },
    )


def train_step(
    model: torch.nn.Module,
    opt: CPUOffloadAdam,
    batch: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
) -> dict:
    """One optimizer step over ``batch`` in micro-batches; wall time, loss and timeline totals."""
    n_micro = cfg.batch // cfg.micro_batch
    opt.timeline.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    losses = []
    for i, mb in enumerate(batch.split(cfg.micro_batch)):
        start = opt.timeline.mark()
        loss = lm_loss(model, mb.to(device, non_blocking=True), cfg.chunk_tokens) / n_micro
        opt.backward(loss, final=i == n_micro - 1)
        opt.timeline.add("gpu_compute", i, start, opt.timeline.mark())
        losses.append(loss.detach())
    t_step = time.perf_counter()
    opt.step()
    opt.timeline.add("step_wait", -1, t_step, time.perf_counter())
    loss_value = float(torch.stack(losses).sum())  # the one sync per step
    wall = time.perf_counter() - t0
    peak_gib = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else math.nan
    totals = opt.timeline.totals()
    return {
        "loss": loss_value,
        "step_s": wall,
        "seq_per_s": cfg.batch / wall,
        "peak_gib": peak_gib,
        "host_rss_gib": psutil.Process().memory_info().rss / GIB,
        **{f"{kind}_s": totals.get(kind, 0.0) for kind in TIMELINE_KINDS},
    }


def run_offload(
    cfg: TrainConfig, batches: list[torch.Tensor], device: torch.device, log: RunLog
) -> list[dict]:
    """Train on ``batches`` with CPUOffloadAdam under the memory cap; one record per step, then
    a summary."""
    cuda = device.type == "cuda"
    if cuda:
        set_memory_cap(device, cfg.memory_cap_gib)
    threads = resolve_cpu_threads(cfg.cpu_threads)
    model = load_model(cfg).train()
    n_params = count_params(model)
    opt = CPUOffloadAdam(
        model.parameters(),
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        device=device,
        working_dtype=torch.bfloat16,
        grad_accumulation=cfg.grad_accumulation,
        num_threads=threads,
    )
    model.to(device)  # buffers; parameters are already bf16 working copies on the device
    static_gib = torch.cuda.memory_allocated(device) / GIB if cuda else math.nan
    act_bytes = measure_activation_bytes(model, opt, device, cfg) if cuda else None
    ckpt = pick_checkpoint_layers(cfg, n_params, act_bytes)
    checkpoint_blocks(model, ckpt)
    opt.timeline.enabled = True
    config = run_config(cfg, n_params, ckpt, threads)
    log_budget(log, cfg, config, static_gib, act_bytes)
    variant = "fixed_batch" if cfg.fixed_batch else "corpus"
    rows = []
    for step, batch in enumerate(tqdm(batches, desc=variant, unit="step")):
        metrics = {"step": step, **train_step(model, opt, batch, cfg, device)}
        if metrics["peak_gib"] > cfg.memory_cap_gib:
            raise RuntimeError(
                f"step {step}: peak GPU memory {metrics['peak_gib']:.3f} GiB exceeds the "
                f"{cfg.memory_cap_gib} GiB cap"
            )
        if step == len(batches) - 1:
            metrics["timeline"] = opt.timeline.spans()
        log.log(variant, config, metrics)
        rows.append(metrics)
    opt.close()
    log.log(f"{variant}_summary", config, summarize(rows, cfg.fixed_batch))
    return rows


def summarize(rows: list[dict], fixed_batch: bool) -> dict:
    """Median speed past the first step (it pays the warm-up), peak memory, loss drop."""
    timed = rows[1:] or rows
    speeds = sorted(r["seq_per_s"] for r in timed)
    first, last = rows[0]["loss"], rows[-1]["loss"]
    metrics = {
        "steps": len(rows),
        "seq_per_s_median": speeds[len(speeds) // 2],
        "peak_gib_max": max(r["peak_gib"] for r in rows),
        "loss_first": first,
        "loss_last": last,
        "loss_drop": 1.0 - last / first,
    }
    if fixed_batch:
        metrics["loss_halved"] = last <= 0.5 * first
    return metrics


def main() -> None:
    args, cfg = parse_args()
    # Every input is checked before the log is opened: a refused run leaves no record.
    model_config = check_model_folder(cfg) or gpt2_config(cfg.size)
    batches = None if cfg.baseline else make_batches(cfg, model_config.vocab_size, args.seed)
    run = start_run(args, task=TASK, logs="gpt2.jsonl")
    if cfg.baseline:
        rows = run_baseline(cfg, run.device, run.log)
        print_table(rows, title=f"Baseline fwd+bwd on {run.where} (log: {run.log.path})")
        return
    rows = run_offload(cfg, batches, run.device, run.log)
    table = [{k: r[k] for k in TABLE_COLUMNS} for r in rows]
    print_table(table, title=f"CPU-offloaded Adam on {run.where} (log: {run.log.path})")
    if cfg.fixed_batch:
        drop = 1.0 - rows[-1]["loss"] / rows[0]["loss"]
        print(f"fixed batch: loss fell by {drop:.1%} in {len(rows)} steps (target >= 50%)")


if __name__ == "__main__":
    run_main(main)
