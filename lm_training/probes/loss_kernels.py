"""The LM loss at the 1B head's shape: fp32-upcast cross-entropy, its compiled form, and
effdl.ops.cross_entropy (probe).

Per token count (the rows of ``tokens x vocab`` bf16 logits): forward + backward of the summed
loss, median ms over timed calls (CUDA events), the peak memory the call adds on top of the
logits, and the loss and gradient against the upcast reference. The byte floor of any exact
implementation: the logits read once for the loss and once for the gradient, the gradient
written once (3 x tokens x vocab x 2 bytes); ``floor_gbs`` is that over the measured time.
Writes ``--out/loss_kernels.jsonl``, one record per variant and token count.

    python3 lm_training/probes/loss_kernels.py --device cuda --out runs/lm_training/probes
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from effdl.cli import (
    ConfigFlags,
    base_parser,
    require_choices,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.labels import IGNORE_INDEX
from effdl.lm.loss import compiled_token_loss_sum, token_loss_sum, upcast_token_loss_sum
from effdl.ops.cross_entropy import uses_triton
from effdl.profiling.timing import benchmark, peak_memory

VARIANTS = ("upcast", "compiled", "effdl")


@dataclass
class ProbeConfig:
    """Shapes and repetitions; the defaults are the 1B model's head (vocabulary 128256)."""

    tokens: list[int] = field(default_factory=lambda: [8192, 16384])  # batch 4 x 2048, 4 x 4096
    vocab: int = 128256
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    warmup: int = 3
    iters: int = 10

    def validate(self) -> None:
        require_positive(self, "tokens", "vocab", "iters")
        require_positive(self, "warmup", minimum=0)
        require_choices(self, "variants", VARIANTS)


FULL = ProbeConfig()
QUICK = ProbeConfig(tokens=[64], vocab=1000, variants=["upcast", "effdl"], warmup=1, iters=3)


def loss_functions(names: list[str]) -> dict[str, Callable]:
    make = {
        "upcast": lambda: upcast_token_loss_sum,
        "compiled": compiled_token_loss_sum,
        "effdl": lambda: token_loss_sum,
    }
    return {n: make[n]() for n in names}


def fwd_bwd(fn: Callable, logits: torch.Tensor, labels: torch.Tensor):
    """The loss and the gradient w.r.t. a fresh leaf copy of ``logits``."""
    x = logits.detach().requires_grad_()
    loss = fn(x, labels)
    loss.backward()
    return loss.detach(), x.grad


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/lm_training/probes")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("tokens", type=int, nargs="+", help="token counts (rows of the logits)")
    flags.add("vocab", type=int, help="vocabulary size (columns)")
    flags.add("variants", nargs="+", help=f"among {' '.join(VARIANTS)}")
    flags.add("warmup", type=int, help="untimed calls per variant")
    flags.add("iters", type=int, help="timed calls per variant")
    args = p.parse_args()
    cfg = flags.resolve(args)
    run = start_run(args, task="lm_loss_kernels", logs="loss_kernels.jsonl")
    fns = loss_functions(cfg.variants)
    g = torch.Generator(device=run.device).manual_seed(run.seed)
    for n in cfg.tokens:
        logits = torch.randn(n, cfg.vocab, device=run.device, generator=g).bfloat16()
        labels = torch.randint(0, cfg.vocab, (n,), device=run.device, generator=g)
        labels[::64] = IGNORE_INDEX  # some ignored tokens, as padding gives
        ref_loss, ref_grad = fwd_bwd(upcast_token_loss_sum, logits, labels)
        floor_bytes = 3 * logits.numel() * logits.element_size()
        for name, fn in fns.items():
            loss, grad = fwd_bwd(fn, logits, labels)
            del grad
            with peak_memory(run.device) as peak:
                _, grad = fwd_bwd(fn, logits, labels)
            grad_err = (grad.float() - ref_grad.float()).abs().max().item()
            del grad
            call = functools.partial(fwd_bwd, fn, logits, labels)
            stats = benchmark(call, warmup=cfg.warmup, iters=cfg.iters, device=run.device)  # fmt: skip
            ms = stats.median * 1e3
            config = {"tokens": n, "vocab": cfg.vocab, "dtype": "bf16", "warmup": cfg.warmup, "iters": cfg.iters,
                      "kernels": "triton" if name == "effdl" and uses_triton(logits) else "torch"}  # fmt: skip
            metrics = {
                "median_ms": ms,
                "extra_peak_gib": None
                if peak.gib is None
                else (peak.bytes - peak.start_bytes) / 2**30,
                "loss": loss.item(),
                "loss_rel_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                "grad_max_abs_err": grad_err,
                "floor_bytes": floor_bytes,
                "floor_gbs": floor_bytes / (ms * 1e-3) / 1e9,
            }
            run.log.log(name, config, metrics)
            peak_txt = (
                "-" if metrics["extra_peak_gib"] is None else f"{metrics['extra_peak_gib']:.2f}"
            )
            print(f"{n:>6} x {cfg.vocab}  {name:9} {ms:8.2f} ms  +{peak_txt} GiB  "
                  f"{metrics['floor_gbs']:7.0f} GB/s of floor  grad err {grad_err:.2e}")  # fmt: skip


if __name__ == "__main__":
    run_main(main)
